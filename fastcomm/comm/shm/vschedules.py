"""The shm schedule of a v-call (``fastcomm.comm.vcoll``): pieces of any size from every rank
to every rank through the segment's slots, the sizes agreed inside the call's first round.

Round 0: every rank writes a header at the start of its slot -- its row (``vcoll.row_of``: op,
root, dtype, the bytes it sends to each rank and expects from each), then, per destination, the
index of the buffer it sends there -- and the first chunk of each distinct buffer it sends to a
peer, publishes, and waits for every peer (descriptor word A, compared as every shm collective
compares it, carries only the opcode: the op, root, dtype and sizes are compared from the
headers, so a disagreement on them is a :class:`~..vcoll.SizesDisagreement` on every rank
with the same message, and since every rank took part in the round the communicator stays
usable). Every rank then holds every row, so every rank computes the same number of rounds.

Chunks: rank ``q`` with ``m`` distinct buffers to send (an ``all_gather_v`` sends one buffer to
everyone, a ``scatter`` root one per rank) gives each of them ``c_q = (slot_bytes - header) //
m`` bytes of its slot (64-byte aligned); round ``k`` holds bytes ``[k c_q, (k + 1) c_q)`` of
each. Rounds run until the longest buffer of any rank is through, at least one (a call moving
nothing is the header's round alone). Readers copy their piece of every peer's slot straight
into their output; a rank's piece to itself is one local copy, after the check.

Bytes move with ``ctypes.memmove`` between the caller's tensors and the segment: at 4 KiB a
torch ``copy_`` (dispatcher, TensorIterator) costs more than the bytes, and any dtype moves.
An output's version counter is bumped as a torch in-place op would.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from ..vcoll import HEAD, disagreement, raise_disagreement, row_of
from .schedules import _OPCODES, SegmentSchedules

__all__ = ["VSchedule"]

_memmove = ctypes.memmove
_increment_version = torch._C._increment_version
_CODE = _OPCODES["all_to_all_v"] << 56


class VSchedule:
    """Runs v-calls for one rank over the slots of ``schedules``' segment.

    Args:
        schedules: the communicator's segment schedules (rounds, flags, layout).
    """

    def __init__(self, schedules: SegmentSchedules) -> None:
        self.s = schedules
        layout = schedules.layout
        n = self.size = layout.size
        self.rank = schedules.rank
        self.width = HEAD + 3 * n  # a header's words: the row, then the buffer per destination
        self.header = -(-8 * self.width // 64) * 64
        self.slot_bytes = layout.slot_bytes
        base = schedules._u8.data_ptr()
        self.slots = [[base + layout.slot(h, r) for r in range(n)] for h in range(2)]
        words = schedules._u8.numpy().view(np.int64)
        # every rank's header in each half as one (size, width) view: one tolist() reads all
        self.headers = [
            np.lib.stride_tricks.as_strided(
                words[layout.slot(h, 0) // 8 :], (n, self.width), (layout.slot_bytes, 8)
            )
            for h in range(2)
        ]

    def fits(self) -> bool:
        """Whether a header leaves every peer 64 bytes of a slot (up to ~40 ranks at 4 KiB
        slots, thousands at the default 1 MiB)."""
        return self._room(self.size) >= 64

    def run(self, kind: str, root: int, outputs: list, inputs: list) -> None:
        """One v-call: ``inputs[r]`` to rank ``r``, ``outputs[q]`` from rank ``q`` (contiguous
        CPU tensors, one dtype; checked by the communicator)."""
        start = time.monotonic()
        s, n, me = self.s, self.size, self.rank
        flags = s.flags
        esize = inputs[0].element_size()
        row = row_of(kind, root, inputs[0].dtype, esize, outputs, inputs)
        # the distinct buffers sent to peers, indexed in order of first use
        slots_of: dict[int, int] = {}
        buffers: list[tuple[int, int]] = []  # (address, bytes)
        where = [-1] * n
        for r, t in enumerate(inputs):
            nbytes = row[HEAD + r]
            if r == me or not nbytes:
                continue
            index = slots_of.get(id(t))
            if index is None:
                index = slots_of[id(t)] = len(buffers)
                buffers.append((t.data_ptr(), nbytes))
            where[r] = index
        room = self._room(len(buffers))
        name = kind
        half = s._enter(name, start, _CODE)
        self.headers[half][me] = row + where
        mine = self.slots[half][me] + self.header
        for i, (addr, nbytes) in enumerate(buffers):
            _memmove(mine + i * room, addr, min(room, nbytes))
        s._first_publish()
        flags.wait_all(flags.seq, name, start)
        s._check(half, _CODE)
        table = self.headers[half].tolist()
        problem = disagreement([t[: HEAD + 2 * n] for t in table])
        if problem is not None:
            raise_disagreement(me, kind, problem)
        # what comes from each peer: (its room per buffer, the slot offset of our piece, bytes)
        sources = []
        rounds = 1
        for q, theirs in enumerate(table):
            index = theirs[HEAD + 2 * n :]
            used = len({i for i in index if i >= 0})
            q_room = self._room(used)
            longest = max((theirs[HEAD + r] for r in range(n) if index[r] >= 0), default=0)
            rounds = max(rounds, -(-longest // q_room))
            nbytes = theirs[HEAD + me]
            if q != me and nbytes:
                sources.append((q, q_room, self.header + index[me] * q_room, nbytes,
                                outputs[q].data_ptr()))
        self._copy_out(half, sources, 0)
        own = row[HEAD + me]
        if own:
            _memmove(outputs[me].data_ptr(), inputs[me].data_ptr(), own)
        for k in range(1, rounds):
            half = s._enter(name, start, _CODE)
            mine = self.slots[half][me] + self.header
            for i, (addr, nbytes) in enumerate(buffers):
                lo = k * room
                if lo < nbytes:
                    _memmove(mine + i * room, addr + lo, min(room, nbytes - lo))
            s._first_publish()
            flags.wait_all(flags.seq, name, start)
            self._copy_out(half, sources, k)
        changed = tuple(t for t in outputs if t.nbytes)
        if changed:
            _increment_version(changed)

    def _room(self, buffers: int) -> int:
        """Bytes of a slot each of ``buffers`` distinct buffers gets per round."""
        return (self.slot_bytes - self.header) // max(buffers, 1) // 64 * 64

    def _copy_out(self, half: int, sources: list, k: int) -> None:
        slots = self.slots[half]
        for q, q_room, offset, nbytes, addr in sources:
            lo = k * q_room
            if lo < nbytes:
                _memmove(addr + lo, slots[q] + offset, min(q_room, nbytes - lo))
