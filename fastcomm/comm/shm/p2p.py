"""Tagged point-to-point on the shm mailboxes: what ``send``/``recv``/``isend``/``irecv``, an
any-source receive and ``batch_isend_irecv`` of the torch backend run on (``c10d/p2p.py``).

Transport: each ordered pair of ranks has one stream of chunks through its two mailbox slots
(``schedules``, "Point to point"; one C call a chunk where the compiled core is built). A
message is one or more consecutive chunks of its pair's stream; every chunk's 64-byte header
holds the message's total bytes, its tag and its dtype code (1 + the dtype's index among
torch's dtypes sorted by name; 0: not said, the communicator's own ``send``/``recv``).

Matching, as Gloo (and MPI) match: a receive takes the first message from its source (any
source: from any rank) whose tag is its own, in the order the sender sent them. A receive
posted while the head of a source's stream carries another tag takes that message out of the
mailbox into a buffer set aside, keyed by (source, tag), and goes on; a later receive looks at
the messages set aside before the mailboxes (the earliest to arrive first). A stream whose head
no posted receive wants is left in the mailbox, so a sender runs at most two chunks ahead of
its receiver (its send completes once its last chunk is in a mailbox slot: eager up to 2 x
``mbox_bytes - 64`` bytes, as Gloo's send of a small message completes before the peer
receives it).

Mismatch: a receive whose tag matches a message of another byte count or dtype raises
:class:`MessageMismatchError` naming both ranks, both element counts, dtypes and byte counts;
the message is taken out of the stream and dropped (so later messages still match), and a
notice goes to the sender in the receiver's own words of the pair (``acked`` line, words 2-7:
the count of notices, then the tag and both sides' dtype codes and bytes). The sender raises
the same error at the first of: the wait of a send to that rank still in flight, its next send
to or receive from that rank (a message that fits the mailbox has left the sender before its
receiver looks at it, so the sender cannot raise within that send). Neither side is aborted:
the pair's stream stays aligned and the group usable.

Progress: every operation is an entry of this engine; :meth:`Mailboxes._progress` moves every
chunk that can move without waiting (sends in issue order per destination, receives per
source), under one lock. An operation is tried once when issued (a small send, or a receive
whose message is there, completes in the call); a ``wait()`` progresses everything (so one
``batch_isend_irecv`` of any size in both directions moves on one thread without deadlock:
each rank drains its peers while it fills their mailboxes), spinning, then yielding, then
sleeping on the futex of the word it needs (announced, so the peer's publish wakes it). While
operations are pending and nobody waits, a thread of the engine progresses them every
``POLL_S`` (a peer is never stuck on data this rank issued but has not waited on yet).

Failures: a peer that does not arrive within the communicator's timeout raises
``CommTimeoutError``, one that aborted, closed or died ``CommAbortedError``, naming this rank,
the operation, the peer and the elapsed time; either marks the communicator aborted (as its
other operations do). Invariant: one thread issues a communicator's calls; the communicator's
own ``send``/``recv`` (untagged, on their per-peer executors) and this engine share the pairs'
streams and counters, so a communicator uses one of the two at a time.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from os import sched_yield

import torch

from ..errors import CommAbortedError, CommClosedError, CommTimeoutError, FastcommError
from ..vcoll import DTYPE_CODES as _V_DTYPE_CODES
from ..work import StoppableThread
from .flags import _FUTEX_WAIT, _MASK32, _syscall, _Timespec, fence
from .segment import process_alive

__all__ = ["DTYPE_CODES", "MessageMismatchError", "Mailboxes", "dtype_code"]

POLL_S = 0.001  # the engine's thread: how often it moves operations nobody waits on
PARK_S = 0.05  # ... and how long it polls after the last operation left pending
_SLEEP_ONE = _Timespec(0, 2_000_000)  # one pair to wake us: sleep in 2 ms slices
_SLEEP_MANY = _Timespec(0, 100_000)  # several pairs (only one futex wakes us): 100 us slices
_LIVENESS_S = 0.05
_HEADER = 64
_U64 = (1 << 64) - 1
# the v-calls' dtype codes, plus one: 0 is no dtype in a header
DTYPE_CODES = {dtype: code + 1 for dtype, code in _V_DTYPE_CODES.items()}
_DTYPE_LIST = tuple(DTYPE_CODES)


class MessageMismatchError(FastcommError, ValueError):
    """A send and the receive that matched it (same source and tag) disagree on the byte count
    or the dtype; raised on both ranks (module docstring)."""


def dtype_code(dtype: torch.dtype) -> int:
    """The dtype's code in a message header (module docstring)."""
    return DTYPE_CODES[dtype]


