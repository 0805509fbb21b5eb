"""What a communicator's owner attaches to its calls: the registry of failure hooks.

Every public call of a :class:`~.base.Communicator` is wrapped the same way: an id and a slot
in the flight recorder when it is issued (:meth:`~.flight.FlightRecorder.issue`), the backend's
op, its end when it returns or its ``Work`` completes. A call that fails after anything was
sent (a timeout, an abort, a lost peer, a :class:`~.errors.CollectiveMismatchError`) then runs
the hooks registered here, once per error; an argument error raised before anything was sent,
or a call after ``close()``, runs none. Errors are told apart by type, never by their text.

Hooks are attached by whoever owns them, with an explicit call, at a clear point:
``fastcomm.comm.world.new_communicator`` hands a communicator it builds to the flight watch
(:func:`~.flight_watch.watch`), which registers the dump of every rank's record here. Nothing
registers itself on import.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from .errors import CommClosedError, FastcommError

__all__ = ["CommHooks", "FailureHook"]

logger = logging.getLogger("fastcomm")

FailureHook = Callable[[BaseException], None]
"""``hook(error)``: a call of the communicator failed with ``error`` (it may add notes)."""

_SEEN = 8  # errors remembered: one error failing many pending works runs the hooks once


class CommHooks:
    """The failure hooks of one communicator (``comm.hooks``)."""

    __slots__ = ("_failure", "_seen")

    def __init__(self) -> None:
        self._failure: list[FailureHook] = []
        self._seen: deque[BaseException] = deque(maxlen=_SEEN)

    def register_failure(self, hook: FailureHook) -> Callable[[], None]:
        """Runs ``hook(error)`` whenever a call fails after anything was sent (module
        docstring), on the thread that saw the failure.

        Returns:
            A function that removes the hook again.
        """
        self._failure.append(hook)

        def remove() -> None:
            if hook in self._failure:
                self._failure.remove(hook)

        return remove

    def failed(self, error: BaseException) -> None:
        """A call failed with ``error``: runs every failure hook, once per error, where
        ``error`` is one fastcomm raises once data may have moved (a ``FastcommError``, a
        ``CollectiveMismatchError`` among them; not ``CommClosedError``)."""
        if not self._failure or isinstance(error, CommClosedError) or not isinstance(
                error, FastcommError):
            return
        if any(seen is error for seen in self._seen):
            return
        self._seen.append(error)
        for hook in list(self._failure):
            try:
                hook(error)
            except Exception as exc:  # noqa: BLE001 - a hook must not hide the error itself
                logger.warning("a failure hook of %s raised %s: %s", error, type(exc).__name__,
                               exc)

    def __repr__(self) -> str:
        return f"CommHooks(failure={len(self._failure)})"
