"""Flags, waits and fences of the ``shm`` communicator.

Every rank owns its progress words and is their only writer: ``seq`` advances by one at every
publish of a collective, identically on all ranks; send/recv use the per-pair ``sent``/``acked``
counters. A waiter spins, then yields, then sleeps on a futex (announced, so a publisher makes
the system call only then); every wait is bounded by the timeout and fails fast when a peer
closed, aborted or died (a peer's exit is seen through its pidfd between two sleep slices,
``exits.ProcessExits``). ``fence()`` orders data and flag on weakly ordered machines (a no-op
on x86-64). Details and the memory-ordering argument: ``docs/shm.md``.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from os import sched_yield

from ... import settings
from ..errors import CommClosedError, CommTimeoutError, PeerLostError
from .exits import FLAG, ProcessExits
from .segment import ABORTED, CLOSED, MESSAGE_BYTES, Segment

__all__ = ["PeerFlags", "fence_supported"]

SLICE_S = 0.002
CROWD_SAMPLE_S = 1.0  # how often the automatic spin looks at the load average
CROWD_FACTOR = 1.5  # load average above this many times our cores: skip the spin
_MASK32 = 0xFFFFFFFF
_monotonic = time.monotonic  # read on every wait's budget: a global, not two lookups
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_MEMBARRIER_PRIVATE_EXPEDITED, _MEMBARRIER_REGISTER = 8, 16
_SYSCALLS = {  # machine: (futex, membarrier)
    "x86_64": (202, 324),
    "aarch64": (98, 283),
    "arm64": (98, 283),
    "riscv64": (98, 283),
    "ppc64le": (221, 365),
    "s390x": (238, 356),
}
_MACHINE = platform.machine().lower()
_TSO = _MACHINE in ("x86_64", "amd64")
try:
    _syscall = ctypes.CDLL(None, use_errno=True).syscall
except (OSError, AttributeError, TypeError):  # no libc with syscall(): shm is unavailable
    _syscall = None
_FENCE_READY = False


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_SLICE = _Timespec(0, int(SLICE_S * 1e9))


def fences_needed() -> bool:
    """Whether flag stores need explicit fences: not on x86 unless ``FASTCOMM_SHM_FENCE=1``.

    Raises:
        ValueError: ``FASTCOMM_SHM_FENCE`` is set to something other than 0 or 1.
    """
    forced = settings.SHM_FENCE.get()  # checked on every machine, fencing or not
    return not _TSO or forced


def fence_supported() -> bool:
    """Whether this machine can order the segment's stores (TSO, or ``membarrier`` works)."""
    global _FENCE_READY
    if _MACHINE not in _SYSCALLS or _syscall is None:
        return False
    if not fences_needed() or _FENCE_READY:
        return True
    _FENCE_READY = _syscall(_SYSCALLS[_MACHINE][1], _MEMBARRIER_REGISTER, 0, 0) == 0
    return _FENCE_READY


def fence() -> None:
    """Full memory barrier: ``membarrier`` brackets the call with ``smp_mb()`` on this CPU."""
    _syscall(_SYSCALLS[_MACHINE][1], _MEMBARRIER_PRIVATE_EXPEDITED, 0, 0)