def _what(code: int, nbytes: int) -> str:
    """``"10 x float32 (40 bytes)"`` for a header's dtype code and byte count."""
    if not 0 < code <= len(_DTYPE_LIST):
        return f"{nbytes} bytes"
    dtype = _DTYPE_LIST[code - 1]
    size = dtype.itemsize
    name = str(dtype).removeprefix("torch.")
    if not size:
        return f"{name} ({nbytes} bytes)"
    return f"{nbytes // size} x {name} ({nbytes} bytes)"


class _Op:
    """One send or receive: its bytes at ``addr`` and how far they moved."""

    __slots__ = ("kind", "peer", "tag", "addr", "nbytes", "dtype", "keep", "offset", "done",
                 "error", "source", "start", "view")

    def __init__(self, kind, peer, tag, tensor: torch.Tensor, dtype: int, start: float):
        self.kind = kind
        self.peer = peer  # None: a receive from any source
        self.tag = tag
        self.keep = tensor  # contiguous; held until the operation is done
        self.addr = tensor.data_ptr()
        self.nbytes = tensor.numel() * tensor.element_size()
        self.dtype = dtype
        self.offset = 0
        self.done = False
        self.error: BaseException | None = None
        self.source = -1
        self.start = start
        self.view: torch.Tensor | None = None  # its bytes as uint8 (the pure-Python path)

    def bytes(self) -> torch.Tensor:
        if self.view is None:
            self.view = self.keep.detach().reshape(-1).view(torch.uint8)
        return self.view


class _Incoming:
    """The message being taken out of one source's stream: into a receive, into a buffer set
    aside (``stash``), or dropped (``op`` with an error)."""

    __slots__ = ("op", "stash", "total", "tag", "dtype", "offset", "arrival")

    def __init__(self, op, stash, total, tag, dtype):
        self.op = op
        self.stash = stash
        self.total = total
        self.tag = tag
        self.dtype = dtype
        self.offset = 0
        self.arrival = 0


