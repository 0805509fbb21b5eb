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

The server is forked from the agent itself where it can be (``_fork_here``: torch is imported
there already), else started as ``python -u _bootstrap.py --server FD``; either way ``ps`` shows
it with that command line.

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
            if _can_fork_here(cmd, bootstrap):
                title = _title(server_command(cmd, bootstrap, fd))
                self.proc = _ServerChild(_fork_here(fd, env, self.sock.fileno(), title))
            else:
                self.proc = subprocess.Popen(
                    server_command(cmd, bootstrap, fd), env=env, pass_fds=[fd],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    start_new_session=True,
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


class _ServerChild:
    """The server forked from the agent itself: the part of ``Popen`` :meth:`ForkServer.close`
    uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"fork server pid {self.pid}", timeout)
            else:
                time.sleep(0.005)
        return self.returncode


def _can_fork_here(cmd: list[str], bootstrap: str) -> bool:
    """Whether the server may be forked from the agent itself, whose torch is imported
    already (the server then imports only what the agent lacks): the workers' interpreter is
    this one, started plainly (``python -u BOOTSTRAP``), and the agent runs no other thread (a
    lock another thread held would stay locked in the child). UTF-8 mode is no reason to
    refuse unless the agent's command line set it (``-X utf8``): from ``PYTHONUTF8`` or the C
    locale (a container's, often) a spawned server would take it the same way."""
    import sys
    import threading

    flags = sys.flags
    return (
        sys.platform.startswith("linux")
        and cmd[:3] == [cmd[0], "-u", bootstrap]
        and os.path.realpath(cmd[0]) == os.path.realpath(sys.executable)
        and "torch" in sys.modules
        and threading.active_count() == 1
        and not (flags.optimize or flags.isolated or flags.ignore_environment
                 or flags.dev_mode or "utf8" in sys._xoptions or flags.no_site)
    )


def _encode(argv: list[str]) -> bytes:
    return b"".join(os.fsencode(arg) + b"\0" for arg in argv)


def stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after ``pid (comm)`` (the state is ``[0]``, field 3 of
    proc(5)); ``None`` where it cannot be read (no such process, no ``/proc``). `pid` may be
    ``"self"``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read()
    except OSError:
        return None
    end = text.rfind(b")")
    return text[end + 1 :].split() if end >= 0 else None


def _cmdline_area() -> tuple[int, int]:
    """The addresses of this process's command line (``/proc/self/stat``'s ``arg_start`` and
    ``arg_end``; ``(0, 0)`` where it does not say)."""
    fields = stat_fields("self")
    if fields is None or len(fields) < 47:
        return 0, 0
    return int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5)


def _title(argv: list[str]) -> list[str]:
    """The command line the forked server shows: the one a spawned server has where the
    agent's leaves room for it, else with the names shortened (a command line cannot grow)."""
    start, end = _cmdline_area()
    _, flag, bootstrap, *rest = argv
    for title in (argv, ["python", flag, os.path.basename(bootstrap), *rest],
                  [os.path.basename(bootstrap), *rest]):
        if len(_encode(title)) <= end - start:
            return title
    return argv  # cut to the room there is


def _set_cmdline(argv: list[str]) -> None:  # pragma: no cover - in the child
    """Writes ``argv`` over this process's command line (what ``ps`` and ``/proc/PID/cmdline``
    show), padded with NULs; best effort."""
    start, end = _cmdline_area()
    if not start:
        return
    data = _encode(argv)[: end - start - 1]
    try:
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(data.ljust(end - start, b"\0"))
    except OSError:
        pass  # the title stays the agent's


def _fork_here(fd: int, env: dict[str, str], agent_end: int, title: list[str]) -> int:
    """Forks the server from the agent; returns its pid. The child leads a session of its own,
    keeps only the socket ``fd`` and stderr, takes the signal dispositions, ``sys.path``,
    unbuffered standard streams and environment a new ``python -u BOOTSTRAP`` would have,
    then serves (``_bootstrap.serve_forked``); it never returns here."""
    import sys
    import warnings

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # nothing the agent wrote is left for the child to write again
        except (AttributeError, OSError, ValueError):
            pass  # closed or None: nothing to write
    with warnings.catch_warnings():  # 3.12+: "multi-threaded, fork() may deadlock"
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return pid
    try:  # pragma: no cover - the child (its tests run it through real launches)
        _set_cmdline(title)
        _become_server(fd, agent_end)
        from . import _bootstrap

        _bootstrap.serve_forked(fd, env)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(1)


def _become_server(fd: int, agent_end: int) -> None:  # pragma: no cover - in the child
    import io
    import sys

    os.setsid()
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    os.close(agent_end)
    os.closerange(3, fd)
    os.closerange(fd + 1, 1 << 16)
    if sys.path and not getattr(sys.flags, "safe_path", False):
        del sys.path[0]  # the agent's script or working folder: a new bootstrap's is removed
    def text(number: int, old, mode: str, **kwargs) -> io.TextIOWrapper:
        raw = io.FileIO(number, mode, closefd=False)
        return io.TextIOWrapper(raw if mode == "w" else io.BufferedReader(raw),
                                encoding=getattr(old, "encoding", None) or "utf-8",
                                errors=getattr(old, "errors", None) or "strict", **kwargs)

    # as ``python -u`` makes them (unbuffered), on the fds each forked worker is given
    sys.stdout = sys.__stdout__ = text(1, sys.__stdout__, "w", newline="\n", write_through=True)
    sys.stderr = sys.__stderr__ = text(2, sys.__stderr__, "w", newline="\n", write_through=True)
    sys.stdin = sys.__stdin__ = text(0, sys.__stdin__, "r")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: the server that would reap it is gone)."""
    fields = stat_fields(pid)
    return bool(fields) and fields[0] not in (b"Z", b"X")
