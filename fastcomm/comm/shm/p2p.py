"""Tagged point-to-point on the shm streams: what ``send``/``recv``/``isend``/``irecv``, an
any-source receive and ``batch_isend_irecv`` of the torch backend run on (``c10d/p2p.py``).

A message is consecutive chunks of its pair's stream (``streams``); a receive takes the first
message from its source whose tag is its own (as Gloo and MPI match), setting aside messages no
posted receive wants. A mismatched size or dtype raises :class:`MessageMismatchError` on both
ranks without aborting. One lock and one progress loop move every chunk that can move; a thread
of the engine moves operations nobody waits on. Matching, mismatch and progress in full:
``docs/shm.md``.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from os import sched_yield

import torch
import torch.autograd.profiler as _profiler

from ..calls import DTYPE_CODES, DTYPES
from ..errors import CommClosedError, CommTimeoutError, FastcommError
from ..work import StoppableThread
from .core import Status
from .flags import fence
from .streams import Streams

__all__ = ["DTYPE_CODES", "MessageMismatchError", "Mailboxes", "dtype_code"]

POLL_S = 0.001  # the engine's thread: how often it moves operations nobody waits on
PARK_S = 0.002  # ... and how long it polls after the last operation left pending (see _loop)
_SLEEP_ONE_NS = 2_000_000  # one pair to wake us: sleep in 2 ms slices
_SLEEP_MANY_NS = 100_000  # several pairs (only one futex wakes us): 100 us slices
_U64 = (1 << 64) - 1
# a header's dtype code: calls.py's (0 is no dtype)


class MessageMismatchError(FastcommError, ValueError):
    """A send and the receive that matched it (same source and tag) disagree on the byte count
    or the dtype; raised on both ranks (module docstring)."""


def dtype_code(dtype: torch.dtype) -> int:
    """The dtype's code in a message header (module docstring)."""
    return DTYPE_CODES[dtype]


def _amount(code: int, nbytes: int) -> str:
    """``"10 x float32 (40 bytes)"`` for a header's dtype code and byte count."""
    if not 0 < code <= len(DTYPES):
        return f"{nbytes} bytes"
    dtype = DTYPES[code - 1]
    size = dtype.itemsize
    name = str(dtype).removeprefix("torch.")
    if not size:
        return f"{name} ({nbytes} bytes)"
    return f"{nbytes // size} x {name} ({nbytes} bytes)"


