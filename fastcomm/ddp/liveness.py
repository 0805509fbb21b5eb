"""Liveness of the members, for in-place recovery: a thread that aborts the communicator in use.

On other hosts: ``fastcomm-run --recover in-process`` sets ``lost_rank_key(RANK)`` in the job's
store for every loss it absorbs (a worker that died, or each rank of a node whose agent stopped
heartbeating). On this host: ``/proc`` (pid and start time), for a communicator whose waits
cannot see a dead peer themselves (no ``capabilities.sees_lost_peers``: Gloo, NCCL, ``ipc``;
shared memory sees it), each member's exit as an event (its pidfd, ``shm.exits``; ``/proc``
every ``POLL_S`` where none opens).
:class:`LossWatch` sleeps on those pidfds, waking at an exit or every ``POLL_S`` for the
store's keys, and aborts the communicator in use (its ``abort``) once a current member is
gone, so a collective waiting on it raises ``PeerLostError`` naming it instead of waiting out
its timeout. It reads the store through a connection of its own; it is stopped at exit, before
the interpreter finalizes.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable

from fastcomm.comm.errors import PeerLostError
from fastcomm.comm.shm.exits import ProcessExits
from fastcomm.comm.store import Store

__all__ = ["POLL_S", "LossWatch"]

#: Seconds between two looks at the lost ranks' keys and at ``/proc``.
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
    """Aborts the communicator in use once a member is lost: on another host named so by the
    launcher, on this one (with ``here``) gone from ``/proc``.

    Args:
        membership: the recovery's ``Membership`` (its members, and the key of each one).
        current: returns the communicator in use (it changes at each shrink); ``None`` once
            its DDP is gone (the thread then ends).
        poll_s: seconds between two looks.
        here: also look at the members on this host (for a communicator without
            ``capabilities.sees_lost_peers``).
    """

    def __init__(self, membership, current: Callable[[], object], poll_s: float = POLL_S,
                 *, here: bool = False) -> None:
        self.membership = membership
        self.current = current
        self.poll_s = poll_s
        self.here = here
        self.lost: dict[int, str] = {}
        """Original rank -> why it was lost (the launcher's words, or ``exited``)."""
        self.seen_by: dict[int, str] = {}
        """Original rank -> how its loss was seen: ``"pidfd"``, ``"poll"`` or ``"store"``."""
        self._store: Store | None = None  # made at the first look at a remote member
        self._exits = ProcessExits(look_s=poll_s)  # the members here, added as they come
        self._stop = threading.Event()
        self._looking = threading.Lock()
        self._wake_read, self._wake_write = os.pipe()  # close() wakes the thread's sleep
        self._thread = threading.Thread(target=self._loop, name="fastcomm-loss-watch",
                                        daemon=True)
        _LIVE.add(self)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self._looking:
                    self._watch_members_here()
                self._exits.wait(self.poll_s, self._wake_read)
                if self._stop.is_set() or self.current() is None:
                    return
                try:
                    self.look()
                except RuntimeError:  # the store is gone: the job is ending
                    return
        finally:
            self._exits.close()
            os.close(self._wake_read)

    def _watch_members_here(self) -> None:
        """Watches the exit of each member on this host not watched yet (members join)."""
        membership = self.membership
        if not self.here:
            return
        for original in membership.members:
            host, pid, start = membership.identity[original][:3]
            if original != membership.me and host == membership.host:
                self._exits.add(original, pid, start)

    def look(self) -> list[int]:
        """Looks once; aborts the communicator in use for each member newly named lost.

        Returns:
            The original ranks newly found lost.
        """
        with self._looking:  # the thread's look and a caller's take each loss once
            return self._look()

    def _look(self) -> list[int]:
        self._watch_members_here()
        membership = self.membership
        found = []
        for original in list(membership.members):
            if original in self.lost or original == membership.me:
                continue
            error = self._gone(original)
            if error is None:
                continue
            found.append(original)
            comm = self.current()
            if original not in membership.members:  # the survivors agreed without it already
                continue
            abort = getattr(comm, "abort", None)
            if abort is not None:
                abort(error)
        return found

    def _gone(self, original: int) -> PeerLostError | None:
        """The error naming member `original` if it is lost (kept in :attr:`lost`), else
        ``None``."""
        membership = self.membership
        host, pid = membership.identity[original][:2]
        who = f"member {original} (launcher rank {membership.launch_rank(original)}"
        key = membership.lost_key(original)
        if key is not None:
            if self._store is None:
                self._store = own_connection(membership.lost_store)
            # polled every POLL_S by every rank: in etcd answered by the nearest member, no
            # round to the leader (a loss is seen at the next look at worst)
            if not self._store.check([key], stale_ok=True):
                return None
            why = self._store.get(key).decode("utf-8", "replace")
            self.lost[original], self.seen_by[original] = why, "store"
            return PeerLostError(f"{who}, host {host}) was lost: {why}", "store", time.time())
        if not self.here or host != membership.host or not self._exits.exited(original):
            return None
        how = self._exits.how(original)
        self.lost[original], self.seen_by[original] = "exited", how
        return PeerLostError(f"{who}, pid {pid}, this host) exited (seen by {how})", how,
                             time.time())

    def close(self) -> None:
        """Stops the thread (idempotent); it closes its pidfds as it ends."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            os.write(self._wake_write, b"x")
        except OSError:  # the thread ended already, its end of the pipe with it
            pass
        finally:
            os.close(self._wake_write)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)


@atexit.register
def _stop_all() -> None:
    for watch in list(_LIVE):
        watch.close()
