"""Dumps of the flight record, the heartbeat, and the warning before the timeout.

One daemon thread per process (:class:`Watch`) serves every watched communicator (built by
``new_communicator``). Every ``FASTCOMM_FLIGHT_POLL_S`` (1 s) it sets this rank's heartbeat,
``flight/hb/<rank>`` in the communicator's store (the last call issued and ended, the one in
flight), and reads the dump requests counter ``flight/req``. A new request makes every rank that
can still run Python write its dump (its records, the stacks of all its threads) to
``flight/dump/<n>/<rank>`` and, with ``FASTCOMM_FLIGHT_DIR`` (``fastcomm-run`` sets it), to
``<dir>/<n>/rank<r>.json``. Requests come from a rank whose oldest call waited longer than
``FASTCOMM_SUSPECT_S`` (30 s; it prints the report as a warning and keeps waiting), from a
timeout or abort (the report goes into the log and onto the error as a note), and SIGUSR1 (a
dump of this process). A rank without a dump is named from its heartbeat (and, on this host, its
process: stopped or gone). :mod:`fastcomm.trace` turns the dumps into the report.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from functools import partial

from .. import settings, trace
from .flight import recorders
from .store import Store, lost_rank_key

__all__ = ["Watch", "dump_record", "request_report", "watch"]

logger = logging.getLogger("fastcomm")

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # fastcomm/
_HIDDEN = (_PKG, os.path.dirname(threading.__file__))


def thread_stacks() -> list[dict]:
    """Every thread's stack: ``[{name, ident, main, frames: [[file, line, func, text]]}]``."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sys._current_frames().items():
        frames = [[f.filename, f.lineno, f.name, f.line or ""]
                  for f in traceback.extract_stack(frame)]
        out.append({"name": names.get(ident, str(ident)), "ident": ident,
                    "main": ident == main, "frames": frames})
    return out


def where(threads: list[dict]) -> str | None:
    """The main thread's innermost frame outside fastcomm and the standard threading code:
    ``train.py:57 in next_batch``."""
    main = next((t for t in threads if t["main"]), None)
    if main is None:
        return None
    for file, line, func, _ in reversed(main["frames"]):
        if not file.startswith(_HIDDEN):
            return f"{os.path.basename(file)}:{line} in {func}"
    return None


class _Target:
    """One watched communicator: its store, rank, size and recorder."""

    def __init__(self, comm) -> None:
        self.comm = weakref.ref(comm)
        self.store: Store = comm.store
        self.rank, self.size = comm.rank, comm.size
        self.recorder = comm.flight
        self.handled = 0  # the last dump request answered
        self.warned = 0  # the sequence number last warned about
        self.last_request = 0.0  # monotonic time of the last request this rank posted

    @property
    def alive(self) -> bool:
        comm = self.comm()
        return comm is not None and not comm.closed

    def beat(self) -> dict:
        recorder = self.recorder
        pending = recorder.in_flight()
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                "launch": os.environ.get("RANK"), "time": time.time(),
                "poll": _WATCH.poll_s if _WATCH else 1.0,
                "seq": recorder.seq, "done": recorder.last_done(),
                "in": list(pending) if pending else None}


def dump_record(target: _Target, reason: str) -> dict:
    """This process's record for ``target``'s communicator: its recorder's calls (and the
    other recorders of the process), every thread's stack."""
    threads = thread_stacks()
    records = []
    for recorder in recorders():
        main = recorder is target.recorder
        if not main and recorder.seq == 0:
            continue
        records.append({"name": recorder.name, "rank": recorder.rank, "size": recorder.size,
                        "main": main, "seq": recorder.seq,
                        "entries": recorder.entries(last=None if main else 20)})
    return {"rank": target.rank, "size": target.size, "host": socket.gethostname(),
            "pid": os.getpid(), "time": time.time(), "reason": reason,
            "comm": target.recorder.name, "recorders": records, "threads": threads,
            "where": where(threads)}


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, default=str)
    os.replace(tmp, path)


def _publish(target: _Target, n: int, reason: str) -> None:
    record = dump_record(target, reason)
    key = f"flight/dump/{n}/{target.rank}"
    try:
        target.store.set(key, target.store.encode(key, record))
    except Exception as exc:  # noqa: BLE001 - the store may be gone with the job
        logger.warning("rank %d: could not write its flight record: %s", target.rank, exc)
    folder = settings.FLIGHT_DIR.get()
    if folder:
        _write_json(os.path.join(folder, target.recorder.name, str(n),
                                 f"rank{target.rank}.json"), record)


