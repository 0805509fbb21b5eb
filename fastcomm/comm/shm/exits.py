"""Processes of this host seen to exit: by event where the kernel gives one, else by a look.

A pidfd (``os.pidfd_open``, Linux >= 5.3) becomes readable once its process has exited, so a
thread can sleep on it (``select.poll``) and wake at the exit itself. The kernel makes it
readable only after tearing the process's memory down, though: 50-58 ms after a SIGKILL for
a process holding 400 MB (the recovery benchmark's survivors, already waiting, saw a rank's
13-15 ms after its kill). A wait that checks between two sleep slices (2 ms) therefore also
looks at the process's stat in ``/proc``, where the kernel's exit flag shows within a few ms
of the kill (``"exiting"``). Where none can be
opened (an older kernel or Python, a sandbox that forbids the call, ``FASTCOMM_PIDFD=0``) the
process is looked up in ``/proc`` every ``LOOK_S`` instead, its start time guarding against a
reused pid. A pidfd is opened only after its process's start time was checked against the one
recorded, so it names that process and no later one.

Invariant: a key is watched one way for its whole life, and :meth:`ProcessExits.how` says
how its exit was seen (``"pidfd"``, ``"exiting"`` or ``"poll"``), for the error that names the
loss.
"""

from __future__ import annotations

import os
import select
import time
import weakref
from collections.abc import Hashable, Iterable

from ... import settings
from .segment import process_alive, process_exiting

__all__ = ["EXITING", "FLAG", "LOOK_S", "PIDFD", "POLL", "ProcessExits", "pidfd_usable"]

#: How a peer's loss was seen: its pidfd, its exit flag in ``/proc`` (before the pidfd), a
#: look at ``/proc`` (no pidfd), its own abort or close mark.
PIDFD, EXITING, POLL, FLAG = "pidfd", "exiting", "poll", "flag"
#: Seconds between two looks at ``/proc`` for a process watched without a pidfd.
LOOK_S = 0.05


def pidfd_usable() -> bool:
    """Whether this Python has ``os.pidfd_open`` and ``FASTCOMM_PIDFD`` allows it."""
    return hasattr(os, "pidfd_open") and settings.PIDFD.get()


def _open(pid: int, start_time: int | None) -> int | None:
    """A pidfd of `pid` if it is still the process that started at `start_time`; ``None``
    where none can be opened or the process is gone already (the look then says so)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # ENOSYS (kernel < 5.3), EPERM (seccomp), ESRCH (gone)
        return None
    if not process_alive(pid, start_time or None):  # gone, or the pid is another's now
        os.close(fd)
        return None
    return fd


class ProcessExits:
    """Watches processes of this host, each under a key (a rank), for their exit.

    Args:
        processes: ``(key, pid, start time)`` of each (start time 0 or ``None``: unknown).
        look_s: seconds between two ``/proc`` looks at a process watched without a pidfd.
    """

    def __init__(self, processes: Iterable[tuple[Hashable, int, int | None]] = (),
                 look_s: float = LOOK_S) -> None:
        self.look_s = look_s
        self._use_pidfd = pidfd_usable()
        self._fds: dict[Hashable, int] = {}
        self._keys_of_fd: dict[int, Hashable] = {}
        self._seen: dict[Hashable, str] = {}  # how an exit was seen, once it was
        # every watched key's (pid, start time); those without a pidfd are looked up in /proc
        self._who: dict[Hashable, tuple[int, int | None]] = {}
        self._next_look: dict[Hashable, float] = {}
        self._poller = select.poll()
        # a communicator's flags may be dropped without release(): the pidfds go with them
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)
        for key, pid, start_time in processes:
            self.add(key, pid, start_time)

    def add(self, key: Hashable, pid: int, start_time: int | None) -> None:
        """Watches process `pid` (started at `start_time`) under `key` (once per key)."""
        if key in self._who:
            return
        self._who[key] = (pid, start_time)
        fd = _open(pid, start_time) if self._use_pidfd else None
        if fd is None:
            self._next_look[key] = 0.0  # looked at the first time it is asked about
            return
        self._fds[key] = fd
        self._keys_of_fd[fd] = key
        self._poller.register(fd, select.POLLIN)

    def how(self, key: Hashable) -> str:
        """How `key`'s exit was seen (:meth:`exited` said so), or is watched: ``"pidfd"``,
        ``"exiting"`` (its exit flag, before its pidfd), ``"poll"`` (a look at ``/proc`` every
        ``look_s``, no pidfd)."""
        return self._seen.get(key) or (PIDFD if key in self._fds else POLL)

    def exited(self, key: Hashable, now: float | None = None) -> bool:
        """Whether `key`'s process has exited or is exiting: its pidfd's state (one system
        call), then its exit flag (a read of its stat); without a pidfd, a ``/proc`` look when
        the last one is ``look_s`` old (``now``: ``time.monotonic()``)."""
        fd = self._fds.get(key)
        if fd is not None:
            if select.select((fd,), (), (), 0)[0]:
                self._seen.setdefault(key, PIDFD)
                return True
            pid, start_time = self._who[key]
            if process_exiting(pid, start_time or None):
                self._seen.setdefault(key, EXITING)
                return True
            return False
        if key not in self._who:  # closed
            return False
        now = time.monotonic() if now is None else now
        if now < self._next_look[key]:
            return False
        self._next_look[key] = now + self.look_s
        pid, start_time = self._who[key]
        return not process_alive(pid, start_time or None)

    def wait(self, timeout_s: float, extra_fd: int | None = None) -> list[Hashable]:
        """Sleeps until a pidfd'd process exits, `extra_fd` is readable or `timeout_s`
        passes; returns the keys whose pidfd woke it (the looked-up ones: :meth:`exited`)."""
        if extra_fd is not None:
            self._poller.register(extra_fd, select.POLLIN)
        try:
            ready = self._poller.poll(max(0, int(timeout_s * 1000)))
        finally:
            if extra_fd is not None:
                self._poller.unregister(extra_fd)
        found = [self._keys_of_fd[fd] for fd, _ in ready if fd in self._keys_of_fd]
        for key in found:  # stays readable: slept on no more (exited() still says so)
            self._poller.unregister(self._fds[key])
        return found

    def close(self) -> None:
        """Closes every pidfd (idempotent); every key is then forgotten (never seen exited)."""
        _close_fds(self._fds)
        self._keys_of_fd.clear()
        self._who.clear()
        self._next_look.clear()
        self._poller = select.poll()


def _close_fds(fds: dict) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
