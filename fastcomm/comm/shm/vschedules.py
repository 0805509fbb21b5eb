"""The shm schedule of a v-call (``fastcomm.comm.vcoll``): pieces of any size from every rank
to every rank through the segment's slots, the sizes agreed inside the call's first round.

Round 0: every rank writes a header (its row of sizes and where each piece sits in its slot)
and the first chunk of each buffer, publishes and waits; a disagreement on the sizes is a
:class:`~..vcoll.SizesDisagreement` on every rank, and the communicator stays usable. Round 0
runs in one C call where the compiled core takes it; bytes otherwise move with
``ctypes.memmove``. The protocol: ``docs/shm.md``.
"""

from __future__ import annotations

import ctypes
import operator
import struct
import time

import torch

from ..calls import DTYPE_CODES, OP_CODES, Call, calls_difference, decode
from ..vcoll import overlaps, raise_disagreement
from .core import CompiledRounds, Status
from .rounds import Rounds

__all__ = ["VSchedule"]

_memmove = ctypes.memmove
_monotonic = time.monotonic
_DONE = Status.DONE
_nbytes = operator.attrgetter("nbytes")
_data_ptr = torch.Tensor.data_ptr
_increment_version = torch._C._increment_version
_CODE = OP_CODES["all_to_all_v"] << 56
# a header's fixed words (the compiled core's V_HEAD, which compares the first three): the op's
# and the dtype's codes of calls.py, the root, the element size; then the bytes sent to and
# expected from each rank, then where each piece sits in the slot
HEAD = 4
_PLAN_CACHE = 512  # signatures whose layout is kept (the cache starts over beyond)


