"""The shm schedule of a v-call (``fastcomm.comm.vcoll``): pieces of any size from every rank
to every rank through the segment's slots, the sizes agreed inside the call's first round.

Round 0: every rank writes a header at the start of its slot -- its row (``vcoll.row_of``:
op, root, dtype, the bytes it sends to each rank and expects from each), then, per
destination, the slot offset of the buffer it sends there (-1: none) -- and the first chunk of
each distinct buffer it sends to a peer, publishes, and waits for every peer. Descriptor word
A, compared as every shm collective compares it, carries only the opcode: the op, root, dtype
and sizes are compared from the headers, so a disagreement on them is a
:class:`~..vcoll.SizesDisagreement` on every rank with the same message, and since every rank
took part in the round the communicator stays usable. Every rank then holds every row, so
every rank computes the same number of rounds.

Chunks: rank ``q`` with ``m`` distinct buffers to send (an ``all_gather_v`` sends one buffer to
everyone, a ``scatter`` root one per rank) gives each of them ``c_q = (slot_bytes - header) //
m`` bytes of its slot (64-byte aligned); round ``k`` holds bytes ``[k c_q, (k + 1) c_q)`` of
each. Rounds run until the longest buffer of any rank is through, at least one (a call moving
nothing is the header's round alone). Readers copy their piece of every peer's slot straight
into their output; a rank's piece to itself is one local copy, after the check.

Round 0 of a call whose pieces from this rank fit it runs in the compiled core where it was
built (``_core.c``, ``v_call``): the header and the pieces copied in, the publish, the wait,
both checks and the copy-out in one C call, as every small shm collective; when the ranks
disagree, or a peer's piece needs more rounds, it returns having copied nothing out and the
call goes on here. Otherwise bytes move with ``ctypes.memmove`` between the caller's tensors
and the segment: at 4 KiB a torch ``copy_`` (dispatcher, TensorIterator) costs more than the
bytes, and any dtype moves. Ranks with and without the core interoperate (the same words).
An output's version counter is bumped as a torch in-place op would.
"""

from __future__ import annotations

import ctypes
import struct
import time

import torch

from ..vcoll import (
    DTYPE_CODES,
    HEAD,
    KIND_CODES,
    disagreement,
    overlaps,
    raise_disagreement,
)
from .schedules import _OPCODES, SegmentSchedules, _core

__all__ = ["VSchedule"]

