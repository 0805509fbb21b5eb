"""The fork server of ``--start-method forkserver`` (the default for Python workers): one
interpreter per round that imports torch and fastcomm once (``_bootstrap.py --server FD``),
then forks every worker of the round, and every replacement, from that warm state.

A worker then starts in milliseconds instead of the seconds its imports cost (about 4 s of CPU
each for torch, torch._dynamo and fastcomm on the 2-core CI machine), and the workers of a node
share the imported code's pages. Note: what the workers inherit is the server's import-time
state, taken in the round's environment; a script that changes ``os.environ`` before its own
``import torch`` to steer torch's import (``OMP_NUM_THREADS``, ``TORCH_LOGS``) needs
``--start-method spawn``. ``OMP_NUM_THREADS`` from the worker's environment is applied with
``torch.set_num_threads``, and numpy's global generator is reseeded in each worker.

The protocol, over a Unix socket pair (one request in flight at a time):
- agent -> server: one JSON line ``{"args": [...], "env": {...}}`` with the worker's stdin,
  stdout and stderr passed along as file descriptors (``SCM_RIGHTS``);
- server -> agent: ``{"ready": pid}`` once it imported, ``{"started": pid}`` once a forked
  worker leads its own session, and ``{"exit": pid, "code": c}`` when the server reaps it
  (``c`` as ``Popen.returncode``).

The agent waits for ``ready`` before it joins the rendezvous (``Agent._open_rendezvous``): a
fork then takes milliseconds, so starting the workers never holds up the agent's heartbeats.

Each worker is a child of the server; it watches the server as a spawned worker watches the
agent (``_bootstrap._watch``), and the server exits when the agent's end of the socket closes,
so a lost agent still takes its workers down.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from typing import BinaryIO

__all__ = ["ForkServer", "Forked", "server_command"]

#: Seconds to wait for the server to fork a worker (the first waits for the imports).
START_TIMEOUT_S = 120.0


def server_command(cmd: list[str], bootstrap: str, fd: int) -> list[str] | None:
    """The server's command line from a worker's ``python [-u] BOOTSTRAP [OPTS] -- ...``: the
    same interpreter and bootstrap with ``--server FD``; ``None`` for a worker the server cannot
    fork (``--no-python``, or ``--cpus``: OpenMP sizes its pool at import from the CPUs)."""
    if bootstrap not in cmd or "--exec" in cmd or "--cpus" in cmd:
        return None
    return [*cmd[: cmd.index(bootstrap) + 1], "--server", str(fd)]


class Forked:
    """A worker forked by the server: the part of ``subprocess.Popen`` the agent uses."""

    def __init__(self, server: ForkServer, pid: int, stdout: BinaryIO | None,
                 stderr: BinaryIO | None) -> None:
        self.server = server
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode


class ForkServer:
    """One server process (started at once; it imports while the agent goes on).

    Args:
        cmd: a worker's command line (:func:`server_command` makes the server's from it).
        bootstrap: the path of ``_bootstrap.py``.
        env: the environment it imports in (a worker's of this round; each fork gets its own).
    """

    def __init__(self, cmd: list[str], bootstrap: str, env: dict[str, str]) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            fd = theirs.fileno()
            self.proc = subprocess.Popen(
                server_command(cmd, bootstrap, fd), env=env, pass_fds=[fd],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
            )
        finally:
            theirs.close()
        self.sock.setblocking(False)
        self._buffer = b""
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self._ready = False
        self._gone = False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> bool:
        """Waits until the server has imported (``False``: it died, or is still importing
        after ``timeout`` s: then start the workers as new interpreters)."""
        deadline = time.monotonic() + timeout
        while not self._ready and not self._gone and time.monotonic() < deadline:
            self._read(wait=min(0.5, max(0.0, deadline - time.monotonic())))
        return self._ready

    @staticmethod
    def usable(cmd: list[str], bootstrap: str) -> bool:
        """Whether the server can fork a worker started as ``cmd``."""
        return server_command(cmd, bootstrap, 0) is not None

    def spawn(self, args: list[str], env: dict[str, str], fds: tuple[int, int, int],
              stdout: BinaryIO | None, stderr: BinaryIO | None) -> Forked | None:
        """Forks a worker running the bootstrap's ``args`` in ``env`` on ``fds`` (stdin,
        stdout, stderr; the caller closes its copies); ``None`` if the server is gone or does
        not answer within :data:`START_TIMEOUT_S` (the caller starts the worker itself)."""
        if not self.wait_ready():
            self.close()
            return None
        line = (json.dumps({"args": args, "env": env}) + "\n").encode()
        try:
            self.sock.setblocking(True)
            self.sock.settimeout(START_TIMEOUT_S)
            sent = socket.send_fds(self.sock, [line], list(fds))
            if sent < len(line):
                self.sock.sendall(line[sent:])
        except OSError:
            self.close()
            return None
        finally:
            self.sock.setblocking(False)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._started and not self._gone and time.monotonic() < deadline:
            self._read(wait=min(1.0, max(0.0, deadline - time.monotonic())))
        if not self._started:
            self.close()
            return None
        return Forked(self, self._started.pop(0), stdout, stderr)

    def exit_code(self, pid: int) -> int | None:
        """``pid``'s exit status once the server reaped it; ``-SIGKILL`` once it is gone with the
        server (it watches the server and kills itself when the server is gone)."""
        self._read(wait=0.0)
        if pid in self._exits:
            return self._exits[pid]
        if self._gone and not _alive(pid):
            return -signal.SIGKILL
        return None

    def _read(self, wait: float) -> None:
        """Takes in what the server wrote (waiting up to ``wait`` s for something)."""
        if self._gone:
            return
        import select

        if wait > 0:
            select.select([self.sock], [], [], wait)
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                self._gone = True
                break
            self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for text in lines:
            msg = json.loads(text)
            if "ready" in msg:
                self._ready = True
            elif "started" in msg:
                self._started.append(int(msg["started"]))
            else:
                self._exits[int(msg["exit"])] = int(msg["code"])

    def close(self) -> None:
        """Ends the server (its workers are the caller's to stop) and reaps it."""
        self._read(wait=0.0)
        self._gone = True
        try:
            self.sock.close()
        except OSError:
            pass  # closed already
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone already
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
            pass


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: the server that would reap it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False
