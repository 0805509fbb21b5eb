"""How an operation runs: the task a backend builds, the executor that orders it, its handle.

Every collective becomes a :class:`Task` (built by the backend's ``_impl_*`` hook) that
``Communicator._run`` runs, the one way every backend's operations execute. A task whose ``run``
blocks until the data is in place (shm, hier) goes to the communicator's
:class:`OrderedExecutor`, which keeps issue order; a task that only issues the operation (a torch
``ProcessGroup``, NCCL on a CUDA stream) runs at once and returns the backend's own ``Work``.

A :class:`Work` is returned by every collective called with ``async_op=True``. Its future's value
is the operation's output tensor; the future is made only when ``get_future()`` is called. For
CPU work the future completes when the data is in place; for CUDA work (NCCL) it is created with
``devices=[...]`` and completed on a stream ordered after the collective, so a consumer's
``wait()``/``value()`` makes its current stream wait on the collective and the host never
blocks.
"""

from __future__ import annotations

import _thread
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from .errors import CommTimeoutError, FastcommError
from .flight import ended

__all__ = [
    "OrderedExecutor", "SettledByWait", "StoppableThread", "Task", "Work", "completed_work",
    "wrap_error",
]

# Orders a Work's completion against the lazy creation of its future (held for a few
# attribute reads: one lock for all works costs less than one per work).
_FUTURE_LOCK = threading.Lock()
_allocate_lock = _thread.allocate_lock

POLL_S = 0.001
"""Seconds an executor's thread waits between looks at its queue while tasks are being
queued (:class:`OrderedExecutor`): the longest a task nobody waits on stays unstarted."""
PARK_S = 1.0
"""Seconds without a task queued after which the thread stops polling and sleeps until
woken."""


