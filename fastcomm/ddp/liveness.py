"""Liveness of the members on other hosts, for in-place recovery over ``hier``.

``fastcomm-run --recover in-process`` sets ``lost_rank_key(RANK)`` in the job's store for every
loss it absorbs: a worker that died, or each rank of a node whose agent stopped heartbeating
(within the heartbeat limit). :class:`LossWatch` is a thread in each rank that looks at those
keys for the current members on other hosts every ``POLL_S`` and aborts the communicator in use
(``HierCommunicator.abort``) once one is set, so a collective waiting on the lost rank raises
``CommAbortedError`` naming it, instead of waiting out its timeout. It reads the store through
a connection of its own; it is stopped at exit, before the interpreter finalizes.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable

from fastcomm.comm.errors import CommAbortedError
from fastcomm.comm.store import Store

__all__ = ["POLL_S", "LossWatch"]

#: Seconds between two looks at the lost ranks' keys.
POLL_S = 0.05

_LIVE: weakref.WeakSet = weakref.WeakSet()


def own_connection(store: Store) -> Store:
    """A root view of ``store`` over a connection of its own (the root view of ``store``
    itself where the server's address is unknown)."""
    host, port = store.host, store.port
    if host == "?" or port <= 0:
        return store.root()
    try:
        return Store(host, port, timeout=store.timeout, _secret=None)
    except RuntimeError:
        return store.root()


class LossWatch:
    """Aborts the communicator in use once a member on another host is named lost.

    Args:
        membership: the recovery's ``Membership`` (its members, and the key of each one).
        current: returns the communicator in use (it changes at each shrink); ``None`` once
            its DDP is gone (the thread then ends).
        poll_s: seconds between two looks.
    """

    def __init__(self, membership, current: Callable[[], object], poll_s: float = POLL_S
                 ) -> None:
        self.membership = membership
        self.current = current
        self.poll_s = poll_s
        self.lost: dict[int, str] = {}
        """Original rank -> why it was lost, as the launcher said."""
        self._store = own_connection(membership.lost_store)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fastcomm-loss-watch",
                                        daemon=True)
        _LIVE.add(self)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.current() is None:
                return
            try:
                self.look()
            except RuntimeError:  # the store is gone: the job is ending
                return

    def look(self) -> list[int]:
        """Looks once; aborts the communicator in use for each member newly named lost.

        Returns:
            The original ranks newly found lost.
        """
        membership = self.membership
        found = []
        for original in list(membership.members):
            key = membership.lost_key(original)
            if key is None or original in self.lost or not self._store.check([key]):
                continue
            why = self._store.get(key).decode("utf-8", "replace")
            self.lost[original] = why
            found.append(original)
            comm = self.current()
            if original not in membership.members:  # the survivors agreed without it already
                continue
            abort = getattr(comm, "abort", None)
            if abort is not None:
                host = membership.identity[original][0]
                abort(CommAbortedError(
                    f"member {original} (launcher rank {membership.launch_rank(original)}, "
                    f"host {host}) was lost: {why}"
                ))
        return found

    def close(self) -> None:
        """Stops the thread (idempotent)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)


@atexit.register
def _stop_all() -> None:
    for watch in list(_LIVE):
        watch.close()