def _process_state(pid: int) -> str | None:
    """``stopped``, ``exited`` or ``None`` (running, or not a process of this host)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "exited"
    return {"T": "stopped", "t": "stopped", "Z": "exited", "X": "exited"}.get(state)


def _named_lost(target: _Target, launch_rank) -> bool:
    """Whether the launcher named the rank of ``RANK`` ``launch_rank``, on another host, lost
    (``fastcomm-run --recover in-process``): it will not answer either."""
    if launch_rank is None or not str(launch_rank).isdigit():
        return False
    try:
        return target.store.root().check([lost_rank_key(int(launch_rank))])
    except Exception:  # noqa: BLE001 - unknown is not lost
        return False


def _beats(target: _Target) -> dict[int, dict]:
    beats = {}
    host = socket.gethostname()
    for rank in range(target.size):
        key = f"flight/hb/{rank}"
        try:
            if not target.store.check([key]):
                continue
            beat = target.store.decode(key, target.store.get(key))
        except Exception:  # noqa: BLE001 - a missing or unreadable beat is no beat
            continue
        if beat.get("host") == host and beat.get("pid"):
            beat["status"] = _process_state(int(beat["pid"]))
        elif _named_lost(target, beat.get("launch")):
            beat["status"] = "lost"
        beats[rank] = beat
    return beats


def _collect(target: _Target, n: int, wait_s: float) -> tuple[dict, dict]:
    """Each rank's dump answering request ``n``, a later one or one of the few before (ranks
    that ask at once post several; each answers the latest it sees), waiting at most
    ``wait_s``, and the heartbeats."""
    deadline = time.monotonic() + wait_s
    store = target.store
    dumps: dict[int, dict] = {}
    beats: dict[int, dict] = {}
    while True:
        top = max(n, store.add("flight/req", 0))
        for rank in range(target.size):
            for m in range(top, max(1, n - 3) - 1, -1):
                key = f"flight/dump/{m}/{rank}"
                if rank not in dumps and store.check([key]):
                    dumps[rank] = store.decode(key, store.get(key))
        if len(dumps) == target.size or time.monotonic() >= deadline:
            break
        beats = _beats(target)
        # a rank whose process is gone or stopped will not answer: no need to wait for it
        if all(r in dumps or beats.get(r, {}).get("status") for r in range(target.size)):
            break
        time.sleep(0.05)
    return dumps, beats or _beats(target)


def request_report(target: _Target, reason: str, wait_s: float) -> list[str]:
    """Asks every rank for its dump (unless a request is under way), waits for them, and
    returns the report's lines (also written under ``FASTCOMM_FLIGHT_DIR``)."""
    store = target.store
    n = store.add("flight/req", 0)
    if n == 0 or time.monotonic() - target.last_request > wait_s or n <= target.handled:
        n = store.add("flight/req", 1)
        target.last_request = time.monotonic()
    target.handled = max(target.handled, n)
    _publish(target, n, reason)
    dumps, beats = _collect(target, n, wait_s)
    lines = trace.analyze(dumps, beats, target.size, target.recorder.name)
    folder = settings.FLIGHT_DIR.get()
    if folder:
        base = os.path.join(folder, target.recorder.name, str(n))
        _write_json(os.path.join(base, "beats.json"), {str(k): v for k, v in beats.items()})
        with open(os.path.join(base, f"report.rank{target.rank}.txt"), "w") as fh:
            fh.write("\n".join(lines) + "\n")
        with open(os.path.join(folder, "report.txt"), "w") as fh:
            fh.write("\n".join(lines) + "\n")
    try:
        store.set(f"flight/report/{n}", "\n".join(lines))
    except Exception:  # noqa: BLE001 - the report is also in the log
        pass
    return lines


