"""The flight recorder: the last ``N`` operations of each communicator, for the hang report.

Every public call of a :class:`~.base.Communicator` takes one slot of its recorder's ring
(:meth:`FlightRecorder.issue`): its sequence number, its name, the raw fields that describe it
(its tensor's dtype and element count, read once per tensor passed call after call; the reduce
op, the root) and, for every ``SAMPLE``-th call, the times it was issued and ended; while a
``torch.profiler`` runs, a range ``fastcomm.<comm>.<op>`` around the call. Nothing is formatted
on the hot path: :meth:`FlightRecorder.entries` words them (:class:`~.calls.Call`) when a
dump is written. States: ``started`` (a synchronous call running), ``issued`` (an
``async_op`` call whose ``Work`` is pending), ``completed``, ``failed``.

``FASTCOMM_FLIGHT_SIZE`` sets the ring's length (default 2000; 0 turns recording off). The
recorder also gives ``comm.stats`` its latencies (:meth:`FlightRecorder.latencies`). A call that
fails is reported to its communicator's failure hooks (:class:`~.hooks.CommHooks`): the flight
watch (:mod:`.flight_watch`) registers the dumps, the heartbeat and the early warning there;
the report lives in :mod:`fastcomm.trace`.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Any

import torch
import torch.autograd.profiler as _profiler
from torch import Tensor as _Tensor

from .. import settings
from .flight_describe import STATES, entry, nbytes_of, wall

if TYPE_CHECKING:
    from .hooks import CommHooks

__all__ = [
    "FlightRecorder", "STATES", "ended", "recorded", "recorder_for", "recorders",
    "run_recorded", "wall",
]

DEFAULT_SIZE = settings.FLIGHT_SIZE.default
EMPTY, ISSUED, STARTED, COMPLETED, FAILED = 0, 1, 2, 3, 4
SAMPLE = 8
"""Every ``SAMPLE``-th call (by sequence number) is timed: its latency, its issue time."""
_UNSAMPLED = SAMPLE - 1
_now = time.perf_counter_ns

_weak = weakref.ref
_enter = torch.ops.profiler._record_function_enter_new
_exit = torch.ops.profiler._record_function_exit


def _NOBODY() -> None:  # a dead weak reference's stand-in
    return None


_RECORDERS: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()
_LOCK = threading.Lock()


def configured_size() -> int:
    """The ring's length from ``FASTCOMM_FLIGHT_SIZE`` (0: off)."""
    return settings.FLIGHT_SIZE.get()


