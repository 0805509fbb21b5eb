"""A rank's schedules over its segment: one entry point per op.

:class:`SegmentSchedules` builds the parts (``rounds``, ``core``, ``reductions``, ``movement``,
``streams``, ``vschedules``) and exposes each op's single entry, which chooses the compiled core
or the Python rounds itself. Every entry takes contiguous CPU tensors (the communicator checks
its arguments) and the time the call began, for timeouts and messages. Protocol:
``docs/shm.md``.
"""

from __future__ import annotations

import torch

from ..reduction import Reduction
from .core import BUILT, CompiledRounds
from .flags import PeerFlags
from .movement import Movement
from .reductions import Reductions
from .rounds import Rounds
from .segment import Layout
from .streams import Streams
from .vschedules import VSchedule

__all__ = ["SegmentSchedules"]


class SegmentSchedules:
    """Every collective and stream of one rank over the slots and mailboxes of a segment.

    Args:
        flags: this rank's flags.
        layout: the segment's layout.
        u8: the whole segment as a flat ``uint8`` tensor.
        one_shot_max: largest all-reduce (bytes) done in one shot.
        reduce: the :data:`~..reduction.Reduction` of every reducing op (default torch ops in
            the buffers' dtype); the same kind on every rank.
        compiled: use the compiled core where it was built and the reduction is the default.
            Ranks with and without it interoperate.

    Entries (``start``: ``time.monotonic()`` when the call began): ``all_reduce(tensor, op,
    start)``, ``reduce(tensor, root, op, start)``, ``broadcast(tensor, src, start)``,
    ``all_gather(out, input, start)``, ``reduce_scatter(out, input, op, start)``,
    ``all_to_all(out, input, start)``, ``barrier(start)``, ``send(data, dst, start)``,
    ``recv(data, src, start)``, ``v_call(kind, root, outputs, inputs)`` and
    ``v_split(output, input, out_bytes, in_bytes)``; a rank whose call differs from a peer's
    raises :class:`~..errors.FastcommError` on every rank.
    """

    def __init__(self, flags: PeerFlags, layout: Layout, u8: torch.Tensor, one_shot_max: int,
                 reduce: Reduction | None = None, compiled: bool = True) -> None:
        self.rounds = rounds = Rounds(flags, layout, u8, one_shot_max)
        self.compiled = CompiledRounds(rounds) if compiled and BUILT and reduce is None else None
        self.reductions = Reductions(rounds, self.compiled, one_shot_max, reduce)
        self.movement = Movement(rounds, self.compiled)
        self.streams = Streams(rounds, self.compiled)
        self.v = VSchedule(rounds, self.compiled)
        self.reduction = self.reductions.reduction  # the Reduction every reducing op calls
        # the entries, bound once: a call costs no forwarding frame
        self.all_reduce = self.reductions.all_reduce
        self.reduce = self.reductions.reduce
        self.reduce_scatter = self.reductions.reduce_scatter
        self.broadcast = self.movement.broadcast
        self.all_gather = self.movement.all_gather
        self.all_to_all = self.movement.all_to_all
        self.barrier = self.movement.barrier
        self.send = self.streams.send
        self.recv = self.streams.recv
        self.v_call = self.v.run
        self.v_split = self.v.run_split

    def fuses_premul(self, dtype: torch.dtype) -> bool:
        """Whether ``all_reduce`` folds a ``PremulSum`` of ``dtype`` into the reduction."""
        return self.reductions.fuses_premul(dtype)