class Watch(threading.Thread):
    """The process's flight thread: heartbeats, dump requests, the early warning."""

    def __init__(self) -> None:
        super().__init__(name="fastcomm-flight", daemon=True)
        self.targets: list[_Target] = []
        self.lock = threading.Lock()
        self.poll_s = settings.FLIGHT_POLL_S.get()
        self.suspect_s = settings.SUSPECT_S.get()
        self.signalled = threading.Event()
        self.stopping = False

    @property
    def answer_s(self) -> float:
        """How long a report waits for the ranks' dumps: a rank answers at its next visit (one
        poll), and a busy host delays the visit and the dump's write across the store; a rank
        whose process is gone or stopped is not waited for."""
        return 3 * self.poll_s + 2.0

    def stop(self, timeout: float = 2.0) -> None:
        """Ends the thread, waiting up to ``timeout`` for a visit in progress (registered at
        exit: a store call that the interpreter's finalization catches midway ends the process
        with ``std::terminate`` where the store is Python behind torch's C++ ``PrefixStore``,
        e.g. in etcd)."""
        self.stopping = True
        self.signalled.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout)

    def add(self, comm) -> _Target:
        """Watches ``comm`` from now on; its target."""
        target = _Target(comm)
        self._beat(target)  # named by its heartbeat from the start, not after a poll
        with self.lock:
            self.targets = [t for t in self.targets if t.alive] + [target]
        return target

    @staticmethod
    def _beat(target: _Target) -> None:
        key = f"flight/hb/{target.rank}"
        target.store.set(key, target.store.encode(key, target.beat()))

    def run(self) -> None:
        while not self.stopping:
            signalled = self.signalled.wait(self.poll_s)  # SIGUSR1 wakes it at once
            self.signalled.clear()
            if self.stopping:
                return
            with self.lock:
                targets = [t for t in self.targets if t.alive]
            for target in targets:
                if self.stopping:
                    return
                try:
                    self._visit(target, signalled)
                except Exception as exc:  # noqa: BLE001 - the store went with the job
                    logger.debug("flight watch of rank %d: %s", target.rank, exc)

    def _visit(self, target: _Target, signalled: bool) -> None:
        store = target.store
        self._beat(target)
        if signalled:  # SIGUSR1 (the launcher asks): every rank's dump and the report
            lines = request_report(target, "SIGUSR1", wait_s=self.answer_s)
            logger.info("rank %d: flight report (SIGUSR1):\n%s", target.rank, "\n".join(lines))
        n = store.add("flight/req", 0)
        if n > target.handled:
            target.handled = n
            _publish(target, n, "requested")
        pending = target.recorder.in_flight()
        if pending is None or pending[0] <= target.warned:
            return
        seq, op, issued = pending
        if time.time() - issued < self.suspect_s:
            return
        target.warned = seq
        lines = request_report(target, f"{op} #{seq} waited {self.suspect_s:.0f} s",
                               wait_s=self.answer_s)
        message = (f"rank {target.rank}: {op} #{seq} has waited {time.time() - issued:.0f} s "
                   f"(suspect after {self.suspect_s:.0f} s; still waiting): " + "\n".join(lines))
        if logger.hasHandlers():
            logger.warning("%s", message)
        else:  # no logging set up: stderr once (logging's last resort would print it bare)
            print(f"[fastcomm] warning: {message}", file=sys.stderr, flush=True)


_WATCH: Watch | None = None
_WATCH_LOCK = threading.Lock()


def _on_sigusr1(signum, frame) -> None:
    if _WATCH is not None:
        _WATCH.signalled.set()


def watch(comm) -> None:
    """Starts (once per process) the flight thread, adds ``comm`` to what it watches and
    registers the dump of every rank's record as one of ``comm``'s failure hooks
    (:meth:`~.hooks.CommHooks.register_failure`)."""
    global _WATCH
    if comm.flight is None:
        return
    comm.flight.main = True
    with _WATCH_LOCK:
        if _WATCH is None:
            _WATCH = Watch()
            _WATCH.start()
            atexit.register(_WATCH.stop)
            if threading.current_thread() is threading.main_thread() and \
                    signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
                signal.signal(signal.SIGUSR1, _on_sigusr1)
    target = _WATCH.add(comm)
    comm.hooks.register_failure(partial(_report_failure, _WATCH, target))


def _report_failure(watch_: Watch, target: _Target, exc: BaseException) -> None:
    """A call of ``target``'s communicator timed out, was aborted or disagreed with its peers'
    (its failure hook): every rank's dump, the report in the log, its first line as a note on
    ``exc``."""
    try:
        lines = request_report(target, f"{type(exc).__name__}: {exc}",
                               wait_s=watch_.answer_s)
    except Exception as err:  # noqa: BLE001 - the report must not hide the error itself
        logger.warning("rank %d: no flight report: %s", target.rank, err)
        return
    logger.error("rank %d: flight report:\n%s", target.rank, "\n".join(lines))
    exc.add_note(f"flight report: {lines[0]}")
