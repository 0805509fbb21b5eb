"""The compiled core (``_core.c``), where it was built: the only module that imports it.

One :class:`CompiledRounds` per communicator runs a whole one-slot round in one C call when the
peers are there within the spin; a wait the core gives up on is finished in Python
(:class:`~.flags.PeerFlags`) and the call resumed. :func:`reduce_terms` is the core's reduction
(``PremulSum`` folded in), for the schedules and the DDP bucket regions. Ranks with and without
the core interoperate: both run the same protocol (``docs/shm.md``).
"""

from __future__ import annotations

import torch

from ..calls import REDUCE_OP_CODES
from ..types import ReduceOp
from .flags import PeerFlags
from .rounds import Rounds, pair_words
from .segment import Layout

try:  # built at install where a C compiler is found
    from . import _core
except ImportError:  # no compiler, or not Linux: the pure-Python path; PremulSum: mul_ + SUM
    _core = None

__all__ = [
    "BUILT",
    "CORE_KINDS",
    "CORE_OPS",
    "PREMUL_KINDS",
    "CompiledRounds",
    "Status",
    "reduce_terms",
]

BUILT = _core is not None
"""Whether the compiled core was built at install."""
# a round's stage, passed back to the core when it resumes after a wait finished here
_FRESH, _ENTERED, _EXCHANGED = 0, 1, 2


class Status:
    """What a call of the core returns (``_core.c``); the pure-Python streams return the same."""

    DONE, ENTER_WAIT, EXCHANGE_WAIT, MISMATCH = 0, 1, 2, 3
    SLOT_WAIT, MESSAGE_WAIT, SIZE_MISMATCH, TAG_OTHER = 4, 5, 6, 7
    V_DISAGREE, V_MORE = 7, 8  # v_call's statuses beyond a round's own


_DONE, _ENTER_WAIT, _EXCHANGE_WAIT = Status.DONE, Status.ENTER_WAIT, Status.EXCHANGE_WAIT

if BUILT:
    assert (_core.DONE, _core.ENTER_WAIT, _core.EXCHANGE_WAIT, _core.MISMATCH, _core.SLOT_WAIT,
            _core.MESSAGE_WAIT, _core.SIZE_MISMATCH, _core.TAG_OTHER) == tuple(range(8))

#: the core's dtype kinds
CORE_KINDS = {} if _core is None else {
    torch.float32: _core.KIND_F32,
    torch.float64: _core.KIND_F64,
    torch.int8: _core.KIND_I8,
    torch.uint8: _core.KIND_U8,
    torch.int32: _core.KIND_I32,
    torch.int64: _core.KIND_I64,
}
#: dtypes whose PremulSum the core reduces with the bits of torch's ``mul_`` then add
PREMUL_KINDS = {dtype: kind for dtype, kind in CORE_KINDS.items() if dtype.is_floating_point}
#: by the op's name (a str hashes faster than an Enum member): (the op's descriptor code, the
#: core's op)
CORE_OPS = {} if _core is None else {
    "SUM": (REDUCE_OP_CODES[ReduceOp.SUM], _core.OP_SUM),
    "AVG": (REDUCE_OP_CODES[ReduceOp.AVG], _core.OP_AVG),
    "PRODUCT": (REDUCE_OP_CODES[ReduceOp.PRODUCT], _core.OP_PRODUCT),
}

def reduce_terms(out: int, terms: list[int], numel: int, kind: int, factor: float = 1.0,
                 outs: list[int] | None = None) -> None:
    """``out = terms[0] * factor + terms[1] * factor + ...`` (addresses; rank order, each
    product rounded in the dtype) in the core; with ``outs``, the result also copied there
    chunk by chunk while in cache. The caller bumps the tensors' version counters."""
    if outs:
        _core.reduce(out, terms, numel, kind, _core.OP_SUM, factor, outs)
    else:
        _core.reduce(out, terms, numel, kind, _core.OP_SUM, factor)


