"""Collective schedules over a segment of per-rank slots: the algorithm, apart from transport.

A schedule only slices typed views, moves data with ``copy_``, combines terms with its
*reduction*, and sequences the steps with :class:`~.flags.PeerFlags`. The reduction is a
parameter, ``reduce(out, terms, op)``, which writes ``terms[0] (op) terms[1] (op) ...`` into
``out`` (``AVG`` included: divided by ``len(terms)``; see :mod:`fastcomm.comm.reduction`). The
default, :func:`~fastcomm.comm.reduction.torch_reduce`, runs torch ops in the buffers' dtype;
the ``ipc`` backend passes one that calls the Triton
kernel ``fastcomm.kernels.peer_reduce`` over the addresses at which this process mapped the
slots (fp32 accumulation, the 1/size of ``AVG`` folded into the same pass). Both reduce in rank
order, so either gives every rank the same bits, but the two do not round alike: all ranks of
a communicator must use the same one.

Rounds and buffer reuse: each round uses one half of the data area, alternating, and writes only
the writer's own slot. Every rank publishes the same number of times per round, so all ranks
agree on every ``seq`` value. A rank finishes its reads of round ``t`` before its first publish in
round ``t + 1``; hence, before writing half ``h`` in round ``t + 2``, it is enough that every peer
reached the first publish of round ``t + 1`` (:meth:`SegmentSchedules._enter`). The next
call therefore never waits for the slowest reader of the last one, and most calls pay no extra
wait at all.

Reductions run in rank order (``x0 + x1 + ...``) from the same bytes on every rank that computes
a given element (or on one rank only, which then distributes it), so every rank ends with
bit-identical results.

Ranks agree or all raise: before its first publish of a call, every rank records the call in two
descriptor words of the round's half. ``A = opcode << 56 | dtype << 48 | reduce op << 40 | numel
mod 2**40`` (the opcode carries ``_TWO_STEP`` when an all-reduce or reduce runs in two steps,
i.e. past this rank's ``one_shot_max``); ``B = (numel >> 40) << 32 | (src or root) + 1`` (0 when
the op has neither). In the first round of every call, every rank -- a broadcast's source and a
reduce's non-roots included -- waits until every peer published and compares their A and B with
its own; any difference raises on every rank, naming both calls, before anything is copied out or
reduced. So ranks that disagree on the op, the element count (an empty tensor against a non-empty
one too), the dtype, the reduce op, the source or root, or on ``one_shot_max`` where it changes
the algorithm, all raise together (a differing slot size fails at setup: ``segment``). A call on
empty tensors is such a round alone, with nothing copied.

All-reduce: up to ``one_shot_max`` bytes, one shot (each rank copies its tensor into its slot,
then reduces all slots into its output: one publish per ``slot_bytes`` chunk). Larger: per chunk,
reduce-scatter then all-gather inside the segment (each rank copies in the slices the others
reduce, reduces its own slice -- read in place from its tensor -- into its part of the half's
shared result slot, then every rank copies the whole result out in one copy: two publishes), so a
tensor of any size streams through the fixed segment. ``reduce`` (to a root) is the same with
only the root copying out. Other ops, one publish per chunk: ``broadcast`` (the root copies in,
the others copy out), ``all_gather``/``all_to_all`` (everyone copies in, then one strided copy
brings every rank's rows out), ``reduce_scatter`` (everyone copies in the rows the others
reduce, then reduces its own). Every view of the segment a round needs is cached by (half,
dtype, size), so a repeated call slices nothing. A call that fits one slot (one round) runs in
the compiled core where it was built (``_core.c``): the same round, in one C call when the peers
are there within the spin; data movement for every dtype, reductions (``SUM``, ``AVG``,
``PRODUCT``) for the dtypes whose torch bits it reproduces. Send/recv stream through two mailbox
slots per ordered pair of ranks, counted by the pair's ``sent``/``acked`` words: chunk ``k`` of the
pair's traffic goes into slot ``k % 2`` (a 64-byte header holding the message's total bytes, then
at most ``mbox_bytes - 64`` of it) once the receiver took chunk ``k - 2``; a receiver whose own
size differs from the header's raises, naming both, without taking the chunk. Each chunk is one
C call where the compiled core is built (the spin without the GIL, the copy, the counter, and a
futex wake only when the peer announced that it sleeps), so a message that fits one slot costs
one call on either side when the peer is there; longer waits finish in Python
(:meth:`~.flags.PeerFlags.wait_word`) and the call resumes. Either side may run either path.
"""

from __future__ import annotations

import contextvars
import struct
import time

import numpy as np
import torch

from ..errors import FastcommError
from ..reduction import _BINARY, Reduction, reduce_into, torch_reduce
from ..types import EXTRA_DTYPES, SUPPORTED_DTYPES, BitwiseOp, PremulSum, ReduceOp, divide_
from .flags import PeerFlags, fence
from .segment import Layout

try:  # built at install where a C compiler is found
    from . import _core
except ImportError:  # no compiler, or not Linux: the pure-Python path; PremulSum: mul_ + SUM
    _core = None

__all__ = ["SegmentSchedules"]

_OPCODES = {
    name: i + 1
    for i, name in enumerate(
        ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "barrier",
         "reduce", "all_to_all_v"]
    )
}
_TWO_STEP = 0x80  # opcode flag: an all-reduce/reduce past one_shot_max (two publishes a round)
_OPCODE_MASK = (1 << 56) - 1  # a descriptor A without its opcode
_NUMEL_BITS = (1 << 40) - 1
_ONE_SHOT_WORD = 10  # misc word 10 of a rank's control block: its one_shot_max (messages)
# the extra dtypes come after the contract's own, so the codes of those never change
_DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(SUPPORTED_DTYPES + EXTRA_DTYPES)}
# by dtype: (element size, the dtype's field of descriptor A), for the one-slot entries
_DTYPE_INFO = {
    dtype: (torch.empty((), dtype=dtype).element_size(), code << 48)
    for dtype, code in _DTYPE_CODES.items()
}
_OP_CODES = {op: i + 1 for i, op in enumerate(ReduceOp)}
_PREMUL_CODE = len(_OP_CODES) + 1  # a PremulSum's op code in the call descriptor
_OP_CODES.update({op: _PREMUL_CODE + 1 + i for i, op in enumerate(BitwiseOp)})
# the compiled core's dtype kinds
_CORE_KINDS = {} if _core is None else {
    torch.float32: _core.KIND_F32,
    torch.float64: _core.KIND_F64,
    torch.int8: _core.KIND_I8,
    torch.uint8: _core.KIND_U8,
    torch.int32: _core.KIND_I32,
    torch.int64: _core.KIND_I64,
}
# dtypes whose PremulSum the compiled core reduces with the bits of torch's mul_ then add
_PREMUL_KINDS = {dtype: kind for dtype, kind in _CORE_KINDS.items() if dtype.is_floating_point}
_FACTOR_WORD = 6  # misc words 6 and 7 of a rank's control block: its PremulSum factor, per half
_FLOAT_BITS, _FLOAT_BITS_D = struct.Struct("<Q"), struct.Struct("<d")  # a float64 as a word
# by the member's name: an Enum member hashes through a Python-level __hash__ (~0.3 us), a str
# through its cached hash; the small-message path looks these up on every call
_OP_ARGS = {op._name_: (_OP_CODES[op], _BINARY[op]) for op in (*ReduceOp, *BitwiseOp)}
_MBOX_HEADER = 64  # first bytes of a mailbox slot: the message's total byte count
# The small-message fast path moves and reduces the bytes with NumPy: a NumPy ufunc call costs
# well under a microsecond where a torch op costs 2-3 (dispatcher, TensorIterator setup), and at
# 4 KiB that overhead is the whole time. Only where the result is bit-identical to torch's: ops
# whose elementwise result is one correctly rounded (or wrapping integer) operation in the
# buffers' dtype, and dtypes NumPy computes natively (not bfloat16; not float16, whose loops
# NumPy and torch vectorize differently). ``AVG``'s division stays with torch (divide_).
_NUMPY_DTYPES = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int32: np.int32,
    torch.int64: np.int64,
}
if int(np.__version__.split(".")[0]) < 2:  # error state not in a context variable: see below
    _NUMPY_DTYPES.clear()
