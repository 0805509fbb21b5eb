"""Work on a CUDA stream, and the watchdog that times it out: shared by every CUDA transport.

A transport that enqueues its collectives on a communication stream (NCCL, ``ipc``'s CUDA
transport) returns an :class:`EventWork` per call: an event recorded on that stream after the
collective. :class:`StreamWatchdog` keeps the transport's pending works.

Invariants: ``wait()`` makes the caller's current stream wait on the event (the host blocks
only with a ``timeout``); ``get_future()`` completes on a side stream that waits on this
collective alone; a pending work (and so its tensors, instead of ``record_stream``) is kept
until its event completes; the watchdog fails every pending work with one error once the oldest
runs past the timeout or the transport reports a failure.

The ``Work`` methods in detail: docs/architecture.md.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch

from .errors import CommTimeoutError
from .work import Work

__all__ = ["EventWork", "StreamWatchdog"]


class EventWork(Work):
    """A collective enqueued on a CUDA stream (see the module docstring).

    Args:
        op: the operation's name.
        rank: the rank that issued it.
        output: the tensor the future resolves to.
        device: the CUDA device of the stream.
        event: recorded on the communication stream after the collective.
        keep: tensors held until the event completes (the watchdog holds the work).
        future_stream: the stream a future is completed on.
        failure: the transport's own failure, if any (``ipc`` reads its barrier's report);
            checked by every consumer call.
    """

    def __init__(
        self,
        op: str,
        rank: int,
        output: torch.Tensor | None,
        device: torch.device,
        event,
        keep: tuple[torch.Tensor, ...],
        future_stream,
        failure: Callable[[], BaseException | None] | None = None,
    ) -> None:
        super().__init__(op, rank, output, devices=[device], completed=True)
        self.event = event
        self._keep = keep
        self._future_stream = future_stream
        self._failure = failure

    def _fail(self, error: BaseException) -> None:
        # done for the host since it was enqueued: the error arrives later, from the device
        self._error = error

    def record_in(self, recorder, seq: int) -> None:
        # done for the host at once: its call ends when the watchdog sees the event complete
        self._flight = (recorder, seq)

    def _check(self) -> None:
        error = self._error
        if error is None and self._failure is not None:
            error = self._error = self._failure()
        if error is not None:
            raise error

    def _resolve(self, future: torch.futures.Future) -> None:
        if self._error is not None:
            future.set_exception(self._error)
            return
        stream = self._future_stream
        stream.wait_event(self.event)
        with torch.cuda.stream(stream):
            future.set_result(self.output)

    def is_completed(self) -> bool:
        """Whether the device has finished the collective (or it failed)."""
        return self._error is not None or self.event.query()

    def is_success(self) -> bool:
        return self.event.query() and self.exception() is None

    def exception(self) -> BaseException | None:
        if self._error is None and self._failure is not None:
            self._error = self._failure()
        return self._error

    host_waits = False
    """Whether ``wait()`` without a timeout also blocks the host until the collective has
    finished or failed (set where a lost peer must be seen before the caller goes on:
    in-place recovery, whose abort lets an aborted collective's garbage reach the stream)."""

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Orders the current stream after the collective; with ``timeout`` (or
        ``host_waits``), also blocks the host until it has finished.

        Raises:
            CommTimeoutError: ``timeout`` passed before the device finished it.
            FastcommError: the collective failed or its transport was aborted.
        """
        self._check()
        if timeout is None and self.host_waits:
            timeout = float("inf")  # the watchdog fails it past the transport's timeout
        if timeout is not None:
            if isinstance(timeout, timedelta):
                timeout = timeout.total_seconds()
            deadline = time.monotonic() + max(timeout, 0.0)
            while not self.event.query():
                if time.monotonic() > deadline:
                    raise CommTimeoutError(
                        f"rank {self.rank}: {self.op} did not complete within {timeout:.3f} s "
                        f"(waited {self._elapsed():.1f} s since it was issued)"
                    )
                time.sleep(0.0002)
                self._check()
            self._check()  # an abort completes the event too: its error is this wait's
        torch.cuda.current_stream().wait_event(self.event)
        return True

    def synchronize(self) -> None:
        """Blocks the host until the collective has finished on the device."""
        self.event.synchronize()
        self._check()


class StreamWatchdog:
    """Tracks a CUDA transport's pending works and times them out (module docstring).

    Args:
        name: the thread's name.
        timeout_s: how long the oldest pending work may run.
        interval_s: how often the thread looks.
        on_stuck: called with the oldest work once it ran past ``timeout_s``; aborts what the
            transport must abort and returns the error every pending work fails with.
        check: the transport's own failure report, polled each interval (``None``: none).
    """

    def __init__(
        self,
        name: str,
        timeout_s: float,
        interval_s: float,
        on_stuck: Callable[[EventWork], BaseException],
        check: Callable[[], BaseException | None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self.pending: deque[EventWork] = deque()
        self.error: BaseException | None = None
        self._on_stuck = on_stuck
        self._check = check
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def track(self, work: EventWork) -> None:
        """Adds a just-enqueued work (call with :attr:`lock` held, in enqueue order)."""
        pending = self.pending
        # drop a finished head now and then, so tensors are released between polls too
        if pending and pending[0].event.query():
            pending.popleft().record_end(None)
        pending.append(work)

    def add(self, work: EventWork) -> None:
        """:meth:`track` without looking at the device (call with :attr:`lock` held): a CUDA
        graph replay's path queries no event; the thread drops finished works each poll."""
        self.pending.append(work)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self.lock:
                while self.pending and self.pending[0].event.query():
                    self.pending.popleft().record_end(None)
                stuck = self.pending[0] if self.pending else None
            error = self._check() if self._check is not None else None
            if error is None and stuck is not None and stuck._elapsed() > self.timeout_s:
                error = self._on_stuck(stuck)
            if error is not None:
                self.fail_all(error)
                return

    def abort(self, error: BaseException, stop: Callable[[], None]) -> bool:
        """From any thread: fails every pending work with ``error``, refuses later ones
        (:attr:`error`), then calls ``stop()`` (the transport's own abort, which lets the
        device finish its kernels) and ends the thread. Once only.

        Returns:
            Whether this call aborted (``False``: already failed or aborted).
        """
        with self.lock:  # after an enqueue in progress, before any later one
            if self.error is not None:
                return False
            self.error = error
        # failed before the device is stopped: a wait that sees its event complete then
        # finds the error, not the garbage an aborted kernel left
        self.fail_all(error)
        try:
            stop()
        except Exception:  # already broken: the abort is best effort
            pass
        self._stop.set()
        return True

    def fail_all(self, error: BaseException) -> None:
        """Fails every pending work with ``error`` and forgets them."""
        with self.lock:
            self.error = error
            failed = list(self.pending)
            for work in failed:
                work._fail(error)
            self.pending.clear()
        for work in failed:  # the flight record of each, and one dump (outside the lock)
            work.record_end(error)

    def close(self, timeout: float = 1.0) -> None:
        """Stops the thread (pending works stay as they are)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
