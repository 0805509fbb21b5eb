"""Worker processes of one agent: start, watch, stop, and their output.

Each worker runs in its own session (so it is the leader of its process group): stopping a
worker signals the whole group, which takes down whatever the worker started too -- also what
a worker leaves running when it exits (even with status 0). Stopping is always SIGTERM (or the
signal the agent received) first, then SIGKILL for what is left after ``--shutdown-timeout``
seconds. Lines the workers write reach the console prefixed (``[rank N]: ``), or files
(``--redirects``/``--tee``). Once the workers are reaped, the ``/dev/shm`` segment files named
after them are removed (those creators are provably gone). Details: docs/launch.md.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from string import Template
from typing import BinaryIO

from fastcomm import settings

from .config import STD_ERR, STD_OUT
from .forkserver import Forked, ForkServer, stat_fields
from .spare import Spare, spare_command

__all__ = ["WorkerSpec", "WorkerGroup", "BOOTSTRAP", "pid_namespace", "start_time"]

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap.py")

_CONSOLE_LOCK = threading.Lock()


@dataclass(slots=True)
class WorkerSpec:
    """How to start one worker."""

    local_rank: int
    rank: int
    cmd: list[str]
    env: dict[str, str]
    log_dir: str
    """``attempt_<round>/<local_rank>`` directory (error file, redirected output)."""
    error_file: str
    console_prefix: bytes | None
    """Prefix of console lines; ``None``: not shown on the console (--local-ranks-filter)."""
    redirect: int = 0
    tee: int = 0


@dataclass(slots=True)
class _Worker:
    spec: WorkerSpec
    proc: subprocess.Popen | Forked
    threads: list[threading.Thread] = field(default_factory=list)
    files: list[BinaryIO] = field(default_factory=list)
    exitcode: int | None = None
    exited_at: float | None = None
    start_time: int | None = None
    """The worker's start time (clock ticks since boot): with its pid, what names its
    shared-memory segments."""


def line_prefix(template: str | None, rank: int, local_rank: int, role: str) -> bytes:
    """The console prefix of a worker's lines: ``[rank N]: `` or ``template`` filled in
    (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``: ``$rank``, ``$local_rank``, ``$role_name``)."""
    if template is None:
        return f"[rank {rank}]: ".encode()
    text = Template(template).safe_substitute(rank=rank, local_rank=local_rank, role_name=role)
    return text.encode()


class _Filtered:
    """``<attempt dir>/filtered_<stream>.log``: the prefixed lines that hold one of ``needles``,
    from every worker's pump."""

    def __init__(self, path: str, needles: tuple[str, ...]) -> None:
        self.needles = tuple(n.encode() for n in needles)
        self.file = open(path, "wb")
        self.lock = threading.Lock()

    def write(self, prefix: bytes, text: bytes) -> None:
        out = [prefix + p for p in _PIECES.findall(text) if any(n in p for n in self.needles)]
        if out:
            with self.lock:
                self.file.write(b"".join(out))
                self.file.flush()


def _pump(
    src: BinaryIO,
    prefix: bytes | None,
    console: BinaryIO | None,
    copy: BinaryIO | None,
    filtered: _Filtered | None = None,
):
    """Copies a worker's output to its log file and, prefixed, to the console (and the lines
    that match to ``filtered``).

    Pieces end at ``\n`` or at ``\r``: a progress bar that redraws its line with ``\r``
    (tqdm) keeps redrawing in place, each redraw prefixed, instead of growing one endless line.
    """
    pending = b""
    try:
        while True:
            chunk = src.read1(1 << 16) if hasattr(src, "read1") else src.readline()
            if not chunk:
                break
            if copy is not None:
                copy.write(chunk)
                copy.flush()
            if (console is None and filtered is None) or prefix is None:
                continue
            pending += chunk
            cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
            if cut:
                if console is not None:
                    console = _emit(console, prefix, pending[:cut])
                if filtered is not None:
                    filtered.write(prefix, pending[:cut])
                pending = pending[cut:]
        if pending and prefix is not None:
            if console is not None:
                _emit(console, prefix, pending + b"\n")
            if filtered is not None:
                filtered.write(prefix, pending + b"\n")
    except (OSError, ValueError):
        pass  # the console or the log file was closed: the launcher is shutting down
    finally:
        try:
            src.close()
        except OSError:
            pass  # the pipe is done either way


