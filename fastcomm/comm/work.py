"""Handles of asynchronous operations.

A :class:`Work` is returned by every collective called with ``async_op=True``. Its future's value
is the operation's output tensor. For CPU work the future completes when the data is in place;
for CUDA work (NCCL) the future is created with ``devices=[...]`` and completed right after the
kernel is enqueued on the communication stream, so a consumer's ``wait()``/``value()`` makes its
current stream wait on that stream and the host never blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch

from .errors import CommTimeoutError, FastcommError

__all__ = ["Work"]


class Work:
    """One in-flight operation.

    Args:
        op: the operation's name (``"all_reduce"``), used in error messages.
        rank: the rank that issued it, used in error messages.
        output: the tensor the future resolves to.
        devices: CUDA devices for a stream-aware future, or ``None`` for a CPU future.
    """

    def __init__(
        self,
        op: str,
        rank: int,
        output: torch.Tensor | None,
        *,
        devices: list[torch.device] | None = None,
    ) -> None:
        self.op = op
        self.rank = rank
        self.output = output
        self.start = time.monotonic()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future = (
            torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        )

    # -------------------------------------------------------------- producer side
    def _complete(self) -> None:
        if self._done.is_set():
            return
        self._done.set()
        self._future.set_result(self.output)

    def _fail(self, error: BaseException) -> None:
        if self._done.is_set():
            return
        self._error = error
        self._done.set()
        self._future.set_exception(error)

    def _elapsed(self) -> float:
        return time.monotonic() - self.start

    # -------------------------------------------------------------- consumer side
    def is_completed(self) -> bool:
        """Whether the operation has finished (successfully or not)."""
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
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
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        if not self._done.wait(timeout):
            raise CommTimeoutError(
                f"rank {self.rank}: {self.op} did not complete within {timeout:.3f} s "
                f"(waited {self._elapsed():.1f} s since it was issued)"
            )
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` whose value is the output tensor."""
        return self._future

    def result(self) -> torch.Tensor | None:
        self.wait()
        return self.output

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"Work({self.op}, rank={self.rank}, {state})"


def completed_work(op: str, rank: int, output: torch.Tensor | None) -> Work:
    """A ``Work`` that is already finished (synchronous paths, zero-size tensors)."""
    work = Work(op, rank, output)
    work._complete()
    return work


def wrap_error(op: str, rank: int, start: float, exc: BaseException) -> FastcommError:
    """Turns a backend error into one naming the rank, the operation and the elapsed time."""
    if isinstance(exc, FastcommError):
        return exc
    elapsed = time.monotonic() - start
    text = str(exc)
    lowered = text.lower()
    cls = CommTimeoutError if ("timed out" in lowered or "timeout" in lowered) else FastcommError
    return cls(f"rank {rank}: {op} failed after {elapsed:.1f} s: {text}")


class CompletionThread:
    """Completes queued works in issue order on a daemon thread.

    Backends whose native handles lack futures (Gloo's reduce_scatter, say) hand each pending
    handle here with a ``finish`` callable that blocks until it is done and post-processes it.
    """

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._queue: list[tuple[Work, Callable[[], None]]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Work, finish: Callable[[], None]) -> None:
        with self._cond:
            self._queue.append((work, finish))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                work, finish = self._queue.pop(0)
            try:
                finish()
            except BaseException as exc:  # delivered to the waiter, never lost
                work._fail(wrap_error(work.op, work.rank, work.start, exc))
            else:
                work._complete()

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
