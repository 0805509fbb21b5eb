"""Worker failures: error files, failure records and the report printed when a job fails.

A worker started through the bootstrap (every Python worker) records an uncaught exception to
the JSON file named by ``TORCHELASTIC_ERROR_FILE``, in torch's ``@record`` format::

    {"message": {"message": "RuntimeError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}

so tools that read torchelastic error files read ours, and a script that already uses torch's
``@record`` keeps its own file (the bootstrap does not overwrite it).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

__all__ = ["Failure", "LaunchError", "read_error_file", "format_report", "exit_description"]


class LaunchError(RuntimeError):
    """The launcher itself could not go on (rendezvous timeout, lost store, ...)."""


@dataclass(slots=True)
class Failure:
    """One worker that exited unsuccessfully (or one agent that was lost)."""

    rank: int
    """Global rank (-1 for a lost node)."""
    local_rank: int
    group_rank: int
    host: str
    pid: int
    exitcode: int
    """The exit status; negative: killed by signal ``-exitcode`` (as ``Popen.returncode``)."""
    timestamp: float
    """When it failed: the error file's time if the worker recorded one, else detection time."""
    round: int = 0
    role: str = "default"
    error_file: str | None = None
    message: str | None = None
    """``"RuntimeError: boom"`` from the error file, or a description."""
    traceback: str | None = None
    """The worker's own traceback, from its error file."""

    @property
    def signal_name(self) -> str | None:
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return f"signal {-self.exitcode}"
        return None


def exit_description(exitcode: int) -> str:
    """``"exit code 1"`` or ``"signal 9 (SIGKILL)"``."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "?"
        return f"signal {-exitcode} ({name})"
    return f"exit code {exitcode}"


def read_error_file(path: str | None) -> tuple[str | None, str | None, float | None]:
    """``(message, traceback, timestamp)`` recorded in a torch-format error file, if any."""
    if not path or not os.path.isfile(path):
        return None, None, None
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None, None, None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):  # torch's format for errors raised outside python
        return message, None, None
    if not isinstance(message, dict):
        return None, None, None
    extra = message.get("extraInfo") or {}
    stamp = extra.get("timestamp")
    try:
        stamp = float(stamp) if stamp is not None else None
    except (TypeError, ValueError):
        stamp = None
    return message.get("message"), extra.get("py_callstack"), stamp


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(stamp))


def _entry(failure: Failure) -> list[str]:
    if failure.rank < 0:
        return [
            f"  time      : {_when(failure.timestamp)}",
            f"  host      : {failure.host}",
            f"  node      : group rank {failure.group_rank} (agent lost)",
            f"  error     : {failure.message}",
        ]
    exit_line = f"{failure.exitcode} (pid: {failure.pid})"
    if failure.signal_name:
        exit_line += f"  ({failure.signal_name})"
    lines = [
        f"  time      : {_when(failure.timestamp)}",
        f"  host      : {failure.host}",
        f"  rank      : {failure.rank} (local_rank: {failure.local_rank}, "
        f"group_rank: {failure.group_rank}, role: {failure.role})",
        f"  exitcode  : {exit_line}",
        f"  error_file: {failure.error_file or '<N/A>'}",
    ]
    if failure.traceback:
        lines.append("  traceback :")
        lines.extend("    " + line for line in failure.traceback.rstrip("\n").splitlines())
    elif failure.message:
        lines.append(f"  traceback : {failure.message}")
    elif failure.signal_name:
        lines.append(
            f"  traceback : Signal {-failure.exitcode} ({failure.signal_name}) received by "
            f"PID {failure.pid}"
        )
    else:
        lines.append("  traceback : <N/A> (the worker recorded no error file; see its output)")
    return lines


def root_cause(failures: list[Failure]) -> Failure | None:
    """The first failure in time (the earliest error-file / detection timestamp)."""
    if not failures:
        return None
    return min(failures, key=lambda f: (f.timestamp, f.rank < 0, f.rank))


def format_report(name: str, failures: list[Failure], *, restarts: int, max_restarts: int) -> str:
    """torchrun-like failure report: the other failures, then the root cause."""
    bar = "=" * 72
    cause = root_cause(failures)
    lines = [bar, f"{name} FAILED (restarts used: {restarts} of {max_restarts})", "-" * 72]
    others = [f for f in failures if f is not cause]
    if others:
        lines.append("Failures:")
        for failure in sorted(others, key=lambda f: (f.rank, f.timestamp)):
            lines.append(f"[{failure.rank}]:")
            lines.extend(_entry(failure))
        lines.append("-" * 72)
    else:
        lines.append("Failures:\n  <NO_OTHER_FAILURES>")
        lines.append("-" * 72)
    lines.append("Root Cause (first observed failure):")
    if cause is not None:
        lines.append(f"[{cause.rank}]:")
        lines.extend(_entry(cause))
    else:
        lines.append("  <unknown>")
    lines.append(bar)
    return "\n".join(lines)