class _Op:
    """One send or receive: its bytes at ``addr`` and how far they moved."""

    __slots__ = ("kind", "peer", "tag", "addr", "nbytes", "dtype", "keep", "offset", "done",
                 "error", "source", "start")

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
        streams: the communicator's pair streams (counters, chunks).
        timeout_s: how long an operation may wait for its peer.
        on_fail: called with ``(op name, start, exception)`` for a timeout or a peer gone; it
            marks the communicator aborted and raises.
    """

    def __init__(self, streams: Streams, timeout_s: float, on_fail) -> None:
        self._streams = streams
        self._flags = flags = streams.flags
        self._words = flags.words
        self.rank = streams.rank
        self.size = streams.size
        self._timeout_s = timeout_s
        self._on_fail = on_fail
        self._send_chunk, self._recv_chunk = streams.send_chunk, streams.recv_chunk
        self._compiled = streams.compiled is not None  # the one-chunk fast paths need it
        self._room = streams.chunk_bytes
        # the most bytes those paths take: a chunk, none without the core (one test per call)
        self._room_now = -1 if not self._compiled else self._room
        self._idx = streams.pair_words  # per peer: (sent, peer's acked, peer's sent, acked)
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
        self._parked = False  # the thread waits on the condition: _wake_thread must notify it
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
            self._wake_thread()
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
            self._wake_thread()
        return op

    def send_now(self, addr: int, nbytes: int, dst: int, tag: int, dtype: int) -> bool:
        """A message of one chunk sent at once, with no operation built, when nothing is
        queued to ``dst`` and its slot is free within the spin budget (the caller checked the
        rejects); else ``False`` having done nothing."""
        if nbytes > self._room_now:
            return False
        lock = self._lock
        lock.acquire()  # not `with`: its __enter__/__exit__ calls cost twice as much
        try:
            if self._sends[dst]:
                return False
            return not self._send_chunk(dst, addr, nbytes, nbytes,
                                        self._flags.spin_budget_ns(), tag, dtype)
        finally:
            lock.release()

    def recv_now(self, addr: int, nbytes: int, src: int, tag: int, dtype: int) -> bool:
        """A message of one chunk from ``src`` received at once, with no operation built,
        when it is there within the spin budget (the peer is usually about to send it: the
        core spins without the GIL, as the communicator's own ``recv`` does; a bounded wait,
        so ``irecv`` still returns at once), has ``tag`` and fits, and no earlier receive
        could claim it; else ``False`` having done nothing (the general path then decides:
        wait, set aside, mismatch)."""
        if nbytes > self._room_now:
            return False
        lock = self._lock
        lock.acquire()  # as send_now's (what is pending is looked at once, under the lock)
        try:
            if (self._incoming[src] is not None or self._stash[src] or self._wanted_any
                    or self._wanted[src]):
                return False
            return not self._recv_chunk(src, addr, nbytes, nbytes,
                                        self._flags.spin_budget_ns(), tag, dtype)
        finally:
            lock.release()

    def lane(self, comm, done_type: type, received_type: type, reuse: bool):
        """The compiled usual send and recv over this engine (``_core.c``'s ``Lane``), or
        ``None`` without the compiled core (docs/shm.md, "The compiled lane").

        ``lane.send(tensors, peer, tag)`` and ``lane.recv`` do what :meth:`check_rejects` then
        :meth:`send_now` / :meth:`recv_now` do, count the call in ``comm.stats``, write its
        slot in ``comm.flight`` and return a finished handle (a ``done_type()``, or a
        ``received_type()`` with ``_src``; one nobody else holds is reused when ``reuse``);
        ``None`` for any other call, ``False`` for a peer not ready within the spin budget,
        nothing done either way. ``comm``: the communicator this engine belongs to.
        """
        compiled = self._streams.compiled
        if compiled is None:
            return None
        recorder = comm.flight
        return compiled.lane(
            engine=self, sends=self._sends, incoming=self._incoming, stash=self._stash,
            wanted=self._wanted, rejects_seen=self._rejects_seen, sent=self._streams.sent,
            received=self._streams.received, lock=self._lock,
            spin_budget=self._flags.spin_budget_ns, room=self._room_now, comm=comm,
            calls=comm.stats.calls, bytes=comm.stats.bytes, recorder=recorder,
            record=None if recorder is None else recorder.slots(), profiler=_profiler,
            codes=DTYPE_CODES, tensor_type=torch.Tensor, strided=torch.strided,
            done_type=done_type, received_type=received_type,
            increment_version=torch._C._increment_version, reuse=reuse,
        )

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
            f"{peer} expected {_amount(theirs, their_bytes)} but rank {self.rank} sent "
            f"{_amount(ours, our_bytes)}; the message was dropped (raised at this rank's next "
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
                    if not self._send_op_chunk(op, dst):
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
            while self._take_chunk(src):
                moved = True
        return moved

    def _send_op_chunk(self, op: _Op, dst: int) -> bool:
        """Puts the next chunk of ``op`` into ``dst``'s stream if its slot is free."""
        count = min(self._room, op.nbytes - op.offset)
        status = self._send_chunk(dst, op.addr + op.offset, count, op.nbytes, 0, op.tag,
                                  op.dtype)
        if status:
            if status == Status.SLOT_WAIT:
                return False
            raise AssertionError(f"the send of a chunk returned status {status}")
        op.offset += count
        return True

    def _take_chunk(self, src: int) -> bool:
        """Takes the next chunk from ``src`` when there is one and someone wants it: a message
        not begun is left in the mailbox while no receive is posted for ``src`` (the receive
        that completed in this loop was the last one)."""
        inc = self._incoming[src]
        if inc is None:
            if not (self._wanted_any or self._wanted[src]):
                return False
            header = self._streams.header(src)
            if header is None:
                return False
            total, tag, dtype = header
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
        status = self._recv_chunk(src, addr, count, inc.total, 0, inc.tag, inc.dtype)
        if status:
            if status == Status.MESSAGE_WAIT:
                return False
            raise AssertionError(f"the recv of a chunk returned status {status}")
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
            f"{_amount(op.dtype, op.nbytes)} but rank {src} sent {_amount(dtype, total)}; the "
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
            peer, streams = op.peer, self._streams
            if op.kind == "send":
                watch = (self._idx[peer][1], lambda: streams.sent[peer] - 1)
            else:
                watch = (self._idx[peer][2], lambda: streams.received[peer] + 1)
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
            self._flags.sleep_on(idx, value,
                                 _SLEEP_ONE_NS if self.pending == 1 else _SLEEP_MANY_NS)
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
                gone = flags.peer_gone(peer, name, op.start)
            elif flags.exits.exited(peer, now):  # its pidfd, else /proc every 50 ms
                gone = flags.peer_exited(peer, name, op.start)
            if gone is not None and (op.peer is not None or len(peers) == 1):
                with self._lock:
                    self._progress()
                if not op.done:
                    self._fail(op, name, gone)
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
    def _wake_thread(self) -> None:
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
        """Polls while operations are pending and for ``PARK_S`` after the last one was left
        pending (a stream of them needs no wakeup each), then parks. A longer tail of polls
        takes a core from ranks spinning on each other's messages: at 50 ms, 4 KiB
        exchanges after one late message were slower for the whole tail."""
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