_NUMPY_OPS = {"SUM": np.add, "AVG": np.add, "PRODUCT": np.multiply}
# torch's intra-op grain: below it a torch op runs on one thread as well, so NumPy (one thread
# always) gives up no parallelism
_NUMPY_MAX_NUMEL = 32768
_FAST_CACHE = 64  # callers' tensors held by the NumPy path (fresh tensors add entries)
# by the op's name, as _OP_ARGS: (descriptor's op code, the core's op)
_CORE_OPS = {} if _core is None else {
    "SUM": (_OP_CODES[ReduceOp.SUM], _core.OP_SUM),
    "AVG": (_OP_CODES[ReduceOp.AVG], _core.OP_AVG),
    "PRODUCT": (_OP_CODES[ReduceOp.PRODUCT], _core.OP_PRODUCT),
}
_increment_version = torch._C._increment_version


def _code_b(numel: int, root: int | None = None) -> int:
    """A call's descriptor word B (module docstring): the element count past 40 bits and the
    source or root + 1."""
    return ((numel >> 40) << 32) | (0 if root is None else root + 1)


def _p2p_words(layout: Layout, rank: int, peer: int) -> tuple[int, int, int, int]:
    """Word indices of the counters of ``rank``'s traffic with ``peer``: ``rank``'s ``sent`` to
    ``peer``, ``peer``'s ``acked`` of those, ``peer``'s ``sent`` to ``rank``, ``rank``'s ``acked``
    of those. The word after each is its owner's announcement (``segment``)."""
    return (
        layout.sent(rank, peer) // 8,
        layout.acked(peer, rank) // 8,
        layout.sent(peer, rank) // 8,
        layout.acked(rank, peer) // 8,
    )


def _overlap(a: int, a_bytes: int, b: int, b_bytes: int) -> bool:
    """Whether the bytes at addresses ``a`` and ``b`` overlap."""
    return a_bytes > 0 and b_bytes > 0 and a < b + b_bytes and b < a + a_bytes


def _quiet_numpy() -> contextvars.Context:
    """A context in which NumPy ignores floating-point errors, as torch does (an overflow gives
    ``inf`` silently; NumPy would warn). NumPy 2 keeps its error state in a context variable,
    so running a ufunc in this context costs tens of nanoseconds where ``np.errstate`` costs
    more than a 4 KiB reduction; the caller's own NumPy settings are untouched."""
    context = contextvars.copy_context()
    context.run(np.seterr, all="ignore")
    return context


def describe(code_a: int, code_b: int = 0) -> str:
    """A call's descriptor words in words, for mismatch messages: ``all_reduce(float32, 10
    elements, op sum)``, ``broadcast(int8, 3 elements, src 1)``."""
    names = {v: k for k, v in _OPCODES.items()}
    dtypes = {v: str(k).removeprefix("torch.") for k, v in _DTYPE_CODES.items()}
    opcode, redop = code_a >> 56, (code_a >> 40) & 0xFF
    name = names.get(opcode & ~_TWO_STEP, f"op{opcode & ~_TWO_STEP}")
    numel = (code_a & _NUMEL_BITS) | ((code_b >> 32) << 40)
    dtype = (code_a >> 48) & 0xFF
    what = [dtypes.get(dtype, f"dtype{dtype}"), f"{numel} elements"] if dtype or numel else []
    if redop:
        ops = {v: k.name.lower() for k, v in _OP_CODES.items()} | {_PREMUL_CODE: "premul_sum"}
        what.append(f"op {ops.get(redop, redop)}")
    if code_b & 0xFFFFFFFF:
        label = "src" if opcode == _OPCODES["broadcast"] else "root"
        what.append(f"{label} {(code_b & 0xFFFFFFFF) - 1}")
    if opcode & _TWO_STEP:
        what.append("two-step")
    return f"{name}({', '.join(what)})"