def _emit(console: BinaryIO, prefix: bytes, text: bytes) -> BinaryIO | None:
    """Writes complete pieces of ``text``, each with ``prefix``; ``None`` once console is gone.

    A bare ``\r`` (a progress bar returning to the line start before it draws) gets no prefix:
    the redraw that follows carries it, so the line shows the prefix once.
    """
    out = [piece if piece == b"\r" else prefix + piece for piece in _PIECES.findall(text)]
    with _CONSOLE_LOCK:
        try:
            console.write(b"".join(out))
            console.flush()
        except (OSError, ValueError):
            return None
    return console


_PIECES = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")


def _console(stream) -> BinaryIO | None:
    try:
        return stream.buffer
    except AttributeError:
        return None


class WorkerGroup:
    """The workers this agent runs in one round."""

    def __init__(
        self, specs: list[WorkerSpec], duplicate_filters: dict[str, tuple[str, ...]] | None = None,
        spares: int = 0, server: ForkServer | None = None,
    ) -> None:
        """``duplicate_filters``: per stream (``stdout``, ``stderr``), the substrings of the
        tee'd lines copied to ``filtered_<stream>.log`` next to the workers' log folders.
        ``spares``: how many replacements (``add``) may start warm: forked by the fork server,
        or else from a warm spare (``spare.py``), one kept ready at a time. ``server``: the
        agent's fork server (``forkserver.py``), which forks the workers it can (the others
        start as new interpreters)."""
        self.specs = specs
        self.workers: list[_Worker] = []
        self._signalled: set[int] = set()
        self._duplicate = {k: v for k, v in (duplicate_filters or {}).items() if v}
        self._filtered: dict[str, _Filtered] = {}
        self._spares = spares
        self._spare: Spare | None = None
        self._server = server

    def start(self) -> None:
        """Starts every worker, each in its own process group, and its output pumps."""
        for name, needles in self._duplicate.items():
            attempt = os.path.dirname(self.specs[0].log_dir)
            os.makedirs(attempt, exist_ok=True)
            self._filtered[name] = _Filtered(os.path.join(attempt, f"filtered_{name}.log"), needles)
        for spec in self.specs:
            self._spawn(spec)
        self._keep_spare()

    def _keep_spare(self) -> None:
        """Starts a warm spare while replacements may still come (none for ``--no-python``,
        nor beside a fork server)."""
        if self._spare is not None or self._spares <= 0 or not self.specs or self._server:
            return
        template = self.specs[0]
        cmd = spare_command(template.cmd, BOOTSTRAP)
        if cmd is not None:
            self._spare = Spare(cmd, template.env)

    def add(self, spec: WorkerSpec) -> _Worker:
        """Starts one more worker (a replacement under ``--recover in-process``), warm where it
        may (forked, or from the spare)."""
        self.specs.append(spec)
        spare, self._spare = self._spare, None
        worker = self._spawn(spec, spare, replacement=True)
        self._spares -= 1
        self._keep_spare()
        return worker

    def _spawn(self, spec: WorkerSpec, spare: Spare | None = None,
               replacement: bool = False) -> _Worker:
        """Starts `spec`'s worker in its own process group (forked by the server, handed to
        `spare`, or a new process), with its output pumps. A `replacement` is forked only while
        spares are allowed (its environment says so: ``FASTCOMM_SPARE_ACTIVATED``)."""
        os.makedirs(spec.log_dir, exist_ok=True)
        env = dict(spec.env)
        env[settings.LAUNCH_AGENT_PID.name] = str(os.getpid())
        server = self._server if not replacement or self._spares > 0 else None
        proc = None
        if spare is not None and BOOTSTRAP in spec.cmd:
            proc = spare.activate(spec.cmd[spec.cmd.index(BOOTSTRAP) + 1 :], env, time.time())
        plan = []  # (stream name, console stream, log file, filtered copy)
        files: list[BinaryIO] = []
        kwargs = {}
        for name, bit, stream in (
            ("stdout", STD_OUT, sys.stdout),
            ("stderr", STD_ERR, sys.stderr),
        ):
            to_file = bool((spec.redirect | spec.tee) & bit)
            to_console = not (spec.redirect & bit) and spec.console_prefix is not None
            fh = open(os.path.join(spec.log_dir, f"{name}.log"), "wb") if to_file else None
            if fh is not None:
                files.append(fh)
            dup = self._filtered.get(name) if spec.tee & bit else None
            if proc is not None:  # a spare's output is piped: drained even where dropped
                plan.append((name, _console(stream) if to_console else None, fh, dup))
            elif to_console:
                kwargs[name] = subprocess.PIPE
                plan.append((name, _console(stream), fh, dup))
            elif fh is not None:
                kwargs[name] = fh
            else:
                kwargs[name] = subprocess.DEVNULL
        if proc is None and server is not None and ForkServer.usable(spec.cmd, BOOTSTRAP):
            proc = _fork(server, spec, env, kwargs, replacement)
        if proc is None:
            proc = subprocess.Popen(
                spec.cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                **kwargs,
            )
        worker = _Worker(spec, proc, files=files, start_time=start_time(proc.pid))
        for name, console, fh, dup in plan:
            thread = threading.Thread(
                target=_pump,
                args=(getattr(proc, name), spec.console_prefix, console, fh, dup),
                name=f"fastcomm-run-{name}-{spec.local_rank}",
                daemon=True,
            )
            thread.start()
            worker.threads.append(thread)
        self.workers.append(worker)
        return worker

    def poll(self) -> list[_Worker]:
        """Updates and returns the workers (``exitcode`` set once exited)."""
        for worker in self.workers:
            if worker.exitcode is None:
                code = worker.proc.poll()
                if code is not None:
                    worker.exitcode = code
                    worker.exited_at = time.time()
        return self.workers

    @property
    def pids(self) -> list[int]:
        """The process ids of the workers, in local rank order."""
        return [w.proc.pid for w in self.workers]

    def signal_all(self, sig: int) -> None:
        """Sends ``sig`` to the process group of every worker with something left running (the
        worker, or what it started)."""
        live = _live_groups()
        for worker in self.workers:
            if _running(worker, live):
                self._signalled.add(worker.proc.pid)
                _killpg(worker.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0, *, again: bool = True):
        """Signals every worker's process group that has something running (``again=False``:
        only those not signalled yet), SIGKILLs the groups still running after ``timeout`` s,
        then reaps the workers and closes their output."""
        self._drop_spare()
        self.poll()
        live = _live_groups()
        running = [w for w in self.workers if _running(w, live)]
        for worker in running:
            if again or worker.proc.pid not in self._signalled:
                _killpg(worker.proc.pid, sig)
        deadline = time.monotonic() + timeout
        while running and time.monotonic() < deadline:
            time.sleep(0.02)
            live = _live_groups()
            running = [w for w in running if _running(w, live)]
        for worker in running:
            _killpg(worker.proc.pid, signal.SIGKILL)
        self.close()

    def close(self) -> None:
        """Reaps every worker, SIGKILLs leftovers of their process groups, joins the output."""
        self._drop_spare()
        for worker in self.workers:
            if worker.proc.poll() is None:
                _killpg(worker.proc.pid, signal.SIGKILL)
            try:
                worker.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                pass
            _killpg(worker.proc.pid, signal.SIGKILL)  # descendants left in the group
        self.poll()
        for worker in self.workers:
            for thread in worker.threads:
                thread.join(timeout=5)
            for fh in worker.files:
                try:
                    fh.close()
                except OSError:
                    pass  # the pump already wrote what it could; nothing to keep open
            worker.threads.clear()
            worker.files.clear()
        for filtered in self._filtered.values():
            try:
                filtered.file.close()
            except OSError:
                pass  # what the pumps wrote is flushed already
        reaped = [w for w in self.workers if w.proc.returncode is not None]
        remove_segments_of({(w.proc.pid, w.start_time) for w in reaped if w.start_time})

    def _drop_spare(self) -> None:
        """Kills the spare (the round is over: no more replacements)."""
        self._spares = 0
        if self._spare is not None:
            self._spare.kill()
            self._spare = None