class FlightRecorder:
    """The ring of one communicator's last ``capacity`` operations.

    Args:
        name: names the communicator in reports (``"world"``, ``"shm"``).
        rank: this process's rank in it.
        size: its ranks.
        capacity: slots in the ring.
        hooks: the communicator's hooks, told of every call that fails (``None``: nobody).
    """

    __slots__ = ("name", "rank", "size", "capacity", "seq", "_op", "_arg", "_extra", "_t0",
                 "_t1", "_state", "_last", "_prev", "_range", "_seen", "done", "backend", "main",
                 "_hooks", "__weakref__")

    def __init__(self, name: str, rank: int, size: int, capacity: int = DEFAULT_SIZE,
                 hooks: CommHooks | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"flight recorder capacity must be >= 1, got {capacity}")
        self.name = name
        self.backend = name
        self.rank = rank
        self.size = size
        self.capacity = capacity
        self.main = False
        """Whether reports follow this communicator (the one the job's ranks all call)."""
        self._hooks = hooks
        self.seq = 0
        """The last sequence number issued (1 is the first call)."""
        self.done = 0
        """The last synchronous call that returned without ``end`` (the hottest path marks its
        call completed with this one store): a ``started`` slot at or below it completed."""
        self._op: list[str | None] = [None] * capacity
        self._arg: list[tuple] = [()] * capacity  # (dtype, numel) of the call's tensor, or ()
        self._extra: list[Any] = [None] * capacity  # the reduce op or the root
        self._t0 = [0] * capacity
        self._t1 = [0] * capacity
        self._state = bytearray(capacity)
        # the last two tensors described (weakly) and their (dtype, numel): a tensor passed
        # call after call, or two taking turns (a send's and a receive's buffer), is described
        # once
        self._last: tuple = (_NOBODY, ())
        self._prev: tuple = (_NOBODY, ())
        self._range: tuple | None = None  # (seq, the profiler range of the call on the caller)
        self._seen: tuple[int, float] = (0, 0.0)  # (an untimed call in flight, first seen at)
        with _LOCK:
            _RECORDERS.add(self)

    # ------------------------------------------------------------------ hot path
    def issue(self, op: str, arg: Any, extra: Any) -> int:
        """Records a call of ``op`` (``arg``: its tensor, a list of them, or ``None``;
        ``extra``: its reduce op or root); returns its sequence number. The slot keeps the
        tensor's ``(dtype, numel)``, never the tensor."""
        seq = self.seq = self.seq + 1
        i = seq % self.capacity
        if arg.__class__ is _Tensor:
            last = self._last
            if last[0]() is arg:  # the same tensor again (a bucket, a loop's buffer)
                shape = last[1]
            else:
                prev = self._prev
                if prev[0]() is arg:  # the other of two taking turns
                    shape = prev[1]
                    self._last, self._prev = prev, last
                else:
                    shape = (arg.dtype, arg.numel())
                    self._last, self._prev = (_weak(arg), shape), last
        else:
            shape = _shape_of(arg)
        self._op[i] = op
        self._arg[i] = shape
        self._extra[i] = extra
        self._state[i] = STARTED
        if _profiler._is_profiler_enabled:  # a range in the trace, only while profiling
            self._range = (seq, _enter(f"fastcomm.{self.name}.{op}", None))
        # a clock read costs about a fifth of the record: every SAMPLE-th call is timed (the
        # same sequence numbers on every rank, so their issue times compare across ranks)
        self._t0[i] = 0 if seq & _UNSAMPLED else _now()
        return seq

    def end(self, seq: int, ok: bool = True) -> None:
        """Marks call ``seq`` completed (or failed)."""
        i = seq % self.capacity
        if not seq & _UNSAMPLED:
            self._t1[i] = _now()
        self._state[i] = COMPLETED if ok else FAILED
        if self._range is not None and self._range[0] == seq:
            self._close_range()

    def fail(self, seq: int, exc: BaseException) -> None:
        """Ends call ``seq``, which raised ``exc``: the communicator's failure hooks run first
        (:meth:`~.hooks.CommHooks.failed`: a dump of the record), while the call still shows as
        in flight."""
        if self._hooks is not None:
            self._hooks.failed(exc)
        self.end(seq, False)

    def pending(self, seq: int) -> None:
        """Marks call ``seq``, which returned with its operation still in flight, ``issued``
        (until :meth:`end`)."""
        self._state[seq % self.capacity] = ISSUED

    def returned(self, seq: int) -> None:
        """Ends synchronous call ``seq``, which returned: an untimed call with no profiler range
        open is marked completed with one store (:attr:`done`), any other by :meth:`end`."""
        if seq & _UNSAMPLED and self._range is None:
            self.done = seq
        else:
            self.end(seq)

    def slots(self) -> tuple:
        """The ring's lists for shm's compiled send/recv lane, which writes a completed call's
        slot as :meth:`issue` and :meth:`end` would: ``(op, arg, extra, state, t0, t1,
        capacity, the sampling mask, the completed state)``. The lists are never replaced."""
        return (self._op, self._arg, self._extra, self._state, self._t0, self._t1,
                self.capacity, _UNSAMPLED, COMPLETED)

    def _close_range(self) -> None:
        _exit(self._range[1])
        self._range = None

    def finish(self, seq: int, result: Any) -> Any:
        """Ends call ``seq`` that returned ``result``: done now (``None``), or when its
        ``Work`` completes (on a CUDA stream: when its event does, as the stream's watchdog
        sees it)."""
        if self._range is not None:  # the caller's range ends as the call returns
            self._close_range()
        if result is None:
            self.end(seq)
            return result
        record_in = getattr(result, "record_in", None)
        if record_in is not None:  # a fastcomm Work: it reports its end (Work.record_in)
            self._state[seq % self.capacity] = ISSUED
            record_in(self, seq)
        else:
            self.end(seq)  # another kind of handle: counted done once issued
        return result

    # ------------------------------------------------------------------ reading
    def in_flight(self) -> tuple[int, str, float] | None:
        """The oldest call not ended: ``(seq, op, issued at (epoch s))``, or ``None``. An
        untimed call's issue time is when this was first asked about it (the watch thread asks
        every poll)."""
        first = max(1, self.seq - self.capacity + 1)
        for seq in range(first, self.seq + 1):
            i = seq % self.capacity
            state = self._state[i]
            if state == ISSUED or (state == STARTED and seq > self.done):
                if self._t0[i]:
                    return seq, self._op[i], wall(self._t0[i])
                if self._seen[0] != seq:
                    self._seen = (seq, time.time())
                return seq, self._op[i], self._seen[1]
        return None

    def last_done(self) -> int:
        """The highest sequence number that ended (completed or failed), 0 for none."""
        first = max(1, self.seq - self.capacity + 1)
        for seq in range(self.seq, first - 1, -1):
            state = self._state[seq % self.capacity]
            if state >= COMPLETED or (state == STARTED and seq <= self.done):
                return seq
        return 0

    def entries(self, last: int | None = None) -> list[dict]:
        """The recorded calls, oldest first, in words (``last``: only that many)."""

        first = max(1, self.seq - self.capacity + 1)
        if last is not None:
            first = max(first, self.seq - last + 1)
        rows = []
        for seq in range(first, self.seq + 1):
            i = seq % self.capacity
            state = self._state[i]
            if state == STARTED and seq <= self.done:
                state = COMPLETED
            rows.append(entry(seq, self._op[i], self._arg[i], self._extra[i], state,
                              self._t0[i], self._t1[i] if state >= COMPLETED and self._t0[i]
                              else 0))
        pending = self.in_flight()
        for row in rows:  # the oldest call in flight has an issue time, timed or not
            if pending is not None and row["seq"] == pending[0] and row["issued"] is None:
                row["issued"] = pending[2]
        return rows

    def latencies(self) -> dict[tuple[str, int], list[float]]:
        """Seconds each timed (every ``SAMPLE``-th) completed call in the ring took, by
        ``(op, bytes)``."""

        out: dict[tuple[str, int], list[float]] = {}
        first = max(1, self.seq - self.capacity + 1)
        for seq in range(first, self.seq + 1):
            i = seq % self.capacity
            if self._state[i] == COMPLETED and self._t0[i] and self._t1[i]:
                key = (self._op[i], nbytes_of(self._arg[i]))
                out.setdefault(key, []).append((self._t1[i] - self._t0[i]) / 1e9)
        return out

    def clear(self) -> None:
        """Forgets every call (the sequence numbers go on)."""
        self._state[:] = bytes(self.capacity)