class SegmentSchedules:
    """Runs collectives for one rank over the slots of a segment.

    Args:
        flags: this rank's flags.
        layout: the segment's layout.
        u8: the whole segment as a flat ``uint8`` tensor.
        one_shot_max: largest all-reduce (bytes) done in one shot.
        reduce: the :data:`Reduction` every reducing schedule calls (default
            :func:`torch_reduce`); the same kind on every rank.
        compiled: use the compiled core (``_core``) where it was built and the reduction is
            the default: collectives that fit one slot, and ``PremulSum`` folded into the
            reduction. Ranks with and without it interoperate.

    Every collective takes tensors on the CPU, contiguous, each the same dtype and element
    count on every rank (the communicator checks its arguments before it calls); a rank whose
    call differs from a peer's raises :class:`FastcommError` on every rank (module docstring).
    """

    def __init__(
        self,
        flags: PeerFlags,
        layout: Layout,
        u8: torch.Tensor,
        one_shot_max: int,
        reduce: Reduction | None = None,
        compiled: bool = True,
    ) -> None:
        self.flags = flags
        self.reduce = torch_reduce if reduce is None else reduce
        # the small-message path inlines the default's two-rank case (one torch call)
        self._inline_torch = reduce is None
        self.layout = layout
        self.rank = flags.rank
        self.size = layout.size
        self.one_shot_max = one_shot_max
        self._u8 = u8
        self._typed: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._views: dict[tuple, list] = {}  # cached slot views, by (half, dtype, shape...)
        self._small: dict[tuple, tuple | bool] = {}  # one-slot all-reduce plans, by dtype, shape
        self._fast: dict[tuple, tuple | bool] = {}  # NumPy-path plans, by address, dtype, numel
        self._quiet_run = _quiet_numpy().run  # one per schedules: a context is entered by one
        self._core = None  # SmallCore where the compiled core is built and wanted: one-slot
        # collectives run in it, and PremulSum is folded into _core.reduce (fuses_premul)
        self._core_plans: dict[tuple, tuple | bool] = {}  # by (dtype, numel)
        if compiled and _core is not None and self._inline_torch:
            n = self.size
            p2p = []  # send/recv's counters and mailboxes (one rank has none)
            if n > 1:
                me = self.rank
                boxes = [
                    [0] * 4 if r == me else [layout.mailbox(me, r, 0), layout.mailbox(me, r, 1),
                                             layout.mailbox(r, me, 0), layout.mailbox(r, me, 1)]
                    for r in range(n)
                ]
                p2p = [
                    [idx for r in range(n) for idx in _p2p_words(layout, me, r)],
                    [offset for four in boxes for offset in four],
                    layout.mbox_bytes,
                ]
            self._core = _core.SmallCore(
                flags.segment.mm,  # held by the core: the mapping outlives it
                self.rank,
                flags.seq_idx,
                flags.wait_idx,
                [idx for r in range(n) for idx in flags.desc_idx[r]],
                [layout.slot(h, r) for h in range(2) for r in range(n)],
                layout.slot_bytes,
                *p2p,
            )
        # this rank's one_shot_max, for the message when ranks disagree on it (module docstring)
        flags.words[layout.misc(self.rank, _ONE_SHOT_WORD) // 8] = min(one_shot_max, 2**64 - 1)
        self._factor_idx = [
            [layout.misc(r, _FACTOR_WORD + h) // 8 for h in range(2)] for r in range(self.size)
        ]
        self._round = 0
        self._prev_first = 0  # seq of the first publish of the previous round
        self._sent = [0] * self.size  # chunks sent to / received from each peer
        self._received = [0] * self.size
        self._p2p_idx = [_p2p_words(layout, self.rank, r) for r in range(self.size)]
        self._mbox_room = layout.mbox_bytes - _MBOX_HEADER  # bytes of a chunk

    # ------------------------------------------------------------------ plumbing
    def slots(self, half: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Typed views of every rank's slot in ``half``, then (index ``size``) its result slot."""
        typed = self._typed.get(dtype)
        if typed is None:
            nbytes = self.layout.slot_bytes
            typed = [
                [
                    self._u8[self.layout.slot(h, r) : self.layout.slot(h, r) + nbytes].view(dtype)
                    for r in range(self.size + 1)
                ]
                for h in range(2)
            ]
            self._typed[dtype] = typed
        return typed[half]

    def _enter(self, op: str, start: float, code: int, code_b: int = 0) -> int:
        """Starts a round: waits until its half is free, records the call; returns the half."""
        half = self._round & 1
        self._round += 1
        flags = self.flags
        flags.wait_all(self._prev_first, op, start)
        desc = flags.desc_idx[self.rank]
        flags.words[desc[half]] = code
        flags.words[desc[2 + half]] = code_b
        return half

    def _first_publish(self) -> None:
        self._prev_first = self.flags.publish()

    def _check(self, half: int, code: int, code_b: int = 0) -> None:
        """Raises unless every peer recorded the same call in ``half`` (after waiting for all)."""
        words, desc_idx = self.flags.words, self.flags.desc_idx
        for p in self.flags.peers:
            theirs, theirs_b = words[desc_idx[p][half]], words[desc_idx[p][2 + half]]
            if theirs != code or theirs_b != code_b:
                raise FastcommError(self._mismatch(p, code, code_b, theirs, theirs_b))

    def _mismatch(self, peer: int, code: int, code_b: int, theirs: int, theirs_b: int) -> str:
        message = (
            f"rank {self.rank}: collective mismatch: this rank called {describe(code, code_b)} "
            f"but rank {peer} called {describe(theirs, theirs_b)}; every rank must issue the "
            f"same collectives in the same order with the same sizes, dtypes, ops and roots"
        )
        if (code ^ theirs) == _TWO_STEP << 56 and code_b == theirs_b:
            words, layout = self.flags.words, self.layout
            mine = words[layout.misc(self.rank, _ONE_SHOT_WORD) // 8]
            other = words[layout.misc(peer, _ONE_SHOT_WORD) // 8]
            message += (
                f" (ranks disagree on one_shot_max: {mine} bytes on rank {self.rank}, {other} "
                f"on rank {peer}; every rank must pass the same ShmOptions)"
            )
        return message

    @staticmethod
    def code(op: str, tensor: torch.Tensor | None, redop: int = 0, two_step: bool = False) -> int:
        """A call's descriptor word A (module docstring); ``redop``: the reduce op's code."""
        opcode = _OPCODES[op] | (_TWO_STEP if two_step else 0)
        if tensor is None:
            return opcode << 56
        return (
            (opcode << 56)
            | (_DTYPE_CODES[tensor.dtype] << 48)
            | (redop << 40)
            | (tensor.numel() & _NUMEL_BITS)
        )

    def _chunks(self, total: int, chunk: int):
        """``(start, count)`` per round; one empty round for ``total == 0`` (the descriptors
        still meet)."""
        if not total:
            yield 0, 0
            return
        for start in range(0, total, chunk):
            yield start, min(chunk, total - start)

    def _core_takes(self, tensor: torch.Tensor) -> bool:
        """Whether the compiled core may read and write ``tensor`` through its address."""
        return tensor.is_cpu and tensor.is_contiguous() and not tensor.requires_grad

    def _core_round(self, call, args: list, name: str, start: float) -> None:
        """One round in the compiled core: ``args`` (the op's own, ending with descriptor A) get
        the round's half, enter, target, stage and spin; a wait the core gave up on is finished
        here and the core resumed (:meth:`_resume_core`)."""
        flags = self.flags
        half = self._round & 1
        self._round += 1
        target = flags.seq + 1
        args += [half, self._prev_first, target, 0, flags.spin_budget_ns()]
        status = call(*args)
        if status:
            self._resume_core(status, call, args, name, start)
        flags.seq = self._prev_first = target

    # ------------------------------------------------------------------ collectives
    def fuses_premul(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`all_reduce` takes a :class:`PremulSum` of ``tensor`` (see there): the
        compiled core is built and wanted (``compiled``), the reduction is the default one, the
        dtype float32/float64."""
        return self._core is not None and tensor.dtype in _PREMUL_KINDS

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp | PremulSum, root: int | None = None
    ) -> None:
        """Reduces ``tensor`` in place on every rank (or, with ``root``, into root's only).

        A :class:`PremulSum` (where :meth:`fuses_premul`; no ``root``) costs no pass of its
        own: the ranks copy their terms in unscaled, and the compiled core multiplies each term
        by the factor as it sums them (each product rounded in the dtype, then added in rank
        order: the bits of ``mul_`` then ``SUM``). A PremulSum scales each rank's term by that
        rank's factor, so every rank also publishes its factor (a word of its control block per
        half); when a peer's differs (a joined DDP rank's zeros go out with factor 1), the
        round multiplies each term by its own rank's factor apart, with the same bits.
        """
        name = "all_reduce" if root is None else "reduce"
        start = time.monotonic()
        if op.__class__ is PremulSum:
            if root is not None:
                raise TypeError(f"reduce: {op!r} is supported by all_reduce only")
            factor, op, redop = op.factor, ReduceOp.SUM, _PREMUL_CODE
        else:
            factor, redop = None, _OP_CODES[op]
        one_shot = tensor.numel() * tensor.element_size() <= self.one_shot_max
        if one_shot and factor is None and self._core is not None:
            core_op = _CORE_OPS.get(op._name_)
            if core_op is not None and self._core_takes(tensor):
                plan = self._core_plans.get((tensor.dtype, tensor.numel()))
                if plan is None:
                    plan = self._plan_core(tensor)
                if plan:
                    root_ = -1 if root is None else root
                    self._all_reduce_core(tensor, core_op, plan, start, root_)
                    return
        code = self.code(name, tensor, redop, two_step=not one_shot)
        code_b = _code_b(tensor.numel(), root)
        if one_shot:
            self._one_shot(tensor, op, name, start, code, code_b, root, factor)
        else:
            self._two_step(tensor.view(-1), op, name, start, code, code_b, root, factor)

    def all_reduce_small(self, tensor: torch.Tensor, op: ReduceOp, start: float) -> int:
        """The one-shot all-reduce of a tensor that fits one slot, with the fewest Python steps.

        Same rounds, flags and results as :meth:`all_reduce` (the two may be mixed freely); only
        the per-call work differs: the slot views and the call's descriptor are planned once per
        (dtype, shape), and the common waits (a peer already there) cost one word read each.
        With the default reduction, a ``SUM``/``AVG``/``PRODUCT`` of a small tensor that does
        not require grad runs in the compiled core where it was built (:meth:`_all_reduce_core`),
        else, for a NumPy-native dtype, moves and reduces its bytes with NumPy
        over arrays planned once per (address, dtype, numel) (:meth:`_plan_fast`): the
        reduction writes straight into the caller's memory, and the tensor's version counter
        is bumped as a torch in-place op would.

        Args:
            tensor: a contiguous CPU tensor (what the communicator's fast path checks).
            op: the reduction.
            start: when the call began (``time.monotonic()``), for timeouts and messages.

        Returns:
            the bytes reduced, or 0, having done nothing, when ``tensor`` does not qualify
            (empty, more than ``one_shot_max`` bytes or one slot): then :meth:`all_reduce`.
        """
        if self._core is not None and not tensor.requires_grad:
            core_op = _CORE_OPS.get(op._name_)
            if core_op is not None:
                plan = self._core_plans.get((tensor.dtype, tensor.numel()))
                if plan is None:
                    plan = self._plan_core(tensor)
                if plan:
                    self._all_reduce_core(tensor, core_op, plan, start)
                    return plan[3]
        np_fn = _NUMPY_OPS.get(op._name_) if self._inline_torch else None
        if np_fn is not None and not tensor.requires_grad:
            key = (tensor.data_ptr(), tensor.dtype, tensor.numel())
            fast = self._fast.get(key)
            if fast is None:
                fast = self._plan_fast(tensor, key)
            if fast:
                self._all_reduce_numpy(tensor, op, np_fn, fast, start)
                return fast[1].nbytes
        plan = self._small.get((tensor.dtype, tensor.shape))
        if plan is None:
            plan = self._plan_small(tensor)
        if not plan:
            return 0
        code_base, rank_views = plan
        op_code, fn = _OP_ARGS[op._name_]
        code = code_base | (op_code << 40)
        half = self._round & 1
        self._round += 1
        self._small_enter(half, code, start)
        views = rank_views[half]
        views[self.rank].copy_(tensor)
        self._small_exchange(half, code, start)
        if not self._inline_torch:
            self.reduce(tensor, views, op)
        else:
            if len(views) == 2:
                fn(views[0], views[1], out=tensor)
            else:
                reduce_into(tensor, views, op)
            if op is ReduceOp.AVG:
                divide_(tensor, self.size)
        return tensor.numel() * tensor.element_size()

    def reduce_small(self, tensor: torch.Tensor, op: ReduceOp, root: int, start: float) -> int:
        """``all_reduce(tensor, op, root)`` of a tensor that fits one slot, for a caller's
        synchronous fast path (as :meth:`all_reduce_small`): the whole round in one C call where
        the compiled core takes it, else the Python path.

        Args:
            tensor: a contiguous CPU tensor (what the communicator's fast path checks).
            op: the reduction (not a ``PremulSum``).
            root: the rank that gets the result.
            start: when the call began (``time.monotonic()``).

        Returns:
            the bytes reduced, or 0, having done nothing, when it does not apply (empty, more
            than ``one_shot_max`` bytes or one slot, ``root`` not a rank, an unsupported dtype).
        """
        info = _DTYPE_INFO.get(tensor.dtype)
        if (
            info is None
            or root.__class__ is not int
            or not 0 <= root < self.size
            or op.__class__ is not ReduceOp
        ):
            return 0
        nbytes = tensor.numel() * info[0]
        if not 0 < nbytes <= min(self.one_shot_max, self.layout.slot_bytes):
            return 0
        if self._core is not None and not tensor.requires_grad:
            core_op = _CORE_OPS.get(op._name_)
            plan = None if core_op is None else self._core_plans.get((tensor.dtype, tensor.numel()))
            if core_op is not None and plan is None:
                plan = self._plan_core(tensor)
            if plan:
                self._all_reduce_core(tensor, core_op, plan, start, root)
                return nbytes
        code = self.code("reduce", tensor, _OP_CODES[op])
        self._one_shot(tensor, op, "reduce", start, code, _code_b(tensor.numel(), root), root)
        return nbytes

    def _all_reduce_core(self, tensor, core_op, plan, start, root: int = -1) -> None:
        """:meth:`all_reduce_small` in the compiled core (``plan`` from :meth:`_plan_core`):
        the whole round in one call when every peer is there within the spin; otherwise
        the core returns where it stopped, Python waits as :meth:`_small_enter` and
        :meth:`_small_exchange` would (yield, sleep, timeout, liveness), and the core resumes.
        ``root`` other than -1: a reduce into rank ``root`` only.
        """
        code_base, numel, kind, _ = plan
        op_code, op = core_op
        flags = self.flags
        half = self._round & 1
        self._round += 1
        target = flags.seq + 1
        if root < 0:
            code, name = code_base | (op_code << 40), "all_reduce"
        else:
            code = (code_base & _OPCODE_MASK) | (_OPCODES["reduce"] << 56) | (op_code << 40)
            name = "reduce"
        args = [
            tensor.data_ptr(), numel, kind, op, root, code, half, self._prev_first, target, 0,
            flags.spin_budget_ns(),
        ]
        status = self._core.all_reduce(*args)
        if status:
            self._resume_core(status, self._core.all_reduce, args, name, start)
        flags.seq = self._prev_first = target
        if root < 0 or root == self.rank:
            _increment_version((tensor,))  # the core wrote the bytes behind torch's back

    def _resume_core(self, status: int, call, args: list, name: str, start: float) -> None:
        """Finishes the waits the core gave up on, resuming ``call(*args)`` after each (see
        :meth:`_core_round`); a descriptor mismatch raises through :meth:`_check`."""
        flags = self.flags
        code, half, enter, target = args[-6], args[-5], args[-4], args[-3]
        while status:
            if status == _core.ENTER_WAIT:
                flags.wait_all(enter, name, start)
                args[-2] = 1
            else:  # published: this rank's seq moved on whatever happens next
                flags.seq = self._prev_first = target
                if status == _core.EXCHANGE_WAIT:
                    flags.wait_all(target, name, start)
                    args[-2] = 2
                else:  # the core stored descriptor B itself: read it back for the message
                    self._check(half, code, flags.words[flags.desc_idx[self.rank][2 + half]])
                    raise AssertionError(f"the compiled core returned status {status}")
            status = call(*args)

    def _plan_core(self, tensor: torch.Tensor) -> tuple | bool:
        """``(descriptor without the op, numel, the core's dtype kind, bytes)`` for the core,
        or ``False`` where it does not apply (a dtype it lacks, empty, more than one slot)."""
        numel = tensor.numel()
        kind = _CORE_KINDS.get(tensor.dtype)
        if len(self._core_plans) >= 512:
            self._core_plans.clear()
        nbytes = numel * tensor.element_size()
        if kind is None or not 0 < nbytes <= min(self.one_shot_max, self.layout.slot_bytes):
            plan = False
        else:
            plan = (self.code("all_reduce", tensor), numel, kind, nbytes)
        self._core_plans[(tensor.dtype, numel)] = plan
        return plan

    def _all_reduce_numpy(self, tensor, op, np_fn, fast, start) -> None:
        """:meth:`all_reduce_small`'s NumPy path (``fast`` from :meth:`_plan_fast`)."""
        code_base, user, rank_arrays = fast
        code = code_base | (_OP_ARGS[op._name_][0] << 40)
        half = self._round & 1
        self._round += 1
        self._small_enter(half, code, start)
        arrays = rank_arrays[half]
        np.copyto(arrays[self.rank], user)
        self._small_exchange(half, code, start)
        run = self._quiet_run
        run(np_fn, arrays[0], arrays[1], out=user)
        for term in arrays[2:]:  # rank order, as reduce_into
            run(np_fn, user, term, out=user)
        _increment_version((tensor,))  # the write above bypassed torch's in-place bookkeeping
        if op is ReduceOp.AVG:
            divide_(tensor, self.size)

    def _small_enter(self, half: int, code: int, start: float) -> None:
        """Waits until ``half`` is free (see :meth:`_enter`) and records the call's descriptor
        (B is 0: an all-reduce of fewer than 2**40 elements); a peer already there costs one
        word read."""
        flags, words = self.flags, self.flags.words
        target = self._prev_first
        for idx in flags.peer_seq_idx:
            if words[idx] < target:
                flags.wait_all(target, "all_reduce", start)
                break
        else:
            if flags.fenced:  # the fence after the flag loads, before the slot is rewritten
                flags.wait_all(target, "all_reduce", start)
        desc = flags.desc_idx[self.rank]
        words[desc[half]] = code
        words[desc[2 + half]] = 0

    def _small_exchange(self, half: int, code: int, start: float) -> None:
        """Publishes this rank's slot, waits for every peer's and checks their descriptors."""
        flags, words = self.flags, self.flags.words
        self._prev_first = target = flags.publish()
        for idx in flags.peer_seq_idx:
            if words[idx] < target:
                flags.wait_all(target, "all_reduce", start)
                break
        else:
            if flags.fenced:
                flags.wait_all(target, "all_reduce", start)  # the fence after the flag loads
        for desc in flags.peer_desc_idx:
            if words[desc[half]] != code or words[desc[2 + half]]:
                self._check(half, code)

    def _plan_fast(self, tensor: torch.Tensor, key: tuple) -> tuple | bool:
        """``(descriptor without the op, the caller's tensor as a flat array, slot arrays per
        half)`` for the NumPy path, or ``False`` where it does not apply.

        The array is ``tensor.numpy()``: it holds the tensor, so no other tensor can be given
        its address while the entry lives (the cache is small and bounded), and an entry found
        by (address, dtype, numel) covers exactly the caller's bytes.
        """
        _, dtype, numel = key
        np_dtype = _NUMPY_DTYPES.get(dtype)
        nbytes = numel * tensor.element_size()
        if len(self._fast) >= _FAST_CACHE:
            self._fast.clear()
        if (
            np_dtype is None
            or self.size < 2  # nothing to reduce: the general path's copy does it
            or not 0 < numel < _NUMPY_MAX_NUMEL
            or nbytes > min(self.one_shot_max, self.layout.slot_bytes)
        ):
            fast = False
        else:
            seg = self._u8.numpy()
            arrays = [
                [
                    seg[self.layout.slot(h, r) : self.layout.slot(h, r) + nbytes].view(np_dtype)
                    for r in range(self.size)
                ]
                for h in range(2)
            ]
            fast = (self.code("all_reduce", tensor), tensor.numpy().reshape(-1), arrays)
        self._fast[key] = fast
        return fast

    def _plan_small(self, tensor: torch.Tensor) -> tuple | bool:
        """``(descriptor without the op, slot views per half)`` for a one-slot all-reduce of
        tensors like ``tensor``, or ``False`` when they are too large for one."""
        nbytes = tensor.numel() * tensor.element_size()
        if len(self._small) >= 512:
            self._small.clear()
        if (
            tensor.dtype not in _DTYPE_CODES
            or not 0 < nbytes <= min(self.one_shot_max, self.layout.slot_bytes)
        ):
            plan = False
        else:
            numel = tensor.numel()
            plan = (
                self.code("all_reduce", tensor),
                [
                    [s[:numel].view(tensor.shape) for s in self.slots(h, tensor.dtype)[: self.size]]
                    for h in range(2)
                ],
            )
        self._small[(tensor.dtype, tensor.shape)] = plan
        return plan

    def _one_shot(self, tensor, op, name, start, code, code_b, root, factor=None) -> None:
        if tensor.numel() * tensor.element_size() > self.layout.slot_bytes:
            pieces = tensor.view(-1).split(self.layout.slot_bytes // tensor.element_size())
        else:
            pieces = (tensor,)
        flags = self.flags
        for i, piece in enumerate(pieces):
            half = self._enter(name, start, code, code_b)
            key = (half, piece.dtype, piece.shape)
            views = self._views.get(key)
            if views is None:  # slot views shaped like the piece: no per-call view or flatten
                numel = piece.numel()
                slots = self.slots(half, piece.dtype)[: self.size]
                views = [s[:numel].view(piece.shape) for s in slots]
                self._remember(key, views)
            views[self.rank].copy_(piece)
            if factor is not None:
                self._publish_factor(half, factor)
            self._first_publish()
            if i == 0:  # every rank, a reduce's non-roots too, checks the call
                flags.wait_all(flags.seq, name, start)
                self._check(half, code, code_b)
            if root is not None and root != self.rank:
                continue
            if i > 0:
                flags.wait_all(flags.seq, name, start)
            if factor is None:
                self.reduce(piece, views, op)
            else:
                self._reduce_premul(piece, views, half, factor)

    def _publish_factor(self, half: int, factor: float) -> None:
        """Stores this rank's PremulSum factor for ``half`` (before the round's first publish,
        which makes it visible with the data)."""
        bits = _FLOAT_BITS.unpack(_FLOAT_BITS_D.pack(factor))[0]
        self.flags.words[self._factor_idx[self.rank][half]] = bits

    def _reduce_premul(
        self, out: torch.Tensor, terms: list[torch.Tensor], half: int, factor: float
    ) -> None:
        """``out = terms[0] * f0 + terms[1] * f1 + ...`` in rank order, ``f`` the factor rank
        ``q`` published for ``half``: every product rounded in the dtype, as ``mul_`` then
        ``SUM``. ``out`` aliases no term."""
        words, idx = self.flags.words, self._factor_idx
        mine = words[idx[self.rank][half]]
        if all(words[idx[p][half]] == mine for p in self.flags.peers):  # the usual case
            _core.reduce(
                out.data_ptr(),
                [term.data_ptr() for term in terms],
                out.numel(),
                _PREMUL_KINDS[out.dtype],
                _core.OP_SUM,
                factor,
            )
            _increment_version((out,))  # written behind torch's back (as the NumPy path)
            return
        factors = [
            _FLOAT_BITS_D.unpack(_FLOAT_BITS.pack(words[idx[q][half]]))[0]
            for q in range(self.size)
        ]
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
        entry = self._views.get(key)
        if entry is None:
            bounds = self._bounds(count, esize)
            sizes = [bounds[p + 1] - bounds[p] for p in range(self.size)]
            slots = self.slots(half, dtype)
            entry = ([s[:count].split(sizes) for s in slots], slots[self.size][:count])
            self._remember(key, entry)
        return entry

    def _two_step(self, flat, op, name, start, code, code_b, root, factor=None) -> None:
        n, rank, flags = self.size, self.rank, self.flags
        esize = flat.element_size()
        counts = [count for _, count in self._chunks(flat.numel(), self.layout.slot_bytes // esize)]
        piece_sizes = []
        for count in counts:
            bounds = self._bounds(count, esize)
            piece_sizes += [bounds[p + 1] - bounds[p] for p in range(n)]
        pieces = flat.split(piece_sizes)  # every round's slices of the tensor, in one call
        chunks = flat.split(counts)
        peers = flags.peers
        for i, count in enumerate(counts):
            half = self._enter(name, start, code, code_b)
            grid, result = self._grid(half, flat.dtype, count, esize)
            mine, own = grid[rank], pieces[i * n : (i + 1) * n]
            for p in peers:  # copy in the slices the peers reduce; ours is read in place
                mine[p].copy_(own[p])
            if factor is not None:
                self._publish_factor(half, factor)
            self._first_publish()
            flags.wait_all(flags.seq, name, start)
            if i == 0:
                self._check(half, code, code_b)
            out = grid[n][rank]  # our slice of the shared result slot
            terms = [own[rank] if q == rank else grid[q][rank] for q in range(n)]
            if factor is None:
                self.reduce(out, terms, op)
            else:
                self._reduce_premul(out, terms, half, factor)
            flags.publish()
            if root is not None and root != rank:
                continue
            flags.wait_all(flags.seq, name, start)
            chunks[i].copy_(result)  # every rank's reduced slice, in one copy

    def broadcast(self, flat: torch.Tensor, src: int) -> None:
        """Copies ``flat`` of rank ``src`` into ``flat`` of every rank. The source waits, in the
        first round, until every peer published its descriptor: all ranks agree or all raise."""
        self._broadcast(flat, src, time.monotonic())

    def broadcast_small(self, tensor: torch.Tensor, src: int, start: float) -> int:
        """:meth:`broadcast` of a tensor that fits one slot, for a caller's synchronous fast
        path (as :meth:`all_reduce_small`): one C call where the compiled core takes it.

        Args:
            tensor: a contiguous CPU tensor of any shape (what the communicator's fast path
                checks).
            src: the source rank.
            start: when the call began (``time.monotonic()``).

        Returns:
            the bytes broadcast, or 0, having done nothing, when it does not apply (empty, more
            than one slot, ``src`` not a rank, a dtype the communicator does not move).
        """
        info = _DTYPE_INFO.get(tensor.dtype)
        if info is None or src.__class__ is not int or not 0 <= src < self.size:
            return 0
        numel = tensor.numel()
        nbytes = numel * info[0]
        if not 0 < nbytes <= self.layout.slot_bytes:
            return 0
        if self._core is not None and not tensor.requires_grad:
            code = (_OPCODES["broadcast"] << 56) | info[1] | numel
            args = [tensor.data_ptr(), nbytes, src, code]
            self._core_round(self._core.broadcast, args, "broadcast", start)
            if self.rank != src:
                _increment_version((tensor,))
            return nbytes
        self._broadcast(tensor.view(-1), src, start)
        return nbytes

    def _broadcast(self, flat: torch.Tensor, src: int, start: float) -> None:
        rank, numel = self.rank, flat.numel()
        if (
            self._core is not None
            and numel * flat.element_size() <= self.layout.slot_bytes
            and self._core_takes(flat)
        ):
            code = (_OPCODES["broadcast"] << 56) | (_DTYPE_CODES[flat.dtype] << 48) | numel
            args = [flat.data_ptr(), numel * flat.element_size(), src, code]
            self._core_round(self._core.broadcast, args, "broadcast", start)
            if rank != src:
                _increment_version((flat,))
            return
        code, code_b = self.code("broadcast", flat), _code_b(numel, src)
        flags = self.flags
        for offset, count in self._chunks(numel, self.layout.slot_bytes // flat.element_size()):
            half = self._enter("broadcast", start, code, code_b)
            view = self.slots(half, flat.dtype)[src][:count]
            if rank == src:
                view.copy_(flat[offset : offset + count])
            self._first_publish()
            if offset == 0:  # the source too: every rank checks the call
                flags.wait_all(flags.seq, "broadcast", start)
                self._check(half, code, code_b)
            elif rank != src:
                flags.wait_all(flags.seq, "broadcast", start, [src])
            if rank != src:
                flat[offset : offset + count].copy_(view)

    def _block(self, half: int, dtype: torch.dtype, rows: int, count: int) -> torch.Tensor:
        """Every rank's slot in ``half`` as one ``(size, rows, count)`` view (slot ``q`` holding
        ``rows`` rows of ``count`` elements), cached: one op then moves all ranks' rows."""
        key = (half, dtype, rows, count, "block")
        block = self._views.get(key)
        if block is None:
            first = self.slots(half, dtype)[0]
            stride = self.layout.slot_bytes // first.element_size()
            block = first.as_strided((self.size, rows, count), (stride, count, 1))
            self._remember(key, block)
        return block

    def _remember(self, key: tuple, views) -> None:
        """Caches views of the segment; bounded, since every new size adds an entry."""
        if len(self._views) >= 512:
            self._views.clear()
        self._views[key] = views

    def all_gather(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        self._all_gather(out, flat, time.monotonic())

    def all_gather_small(self, out: torch.Tensor, input: torch.Tensor, start: float) -> int:
        """:meth:`all_gather` of an input that fits one slot, for a caller's synchronous fast
        path (as :meth:`all_reduce_small`): one C call where the compiled core takes it.

        Args:
            out: a contiguous CPU tensor of any shape, ``size`` times ``input``'s elements.
            input: a contiguous CPU tensor of any shape, ``out``'s dtype.
            start: when the call began (``time.monotonic()``).

        Returns:
            the input's bytes, or 0, having done nothing, when it does not apply (empty, more
            than one slot, mismatched sizes or dtypes).
        """
        info = _DTYPE_INFO.get(input.dtype)
        m = input.numel()
        if info is None or out.dtype != input.dtype or out.numel() != self.size * m:
            return 0
        nbytes = m * info[0]
        if not 0 < nbytes <= self.layout.slot_bytes:
            return 0
        if self._core is not None and not out.requires_grad:
            code = (_OPCODES["all_gather"] << 56) | info[1] | m
            args = [out.data_ptr(), input.data_ptr(), nbytes, code]
            self._core_round(self._core.all_gather, args, "all_gather", start)
            _increment_version((out,))
            return nbytes
        self._all_gather(out.view(-1), input.view(-1), start)
        return nbytes

    def _all_gather(self, out: torch.Tensor, flat: torch.Tensor, start: float) -> None:
        n, rank, m = self.size, self.rank, flat.numel()
        esize = flat.element_size()
        if (
            self._core is not None
            and m * esize <= self.layout.slot_bytes
            and self._core_takes(out)
            and self._core_takes(flat)
        ):
            code = (_OPCODES["all_gather"] << 56) | (_DTYPE_CODES[flat.dtype] << 48) | m
            args = [out.data_ptr(), flat.data_ptr(), m * esize, code]
            self._core_round(self._core.all_gather, args, "all_gather", start)
            _increment_version((out,))
            return
        code = self.code("all_gather", flat)
        out2d = out.view(n, m)
        for offset, count in self._chunks(m, self.layout.slot_bytes // esize):
            half = self._enter("all_gather", start, code)
            block = self._block(half, flat.dtype, 1, count)
            whole = count == m  # one round: no slicing at all
            block[rank, 0].copy_(flat if whole else flat[offset : offset + count])
            self._first_publish()
            self.flags.wait_all(self.flags.seq, "all_gather", start)
            if offset == 0:
                self._check(half, code)
            (out2d if whole else out2d[:, offset : offset + count]).copy_(block[:, 0])

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, op: ReduceOp) -> None:
        self._reduce_scatter(out, flat, op, time.monotonic())

    def reduce_scatter_small(
        self, out: torch.Tensor, input: torch.Tensor, op: ReduceOp, start: float
    ) -> int:
        """:meth:`reduce_scatter` of an input that fits one slot, for a caller's synchronous
        fast path (as :meth:`all_reduce_small`): one C call where the compiled core takes it
        (its dtypes; ``SUM``, ``AVG``, ``PRODUCT``), else the Python path.

        Args:
            out: a contiguous CPU tensor of any shape.
            input: a contiguous CPU tensor of any shape, ``size`` times ``out``'s elements, of
                its dtype.
            op: the reduction (not a ``PremulSum``).
            start: when the call began (``time.monotonic()``).

        Returns:
            the input's bytes, or 0, having done nothing, when it does not apply (empty, more
            than one slot, mismatched sizes or dtypes).
        """
        info = _DTYPE_INFO.get(input.dtype)
        m = out.numel()
        if (
            info is None
            or out.dtype != input.dtype
            or input.numel() != self.size * m
            or op.__class__ is not ReduceOp
        ):
            return 0
        nbytes = self.size * m * info[0]
        if not 0 < nbytes <= self.layout.slot_bytes:
            return 0
        core_op = _CORE_OPS.get(op._name_)
        kind = _CORE_KINDS.get(input.dtype)
        if self._core is not None and core_op and kind is not None and not out.requires_grad:
            code = (_OPCODES["reduce_scatter"] << 56) | info[1] | (core_op[0] << 40) | m
            args = [out.data_ptr(), input.data_ptr(), m, kind, core_op[1], code]
            self._core_round(self._core.reduce_scatter, args, "reduce_scatter", start)
            _increment_version((out,))
            return nbytes
        self._reduce_scatter(out.view(-1), input.view(-1), op, start)
        return nbytes

    def _reduce_scatter(
        self, out: torch.Tensor, flat: torch.Tensor, op: ReduceOp, start: float
    ) -> None:
        n, rank, m = self.size, self.rank, out.numel()
        esize = flat.element_size()
        code = self.code("reduce_scatter", out, _OP_CODES[op])
        if self._core is not None and n * m * esize <= self.layout.slot_bytes:
            kind, core_op = _CORE_KINDS.get(flat.dtype), _CORE_OPS.get(op._name_)
            if (
                kind is not None
                and core_op is not None
                and self._core_takes(out)
                and self._core_takes(flat)
            ):
                args = [out.data_ptr(), flat.data_ptr(), m, kind, core_op[1], code]
                self._core_round(self._core.reduce_scatter, args, "reduce_scatter", start)
                _increment_version((out,))
                return
        in2d = flat.view(n, m)
        # an output sharing bytes with our own row: that row is reduced from our slot instead
        # (a reduction's output may alias its first two terms only), as the compiled core does
        row = m * esize
        own_in_slot = _overlap(out.data_ptr(), row, flat.data_ptr() + rank * row, row)
        for offset, count in self._chunks(m, self.layout.slot_bytes // esize // n):
            half = self._enter("reduce_scatter", start, code)
            block = self._block(half, flat.dtype, n, count)  # [source rank, destination rank]
            part = in2d if count == m else in2d[:, offset : offset + count]
            for p in self.flags.peers:
                block[rank, p].copy_(part[p])
            if own_in_slot:
                block[rank, rank].copy_(part[rank])
            self._first_publish()
            self.flags.wait_all(self.flags.seq, "reduce_scatter", start)
            if offset == 0:
                self._check(half, code)
            target = out if count == m else out[offset : offset + count]
            own = block[rank, rank] if own_in_slot else part[rank]
            self.reduce(target, [own if q == rank else block[q, rank] for q in range(n)], op)

    def all_to_all(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        self._all_to_all(out, flat, time.monotonic())

    def all_to_all_small(self, out: torch.Tensor, input: torch.Tensor, start: float) -> int:
        """:meth:`all_to_all` of an input that fits one slot, for a caller's synchronous fast
        path (as :meth:`all_reduce_small`): one C call where the compiled core takes it.

        Args:
            out: a contiguous CPU tensor of any shape, ``input``'s elements and dtype.
            input: a contiguous CPU tensor of any shape, a multiple of ``size`` elements.
            start: when the call began (``time.monotonic()``).

        Returns:
            the input's bytes, or 0, having done nothing, when it does not apply (empty, more
            than one slot, mismatched sizes or dtypes).
        """
        info = _DTYPE_INFO.get(input.dtype)
        numel = input.numel()
        if info is None or out.dtype != input.dtype or out.numel() != numel or numel % self.size:
            return 0
        nbytes = numel * info[0]
        if not 0 < nbytes <= self.layout.slot_bytes:
            return 0
        if self._core is not None and not out.requires_grad:
            code = (_OPCODES["all_to_all"] << 56) | info[1] | numel
            args = [out.data_ptr(), input.data_ptr(), nbytes // self.size, code]
            self._core_round(self._core.all_to_all, args, "all_to_all", start)
            _increment_version((out,))
            return nbytes
        self._all_to_all(out.view(-1), input.view(-1), start)
        return nbytes

    def _all_to_all(self, out: torch.Tensor, flat: torch.Tensor, start: float) -> None:
        n, rank = self.size, self.rank
        m, esize = flat.numel() // n, flat.element_size()
        code = self.code("all_to_all", flat)
        if (
            self._core is not None
            and n * m * esize <= self.layout.slot_bytes
            and self._core_takes(out)
            and self._core_takes(flat)
        ):
            args = [out.data_ptr(), flat.data_ptr(), m * esize, code]
            self._core_round(self._core.all_to_all, args, "all_to_all", start)
            _increment_version((out,))
            return
        in2d, out2d = flat.view(n, m), out.view(n, m)
        for offset, count in self._chunks(m, self.layout.slot_bytes // esize // n):
            half = self._enter("all_to_all", start, code)
            block = self._block(half, flat.dtype, n, count)  # [source rank, destination rank]
            whole = count == m
            block[rank].copy_(in2d if whole else in2d[:, offset : offset + count])
            self._first_publish()
            self.flags.wait_all(self.flags.seq, "all_to_all", start)
            if offset == 0:
                self._check(half, code)
            # in place (out is flat) is safe: this chunk of the input was copied in above
            (out2d if whole else out2d[:, offset : offset + count]).copy_(block[:, rank])

    def barrier(self) -> None:
        self.barrier_small(time.monotonic())

    def barrier_small(self, start: float) -> int:
        """:meth:`barrier` for a caller's synchronous fast path (``start``: when the call
        began); one C call where the compiled core is on. Returns 1 (it always applies)."""
        code = _OPCODES["barrier"] << 56
        if self._core is not None:
            self._core_round(self._core.barrier, [code], "barrier", start)
            return 1
        half = self._enter("barrier", start, code)
        self._first_publish()
        self.flags.wait_all(self.flags.seq, "barrier", start)
        self._check(half, code)
        return 1

    # ------------------------------------------------------------------ point to point
    # Any contiguous CPU tensor goes as its bytes. A chunk (at most one mailbox slot) is one C
    # call where the compiled core is built: it spins without the GIL for the spin budget and
    # says when the wait is not over; the wait is then finished here (timeouts, peer checks,
    # futex sleep) and the call resumed, as a collective's round is (_core_round).
    def _mailbox(self, src: int, dst: int, k: int) -> torch.Tensor:
        offset = self.layout.mailbox(src, dst, k)
        return self._u8[offset : offset + self.layout.mbox_bytes]

    def send(self, data: torch.Tensor, dst: int, start: float | None = None) -> None:
        """Streams the bytes of ``data`` (contiguous, on the CPU) through the two mailbox slots
        of (this rank, ``dst``), one chunk of at most ``mbox_bytes - 64`` per slot; ``start``:
        when the call began (default: now)."""
        if start is None:
            start = time.monotonic()
        if self._core is None or data.requires_grad:
            self._send_python(data.view(-1).view(torch.uint8), dst, start)
        else:
            self._stream_core("send", data, dst, start)

    def recv(self, data: torch.Tensor, src: int, start: float | None = None) -> None:
        """Receives the bytes of ``data`` (contiguous, on the CPU) from ``src`` (as
        :meth:`send` streams them).

        Raises:
            FastcommError: ``src`` sent another number of bytes (nothing is copied).
        """
        if start is None:
            start = time.monotonic()
        if self._core is None or data.requires_grad:
            self._recv_python(data.view(-1).view(torch.uint8), src, start)
        else:
            self._stream_core("recv", data, src, start)
            _increment_version((data,))

    def _stream_core(self, op: str, data: torch.Tensor, peer: int, start: float) -> None:
        """:meth:`send` or :meth:`recv` (``op``) on the compiled core, one call per chunk. A
        send waits for the slot (the peer's ``acked`` of the pair reaching ``k - 1``), a recv
        for the chunk (the peer's ``sent`` reaching ``k + 1``); each announces itself in the
        word after its own counter of the pair while it sleeps."""
        core, flags = self._core, self.flags
        idx = self._p2p_idx[peer]  # the pair's four counters (_p2p_words)
        if op == "send":
            call, counters, waiting = core.send, self._sent, _core.SLOT_WAIT
            word, announce, ahead = idx[1], idx[0] + 1, -1
        else:
            call, counters, waiting = core.recv, self._received, _core.MESSAGE_WAIT
            word, announce, ahead = idx[2], idx[3] + 1, 1
        total = data.numel() * data.element_size()
        addr, room, offset = data.data_ptr(), self._mbox_room, 0
        while True:
            count = min(room, total - offset)
            k = counters[peer]
            status = call(addr + offset, count, total, peer, k, flags.spin_budget_ns())
            if status == waiting:
                flags.wait_word(word, k + ahead, peer, op, start, announce_idx=announce)
                status = call(addr + offset, count, total, peer, k, 0)
            if status:
                if status == _core.SIZE_MISMATCH:
                    self._size_mismatch(total, peer, k)
                raise AssertionError(f"the compiled core's {op} returned status {status}")
            counters[peer] = k + 1
            offset += count
            if offset >= total:
                return

    def _size_mismatch(self, expected: int, src: int, k: int) -> None:
        """Raises for a message whose header (chunk ``k`` from ``src``) holds another size."""
        sent = self.flags.words[self.layout.mailbox(src, self.rank, k & 1) // 8]
        raise FastcommError(
            f"rank {self.rank}: recv from rank {src} expected {expected} bytes but rank {src} "
            f"sent {sent}"
        )

    def _send_python(self, data: torch.Tensor, dst: int, start: float) -> None:
        """:meth:`send` of ``data`` (bytes) without the compiled core: the same protocol."""
        flags = self.flags
        sent_idx, acked_idx = self._p2p_idx[dst][:2]
        for offset, count in self._chunks(data.numel(), self._mbox_room):
            k = self._sent[dst]
            if k >= 2:  # slot k % 2 is free once the receiver took chunk k - 2
                flags.wait_word(acked_idx, k - 1, dst, "send", start, announce_idx=sent_idx + 1)
            box = self._mailbox(self.rank, dst, k & 1)
            header = box[:24].view(torch.int64)  # total bytes, tag 0, dtype not said (p2p.py)
            header[0], header[1], header[2] = data.numel(), 0, 0
            box[_MBOX_HEADER : _MBOX_HEADER + count].copy_(data[offset : offset + count])
            self._sent[dst] = k + 1
            flags.set_word(sent_idx, k + 1, acked_idx + 1)

    def _recv_python(self, data: torch.Tensor, src: int, start: float) -> None:
        """:meth:`recv` into ``data`` (bytes) without the compiled core: the same protocol."""
        flags = self.flags
        sent_idx, acked_idx = self._p2p_idx[src][2:]
        for offset, count in self._chunks(data.numel(), self._mbox_room):
            k = self._received[src]
            flags.wait_word(sent_idx, k + 1, src, "recv", start, announce_idx=acked_idx + 1)
            if flags.fenced:  # the chunk's bytes after the counter (module docstring of flags)
                fence()
            box = self._mailbox(src, self.rank, k & 1)
            if int(box[:8].view(torch.int64)[0]) != data.numel():
                self._size_mismatch(data.numel(), src, k)
            data[offset : offset + count].copy_(box[_MBOX_HEADER : _MBOX_HEADER + count])
            self._received[src] = k + 1
            flags.set_word(acked_idx, k + 1, sent_idx + 1)