def _call_of(header, size: int) -> Call:
    """The :class:`~..calls.Call` a header describes (its byte counts as elements)."""
    op, root, dtype, esize = header[:HEAD]
    esize = max(esize, 1)
    flows = [nbytes // esize for nbytes in header[HEAD:HEAD + 2 * size]]
    return decode([op, dtype, -1, 0, root, 0, 0, *flows])


class VSchedule:
    """Runs v-calls for one rank over the slots of ``schedules``' segment.

    Args:
        rounds: the rank's rounds (flags, layout, the segment).
        compiled: the compiled core, or ``None``.
    """

    def __init__(self, rounds: Rounds, compiled: CompiledRounds | None) -> None:
        self.rounds = rounds
        self.compiled = compiled
        layout = rounds.layout
        n = self.size = layout.size
        self.rank = rounds.rank
        self.width = HEAD + 3 * n  # a header's words: the row, then the buffer per destination
        self.header = -(-8 * self.width // 64) * 64
        self.slot_bytes = layout.slot_bytes
        # bytes of a slot each of m distinct buffers gets per round, by m
        self.rooms = [(self.slot_bytes - self.header) // max(m, 1) // 64 * 64
                      for m in range(n + 1)]
        base = rounds.u8.data_ptr()
        self.slots = [[base + layout.slot(h, r) for r in range(n)] for h in range(2)]
        # headers are packed and unpacked in place in the mapping (a struct call each: a
        # fraction of a NumPy assignment's cost)
        self._mm = rounds.flags.segment.mm
        self._header = struct.Struct(f"<{self.width}q")
        self._offsets = [[layout.slot(h, r) for r in range(n)] for h in range(2)]
        # the compiled core's plan: the header, then every output's and input's address
        self._plan_struct = struct.Struct(f"<{self.width + 2 * n}q")
        self._plan = (ctypes.c_int64 * (self.width + 2 * n))()
        self._plan_address = ctypes.addressof(self._plan)
        self._addr_struct = struct.Struct(f"<{2 * n}q")
        self._addr_offset = 8 * self.width
        self._packed: tuple | None = None  # the layout whose words the plan holds
        self._ranks = tuple(range(n))
        self._zeros = [0] * n  # read only: the sizes and addresses of n empty pieces
        self._plans: dict[tuple, tuple] = {}  # by a call's signature: see _layout
        self._rooted_plans: dict[tuple, tuple] = {}  # by a gather's or scatter's sizes

    def fits(self) -> bool:
        """Whether a header leaves every peer 64 bytes of a slot (up to ~40 ranks at 4 KiB
        slots, thousands at the default 1 MiB)."""
        return self.rooms[-1] >= 64

    def run(self, kind: str, root: int, outputs: list, inputs: list) -> None:
        """One v-call: ``inputs[r]`` to rank ``r``, ``outputs[q]`` from rank ``q`` (contiguous
        CPU tensors, one dtype; checked by the communicator). A tensor given for several
        destinations goes into the slot once."""
        plan, sent, expected, in_addrs, out_addrs = self._plan_of(kind, root, outputs, inputs)
        bump = plan[-1]
        self._run(kind, plan, sent, expected, in_addrs, out_addrs,
                  outputs if bump is True else [outputs[q] for q in bump])

    def run_rooted(self, kind: str, root: int, mine: torch.Tensor, theirs: list | None) -> None:
        """:meth:`run` of a ``gather`` (``mine``: the input; ``theirs``: the root's outputs) or
        ``scatter`` (``mine``: the output; ``theirs``: the root's inputs), whose pieces are
        empty but the root's (``adapt.rooted_pieces``), with no list of pieces made: the plan,
        the sizes and which outputs change are found by the call's sizes (worked out once by
        :meth:`_plan_of`, so the same as :meth:`run`'s). ``theirs`` is read on the root only;
        the tensors are contiguous CPU tensors of one dtype (checked by the caller)."""
        me, gather = self.rank, kind == "gather"
        if me != root:
            key = (kind, root, mine.dtype, mine.nbytes)
        else:
            key = (kind, root, mine.dtype, mine.nbytes, *map(_nbytes, theirs))
            if not gather and self.size > 2:  # which of a scatter's inputs share a buffer
                seen: dict[int, int] = {}
                key += (tuple(map(seen.setdefault, map(id, theirs), self._ranks)),)
        found = self._rooted_plans.get(key)
        if found is None:
            found = self._rooted_layout(key, kind, root, mine, theirs)
        plan, sent, expected, bump = found
        zeros = self._zeros
        if gather:
            in_addrs = zeros.copy()
            in_addrs[root] = mine.data_ptr()
            if me != root:
                self._run(kind, plan, sent, expected, in_addrs, zeros, ())
                return
            changed = theirs if bump is True else [theirs[q] for q in bump]
            self._run(kind, plan, sent, expected, in_addrs, list(map(_data_ptr, theirs)),
                      changed)
            return
        out_addrs = zeros.copy()
        out_addrs[root] = mine.data_ptr()
        in_addrs = zeros if me != root else list(map(_data_ptr, theirs))
        self._run(kind, plan, sent, expected, in_addrs, out_addrs, (mine,) if bump else ())

    def _rooted_layout(self, key: tuple, kind: str, root: int, mine: torch.Tensor,
                       theirs: list | None) -> tuple:
        """What :meth:`run_rooted` keeps for a call's ``key``: ``(plan, sent, expected,
        outputs written)`` of :meth:`_plan_of` on the call's pieces (a scatter's: whether its
        output is written)."""
        empty = mine.new_empty(0)
        pieces = [empty] * self.size
        pieces[root] = mine
        others = theirs if self.rank == root else [empty] * self.size
        outputs, inputs = (others, pieces) if kind == "gather" else (pieces, others)
        plan, sent, expected, _, _ = self._plan_of(kind, root, outputs, inputs)
        bump = plan[-1]
        if kind == "scatter":
            bump = bump is True or root in bump
        if len(self._rooted_plans) >= _PLAN_CACHE:
            self._rooted_plans.clear()
        found = self._rooted_plans[key] = (plan, sent, expected, bump)
        return found

    def _plan_of(self, kind: str, root: int, outputs: list, inputs: list) -> tuple:
        """``(plan, sent, expected, input addresses, output addresses)`` of a v-call's pieces
        (:meth:`run`)."""
        first = inputs[0]
        if kind == "gather" or kind == "scatter":  # every piece but the root's is empty
            sent, expected, in_addrs, out_addrs = self._rooted(kind, root, outputs, inputs)
        else:
            sent = [t.nbytes for t in inputs]
            expected = [t.nbytes for t in outputs]
            in_addrs = [t.data_ptr() for t in inputs]
            out_addrs = [t.data_ptr() for t in outputs]
        key = (kind, root, first.dtype, *sent, *expected)
        if self.size > 2:  # which destinations share a buffer (two ranks: one peer, no choice)
            seen: dict[int, int] = {}
            key += (tuple(map(seen.setdefault, map(id, inputs), self._ranks)),)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._layout(key, kind, root, first, sent, expected)
        return plan, sent, expected, in_addrs, out_addrs

    def _rooted(self, kind: str, root: int, outputs: list, inputs: list) -> tuple:
        """``(sent, expected, input addresses, output addresses)`` of a ``gather`` or
        ``scatter``, whose pieces are empty but the root's (``adapt.rooted_pieces``): only the
        pieces that can hold bytes are read (an empty piece has address 0)."""
        me, zeros = self.rank, self._zeros
        if kind == "gather":
            mine = inputs[root]
            sent, in_addrs = zeros.copy(), zeros.copy()
            sent[root], in_addrs[root] = mine.nbytes, mine.data_ptr()
            if me != root:
                return sent, zeros, in_addrs, zeros
            return (sent, [t.nbytes for t in outputs], in_addrs,
                    [t.data_ptr() for t in outputs])
        mine = outputs[root]
        expected, out_addrs = zeros.copy(), zeros.copy()
        expected[root], out_addrs[root] = mine.nbytes, mine.data_ptr()
        if me != root:
            return zeros, expected, zeros, out_addrs
        return [t.nbytes for t in inputs], expected, [t.data_ptr() for t in inputs], out_addrs

    def run_split(self, output: torch.Tensor, input: torch.Tensor, out_bytes: list[int],
                  in_bytes: list[int]) -> None:
        """An ``all_to_all`` v-call of consecutive pieces of one tensor each side (``out_bytes``
        and ``in_bytes``: each piece's bytes, in rank order; contiguous CPU tensors of one
        dtype, checked by the communicator), with no tensor made per piece."""
        key = ("all_to_all", -1, input.dtype, *in_bytes, *out_bytes)
        if self.size > 2:
            key += (self._ranks,)  # every destination its own buffer
        plan = self._plans.get(key)
        if plan is None:
            plan = self._layout(key, "all_to_all", -1, input, in_bytes, out_bytes)
        out_addrs, in_addrs = [], []
        address = output.data_ptr()
        for nbytes in out_bytes:
            out_addrs.append(address)
            address += nbytes
        address = input.data_ptr()
        for nbytes in in_bytes:
            in_addrs.append(address)
            address += nbytes
        self._run("all_to_all", plan, in_bytes, out_bytes, in_addrs, out_addrs,
                  (output,) if output.nbytes else ())

    def _layout(self, key: tuple, kind: str, root: int, first: torch.Tensor, sent: list,
              expected: list) -> tuple:
        """What a call's signature (``key``: the op, the root, the dtype, the bytes to and from
        every rank, which destinations share a buffer) fixes, worked out once: ``(header
        words, bytes per buffer per round, the first destination of each distinct buffer,
        whether each fits one round, the outputs written: True for all, else their ranks)``."""
        n, me, head = self.size, self.rank, self.header
        keys = key[-1] if n > 2 else self._ranks
        firsts: list[int] = []  # per distinct buffer sent to peers: the first rank it goes to
        index = [-1] * n
        seen: dict[int, int] = {}
        for r in self._ranks:
            if r == me or not sent[r]:
                continue
            i = seen.get(keys[r])
            if i is None:
                i = seen[keys[r]] = len(firsts)
                firsts.append(r)
            index[r] = i
        room = self.rooms[len(firsts)]
        offsets = [-1 if i < 0 else head + i * room for i in index]
        words = (OP_CODES[kind], root, DTYPE_CODES[first.dtype], first.element_size(), *sent,
                 *expected, *offsets)
        fits = all(sent[r] <= room for r in firsts)
        written = tuple(q for q in self._ranks if expected[q])
        if len(self._plans) >= _PLAN_CACHE:
            self._plans.clear()
        plan = self._plans[key] = (words, room, tuple(firsts), fits,
                                   True if len(written) == n else written)
        return plan

    def _run(self, kind: str, plan: tuple, sent: list, expected: list, in_addrs: list,
             out_addrs: list, changed) -> None:
        """A v-call of pieces given as addresses and bytes, laid out by ``plan``
        (:meth:`_layout`); ``changed``: the tensors whose version counters the call bumps."""
        start = _monotonic()
        words, room, firsts, fits, _ = plan
        compiled = self.compiled
        if compiled is not None and fits:
            # the round in one C call; it returns having copied nothing out when the ranks
            # disagree or a peer's piece needs more rounds (then on as below)
            if plan is self._packed:  # its words are in the plan already: the addresses only
                self._addr_struct.pack_into(self._plan, self._addr_offset, *out_addrs,
                                            *in_addrs)
            else:
                self._plan_struct.pack_into(self._plan, 0, *words, *out_addrs, *in_addrs)
                self._packed = plan
            half, status = compiled.v_call(self._plan_address, _CODE, kind, start)
            if status == _DONE:
                if changed:
                    _increment_version(changed)
                return
            buffers = [[in_addrs[r], sent[r]] for r in firsts]
        else:
            buffers = [[in_addrs[r], sent[r]] for r in firsts]
            steps, head = self.rounds, self.header
            half = steps.enter(kind, start, _CODE)
            self._header.pack_into(self._mm, self._offsets[half][self.rank], *words)
            mine = self.slots[half][self.rank]
            for i, (addr, nbytes) in enumerate(buffers):
                _memmove(mine + head + i * room, addr, nbytes if nbytes < room else room)
            steps.publish_first()
            steps.flags.wait_all(steps.flags.seq, kind, start)
            steps.check(half, _CODE)
        self._after_round0(kind, start, half, room, buffers, expected, in_addrs, out_addrs)
        if changed:
            _increment_version(changed)

    def _after_round0(self, kind: str, start: float, half: int, room: int, buffers: list,
                      expected: list, in_addrs: list, out_addrs: list) -> None:
        """The rest of a v-call once round 0 is published and every header is in: the sizes
        compared, the peers' pieces copied out, later rounds where a buffer needs them."""
        n, me = self.size, self.rank
        unpack, mm = self._header.unpack_from, self._mm
        table = [unpack(mm, offset) for offset in self._offsets[half]]
        problem = calls_difference([_call_of(header, n) for header in table])
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
            self._later_round(kind, start, k, room, buffers, sources)
        del keep

    def _later_round(self, kind: str, start: float, k: int, room: int, buffers: list,
                     sources: list) -> None:
        """Round ``k`` (> 0): the next ``room`` bytes of each buffer in, the peers' out."""
        steps, flags = self.rounds, self.rounds.flags
        half = steps.enter(kind, start, _CODE)
        mine = self.slots[half][self.rank] + self.header
        lo = k * room
        for i, (addr, nbytes) in enumerate(buffers):
            if lo < nbytes:
                _memmove(mine + i * room, addr + lo, min(room, nbytes - lo))
        steps.publish_first()
        flags.wait_all(flags.seq, kind, start)
        self._copy_out(half, sources, k)

    def _copy_out(self, half: int, sources: list, k: int) -> None:
        slots = self.slots[half]
        for q, q_room, offset, nbytes, addr in sources:
            lo = k * q_room
            if lo < nbytes:
                _memmove(addr + lo, slots[q] + offset, min(q_room, nbytes - lo))