class PeerFlags:
    """This rank's view of every rank's control words.

    Args:
        seg: the mapped segment.
        rank: this rank.
        timeout_s: seconds any one operation may wait in total.
        spin_us: microseconds to poll in a tight loop.
        yield_us: microseconds to poll with ``sched_yield`` after that, before sleeping.
        crowd_check: skip the spin while the host is crowded (module docstring).
    """

    def __init__(
        self,
        seg: Segment,
        rank: int,
        timeout_s: float,
        spin_us: float,
        yield_us: float,
        *,
        crowd_check: bool = False,
    ) -> None:
        layout = seg.layout
        self.rank = rank
        self.size = layout.size
        self.timeout_s = timeout_s
        self.spin_ns = int(spin_us * 1000)
        self.yield_ns = int(yield_us * 1000)
        self._crowd_check = crowd_check and self.spin_ns > 0
        self._crowd_cores = len(os.sched_getaffinity(0))
        self._crowd_next = 0.0  # monotonic time of the next load-average sample
        self._spin_now = self.spin_ns
        self.words = memoryview(seg.mm).cast("Q")
        anchor = ctypes.c_char.from_buffer(seg.mm)
        self.base_address = ctypes.addressof(anchor)
        del anchor  # the memoryview keeps the mapping pinned; one export is enough
        self._seg = seg
        self.seq_idx = [layout.seq(r) // 8 for r in range(self.size)]
        self.wait_idx = [layout.misc(r, 0) // 8 for r in range(self.size)]
        self.state_idx = [layout.misc(r, 1) // 8 for r in range(self.size)]
        # a rank's call descriptor words: A of half 0, A of half 1, B of half 0, B of half 1
        self.desc_idx = [
            tuple(layout.misc(r, w) // 8 for w in (4, 5, 8, 9)) for r in range(self.size)
        ]
        self.peers = [r for r in range(self.size) if r != rank]
        self.peer_seq_idx = [self.seq_idx[p] for p in self.peers]
        self.peer_desc_idx = [self.desc_idx[p] for p in self.peers]
        self.identity = {p: seg.peer_identity(p) for p in self.peers}
        self.exits = ProcessExits((p, *self.identity[p]) for p in self.peers)
        """Each peer's process, watched for its exit (a pidfd where one opens)."""
        self._futex = _SYSCALLS[_MACHINE][0]
        self._slices: dict[int, _Timespec] = {}  # sleep_on's timeouts, by nanoseconds
        self.fenced = fences_needed() and fence_supported()
        self.seq = self.words[self.seq_idx[rank]]  # this rank's last published value

    @property
    def segment(self) -> Segment:
        """The mapped segment these flags live in."""
        return self._seg

    def release(self) -> None:
        """Drops the export of the mapping (before ``Segment.close``) and the peers' pidfds."""
        self.words.release()
        self.exits.close()

    # ------------------------------------------------------------------ publishing
    def publish(self) -> int:
        """Advances this rank's ``seq`` by one (after its data stores) and wakes sleepers."""
        if self.fenced:
            fence()
        words = self.words
        self.seq = value = self.seq + 1
        idx = self.seq_idx[self.rank]
        words[idx] = value
        me = self.rank + 1
        for p in self.peers:
            if words[self.wait_idx[p]] == me:
                self.wake(idx)
                break
        return value

    def set_word(self, idx: int, value: int, announce_idx: int) -> None:
        """Stores ``value`` in one of this rank's own words (a send/recv counter) and wakes its
        sleepers when its waiter announced itself in word ``announce_idx`` (module docstring:
        without a fence between the store and that read, a waiter announcing itself meanwhile
        may sleep one slice before it sees the value; the compiled core fences)."""
        if self.fenced:
            fence()
        words = self.words
        words[idx] = value
        if words[announce_idx]:
            self.wake(idx)

    def wake(self, idx: int) -> None:
        """Wakes every rank sleeping on word ``idx``."""
        addr = ctypes.c_void_p(self.base_address + 8 * idx)
        _syscall(self._futex, addr, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    def sleep_on(self, idx: int, value: int, slice_ns: int) -> None:
        """Sleeps on word ``idx`` while it holds ``value``, at most ``slice_ns`` (a futex wait;
        the caller announced itself and checks why it woke)."""
        timespec = self._slices.get(slice_ns)
        if timespec is None:
            timespec = self._slices[slice_ns] = _Timespec(0, slice_ns)
        addr = ctypes.c_void_p(self.base_address + 8 * idx)
        _syscall(self._futex, addr, _FUTEX_WAIT, value & _MASK32, ctypes.byref(timespec), None,
                 0)

    def mark(self, state: int, message: str = "") -> None:
        """Records that this rank closed or aborted, and wakes everyone sleeping on its words."""
        data = message.encode("utf-8", "replace")[: MESSAGE_BYTES - 1] + b"\0"
        offset = self._seg.layout.message(self.rank)
        self._seg.mm[offset : offset + len(data)] = data
        if self.fenced:
            fence()
        self.words[self.state_idx[self.rank]] = state
        layout = self._seg.layout
        for idx in [self.seq_idx[self.rank]] + [
            layout.sent(self.rank, p) // 8 for p in self.peers
        ] + [layout.acked(self.rank, p) // 8 for p in self.peers]:
            self.wake(idx)

    # ------------------------------------------------------------------ waiting
    def spin_budget_ns(self) -> int:
        """Nanoseconds the next wait may spin: ``spin_us``, or 0 while the host is crowded."""
        if self._crowd_check:
            now = _monotonic()
            if now >= self._crowd_next:
                self._crowd_next = now + CROWD_SAMPLE_S
                try:
                    load = os.getloadavg()[0]
                except OSError:  # no load average here: keep spinning
                    load = 0.0
                crowded = load > CROWD_FACTOR * self._crowd_cores
                self._spin_now = 0 if crowded else self.spin_ns
        return self._spin_now

    def wait_all(self, target: int, op: str, start: float, peers: list[int] | None = None) -> None:
        """Waits until every rank in ``peers`` (default: all others) has ``seq >= target``."""
        words = self.words
        for p in self.peers if peers is None else peers:
            idx = self.seq_idx[p]
            if words[idx] < target:
                self.wait_word(idx, target, p, op, start, announce=True, group=peers)
        if self.fenced:
            fence()

    def wait_word(
        self,
        idx: int,
        target: int,
        peer: int,
        op: str,
        start: float,
        *,
        announce: bool = False,
        group: list[int] | None = None,
        announce_idx: int | None = None,
    ) -> None:
        """Waits until word ``idx`` (owned by ``peer``) reaches ``target``.

        Before it sleeps, a waiter announces itself: ``announce`` (a ``seq`` wait) stores
        ``peer + 1`` in this rank's ``waiting_on`` word; ``announce_idx`` (a send/recv counter)
        stores 1 in that word of this rank's. Either is cleared on return.

        Raises:
            CommTimeoutError: the operation's timeout passed; names the ranks not arrived.
            CommAbortedError: ``peer`` aborted, closed its communicator or its process died.
        """
        if self._poll(idx, target):
            return
        words = self.words
        deadline = start + self.timeout_s
        addr = ctypes.c_void_p(self.base_address + 8 * idx)
        if announce:
            words[self.wait_idx[self.rank]] = peer + 1
        elif announce_idx is not None:
            words[announce_idx] = 1
        try:
            while True:
                value = words[idx]
                if value >= target:
                    return
                if words[self.state_idx[peer]]:
                    # The peer may have published this step and then closed between the read
                    # of the word above and this one (a waiter preempted on a busy machine): a
                    # step it joined counts, only a step it never reached fails. Its state is
                    # written after its last publish, so re-reading the word now decides.
                    if self.fenced:
                        fence()
                    if words[idx] >= target:
                        return
                    raise self.peer_gone(peer, op, start)
                if words[self.state_idx[self.rank]]:
                    raise CommClosedError(
                        f"rank {self.rank}: {op} interrupted: this communicator was closed"
                    )
                now = time.monotonic()
                if now > deadline:
                    raise self._timeout(idx, target, peer, op, start, group)
                if self.exits.exited(peer, now):
                    if words[idx] >= target:
                        return
                    raise self.peer_exited(peer, op, start)
                _syscall(self._futex, addr, _FUTEX_WAIT, value & _MASK32, ctypes.byref(_SLICE),
                         None, 0)
        finally:
            if announce:
                words[self.wait_idx[self.rank]] = 0
            elif announce_idx is not None:
                words[announce_idx] = 0

    def _poll(self, idx: int, target: int) -> bool:
        """Whether word ``idx`` reaches ``target`` within the spin, then the yield phase."""
        words = self.words
        now_ns = time.perf_counter_ns
        spin_ns = self.spin_budget_ns() if self._crowd_check else self.spin_ns
        if spin_ns:
            end = now_ns() + spin_ns
            while True:
                for _ in range(32):
                    if words[idx] >= target:
                        return True
                if now_ns() > end:
                    break
        if self.yield_ns:
            end = now_ns() + self.yield_ns
            while now_ns() < end:
                sched_yield()  # releases the GIL and the core to anything runnable
                if words[idx] >= target:
                    return True
        return False

    def peer_exited(self, peer: int, op: str, start: float) -> PeerLostError:
        """The error of `op` (begun at `start`) whose `peer`'s process exited, saying how its
        exit was seen (``exits.PIDFD`` or ``exits.POLL``)."""
        pid = self.identity[peer][0]
        how = self.exits.how(peer)
        return PeerLostError(
            f"rank {self.rank}: {op} failed after {time.monotonic() - start:.1f} s: rank "
            f"{peer} (pid {pid}) exited without joining it (seen by {how})", how, time.time(),
        )

    def peer_gone(self, peer: int, op: str, start: float) -> PeerLostError:
        state = self.words[self.state_idx[peer]]
        elapsed = time.monotonic() - start
        if state == ABORTED:
            offset = self._seg.layout.message(peer)
            raw = bytes(self._seg.mm[offset : offset + MESSAGE_BYTES]).split(b"\0", 1)[0]
            why = f"rank {peer} aborted: {raw.decode('utf-8', 'replace')}"
        elif state == CLOSED:
            why = f"rank {peer} closed the communicator without joining it"
        else:
            why = f"rank {peer} is in state {state}"
        return PeerLostError(f"rank {self.rank}: {op} failed after {elapsed:.1f} s: {why}", FLAG,
                             time.time())

    def _timeout(
        self, idx: int, target: int, peer: int, op: str, start: float, group: list[int] | None
    ) -> CommTimeoutError:
        if idx == self.seq_idx[peer]:
            group = self.peers if group is None else group
            missing = [p for p in group if self.words[self.seq_idx[p]] < target]
        else:
            missing = [peer]
        return CommTimeoutError(
            f"rank {self.rank}: {op} timed out after {time.monotonic() - start:.1f} s (the "
            f"timeout is {self.timeout_s:.1f} s): rank(s) {missing} never arrived"
        )
