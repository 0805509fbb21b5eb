"""Data movement over a segment's slots: broadcast, all-gather, all-to-all and barrier, one
entry point per op.

Each entry runs the round in one C call when the call fits one slot and the compiled core
takes it, else streams any size through the slots in Python rounds (one publish a round).
Gather, scatter and the uneven all-to-all are v-calls (``vschedules``). Protocol:
``docs/shm.md``.
"""

from __future__ import annotations

import torch

from ..calls import DTYPE_SIZE_AND_FIELD, OP_CODES, shm_word_a, shm_word_b
from .core import CompiledRounds
from .rounds import Rounds, chunks

__all__ = ["Movement"]

_increment_version = torch._C._increment_version
_BROADCAST, _ALL_GATHER, _ALL_TO_ALL = (OP_CODES[op] << 56 for op in
                                        ("broadcast", "all_gather", "all_to_all"))
_BARRIER = OP_CODES["barrier"] << 56


def _takes_address(tensor: torch.Tensor) -> bool:
    """Whether the compiled core may read and write ``tensor`` through its address."""
    return tensor.is_cpu and tensor.is_contiguous() and not tensor.requires_grad


class Movement:
    """One rank's data-movement collectives.

    Args:
        rounds: the rank's rounds.
        compiled: the compiled core, or ``None``.
    """

    def __init__(self, rounds: Rounds, compiled: CompiledRounds | None) -> None:
        self.rounds = rounds
        self.flags = rounds.flags
        self.rank, self.size = rounds.rank, rounds.size
        self.compiled = compiled

    def broadcast(self, tensor: torch.Tensor, src: int, start: float) -> None:
        """Copies ``tensor`` of rank ``src`` into ``tensor`` of every rank. The source waits, in
        the first round, until every peer published its descriptor: all agree or all raise."""
        numel = tensor.numel()
        esize, dtype_field = DTYPE_SIZE_AND_FIELD[tensor.dtype]
        nbytes = numel * esize
        if self.compiled is not None and 0 < nbytes <= self.rounds.slot_bytes and (
                _takes_address(tensor)):
            self.compiled.broadcast(tensor.data_ptr(), nbytes, src,
                                    _BROADCAST | dtype_field | numel, start)
            if self.rank != src:
                _increment_version((tensor,))
            return
        self._broadcast_rounds(tensor.view(-1), src, start)

    def _broadcast_rounds(self, flat: torch.Tensor, src: int, start: float) -> None:
        rank, numel, rounds, flags = self.rank, flat.numel(), self.rounds, self.flags
        word_a, word_b = shm_word_a("broadcast", flat), shm_word_b(numel, src)
        for offset, count in chunks(numel, rounds.slot_bytes // flat.element_size()):
            half = rounds.enter("broadcast", start, word_a, word_b)
            view = rounds.slots(half, flat.dtype)[src][:count]
            if rank == src:
                view.copy_(flat[offset : offset + count])
            rounds.publish_first()
            if offset == 0:  # the source too: every rank checks the call
                flags.wait_all(flags.seq, "broadcast", start)
                rounds.check(half, word_a, word_b)
            elif rank != src:
                flags.wait_all(flags.seq, "broadcast", start, [src])
            if rank != src:
                flat[offset : offset + count].copy_(view)

    def all_gather(self, out: torch.Tensor, input: torch.Tensor, start: float) -> None:
        """Every rank's ``input`` into ``out`` (``size`` times its elements), in rank order."""
        m = input.numel()
        esize, dtype_field = DTYPE_SIZE_AND_FIELD[input.dtype]
        if self.compiled is not None and 0 < m * esize <= self.rounds.slot_bytes and (
                _takes_address(out) and _takes_address(input)):
            self.compiled.all_gather(out.data_ptr(), input.data_ptr(), m * esize,
                                     _ALL_GATHER | dtype_field | m, start)
            _increment_version((out,))
            return
        self._all_gather_rounds(out.view(-1), input.view(-1), start)

    def _all_gather_rounds(self, out: torch.Tensor, flat: torch.Tensor, start: float) -> None:
        n, rank, m, rounds = self.size, self.rank, flat.numel(), self.rounds
        word_a = shm_word_a("all_gather", flat)
        out2d = out.view(n, m)
        for offset, count in chunks(m, rounds.slot_bytes // flat.element_size()):
            half = rounds.enter("all_gather", start, word_a)
            block = rounds.rows_of_every_slot(half, flat.dtype, 1, count)
            whole = count == m  # one round: no slicing at all
            block[rank, 0].copy_(flat if whole else flat[offset : offset + count])
            rounds.publish_first()
            self.flags.wait_all(self.flags.seq, "all_gather", start)
            if offset == 0:
                rounds.check(half, word_a)
            (out2d if whole else out2d[:, offset : offset + count]).copy_(block[:, 0])

    def all_to_all(self, out: torch.Tensor, input: torch.Tensor, start: float) -> None:
        """Row ``r`` of ``input`` (``size`` equal rows) to rank ``r``; row ``q`` of ``out`` from
        rank ``q``."""
        numel = input.numel()
        esize, dtype_field = DTYPE_SIZE_AND_FIELD[input.dtype]
        nbytes = numel * esize
        if self.compiled is not None and 0 < nbytes <= self.rounds.slot_bytes and (
                _takes_address(out) and _takes_address(input)):
            self.compiled.all_to_all(out.data_ptr(), input.data_ptr(), nbytes // self.size,
                                     _ALL_TO_ALL | dtype_field | numel, start)
            _increment_version((out,))
            return
        self._all_to_all_rounds(out.view(-1), input.view(-1), start)

    def _all_to_all_rounds(self, out: torch.Tensor, flat: torch.Tensor, start: float) -> None:
        n, rank, rounds = self.size, self.rank, self.rounds
        m, esize = flat.numel() // n, flat.element_size()
        word_a = shm_word_a("all_to_all", flat)
        in2d, out2d = flat.view(n, m), out.view(n, m)
        for offset, count in chunks(m, rounds.slot_bytes // esize // n):
            half = rounds.enter("all_to_all", start, word_a)
            block = rounds.rows_of_every_slot(half, flat.dtype, n, count)  # [source, dest]
            whole = count == m
            block[rank].copy_(in2d if whole else in2d[:, offset : offset + count])
            rounds.publish_first()
            self.flags.wait_all(self.flags.seq, "all_to_all", start)
            if offset == 0:
                rounds.check(half, word_a)
            # in place (out is flat) is safe: this chunk of the input was copied in above
            (out2d if whole else out2d[:, offset : offset + count]).copy_(block[:, rank])

    def barrier(self, start: float) -> None:
        """Returns once every rank entered the barrier."""
        if self.compiled is not None:
            self.compiled.barrier(_BARRIER, start)
            return
        rounds = self.rounds
        half = rounds.enter("barrier", start, _BARRIER)
        rounds.publish_first()
        self.flags.wait_all(self.flags.seq, "barrier", start)
        rounds.check(half, _BARRIER)