def _shape_of(arg: Any) -> tuple:
    """``(dtype, numel)`` of a tensor, or of the first tensor of a list; ``()`` otherwise."""
    if arg is None:
        return ()
    if isinstance(arg, list | tuple):
        arg = next((a for a in arg if hasattr(a, "dtype")), None)
    if arg is None or not hasattr(arg, "dtype"):
        return ()
    return (arg.dtype, arg.numel())


def recorder_for(comm) -> FlightRecorder | None:
    """A new recorder for ``comm`` that tells ``comm.hooks`` of failed calls (``None`` where
    ``FASTCOMM_FLIGHT_SIZE=0``)."""
    size = configured_size()
    if not size:
        return None
    return FlightRecorder(comm.backend, comm.rank, comm.size, size, comm.hooks)


def recorders() -> list[FlightRecorder]:
    """Every live recorder of this process."""
    with _LOCK:
        return list(_RECORDERS)


def recorded(op: str, arg: int = 0, extra: int | None = None,
             extra_name: str | None = None) -> Callable:
    """Records every call of the decorated public method as ``op``: positional argument
    ``arg`` describes it (-1: none), ``extra`` (index after ``self``, or keyword
    ``extra_name``) is its reduce op or root. A call that raises is recorded failed, and a
    timeout or abort runs the communicator's failure hooks (:mod:`.hooks`)."""

    def wrap(method: Callable) -> Callable:
        @wraps(method)
        def call(self, *args, **kwargs):
            recorder = self.flight
            if recorder is None:
                return method(self, *args, **kwargs)
            value = args[arg] if 0 <= arg < len(args) else None
            more = None
            if extra is not None:
                more = args[extra] if extra < len(args) else kwargs.get(extra_name)
            seq = recorder.issue(op, value, more)
            try:
                result = method(self, *args, **kwargs)
            except BaseException as exc:
                recorder.fail(seq, exc)
                raise
            return recorder.finish(seq, result)

        return call

    return wrap


def run_recorded(recorder: FlightRecorder | None, op: str, arg: Any, extra: Any,
                 run: Callable[..., Any], *args: Any) -> None:
    """``run(*args)``, a synchronous call of ``op`` made outside the recorded public methods,
    recorded as they record theirs (``recorder`` ``None``: not recorded)."""
    if recorder is None:
        run(*args)
        return
    seq = recorder.issue(op, arg, extra)
    try:
        run(*args)
    except BaseException as exc:
        recorder.fail(seq, exc)
        raise
    recorder.returned(seq)


def ended(flight: tuple[FlightRecorder, int] | None, error: BaseException | None) -> None:
    """Ends a recorded call whose operation outlived it (``flight``: its ``(recorder, seq)``,
    held by its ``Work`` until now; ``None``: not recorded): completed, or failed with
    ``error`` (the communicator's failure hooks run first, once per error)."""
    if flight is None:
        return
    recorder, seq = flight
    if error is not None:
        recorder.fail(seq, error)
    else:
        recorder.end(seq)