def _fork(server: ForkServer, spec: WorkerSpec, env: dict[str, str], kwargs: dict,
          replacement: bool) -> Forked | None:
    """Has the server fork `spec`'s worker with the output `kwargs` would give ``Popen``
    (``PIPE``, a log file, ``DEVNULL``); ``None`` if the server could not (the caller starts a
    new interpreter). The worker watches the server, its parent, as a new interpreter
    watches the agent."""
    env = {**env, settings.LAUNCH_AGENT_PID.name: str(server.proc.pid)}
    if replacement:
        env[settings.SPARE_ACTIVATED.name] = repr(time.time())
    null = os.open(os.devnull, os.O_RDWR)
    theirs, ours, mine = [null], {}, []
    try:
        for name in ("stdout", "stderr"):
            target = kwargs.get(name, subprocess.DEVNULL)
            if target is subprocess.PIPE:
                read, write = os.pipe()
                ours[name] = os.fdopen(read, "rb")
                mine.append(write)
                theirs.append(write)
            elif target is subprocess.DEVNULL:
                theirs.append(null)
            else:
                theirs.append(target.fileno())
        args = spec.cmd[spec.cmd.index(BOOTSTRAP) + 1 :]
        proc = server.spawn(args, env, tuple(theirs), ours.get("stdout"), ours.get("stderr"))
    finally:
        for fd in (null, *mine):
            os.close(fd)
    if proc is None:
        for reader in ours.values():
            reader.close()
    return proc


SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "fastcomm-"


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of ``/proc/<pid>/stat``)."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def pid_namespace() -> int:
    """Inode of this process's PID namespace (0 when ``/proc`` does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def remove_segments_of(owners: set[tuple[int, int]]) -> list[str]:
    """Unlinks the ``/dev/shm`` segment files created by one of ``owners`` (reaped workers,
    as ``(pid, start time)``) in this PID namespace; returns their names."""
    namespace = pid_namespace()
    if not owners or not namespace:
        return []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for name in names:
        fields = name[len(SEGMENT_PREFIX) :].split("-")
        if not name.startswith(SEGMENT_PREFIX) or len(fields) < 4:
            continue
        if not all(f.isdigit() for f in fields[:3]) or int(fields[2]) != namespace:
            continue
        if (int(fields[0]), int(fields[1])) in owners:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass  # swept meanwhile by a segment created elsewhere on the host
    return removed


def _running(worker: _Worker, live: set[int] | None) -> bool:
    """Whether the worker, or anything left in its process group, still runs (reaps it)."""
    if worker.proc.poll() is None:
        return True
    if live is not None:
        return worker.proc.pid in live
    try:
        os.killpg(worker.proc.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _live_groups() -> set[int] | None:
    """The process groups with a process other than a zombie in them (``None``: no ``/proc``).

    Leftovers of an exited worker are orphans: a zombie among them (its reaper may not reap)
    must not count as running, so ``/proc`` is read rather than ``killpg(pgid, 0)`` asked.
    """
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    groups = set()
    for name in names:
        if not name.isdigit():
            continue
        fields = stat_fields(name)
        if fields is None or len(fields) < 3:
            continue  # gone meanwhile
        if fields[0] not in (b"Z", b"X"):
            groups.add(int(fields[2]))
    return groups


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone (or its pid reused by another user's process)