class Mailboxes(StoppableThread):
    """This rank's tagged send/recv engine over a communicator's mailbox streams.

    Args:
        schedules: the communicator's ``SegmentSchedules`` (the streams' counters, the core).
        timeout_s: how long an operation may wait for its peer.
        on_fail: called with ``(op name, start, exception)`` for a timeout or a peer gone; it
            marks the communicator aborted and raises.
    """

    def __init__(self, schedules, timeout_s: float, on_fail) -> None:
        self._s = schedules
        self._flags = flags = schedules.flags
        self._words = flags.words
        self._layout = schedules.layout
        self.rank = schedules.rank
        self.size = schedules.size
        self._timeout_s = timeout_s
        self._on_fail = on_fail
        self._core = schedules._core
        self._room = schedules._mbox_room
        self._idx = schedules._p2p_idx  # per peer: (sent, peer's acked, peer's sent, acked)
        self._peers = [r for r in range(self.size) if r != self.rank]
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._sends: list[deque[_Op]] = [deque() for _ in range(self.size)]
        self._busy_dsts: set[int] = set()
        self._posted: list[_Op] = []  # receives in the order they were posted
        self._wanted = [0] * self.size  # posted receives naming each source
        self._wanted_any = 0  # posted any-source receives
        self._incoming: list[_Incoming | None] = [None] * self.size
        self._stash: list[deque[_Incoming]] = [deque() for _ in range(self.size)]
        self._arrivals = 0
        self._rejects_seen = [0] * self.size
        self._rejects_sent = [0] * self.size
        self.pending = 0
        self._waiters = 0
        self._scratch = torch.empty(max(self._room, 1), dtype=torch.uint8)  # dropped chunks
        self._thread: threading.Thread | None = None
        self._closed = False
        self._liveness = 0.0  # when the peers' processes were last looked at
        self._parked = False  # the thread waits on the condition: _kick must notify it
        self._last_pending = 0.0  # when an operation was last left pending at its issue

    # ------------------------------------------------------------------ issuing
    def isend(self, tensor: torch.Tensor, dst: int, tag: int, dtype: int) -> _Op:
        """Queues the send of ``tensor``'s bytes (contiguous, CPU) and moves what it can now.
        The caller has called :meth:`check_rejects` for ``dst`` (before its fast path too)."""
        op = _Op("send", dst, tag & _U64, tensor, dtype, time.monotonic())
        with self._lock:
            self._sends[dst].append(op)
            self._busy_dsts.add(dst)
            self.pending += 1
            self._progress()
        if not op.done:
            self._kick()
        return op

    def irecv(self, tensor: torch.Tensor, src: int | None, tag: int, dtype: int) -> _Op:
        """Posts a receive into ``tensor`` (contiguous, CPU) from ``src`` (``None``: any) and
        moves what it can now. The caller has called :meth:`check_rejects` for a ``src``."""
        op = _Op("recv", src, tag & _U64, tensor, dtype, time.monotonic())
        with self._lock:
            self.pending += 1
            if not self._from_stash(op):
                self._posted.append(op)
                if src is None:
                    self._wanted_any += 1
                else:
                    self._wanted[src] += 1
                self._progress()
        if not op.done:
            self._kick()
        return op

    def send_now(self, addr: int, nbytes: int, dst: int, tag: int, dtype: int) -> bool:
        """A message of one chunk sent at once, with no operation built, when nothing is
        queued to ``dst`` and its slot is free within the spin budget (the caller checked the
        rejects); else ``False`` having done nothing."""
        core = self._core
        if core is None or nbytes > self._room or self._sends[dst]:
            return False
        with self._lock:
            s = self._s
            k = s._sent[dst]
            if self._sends[dst] or core.send(addr, nbytes, nbytes, dst, k,
                                             self._flags.spin_budget_ns(), tag & _U64, dtype):
                return False
            s._sent[dst] = k + 1
        return True

    def recv_now(self, addr: int, nbytes: int, src: int, tag: int, dtype: int) -> bool:
        """A message of one chunk from ``src`` received at once, with no operation built,
        when it is there within the spin budget (the peer is usually about to send it: the
        core spins without the GIL, as the communicator's own ``recv`` does; a bounded wait,
        so ``irecv`` still returns at once), has ``tag`` and fits, and no earlier receive
        could claim it; else ``False`` having done nothing (the general path then decides:
        wait, set aside, mismatch)."""
        core = self._core
        if (core is None or nbytes > self._room or self._wanted_any or self._wanted[src]
                or self._incoming[src] is not None or self._stash[src]):
            return False
        with self._lock:
            s = self._s
            k = s._received[src]
            if (self._incoming[src] is not None or self._stash[src] or self._wanted_any
                    or self._wanted[src] or core.recv(addr, nbytes, nbytes, src, k,
                                                      self._flags.spin_budget_ns(),
                                                      tag & _U64, dtype)):
                return False
            s._received[src] = k + 1
        return True

    def check_rejects(self, peer: int, verb: str) -> None:
        """Raises the notice of a message of ours ``peer`` rejected, once (module docstring)."""
        if self._words[self._idx[peer][1] + 2] != self._rejects_seen[peer]:
            self._check_rejects(peer, verb)

    def _check_rejects(self, peer: int, verb: str) -> None:
        """Raises the notice of a message of ours ``peer`` rejected, once (module docstring)."""
        base = self._idx[peer][1] + 2  # the peer's acked line of our messages
        words = self._words
        count = words[base]
        if count == self._rejects_seen[peer]:
            return
        if self._flags.fenced:
            fence()
        self._rejects_seen[peer] = count
        tag, theirs, their_bytes, ours, our_bytes = (words[base + i] for i in range(1, 6))
        raise MessageMismatchError(
            f"rank {self.rank}: send to rank {peer} (tag {_signed(tag)}) was rejected: rank "
            f"{peer} expected {_what(theirs, their_bytes)} but rank {self.rank} sent "
            f"{_what(ours, our_bytes)}; the message was dropped (raised at this rank's next "
            f"{verb} rank {peer})"
        )

    # ------------------------------------------------------------------ progress
    def _progress(self) -> bool:
        """Moves every chunk that can move now (call with the lock held); whether any did."""
        moved = False
        if self._busy_dsts:
            for dst in list(self._busy_dsts):
                queue = self._sends[dst]
                while queue:
                    op = queue[0]
                    if not self._send_chunk(op, dst):
                        break
                    moved = True
                    if op.offset >= op.nbytes:
                        queue.popleft()
                        self._finish(op)
                if not queue:
                    self._busy_dsts.discard(dst)
        incoming = self._incoming
        wanted = self._wanted
        any_source = self._wanted_any
        for src in self._peers:
            if incoming[src] is None and not (any_source or wanted[src]):
                continue
            while self._pull(src):
                moved = True
        return moved

    def _send_chunk(self, op: _Op, dst: int) -> bool:
        s = self._s
        k = s._sent[dst]
        count = min(self._room, op.nbytes - op.offset)
        core = self._core
        if core is not None:
            status = core.send(op.addr + op.offset, count, op.nbytes, dst, k, 0, op.tag, op.dtype)
            if status:
                if status == 4:  # SLOT_WAIT
                    return False
                raise AssertionError(f"the compiled core's send returned status {status}")
        else:
            sent_idx, acked_idx = self._idx[dst][:2]
            words = self._words
            if k >= 2 and words[acked_idx] < k - 1:
                return False
            box = self._layout.mailbox(self.rank, dst, k & 1)
            w = box // 8
            words[w], words[w + 1], words[w + 2] = op.nbytes, op.tag, op.dtype
            s._u8[box + _HEADER : box + _HEADER + count].copy_(
                op.bytes()[op.offset : op.offset + count]
            )
            self._flags.set_word(sent_idx, k + 1, acked_idx + 1)
        s._sent[dst] = k + 1
        op.offset += count
        return True

    def _pull(self, src: int) -> bool:
        """Takes the next chunk from ``src`` when there is one and someone wants it."""
        inc = self._incoming[src]
        s = self._s
        k = s._received[src]
        words = self._words
        if inc is None:
            if words[self._idx[src][2]] < k + 1:
                return False
            if self._flags.fenced:
                fence()
            w = self._layout.mailbox(src, self.rank, k & 1) // 8
            total, tag, dtype = words[w], words[w + 1], words[w + 2]
            op = self._match(src, tag)
            if op is None:  # wanted by no receive: set aside
                stash = torch.empty(total, dtype=torch.uint8)
                inc = _Incoming(None, stash, total, tag, dtype)
            else:
                inc = _Incoming(op, None, total, tag, dtype)
                op.error = self._mismatch(op, src, total, dtype)
            self._incoming[src] = inc
        count = min(self._room, inc.total - inc.offset)
        op = inc.op
        if inc.stash is not None:
            addr = inc.stash.data_ptr() + inc.offset
        elif op.error is not None:
            addr = self._scratch.data_ptr()
        else:
            addr = op.addr + inc.offset
        core = self._core
        if core is not None:
            status = core.recv(addr, count, inc.total, src, k, 0, inc.tag, inc.dtype)
            if status:
                if status == 5:  # MESSAGE_WAIT
                    return False
                raise AssertionError(f"the compiled core's recv returned status {status}")
        else:
            sent_idx, acked_idx = self._idx[src][2:]
            if words[sent_idx] < k + 1:
                return False
            if self._flags.fenced:
                fence()
            box = self._layout.mailbox(src, self.rank, k & 1) + _HEADER
            ctypes.memmove(addr, self._s._u8[box : box + count].data_ptr(), count)
            self._flags.set_word(acked_idx, k + 1, sent_idx + 1)
        s._received[src] = k + 1
        inc.offset += count
        if inc.offset >= inc.total:
            self._incoming[src] = None
            if inc.stash is not None:
                self._set_aside(src, inc)
            else:
                op.source = src
                self._finish(op)
        return True

    def _match(self, src: int, tag: int) -> _Op | None:
        """Removes and returns the first posted receive that takes ``(src, tag)``."""
        for i, op in enumerate(self._posted):
            if op.tag == tag and (op.peer is None or op.peer == src):
                del self._posted[i]
                if op.peer is None:
                    self._wanted_any -= 1
                else:
                    self._wanted[src] -= 1
                return op
        return None

    def _mismatch(self, op: _Op, src: int, total: int, dtype: int) -> BaseException | None:
        """The receiver's error for a message that does not fit ``op`` (and the notice to
        its sender), else ``None``."""
        if total == op.nbytes and (dtype == op.dtype or not dtype or not op.dtype):
            return None
        base = self._idx[src][3] + 2  # this rank's acked line of src's messages
        words = self._words
        words[base + 1], words[base + 2], words[base + 3] = op.tag, op.dtype, op.nbytes
        words[base + 4], words[base + 5] = dtype, total
        if self._flags.fenced:
            fence()
        self._rejects_sent[src] += 1
        words[base] = self._rejects_sent[src]
        return MessageMismatchError(
            f"rank {self.rank}: recv from rank {src} (tag {_signed(op.tag)}) expected "
            f"{_what(op.dtype, op.nbytes)} but rank {src} sent {_what(dtype, total)}; the "
            "message was dropped"
        )

    def _set_aside(self, src: int, inc: _Incoming) -> None:
        op = self._match(src, inc.tag)
        if op is not None:  # posted while the message was being set aside
            self._deliver(op, src, inc)
            return
        self._arrivals += 1
        inc.arrival = self._arrivals
        self._stash[src].append(inc)

    def _from_stash(self, op: _Op) -> bool:
        """Completes ``op`` from a message set aside, if one matches."""
        best, where = None, -1
        for src in (self._peers if op.peer is None else (op.peer,)):
            for i, inc in enumerate(self._stash[src]):
                if inc.tag == op.tag:
                    if best is None or inc.arrival < best[2].arrival:
                        best, where = (src, i, inc), src
                    break
        if best is None:
            return False
        src, i, inc = best
        del self._stash[where][i]
        self._deliver(op, src, inc)
        return True

    def _deliver(self, op: _Op, src: int, inc: _Incoming) -> None:
        op.error = self._mismatch(op, src, inc.total, inc.dtype)
        if op.error is None and inc.total:
            ctypes.memmove(op.addr, inc.stash.data_ptr(), inc.total)
        op.source = src
        self._finish(op)

    def _finish(self, op: _Op) -> None:
        op.done = True
        self.pending -= 1

    # ------------------------------------------------------------------ waiting
    def wait(self, op: _Op, limit_s: float | None = None) -> None:
        """Progresses every operation until ``op`` is done; raises its error.

        Args:
            op: the operation.
            limit_s: a limit for this wait (``None``: the communicator's timeout from the
                operation's start, after which the communicator is aborted); when it passes,
                ``CommTimeoutError`` is raised and the operation is left pending.
        """
        if not op.done:
            self._wait(op, limit_s)
        if op.error is not None:
            raise op.error
        if op.kind == "send":
            self.check_rejects(op.peer, "send to")

    def _wait(self, op: _Op, limit_s: float | None) -> None:
        flags = self._flags
        now_ns = time.perf_counter_ns
        spin_end = now_ns() + flags.spin_budget_ns()
        yield_end = spin_end + flags.yield_ns
        lock = self._lock
        # one pending operation with a known peer: poll its peer's counter, a word read,
        # and progress only once it moved
        watch = None
        if self.pending == 1 and op.peer is not None and self._incoming[op.peer] is None:
            peer, s = op.peer, self._s
            if op.kind == "send":
                watch = (self._idx[peer][1], lambda: s._sent[peer] - 1)
            else:
                watch = (self._idx[peer][2], lambda: s._received[peer] + 1)
        with lock:  # a future's thread may wait beside the issuing one
            self._waiters += 1
        try:
            words = self._words
            while True:
                if watch is None or words[watch[0]] >= watch[1]():
                    with lock:
                        self._progress()
                    if op.done:
                        return
                now = now_ns()
                if now < spin_end:
                    continue
                if now < yield_end:
                    sched_yield()
                    continue
                self._sleep(op, limit_s)
                if op.done:
                    return
        finally:
            with lock:
                self._waiters -= 1

    def _sleep(self, op: _Op, limit_s: float | None) -> None:
        """One futex sleep on a word ``op`` waits on (announced), after the checks that end a
        wait: the limit, the timeout, a peer gone."""
        self._check_alive(op, time.monotonic(), limit_s)
        words = self._words
        if op.peer is None:
            time.sleep(0.0001)
            return
        peer = op.peer
        if op.kind == "send":
            idx, announce = self._idx[peer][1], self._idx[peer][0] + 1
        else:
            idx, announce = self._idx[peer][2], self._idx[peer][3] + 1
        value = words[idx]
        words[announce] = 1
        try:
            with self._lock:
                if self._progress() or op.done:
                    return
            slice_ = _SLEEP_ONE if self.pending == 1 else _SLEEP_MANY
            addr = ctypes.c_void_p(self._flags.base_address + 8 * idx)
            _syscall(self._flags._futex, addr, _FUTEX_WAIT, value & _MASK32,
                     ctypes.byref(slice_), None, 0)
        finally:
            words[announce] = 0

    def _check_alive(self, op: _Op, now: float, limit_s: float | None) -> None:
        words, flags = self._words, self._flags
        elapsed = now - op.start
        name = f"{op.kind} {'to' if op.kind == 'send' else 'from'} " + (
            "any rank" if op.peer is None else f"rank {op.peer}") + f" (tag {_signed(op.tag)})"
        peers = self._peers if op.peer is None else [op.peer]
        if words[flags.state_idx[self.rank]]:
            raise CommClosedError(f"rank {self.rank}: {name} interrupted: this communicator "
                                  "was closed")
        if limit_s is not None and elapsed > limit_s:
            raise CommTimeoutError(
                f"rank {self.rank}: {name}: wait(timeout={limit_s:.3f} s) passed after "
                f"{elapsed:.1f} s; the operation is still pending"
            )
        for peer in peers:
            gone = None
            if words[flags.state_idx[peer]]:
                gone = flags._peer_gone(peer, name, op.start)
            elif now - self._liveness > _LIVENESS_S:
                pid, start_time = flags._identity[peer]
                if not process_alive(pid, start_time):
                    gone = CommAbortedError(
                        f"rank {self.rank}: {name} failed after {elapsed:.1f} s: rank {peer} "
                        f"(pid {pid}) exited"
                    )
            if gone is not None and (op.peer is not None or len(peers) == 1):
                with self._lock:
                    self._progress()
                if not op.done:
                    self._fail(op, name, gone)
        self._liveness = now
        if elapsed > self._timeout_s:
            missing = [op.peer] if op.peer is not None else self._peers
            self._fail(op, name, CommTimeoutError(
                f"rank {self.rank}: {name} timed out after {elapsed:.1f} s (the timeout is "
                f"{self._timeout_s:.1f} s): rank(s) {missing} never arrived (peer rank "
                f"{'any' if op.peer is None else op.peer})"
            ))

    def _fail(self, op: _Op, name: str, error: BaseException) -> None:
        """Fails ``op`` and aborts the communicator (``on_fail`` raises)."""
        with self._lock:
            self._drop(op)
        try:
            self._on_fail(name, op.start, error)
        except BaseException as exc:  # the operation's outcome for every later wait()
            op.error = exc
            raise

    def _drop(self, op: _Op) -> None:
        """Takes a failed ``op`` out of the queues (call with the lock held)."""
        if op.done:
            return
        if op.kind == "send":
            queue = self._sends[op.peer]
            if op in queue:
                queue.remove(op)
        elif op in self._posted:
            self._posted.remove(op)
            if op.peer is None:
                self._wanted_any -= 1
            else:
                self._wanted[op.peer] -= 1
        op.done = True
        self.pending -= 1

    # ------------------------------------------------------------------ the thread
    def _kick(self) -> None:
        """Has the engine's thread move pending operations nobody waits on: started on first
        use, woken only when parked. A running thread polls (``POLL_S``) rather than being
        woken per operation: a woken thread takes the GIL and a core from the caller that is
        about to wait on the operation anyway (as ``OrderedExecutor``'s does)."""
        self._last_pending = time.monotonic()
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop, name=f"fastcomm-shm-r{self.rank}-p2p", daemon=True
                    )
                    self._thread.start()
        elif self._parked:
            with self._lock:
                self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self.pending and (
                        time.monotonic() - self._last_pending > PARK_S):
                    self._parked = True
                    self._cond.wait()
                    self._parked = False
                if self._closed:
                    return
                moved = self.pending and not self._waiters and self._progress()
            time.sleep(0 if moved else POLL_S)



def _signed(tag: int) -> int:
    """A header's tag as the caller wrote it (negative tags are stored modulo 2**64)."""
    return tag - (1 << 64) if tag >= 1 << 63 else tag
