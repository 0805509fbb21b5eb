"""In-order executors for the ``shm`` and ``hier`` communicators.

A :class:`Lane` runs submitted tasks one after another on its own daemon thread, started on first
use. A synchronous call runs on the caller's thread instead when its lane is idle (no thread
hand-off: that is what keeps a small all-reduce in the tens of microseconds); otherwise it queues
behind the pending asynchronous work, so every rank executes its operations in issue order.

Invariant: ``busy`` counts tasks submitted and not yet finished; it drops *before* the task's
``Work`` completes, so a caller woken by that ``Work`` already sees the lane idle.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from .work import Work

__all__ = ["Lane"]


class Lane:
    """A FIFO of ``(Work, fn)`` executed on one thread.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy = 0
        self._cond = threading.Condition()
        self._queue: deque[tuple[Work, Callable[[], None]]] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, work: Work, fn: Callable[[], None]) -> None:
        """Queues ``fn``; its outcome completes or fails ``work``."""
        with self._cond:
            self.busy += 1
            self._queue.append((work, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                work, fn = self._queue.popleft()
            error = None
            try:
                fn()
            except BaseException as exc:  # delivered to the waiter, never lost
                error = exc
            with self._cond:
                self.busy -= 1
                self._cond.notify_all()
            if error is None:
                work._complete()
            else:
                work._fail(error)

    def close(self, timeout: float) -> bool:
        """Stops the thread after the queued tasks; returns whether it ended within ``timeout``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()