class Work:
    """One in-flight operation.

    Cheap to make: the ``torch.futures.Future`` is built only when `get_future` is called
    (most callers only ``wait()``), and a finished operation (`completed_work`) needs no
    lock at all. The future, when asked for, resolves exactly once with the operation's
    outcome, whichever of completion and `get_future` comes first.

    Args:
        op: the operation's name (``"all_reduce"``), used in error messages.
        rank: the rank that issued it, used in error messages.
        output: the tensor the future resolves to.
        devices: CUDA devices for a stream-aware future, or ``None`` for a CPU future.
        completed: the operation has already finished (successfully).
        executor: the :class:`OrderedExecutor` it is queued on (``wait()`` may run it there).
    """

    def __init__(
        self,
        op: str,
        rank: int,
        output: torch.Tensor | None,
        *,
        devices: list[torch.device] | None = None,
        completed: bool = False,
        executor: OrderedExecutor | None = None,
    ) -> None:
        self.op = op
        self.rank = rank
        self.output = output
        self.start = time.monotonic()
        self._devices = devices
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None
        self._done = completed
        self._executor = executor  # queued there: wait() may run it
        # Held while pending, released once done: a waiter blocks on it (a bare lock is
        # several times cheaper to make than a threading.Event).
        self._latch = None
        if not completed:
            self._latch = _allocate_lock()
            self._latch.acquire()

    # -------------------------------------------------------------- producer side
    def _complete(self) -> None:
        self._finish(None)

    def _fail(self, error: BaseException) -> None:
        self._finish(error)

    _flight = None  # (recorder, seq) of the call that returned it, until its end is recorded

    def record_in(self, recorder, seq: int) -> None:
        """Ends call ``seq`` of ``recorder`` (the flight recorder of the call that returned
        this work) when the operation completes: now where it already has."""
        self._flight = (recorder, seq)
        if self._done:  # finished before it was told (a synchronous path's completed work)
            self.record_end(self._error)

    def record_end(self, error: BaseException | None) -> None:
        """Ends this work's call in its flight recorder (once; a failure runs the
        communicator's failure hooks): called by whatever completes the work."""
        flight, self._flight = self._flight, None
        ended(flight, error)

    def _finish(self, error: BaseException | None) -> None:
        with _FUTURE_LOCK:
            if self._done:
                return
            self._error = error
            self._done = True
            future = self._future
        flight = self._flight
        if flight is not None:  # its call ends in the flight recorder (record_end, inlined)
            self._flight = None
            ended(flight, error)
        if self._latch is not None:
            self._latch.release()
        if future is not None:
            self._resolve(future)

    def _new_future(self) -> torch.futures.Future:
        devices = self._devices
        return torch.futures.Future(devices=devices) if devices else torch.futures.Future()

    def _resolve(self, future: torch.futures.Future) -> None:
        """Completes `future` with the outcome (called once, after the operation is done)."""
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self.output)

    def _elapsed(self) -> float:
        return time.monotonic() - self.start

    # -------------------------------------------------------------- consumer side
    def is_completed(self) -> bool:
        """Whether the operation has finished (successfully or not); a queued one is started
        now (a caller polling this is not going to help it along in ``wait``)."""
        if not self._done and self._executor is not None:
            self._executor.wake()
        return self._done

    def is_success(self) -> bool:
        """Whether the operation has finished without an error."""
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        """The operation's error, or ``None`` (pending or successful)."""
        if not self._done and self._executor is not None:
            self._executor.wake()
        return self._error

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Blocks until the operation finishes and re-raises its error.

        Args:
            timeout: seconds or ``timedelta``; ``None`` waits for the communicator's own
                timeout to resolve the operation.

        Returns:
            ``True`` (as torch's ``Work.wait``).

        Raises:
            CommTimeoutError: ``timeout`` passed before the operation finished (the operation
                itself is left running; the communicator's timeout still applies to it).
            FastcommError: the operation failed.
        """
        if not self._done:
            if isinstance(timeout, timedelta):
                timeout = timeout.total_seconds()
            executor = self._executor
            if executor is not None:
                if timeout is None:
                    executor.help(self)  # runs it here if the executor's thread has not yet
                else:  # a bounded wait leaves the task to the thread: start it now
                    executor.wake()
            if not self._done:  # else this thread ran it (help)
                latch = self._latch
                if not latch.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
                    raise CommTimeoutError(
                        f"rank {self.rank}: {self.op} did not complete within {timeout:.3f} s "
                        f"(waited {self._elapsed():.1f} s since it was issued)"
                    )
                latch.release()  # let every other waiter through too
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` whose value is the output tensor (made on first call)."""
        with _FUTURE_LOCK:
            future = self._future
            if future is not None:
                return future
            future = self._future = self._new_future()
            done = self._done
        if done:
            self._resolve(future)
        elif self._executor is not None:  # its callbacks run on the thread: start it now
            self._executor.wake()
        return future

    def result(self) -> torch.Tensor | None:
        """Waits (as :meth:`wait`) and returns the output tensor."""
        self.wait()
        return self.output

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"Work({self.op}, rank={self.rank}, {state})"


class SettledByWait:
    """``is_completed``, ``is_success`` and ``exception`` of a handle over other works whose
    outcome its own ``wait()`` settles (sets ``_finished`` and ``_error``) once they are done
    (``_inner_done()``): asking whether it completed settles it too."""

    __slots__ = ()

    # The class mixing this in defines ``_inner_done() -> bool`` (whether the works it holds
    # are done) and the ``_finished`` / ``_error`` fields: PGWork, the c10d FastcommWork.

    def is_completed(self) -> bool:
        if not self._finished and self._inner_done():
            try:
                self.wait()
            except BaseException:  # noqa: BLE001 - reported by exception() and wait()
                pass
        return self._finished

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error if self.is_completed() else None


def completed_work(op: str, rank: int, output: torch.Tensor | None) -> Work:
    """A ``Work`` that is already finished (synchronous paths, zero-size tensors)."""
    return Work(op, rank, output, completed=True)


def wrap_error(op: str, rank: int, start: float, exc: BaseException) -> FastcommError:
    """Turns a backend error into one naming the rank, the operation and the elapsed time."""
    if isinstance(exc, FastcommError):
        return exc
    elapsed = time.monotonic() - start
    text = str(exc)
    lowered = text.lower()
    cls = CommTimeoutError if ("timed out" in lowered or "timeout" in lowered) else FastcommError
    return cls(f"rank {rank}: {op} failed after {elapsed:.1f} s: {text}")


@dataclass(slots=True)
class Task:
    """One operation of a communicator, built by its backend and run by :meth:`Communicator._run`.

    Attributes:
        op: the operation's name (``"all_reduce"``), for its ``Work`` and error messages.
        output: the tensor the operation's ``Work`` resolves to (``None`` for a barrier).
        run: one rule on every backend: does the host's part of the operation and returns
            the ``Work`` of what is left, or ``None`` when the data is already in place. A
            backend whose host part is the whole transfer (shm, hier, ipc on CPU) returns
            ``None``; one that hands the transfer to an engine that completes it by itself
            (a torch ``ProcessGroup``, a CUDA stream) returns that engine's ``Work``. The
            caller (:meth:`Communicator._run`, an :class:`OrderedExecutor`) waits on it the
            same way whichever it is.
        executor: the executor that runs ``run`` in issue order; ``None`` when the backend
            orders its operations itself (a torch ``ProcessGroup``, a CUDA stream).
    """

    op: str
    output: torch.Tensor | None
    run: Callable[[], Work | None]
    executor: OrderedExecutor | None = None


class StoppableThread:
    """The stop of an object that runs one thread of its own, guarded by ``_lock`` and its
    condition ``_cond``: the thread leaves its loop once it sees ``_closed``."""

    _lock: threading.Lock
    _cond: threading.Condition
    _closed: bool
    _thread: threading.Thread | None

    def close(self, timeout: float = 5.0) -> bool:
        """Stops the thread (after what it must finish first); returns whether it ended
        within ``timeout``."""
        with self._lock:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()


class OrderedExecutor(StoppableThread):
    """Runs a communicator's blocking tasks in issue order and completes their ``Work``.

    A synchronous call runs on the caller's thread when nothing is pending (no thread hand-off:
    that keeps a small shm all-reduce in the microseconds); otherwise, and for every
    asynchronous call, the task queues behind the pending ones and runs on one daemon thread
    (started on first use), so every rank executes its operations in issue order.

    Waiting runs too (help first): a ``wait()`` on a queued ``Work`` runs the queued tasks up
    to it on the waiting thread while the executor's thread is not running one, so an
    asynchronous call waited on at once costs about what the synchronous call does, instead of
    a thread wake-up each way (docs/architecture.md). One task runs at a time either way
    (``running``), always the oldest queued, so issue order holds.

    Queueing does not wake the thread either, unless it is parked: a woken thread takes the
    GIL and the core from the caller that is about to wait, and the hand-off back costs as
    much again (figures: docs/architecture.md). The thread instead polls
    every ``POLL_S`` while asynchronous work is being issued (it parks after ``PARK_S``
    without any), so a task nobody waits on starts within ``POLL_S`` (DDP's buckets overlap
    backward as before, a peer is never left waiting on it for longer); asking a ``Work`` for
    its future or whether it completed wakes the thread at once (a future's callbacks run on
    it).

    Invariants: ``busy`` counts tasks queued and not yet finished; it drops *before* the task's
    ``Work`` completes, so a caller woken by that ``Work`` already sees the executor idle.
    Works complete in issue order (the next task starts only once the last one's ``Work`` has
    completed).

    Args:
        name: the thread's name.
        rank: the rank that owns it, named by the ``Work`` of queued tasks.
        run_task: runs one task, given the time it was issued; it raises errors that already
            name the rank and the operation (see :func:`wrap_error`).
    """

    def __init__(self, name: str, rank: int, run_task: Callable[[Task, float], None]) -> None:
        self.name = name
        self.rank = rank
        self.busy = 0
        self._run_task = run_task
        # the short critical sections take the bare lock (a C-level context manager), the
        # thread's waits its condition
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[tuple[Work, Task]] = deque()
        self._running = False  # a task is running, on the thread or on a helping waiter
        self._thread: threading.Thread | None = None
        self._closed = False
        self._parked = False  # the thread waits without a timeout: queueing must wake it
        self._last_queued = 0.0  # monotonic time of the last task queued

    def run(self, task: Task, async_op: bool) -> Work | None:
        """Runs ``task`` in issue order.

        Returns:
            ``None`` when the task ran to completion on the caller's thread, else the ``Work``
            it completes once it has run.
        """
        if not async_op and self.busy == 0:
            self._run_task(task, time.monotonic())
            return None
        work = Work(task.op, self.rank, task.output, executor=self)
        with self._lock:
            self.busy += 1
            self._queue.append((work, task))
            self._last_queued = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            elif self._parked:  # else the caller's wait() or the thread's next poll runs it
                self._cond.notify()
        return work

    def wake(self) -> None:
        """Has the thread take the queued tasks now, not at its next poll."""
        with self._lock:
            if self._queue:
                self._cond.notify()

    def _take(self) -> tuple[Work, Task] | None:
        """The oldest queued task, marked running (call with the lock held), or ``None``."""
        if self._running or not self._queue:
            return None
        self._running = True
        return self._queue.popleft()

    def _finish(self, work: Work, task: Task) -> None:
        """Runs ``task`` (taken by :meth:`_take`) and completes ``work``."""
        error = None
        try:
            self._run_task(task, work.start)
        except BaseException as exc:  # delivered to the waiter, never lost
            error = exc
        with self._lock:
            self.busy -= 1
        # completed while still `running`, so works complete (and their futures' callbacks
        # run) in issue order whichever thread ran them
        if error is None:
            work._complete()
        else:
            work._fail(error)
        with self._lock:
            self._running = False
            if self._queue and self._parked:  # a polling thread finds the next one itself
                self._cond.notify()

    def help(self, work: Work) -> None:
        """Runs queued tasks on the calling thread, in order, until ``work`` has run or the
        executor's thread is running one (then the caller just waits)."""
        while not work._done:
            with self._lock:
                taken = self._take()
            if taken is None:
                return
            self._finish(*taken)

    def _loop(self) -> None:
        cond = self._cond
        while True:
            with self._lock:
                taken = self._take()
                while taken is None and not (self._closed and not self._queue):
                    # parked only with nothing queued: a queued task is left to a
                    # waiter's help() or to this poll
                    if not self._queue and time.monotonic() - self._last_queued > PARK_S:
                        self._parked = True
                        cond.wait()
                        self._parked = False
                    else:
                        cond.wait(POLL_S)
                    taken = self._take()
                if taken is None:
                    return
            self._finish(*taken)

