"""What a test session leaves behind: fastcomm shared-memory segments and running processes.

The session puts a token in its environment (``FASTCOMM_TEST_SESSION``), which every process
it starts inherits, and a watcher thread notes the pid of each process that carries it while
that process runs. At the end, a segment is the session's when it appeared during the session,
belongs to this user and its creator (the pid its name starts with) was one of those
processes; a process is the session's while it carries the token. Other users' files, segments
that were there before, and other sessions' segments and processes are never judged.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

from fastcomm.comm.shm.segment import PREFIX, SHM_DIR

TOKEN_VAR = "FASTCOMM_TEST_SESSION"
#: Processes of the session that may outlive its checks: multiprocessing's helpers, which
#: exit with the pytest process.
ALLOWED = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def creator(name: str) -> int | None:
    """The pid a segment's name starts with (``None`` for a name of another form)."""
    head = name[len(PREFIX) :].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


class Leftovers:
    """Watches the processes of this session; :meth:`check` names what they left behind.

    Args:
        interval: seconds between two looks at ``/proc``.
    """

    def __init__(self, interval: float = 0.2) -> None:
        self.token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._marker = f"{TOKEN_VAR}={self.token}".encode()
        self._uid = os.getuid()
        self._interval = interval
        self.pids: set[int] = {os.getpid()}
        self.before = set(self.segments())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="leftovers", daemon=True)

    def start(self) -> None:
        os.environ[TOKEN_VAR] = self.token
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def segments(self) -> list[str]:
        """This user's fastcomm segments now in ``SHM_DIR``."""
        try:
            names = os.listdir(SHM_DIR)
        except OSError:
            return []
        mine = []
        for name in names:
            if not name.startswith(PREFIX):
                continue
            try:
                if os.stat(os.path.join(SHM_DIR, name)).st_uid == self._uid:
                    mine.append(name)
            except OSError:  # unlinked meanwhile
                continue
        return sorted(mine)

    def running(self) -> set[int]:
        """Pids of the processes, other than this one, that carry this session's token."""
        found = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                if os.stat(f"/proc/{entry}").st_uid != self._uid:
                    continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = f.read()
            except OSError:  # gone, or not ours to read
                continue
            if self._marker in environ.split(b"\0"):
                found.add(int(entry))
        return found

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            self.pids |= self.running()

    def check(self, grace: float = 10.0) -> list[str]:
        """What the session left: one line per kind, empty when nothing.

        Segments and processes get ``grace`` seconds to go (a pool closing as the session ends).
        """
        self.stop()
        deadline = time.monotonic() + grace
        while True:
            alive = {p for p in self.running() if not any(a in command_line(p) for a in ALLOWED)}
            self.pids |= alive
            leaked = [
                n for n in self.segments() if n not in self.before and creator(n) in self.pids
            ]
            if (not alive and not leaked) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        problems = []
        if leaked:
            problems.append(f"shared-memory segments in {SHM_DIR}: {leaked}")
        if alive:
            named = "; ".join(f"pid {p}: {command_line(p)}" for p in sorted(alive))
            problems.append(f"processes still running: {named}")
        return problems