_memmove = ctypes.memmove
_increment_version = torch._C._increment_version
_CODE = _OPCODES["all_to_all_v"] << 56
_V_DISAGREE, _V_MORE = 7, 8  # the compiled core's v_call statuses beyond a round's own


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
        # bytes of a slot each of m distinct buffers gets per round, by m
        self.rooms = [(self.slot_bytes - self.header) // max(m, 1) // 64 * 64
                      for m in range(n + 1)]
        base = schedules._u8.data_ptr()
        self.slots = [[base + layout.slot(h, r) for r in range(n)] for h in range(2)]
        # headers are packed and unpacked in place in the mapping (a struct call each: a
        # fraction of a NumPy assignment's cost)
        self._mm = schedules.flags.segment.mm
        self._header = struct.Struct(f"<{self.width}q")
        self._offsets = [[layout.slot(h, r) for r in range(n)] for h in range(2)]
        # the compiled core's plan: the header, then every output's and input's address
        self._plan_struct = struct.Struct(f"<{self.width + 2 * n}q")
        self._plan = (ctypes.c_int64 * (self.width + 2 * n))()
        self._plan_address = ctypes.addressof(self._plan)

    def fits(self) -> bool:
        """Whether a header leaves every peer 64 bytes of a slot (up to ~40 ranks at 4 KiB
        slots, thousands at the default 1 MiB)."""
        return self.rooms[-1] >= 64

    def run(self, kind: str, root: int, outputs: list, inputs: list) -> None:
        """One v-call: ``inputs[r]`` to rank ``r``, ``outputs[q]`` from rank ``q`` (contiguous
        CPU tensors, one dtype; checked by the communicator). A tensor given for several
        destinations goes into the slot once."""
        first = inputs[0]
        self._run(kind, root, first.dtype, first.element_size(),
                  [t.nbytes for t in inputs], [t.nbytes for t in outputs],
                  [t.data_ptr() for t in inputs], [t.data_ptr() for t in outputs],
                  [id(t) for t in inputs], tuple(t for t in outputs if t.nbytes))

    def run_split(self, output: torch.Tensor, input: torch.Tensor, out_bytes: list[int],
                  in_bytes: list[int]) -> None:
        """An ``all_to_all`` v-call of consecutive pieces of one tensor each side (``out_bytes``
        and ``in_bytes``: each piece's bytes, in rank order; contiguous CPU tensors of one
        dtype, checked by the communicator), with no tensor made per piece."""
        out_addrs, in_addrs = [], []
        address = output.data_ptr()
        for nbytes in out_bytes:
            out_addrs.append(address)
            address += nbytes
        address = input.data_ptr()
        for nbytes in in_bytes:
            in_addrs.append(address)
            address += nbytes
        self._run("all_to_all", -1, input.dtype, input.element_size(), in_bytes, out_bytes,
                  in_addrs, out_addrs, range(self.size), (output,) if output.nbytes else ())

    def _run(self, kind: str, root: int, dtype: torch.dtype, esize: int, sent: list,
             expected: list, in_addrs: list, out_addrs: list, keys, changed: tuple) -> None:
        """A v-call of pieces given as addresses and bytes; ``keys[r]``: the identity of the
        buffer sent to rank ``r`` (equal keys: one buffer); ``changed``: the tensors whose
        version counters the call bumps."""
        start = time.monotonic()
        s, n, me, head = self.s, self.size, self.rank, self.header
        flags = s.flags
        # the distinct buffers sent to peers, in order of first use, each at its slot offset
        buffers: list[list[int]] = []  # [address, bytes]
        offsets = [-1] * n
        seen: dict[int, int] = {}
        for r, key in enumerate(keys):
            if r == me or not sent[r]:
                continue
            i = seen.get(key)
            if i is None:
                i = seen[key] = len(buffers)
                buffers.append([in_addrs[r], sent[r]])
            offsets[r] = i
        room = self.rooms[len(buffers)]
        offsets = [-1 if i < 0 else head + i * room for i in offsets]
        words = (KIND_CODES[kind], root, DTYPE_CODES[dtype], esize, *sent, *expected, *offsets)
        if s._core is not None and all(nbytes <= room for _, nbytes in buffers):
            # the round in one C call; it returns having copied nothing out when the ranks
            # disagree or a peer's piece needs more rounds (then on as below)
            self._plan_struct.pack_into(self._plan, 0, *words, *out_addrs, *in_addrs)
            half, status = self._core_round(kind, start)
            if status == _core.DONE:
                if changed:
                    _increment_version(changed)
                return
        else:
            half = s._enter(kind, start, _CODE)
            self._header.pack_into(self._mm, self._offsets[half][me], *words)
            mine = self.slots[half][me]
            for i, (addr, nbytes) in enumerate(buffers):
                _memmove(mine + head + i * room, addr, nbytes if nbytes < room else room)
            s._first_publish()
            flags.wait_all(flags.seq, kind, start)
            s._check(half, _CODE)
        unpack, mm = self._header.unpack_from, self._mm
        table = [unpack(mm, offset) for offset in self._offsets[half]]
        problem = disagreement(table)
        if problem is not None:
            raise_disagreement(me, kind, problem)
        # per peer sending us a piece: (its room per buffer, our piece's slot offset, bytes,
        # where it lands); and how many rounds the longest buffer of any rank takes
        sources = []
        rounds = 1
        for q, theirs in enumerate(table):
            where = theirs[HEAD + 2 * n :]
            q_room = self.rooms[len({o for o in where if o >= 0})]
            for r in range(n):
                if where[r] >= 0 and theirs[HEAD + r] > rounds * q_room:
                    rounds = -(-theirs[HEAD + r] // q_room)
            if q != me and expected[q]:
                sources.append((q, q_room, where[me], expected[q], out_addrs[q]))
        if rounds > 1 and overlaps(list(zip(out_addrs, expected, strict=True)),
                                   [(addr, nbytes) for addr, nbytes in buffers]):
            # later rounds still read the inputs: received pieces must not land on them
            keep = [torch.empty(nbytes, dtype=torch.uint8) for _, nbytes in buffers]
            for piece, entry in zip(keep, buffers, strict=True):
                _memmove(piece.data_ptr(), entry[0], entry[1])
                entry[0] = piece.data_ptr()
        else:
            keep = None
        if expected[me]:  # first: the peers' pieces may land on our own input
            _memmove(out_addrs[me], in_addrs[me], expected[me])
        self._copy_out(half, sources, 0)
        for k in range(1, rounds):
            half = s._enter(kind, start, _CODE)
            mine = self.slots[half][me] + head
            lo = k * room
            for i, (addr, nbytes) in enumerate(buffers):
                if lo < nbytes:
                    _memmove(mine + i * room, addr + lo, min(room, nbytes - lo))
            s._first_publish()
            flags.wait_all(flags.seq, kind, start)
            self._copy_out(half, sources, k)
        del keep
        if changed:
            _increment_version(changed)

    def _core_round(self, kind: str, start: float) -> tuple[int, int]:
        """Round 0 in the compiled core, from the plan packed in ``self._plan``: ``(half,
        status)``; waits the core gave up on are finished here and the core resumed (as
        ``SegmentSchedules._core_round`` does)."""
        s = self.s
        flags, call = s.flags, s._core.v_call
        half = s._round & 1
        s._round += 1
        target = flags.seq + 1
        args = [self._plan_address, _CODE, half, s._prev_first, target, 0,
                flags.spin_budget_ns()]
        status = call(*args)
        while status in (_core.ENTER_WAIT, _core.EXCHANGE_WAIT):
            if status == _core.ENTER_WAIT:
                flags.wait_all(args[3], kind, start)
                args[5] = 1
            else:  # published: this rank's seq moved on whatever happens next
                flags.seq = s._prev_first = target
                flags.wait_all(target, kind, start)
                args[5] = 2
            status = call(*args)
        flags.seq = s._prev_first = target
        if status == _core.MISMATCH:
            s._check(half, _CODE)
        if status not in (_core.DONE, _V_DISAGREE, _V_MORE):
            raise AssertionError(f"the compiled core's v_call returned status {status}")
        return half, status

    def _copy_out(self, half: int, sources: list, k: int) -> None:
        slots = self.slots[half]
        for q, q_room, offset, nbytes, addr in sources:
            lo = k * q_room
            if lo < nbytes:
                _memmove(addr + lo, slots[q] + offset, min(q_room, nbytes - lo))
