"""Reductions over a segment's slots: all-reduce and reduce (one-shot, two-step, ``PremulSum``)
and reduce-scatter, one entry point per op.

Each entry takes the compiled core when the call fits one slot and the core takes it, else
moves small tensors with NumPy or torch over views planned once, else streams any size through
the slots in Python rounds. Every path reduces in rank order, so every rank ends with the same
bits. The reduction (``reduce(out, terms, op)``) is a parameter; all ranks must use the same
one. Protocol and algorithms: ``docs/shm.md``.
"""

from __future__ import annotations

import contextvars
import struct

import numpy as np
import torch

from ..calls import (
    DTYPE_SIZE_AND_FIELD,
    OP_CODES,
    OPCODE_MASK,
    PREMUL_CODE,
    REDUCE_OP_CODES,
    shm_word_a,
    shm_word_b,
)
from ..reduction import BINARY_OPS, Reduction, reduce_into, torch_reduce
from ..types import PremulSum, ReduceOp, divide_
from .core import CORE_KINDS, CORE_OPS, PREMUL_KINDS, CompiledRounds, reduce_terms
from .rounds import Rounds, chunks

__all__ = ["Reductions"]

_FACTOR_WORD = 6  # misc words 6 and 7 of a rank's control block: its PremulSum factor, per half
_FLOAT_BITS, _FLOAT_BITS_D = struct.Struct("<Q"), struct.Struct("<d")  # a float64 as a word
# by the op's name (an Enum member hashes through a Python-level __hash__, a str through its
# cached hash): (descriptor's op code, torch's binary function)
_OP_ARGS = {op._name_: (REDUCE_OP_CODES[op], BINARY_OPS[op]) for op in REDUCE_OP_CODES}
# Small tensors are moved and reduced with NumPy where its result is bit-identical to torch's
# (one correctly rounded or wrapping operation per element, dtypes NumPy computes natively):
# a NumPy ufunc call costs far less than a torch op's dispatch. AVG's division stays with torch.
_NUMPY_DTYPES = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int32: np.int32,
    torch.int64: np.int64,
}
if int(np.__version__.split(".")[0]) < 2:  # error state not in a context variable
    _NUMPY_DTYPES.clear()
_NUMPY_OPS = {"SUM": np.add, "AVG": np.add, "PRODUCT": np.multiply}
_NUMPY_MAX_NUMEL = 32768  # torch's intra-op grain: below it torch runs one thread as well
_NUMPY_CACHE = 64  # callers' tensors held by the NumPy plans (fresh tensors add entries)
_PLAN_CACHE = 512
_increment_version = torch._C._increment_version


def _quiet_numpy() -> contextvars.Context:
    """A context in which NumPy ignores floating-point errors, as torch does; NumPy 2 keeps its
    error state in a context variable, so this costs far less than ``np.errstate``."""
    context = contextvars.copy_context()
    context.run(np.seterr, all="ignore")
    return context


def _overlap(a: int, a_bytes: int, b: int, b_bytes: int) -> bool:
    """Whether the bytes at addresses ``a`` and ``b`` overlap."""
    return a_bytes > 0 and b_bytes > 0 and a < b + b_bytes and b < a + a_bytes


def _takes_address(tensor: torch.Tensor) -> bool:
    """Whether the compiled core may read and write ``tensor`` through its address."""
    return tensor.is_cpu and tensor.is_contiguous() and not tensor.requires_grad