class CompiledRounds:
    """The compiled core of one rank: its one-slot collectives, v-call rounds and stream chunks.

    Args:
        rounds: the rank's rounds (flags, layout, half alternation).
    """

    def __init__(self, rounds: Rounds) -> None:
        flags: PeerFlags = rounds.flags
        layout: Layout = rounds.layout
        self.rounds = rounds
        self.flags = flags
        n, me = layout.size, rounds.rank
        p2p = []  # send/recv's counters and mailboxes (one rank has none)
        if n > 1:
            boxes = [
                [0] * 4 if r == me else [layout.mailbox(me, r, 0), layout.mailbox(me, r, 1),
                                         layout.mailbox(r, me, 0), layout.mailbox(r, me, 1)]
                for r in range(n)
            ]
            p2p = [[idx for r in range(n) for idx in pair_words(layout, me, r)],
                   [offset for four in boxes for offset in four], layout.mbox_bytes]
        core = _core.SmallCore(
            flags.segment.mm,  # held by the core: the mapping outlives it
            me,
            flags.seq_idx,
            flags.wait_idx,
            [idx for r in range(n) for idx in flags.desc_idx[r]],
            [layout.slot(h, r) for h in range(2) for r in range(n)],
            layout.slot_bytes,
            *p2p,
        )
        self._all_reduce, self._broadcast = core.all_reduce, core.broadcast
        self._all_gather, self._reduce_scatter = core.all_gather, core.reduce_scatter
        self._all_to_all, self._barrier, self._v_call = core.all_to_all, core.barrier, core.v_call
        self._core = core
        self.send_chunk, self.recv_chunk = core.send, core.recv
        """``send_chunk(addr, nbytes, total, peer, k, spin_ns[, tag, dtype])`` and
        ``recv_chunk``: chunk ``k`` of a pair's stream; a :class:`Status`."""

    def lane(self, **parts):
        """The compiled usual send and recv over this core (``_core.Lane``; ``parts``: see
        :meth:`.p2p.Mailboxes.lane`)."""
        return _core.Lane(core=self._core, **parts)

    # ------------------------------------------------------------------ rounds
    def _round(self, call, args: list, name: str, start: float) -> None:
        """One round: ``args`` (the op's own, ending with descriptor A) get the round's half,
        enter, target, stage and spin; a wait the core gave up on is finished here and the
        core resumed."""
        rounds, flags = self.rounds, self.flags
        half = rounds.next_half()
        target = flags.seq + 1
        args += [half, rounds.first_seq, target, _FRESH, flags.spin_budget_ns()]
        status = call(*args)
        while status:
            if status == Status.ENTER_WAIT:
                flags.wait_all(args[-4], name, start)
                args[-2] = _ENTERED
            else:  # published: this rank's seq moved on whatever happens next
                flags.seq = rounds.first_seq = target
                if status != Status.EXCHANGE_WAIT:  # the core stored B itself: read it back
                    word_b = flags.words[flags.desc_idx[rounds.rank][2 + half]]
                    rounds.check(half, args[-6], word_b)
                    raise AssertionError(f"the compiled core returned status {status}")
                flags.wait_all(target, name, start)
                args[-2] = _EXCHANGED
            status = call(*args)
        flags.seq = rounds.first_seq = target

    def all_reduce(self, addr: int, numel: int, kind: int, op: int, root: int, word_a: int,
                   name: str, start: float) -> None:
        """Reduces ``numel`` elements at ``addr`` (``root`` -1: on every rank)."""
        self._round(self._all_reduce, [addr, numel, kind, op, root, word_a], name, start)

    def broadcast(self, addr: int, nbytes: int, src: int, word_a: int, start: float) -> None:
        self._round(self._broadcast, [addr, nbytes, src, word_a], "broadcast", start)

    def all_gather(self, out: int, inp: int, nbytes: int, word_a: int, start: float) -> None:
        self._round(self._all_gather, [out, inp, nbytes, word_a], "all_gather", start)

    def reduce_scatter(self, out: int, inp: int, numel: int, kind: int, op: int, word_a: int,
                       start: float) -> None:
        self._round(self._reduce_scatter, [out, inp, numel, kind, op, word_a], "reduce_scatter",
                    start)

    def all_to_all(self, out: int, inp: int, row_bytes: int, word_a: int, start: float) -> None:
        self._round(self._all_to_all, [out, inp, row_bytes, word_a], "all_to_all", start)

    def barrier(self, word_a: int, start: float) -> None:
        self._round(self._barrier, [word_a], "barrier", start)

    def v_call(self, plan_address: int, word_a: int, name: str, start: float) -> tuple[int, int]:
        """Round 0 of a v-call from the plan at ``plan_address`` (``vschedules``): ``(half,
        status)``, status :attr:`Status.DONE`, ``V_DISAGREE`` or ``V_MORE``."""
        rounds, flags = self.rounds, self.flags
        half = rounds.started & 1  # rounds.next_half(), inlined: a frame less per v-call
        rounds.started += 1
        target = flags.seq + 1
        first, spin = rounds.first_seq, flags.spin_budget_ns()
        status = self._v_call(plan_address, word_a, half, first, target, _FRESH, spin)
        if status == _ENTER_WAIT or status == _EXCHANGE_WAIT:
            args = [plan_address, word_a, half, first, target, _FRESH, spin]
            while status in (Status.ENTER_WAIT, Status.EXCHANGE_WAIT):
                if status == Status.ENTER_WAIT:
                    flags.wait_all(args[3], name, start)
                    args[5] = _ENTERED
                else:  # published: this rank's seq moved on whatever happens next
                    flags.seq = rounds.first_seq = target
                    flags.wait_all(target, name, start)
                    args[5] = _EXCHANGED
                status = self._v_call(*args)
        flags.seq = rounds.first_seq = target
        if status == _DONE:  # the usual outcome: one comparison
            return half, status
        if status == Status.MISMATCH:
            rounds.check(half, word_a)
        if status not in (Status.DONE, Status.V_DISAGREE, Status.V_MORE):
            raise AssertionError(f"the compiled core's v_call returned status {status}")
        return half, status
