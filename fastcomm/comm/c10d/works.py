"""The work handles the fastcomm torch.distributed backend returns: :class:`FinishedWork` for a
call that finished before it returned, :class:`FastcommWork` for one still in flight. Both are
``dist._Work`` subclasses whose futures' value is the list of output tensors."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..work import SettledByWait, wrap_error


def wait_seconds(timeout: Any) -> float | None:
    """A wait's limit in seconds; ``None`` or zero (C++'s ``kNoTimeout``) means none."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return seconds if seconds > 0 else None


class FinishedWork(dist._Work):
    """The handle of a call that finished before it returned (torch issued it synchronously):
    ``wait()`` returns at once, the future is already completed with the outputs. Made by
    :func:`finished_work` (no ``__init__`` of its own: it is made on every synchronous call)."""

    __slots__ = ("_outputs",)

    def holding(self, outputs: list) -> FinishedWork:
        """This handle, now of a call whose outputs are ``outputs`` (a group reuses its last
        one while nobody holds it: making a ``dist._Work`` costs more than the rest of a
        call)."""
        self._outputs = outputs
        return self

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> list:
        return self._outputs

    def synchronize(self) -> None:
        pass

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(self._outputs)
        return future

    def __repr__(self) -> str:
        return "FinishedWork()"


def finished_work(outputs: list) -> FinishedWork:
    """A new finished handle of ``outputs``."""
    return FinishedWork().holding(outputs)


class FastcommWork(SettledByWait, dist._Work):
    """The handle of a call still in flight: over the communicator's ``Work`` (or Gloo's), with
    the step that completes the call afterwards (copying a packed result out), run once by
    whichever of ``wait()``, ``is_completed()`` and the future comes first.

    Args:
        op: the operation's name, for errors.
        rank: this rank in the group, for errors.
        outputs: the tensors the future resolves to (torch's convention: a list).
        inner: the pending works the call is made of.
        post: what runs once they are done, or ``None``.
    """

    __slots__ = (
        "_op", "_rank", "_outputs", "_inner", "_post", "_start", "_finished", "_error",
        "_future", "_lock",
    )

    def __init__(
        self,
        op: str,
        rank: int,
        outputs: list,
        inner: Sequence[Any],
        post: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._op = op
        self._rank = rank
        self._outputs = outputs
        self._inner = inner
        self._post = post
        self._start = time.monotonic()
        self._finished = False
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None
        self._lock = threading.Lock()

    def _settle(self, error: BaseException | None) -> None:
        """Records the outcome once: runs ``post`` after the inner works succeeded."""
        with self._lock:
            if self._finished:
                return
            try:
                if error is not None:
                    raise error
                if self._post is not None:
                    self._post()
            except BaseException as exc:  # kept for every later wait() and the future
                self._error = wrap_error(self._op, self._rank, self._start, exc)
            self._finished = True

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Blocks until the call is done and raises its error.

        Args:
            timeout: a limit for this wait (``None`` or zero: the group's own timeout ends a
                call that cannot finish). When it passes, ``CommTimeoutError`` is raised and
                the operation is left running.

        Returns:
            ``True``, as torch's ``Work.wait``.
        """
        if not self._finished:
            limit = wait_seconds(timeout)
            try:
                for work in self._inner:
                    if limit is None:
                        work.wait()
                    elif isinstance(work, dist._Work):
                        work.wait(timedelta(seconds=limit))
                    else:
                        work.wait(limit)
            except BaseException as exc:
                if limit is not None and not all(w.is_completed() for w in self._inner):
                    raise wrap_error(self._op, self._rank, self._start, exc) from exc
                self._settle(exc)
            else:
                self._settle(None)
        if self._error is not None:
            raise self._error
        return True

    def _inner_done(self) -> bool:
        return all(w.is_completed() for w in self._inner)

    def result(self) -> list:
        """Waits, then returns the output tensors."""
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        """The sender of a ``recv_anysource`` (torch reads it as ``work._source_rank()``)."""
        return self._inner[0]._source_rank()

    source_rank = _source_rank

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` whose value is the list of output tensors."""
        if self._future is None:
            futures = [_future_of(w) for w in self._inner]
            if len(futures) == 1:
                joined = futures[0]
            else:  # several works, or none (a call whose data was in place at once)
                joined = torch.futures.collect_all(futures)
            self._future = joined.then(self._resolve)
        return self._future

    def _resolve(self, joined: torch.futures.Future) -> list:
        try:
            value = joined.value()
            for part in value if len(self._inner) > 1 else ():
                part.value()
        except BaseException as exc:  # the call failed: so does every chained future
            self._settle(exc)
        else:
            self._settle(None)
        if self._error is not None:
            raise self._error
        return self._outputs

    def __repr__(self) -> str:
        state = "done" if self._finished else "pending"
        return f"FastcommWork({self._op}, rank={self._rank}, {state})"


def _future_of(work: Any) -> torch.futures.Future:
    """``work``'s future; for a torch handle without one (Gloo's send, recv, gather...), one
    completed by a thread of its own once the handle is done (never on a communicator's
    executor: a receive waiting there would stall the collectives queued behind it)."""
    try:
        return work.get_future()
    except RuntimeError:
        pass
    return thread_future(work.wait, lambda: None, "fastcomm-c10d-future")


def thread_future(wait, value, name: str) -> torch.futures.Future:
    """A future completed by a daemon thread of its own: ``value()`` once ``wait()`` returned,
    or the error it raised."""
    future = torch.futures.Future()

    def run() -> None:
        try:
            wait()
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            future.set_exception(exc)
        else:
            future.set_result(value())

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