class Reductions:
    """One rank's reducing collectives.

    Args:
        rounds: the rank's rounds.
        compiled: the compiled core (used with the default reduction only), or ``None``.
        one_shot_max: largest all-reduce (bytes) done in one shot.
        reduce: the :data:`~..reduction.Reduction` (default :func:`torch_reduce`).
    """

    def __init__(self, rounds: Rounds, compiled: CompiledRounds | None, one_shot_max: int,
                 reduce: Reduction | None = None) -> None:
        self.rounds = rounds
        self.flags = rounds.flags
        self.rank, self.size = rounds.rank, rounds.size
        self.one_shot_max = one_shot_max
        self.reduction = torch_reduce if reduce is None else reduce
        self._default_reduce = reduce is None  # the small paths inline the default
        self.compiled = compiled if reduce is None else None
        # one-slot limit of a one-shot reduction
        self._one_slot = min(one_shot_max, rounds.slot_bytes)
        self.core_plans: dict[tuple, tuple | bool] = {}  # by (dtype, numel)
        self.numpy_plans: dict[tuple, tuple | bool] = {}  # by (address, dtype, numel)
        self._torch_plans: dict[tuple, tuple | bool] = {}  # by (dtype, shape)
        self._quiet_run = _quiet_numpy().run  # a context is entered by one thread at a time
        self._factor_idx = [
            [rounds.layout.misc(r, _FACTOR_WORD + h) // 8 for h in range(2)]
            for r in range(self.size)
        ]

    def fuses_premul(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`all_reduce` folds a ``PremulSum`` of ``dtype`` into the reduction."""
        return self.compiled is not None and dtype in PREMUL_KINDS

    # ------------------------------------------------------------------ entry points
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp | PremulSum, start: float) -> None:
        """Reduces ``tensor`` (contiguous, CPU) in place on every rank.

        One slot: one C call where the core takes it, else NumPy or torch over slot views
        planned once per (dtype, shape); larger: one-shot or two-step rounds. A
        :class:`PremulSum` (where :meth:`fuses_premul`) costs no pass of its own: each term is
        multiplied by its rank's factor as the terms are summed (``docs/shm.md``).
        """
        if op.__class__ is PremulSum:
            self._general(tensor, ReduceOp.SUM, start, None, op.factor)
            return
        if not tensor.requires_grad:
            if self.compiled is not None:
                core_op = CORE_OPS.get(op._name_)
                if core_op is not None:
                    plan = self.core_plans.get((tensor.dtype, tensor.numel()))
                    if plan is None:
                        plan = self._plan_core(tensor)
                    if plan:
                        self._all_reduce_core(tensor, core_op, plan, start, -1)
                        return
            np_fn = _NUMPY_OPS.get(op._name_) if self._default_reduce else None
            if np_fn is not None:
                key = (tensor.data_ptr(), tensor.dtype, tensor.numel())
                plan = self.numpy_plans.get(key)
                if plan is None:
                    plan = self._plan_numpy(tensor, key)
                if plan:
                    self._all_reduce_numpy(tensor, op, np_fn, plan, start)
                    return
        plan = self._torch_plans.get((tensor.dtype, tensor.shape))
        if plan is None:
            plan = self._plan_torch(tensor)
        if plan:
            self._all_reduce_torch(tensor, op, plan, start)
        else:
            self._general(tensor, op, start, None)

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp | PremulSum,
               start: float) -> None:
        """Reduces ``tensor`` into rank ``root``'s (the others' are left as they were)."""
        if op.__class__ is PremulSum:
            raise TypeError(f"reduce: {op!r} is supported by all_reduce only")
        core_op = CORE_OPS.get(op._name_) if self.compiled is not None else None
        if core_op is not None and _takes_address(tensor):
            plan = self.core_plans.get((tensor.dtype, tensor.numel()))
            if plan is None:
                plan = self._plan_core(tensor)
            if plan:
                self._all_reduce_core(tensor, core_op, plan, start, root)
                return
        self._general(tensor, op, start, root)

    def reduce_scatter(self, out: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                       start: float) -> None:
        """Reduces ``input`` (``size`` rows of ``out``'s elements) across ranks; this rank's row
        of the result into ``out``."""
        n, m = self.size, out.numel()
        info = DTYPE_SIZE_AND_FIELD[input.dtype]
        core_op = CORE_OPS.get(op._name_) if self.compiled is not None else None
        kind = CORE_KINDS.get(input.dtype)
        fits = 0 < n * m * info[0] <= self.rounds.slot_bytes
        if (core_op is not None and kind is not None and fits and _takes_address(out)
                and _takes_address(input)):
            word_a = (OP_CODES["reduce_scatter"] << 56) | info[1] | (core_op[0] << 40) | m
            self.compiled.reduce_scatter(out.data_ptr(), input.data_ptr(), m, kind, core_op[1],
                                         word_a, start)
            _increment_version((out,))
            return
        self._reduce_scatter_rounds(out.view(-1), input.view(-1), op, start)

    # ------------------------------------------------------------------ one slot
    def _plan_core(self, tensor: torch.Tensor) -> tuple | bool:
        """``(descriptor A without the op, numel, the core's dtype kind)``, or ``False`` where
        the core does not apply (a dtype it lacks, empty, more than one slot)."""
        numel = tensor.numel()
        kind = CORE_KINDS.get(tensor.dtype)
        if len(self.core_plans) >= _PLAN_CACHE:
            self.core_plans.clear()
        if kind is None or not 0 < numel * tensor.element_size() <= self._one_slot:
            plan = False
        else:
            plan = (shm_word_a("all_reduce", tensor), numel, kind)
        self.core_plans[(tensor.dtype, numel)] = plan
        return plan

    def _all_reduce_core(self, tensor, core_op, plan, start: float, root: int) -> None:
        """The one-slot round in the compiled core; ``root`` -1: on every rank."""
        word_base, numel, kind = plan
        op_code, op = core_op
        if root < 0:
            word_a, name = word_base | (op_code << 40), "all_reduce"
        else:
            word_a = (word_base & OPCODE_MASK) | (OP_CODES["reduce"] << 56) | (op_code << 40)
            name = "reduce"
        self.compiled.all_reduce(tensor.data_ptr(), numel, kind, op, root, word_a, name, start)
        if root < 0 or root == self.rank:
            _increment_version((tensor,))  # the core wrote the bytes behind torch's back

    def _plan_numpy(self, tensor: torch.Tensor, key: tuple) -> tuple | bool:
        """``(descriptor A without the op, the caller's tensor as a flat array, slot arrays per
        half)``, or ``False``. The array holds the tensor, so no other tensor can be given its
        address while the entry lives: an entry found by (address, dtype, numel) covers exactly
        the caller's bytes."""
        _, dtype, numel = key
        np_dtype = _NUMPY_DTYPES.get(dtype)
        nbytes = numel * tensor.element_size()
        if len(self.numpy_plans) >= _NUMPY_CACHE:
            self.numpy_plans.clear()
        if (np_dtype is None or self.size < 2 or not 0 < numel < _NUMPY_MAX_NUMEL
                or nbytes > self._one_slot):
            plan = False
        else:
            seg, layout = self.rounds.u8.numpy(), self.rounds.layout
            arrays = [[seg[layout.slot(h, r) : layout.slot(h, r) + nbytes].view(np_dtype)
                       for r in range(self.size)] for h in range(2)]
            plan = (shm_word_a("all_reduce", tensor), tensor.numpy().reshape(-1), arrays)
        self.numpy_plans[key] = plan
        return plan

    def _all_reduce_numpy(self, tensor, op, np_fn, plan, start: float) -> None:
        word_base, user, rank_arrays = plan
        word_a = word_base | (_OP_ARGS[op._name_][0] << 40)
        rounds = self.rounds
        half = rounds.next_half()
        rounds.enter_quick(half, word_a, "all_reduce", start)
        arrays = rank_arrays[half]
        np.copyto(arrays[self.rank], user)
        rounds.exchange_quick(half, word_a, "all_reduce", start)
        run = self._quiet_run
        run(np_fn, arrays[0], arrays[1], out=user)
        for term in arrays[2:]:  # rank order, as reduce_into
            run(np_fn, user, term, out=user)
        _increment_version((tensor,))  # written behind torch's in-place bookkeeping
        if op is ReduceOp.AVG:
            divide_(tensor, self.size)

    def _plan_torch(self, tensor: torch.Tensor) -> tuple | bool:
        """``(descriptor A without the op, slot views per half)`` for a one-slot all-reduce of
        tensors like ``tensor``, or ``False`` when they do not fit one."""
        nbytes = tensor.numel() * tensor.element_size()
        if len(self._torch_plans) >= _PLAN_CACHE:
            self._torch_plans.clear()
        if tensor.dtype not in DTYPE_SIZE_AND_FIELD or not 0 < nbytes <= self._one_slot:
            plan = False
        else:
            numel, slots = tensor.numel(), self.rounds.slots
            plan = (shm_word_a("all_reduce", tensor),
                    [[s[:numel].view(tensor.shape) for s in slots(h, tensor.dtype)[: self.size]]
                     for h in range(2)])
        self._torch_plans[(tensor.dtype, tensor.shape)] = plan
        return plan

    def _all_reduce_torch(self, tensor, op, plan, start: float) -> None:
        word_base, rank_views = plan
        op_code, fn = _OP_ARGS[op._name_]
        word_a = word_base | (op_code << 40)
        rounds = self.rounds
        half = rounds.next_half()
        rounds.enter_quick(half, word_a, "all_reduce", start)
        views = rank_views[half]
        views[self.rank].copy_(tensor)
        rounds.exchange_quick(half, word_a, "all_reduce", start)
        if not self._default_reduce:
            self.reduction(tensor, views, op)
            return
        if len(views) == 2:
            fn(views[0], views[1], out=tensor)
        else:
            reduce_into(tensor, views, op)
        if op is ReduceOp.AVG:
            divide_(tensor, self.size)

    # ------------------------------------------------------------------ any size
    def _general(self, tensor, op, start: float, root: int | None, factor=None) -> None:
        """One-shot rounds up to ``one_shot_max`` bytes, else two-step rounds."""
        name = "all_reduce" if root is None else "reduce"
        redop = REDUCE_OP_CODES[op] if factor is None else PREMUL_CODE
        one_shot = tensor.numel() * tensor.element_size() <= self.one_shot_max
        word_a = shm_word_a(name, tensor, redop, two_step=not one_shot)
        word_b = shm_word_b(tensor.numel(), root)
        if one_shot:
            self._one_shot(tensor, op, name, start, word_a, word_b, root, factor)
        else:
            self._two_step(tensor.view(-1), op, name, start, word_a, word_b, root, factor)

    def _one_shot(self, tensor, op, name, start, word_a, word_b, root, factor) -> None:
        """Per slot-sized piece: every rank copies it in, then reduces all slots into its own."""
        rounds, flags = self.rounds, self.flags
        esize = tensor.element_size()
        if tensor.numel() * esize > rounds.slot_bytes:
            pieces = tensor.view(-1).split(rounds.slot_bytes // esize)
        else:
            pieces = (tensor,)
        for i, piece in enumerate(pieces):
            half = rounds.enter(name, start, word_a, word_b)
            views = rounds.slot_views_like(half, piece)
            views[self.rank].copy_(piece)
            if factor is not None:
                self._publish_factor(half, factor)
            rounds.publish_first()
            if i == 0:  # every rank, a reduce's non-roots too, checks the call
                flags.wait_all(flags.seq, name, start)
                rounds.check(half, word_a, word_b)
            if root is not None and root != self.rank:
                continue
            if i > 0:
                flags.wait_all(flags.seq, name, start)
            if factor is None:
                self.reduction(piece, views, op)
            else:
                self._reduce_premul(piece, views, half, factor)

    def _publish_factor(self, half: int, factor: float) -> None:
        """Stores this rank's PremulSum factor for ``half`` (before the round's first publish,
        which makes it visible with the data)."""
        bits = _FLOAT_BITS.unpack(_FLOAT_BITS_D.pack(factor))[0]
        self.flags.words[self._factor_idx[self.rank][half]] = bits

    def _reduce_premul(self, out: torch.Tensor, terms: list[torch.Tensor], half: int,
                       factor: float) -> None:
        """``out = terms[0] * f0 + terms[1] * f1 + ...`` in rank order, ``fq`` the factor rank
        ``q`` published for ``half``: each product rounded in the dtype, as ``mul_`` then
        ``SUM``. ``out`` aliases no term."""
        words, idx = self.flags.words, self._factor_idx
        mine = words[idx[self.rank][half]]
        if all(words[idx[p][half]] == mine for p in self.flags.peers):  # the usual case
            reduce_terms(out.data_ptr(), [term.data_ptr() for term in terms], out.numel(),
                         PREMUL_KINDS[out.dtype], factor)
            _increment_version((out,))  # written behind torch's back
            return
        factors = [_FLOAT_BITS_D.unpack(_FLOAT_BITS.pack(words[idx[q][half]]))[0]
                   for q in range(self.size)]
        # terms are read by peers too (one shot): each scaled product is a temporary
        torch.mul(terms[0], factors[0], out=out)
        for term, term_factor in zip(terms[1:], factors[1:], strict=True):
            out.add_(term * term_factor)

    def _bounds(self, count: int, esize: int) -> list[int]:
        """Split points of ``count`` elements into ``size`` slices, on 64-byte boundaries (no
        two ranks write one cache line of the result slot)."""
        align = max(1, 64 // esize)
        n = self.size
        return [0] + [(p * count // n) // align * align for p in range(1, n)] + [count]

    def _grid(self, half: int, dtype: torch.dtype, count: int, esize: int):
        """Cached views for one two-step round of ``count`` elements: ``grid[q][p]`` is slice
        ``p`` of slot ``q``, ``result`` the first ``count`` elements of the result slot."""
        key = (half, dtype, count, "grid")
        entry = self.rounds.cached_view(key)
        if entry is None:
            bounds = self._bounds(count, esize)
            sizes = [bounds[p + 1] - bounds[p] for p in range(self.size)]
            slots = self.rounds.slots(half, dtype)
            entry = ([s[:count].split(sizes) for s in slots], slots[self.size][:count])
            self.rounds.cache_view(key, entry)
        return entry

    def _two_step(self, flat, op, name, start, word_a, word_b, root, factor) -> None:
        """Per chunk: reduce-scatter into the shared result slot, then every rank copies the
        whole result out (two publishes a round)."""
        n, rank, flags, rounds = self.size, self.rank, self.flags, self.rounds
        esize = flat.element_size()
        counts = [count for _, count in chunks(flat.numel(), rounds.slot_bytes // esize)]
        piece_sizes = []
        for count in counts:
            bounds = self._bounds(count, esize)
            piece_sizes += [bounds[p + 1] - bounds[p] for p in range(n)]
        pieces = flat.split(piece_sizes)  # every round's slices of the tensor, in one call
        parts = flat.split(counts)
        for i, count in enumerate(counts):
            half = rounds.enter(name, start, word_a, word_b)
            grid, result = self._grid(half, flat.dtype, count, esize)
            mine, own = grid[rank], pieces[i * n : (i + 1) * n]
            for p in flags.peers:  # copy in the slices the peers reduce; ours is read in place
                mine[p].copy_(own[p])
            if factor is not None:
                self._publish_factor(half, factor)
            rounds.publish_first()
            flags.wait_all(flags.seq, name, start)
            if i == 0:
                rounds.check(half, word_a, word_b)
            out = grid[n][rank]  # our slice of the shared result slot
            terms = [own[rank] if q == rank else grid[q][rank] for q in range(n)]
            if factor is None:
                self.reduction(out, terms, op)
            else:
                self._reduce_premul(out, terms, half, factor)
            flags.publish()
            if root is not None and root != rank:
                continue
            flags.wait_all(flags.seq, name, start)
            parts[i].copy_(result)  # every rank's reduced slice, in one copy

    def _reduce_scatter_rounds(self, out, flat, op, start: float) -> None:
        """Per chunk: every rank copies in the rows the others reduce, then reduces its own."""
        n, rank, m, rounds = self.size, self.rank, out.numel(), self.rounds
        esize = flat.element_size()
        word_a = shm_word_a("reduce_scatter", out, REDUCE_OP_CODES[op])
        in2d = flat.view(n, m)
        # an output sharing bytes with our own row: that row is reduced from our slot instead
        # (a reduction's output may alias its first two terms only), as the compiled core does
        row = m * esize
        own_in_slot = _overlap(out.data_ptr(), row, flat.data_ptr() + rank * row, row)
        for offset, count in chunks(m, rounds.slot_bytes // esize // n):
            half = rounds.enter("reduce_scatter", start, word_a)
            block = rounds.rows_of_every_slot(half, flat.dtype, n, count)  # [source, dest]
            part = in2d if count == m else in2d[:, offset : offset + count]
            for p in self.flags.peers:
                block[rank, p].copy_(part[p])
            if own_in_slot:
                block[rank, rank].copy_(part[rank])
            rounds.publish_first()
            self.flags.wait_all(self.flags.seq, "reduce_scatter", start)
            if offset == 0:
                rounds.check(half, word_a)
            target = out if count == m else out[offset : offset + count]
            own = block[rank, rank] if own_in_slot else part[rank]
            self.reduction(target, [own if q == rank else block[q, rank] for q in range(n)], op)
