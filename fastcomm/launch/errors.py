"""Worker failures: error files, failure records and the report printed when a job fails.

A worker started through the bootstrap records an uncaught exception to the JSON file named by
``TORCHELASTIC_ERROR_FILE`` in torch's ``@record`` format (a script using torch's ``@record``
keeps its own file).

Root cause: a worker killed by a signal (or a lost node) first, then any failure that is not a
peer-loss error, then the peer-loss errors (which may be recorded before the agent notices the
dead worker); the earliest of the first non-empty class is the cause, and the report lists the
others under it.

The file format and the reasoning: docs/launch.md.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

__all__ = [
    "Failure",
    "LaunchError",
    "UsageError",
    "exit_description",
    "format_report",
    "headline",
    "is_peer_loss",
    "read_error_file",
    "root_cause",
]

#: Text of the errors a worker raises because a *peer* failed: consequences, never the cause.
PEER_LOSS_PATTERNS = (
    "CommAbortedError",
    "CommClosedError",
    "exited without joining",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
)


class LaunchError(RuntimeError):
    """The launcher itself could not go on (rendezvous timeout, lost store, ...)."""


class UsageError(LaunchError):
    """A setting found bad once the agent uses it (e.g. a port in use): exit status 2."""


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
        """The name of the signal that killed the worker, or ``None`` if it exited."""
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


def is_peer_loss(failure: Failure) -> bool:
    """Whether `failure` is a worker's error about a peer that went away (a consequence)."""
    if failure.rank < 0 or failure.exitcode < 0:
        return False
    text = f"{failure.message or ''}\n{failure.traceback or ''}"
    return any(pattern in text for pattern in PEER_LOSS_PATTERNS)


def cause_class(failure: Failure) -> int:
    """0: killed by a signal or node lost; 1: an error of its own; 2: a peer-loss error."""
    if failure.rank < 0 or failure.exitcode < 0:
        return 0
    return 2 if is_peer_loss(failure) else 1


def root_cause(failures: list[Failure]) -> Failure | None:
    """The failure the others follow from (see the module docstring): the earliest of the
    most causal class."""
    if not failures:
        return None
    return min(failures, key=lambda f: (cause_class(f), f.timestamp, f.rank < 0, f.rank))


def headline(failures: list[Failure]) -> str:
    """One line naming the root cause and how many failures followed it."""
    cause = root_cause(failures)
    if cause is None:
        return "a failure"
    if cause.rank < 0:
        what = f"node {cause.group_rank} ({cause.host}) was lost: {cause.message}"
    else:
        how = (
            f"was killed by {exit_description(cause.exitcode)}"
            if cause.exitcode < 0
            else f"failed with {exit_description(cause.exitcode)}"
        )
        what = f"rank {cause.rank} (local_rank {cause.local_rank}, host {cause.host}) {how}"
        if cause.message:
            what += f": {cause.message}"
    others = [f for f in failures if f is not cause]
    if others:
        ranks = ", ".join(str(f.rank) for f in sorted(others, key=lambda f: f.rank))
        what += f" (then {len(others)} more: rank(s) {ranks})"
    return what


def format_report(name: str, failures: list[Failure], *, restarts: int, max_restarts: int) -> str:
    """Failure report: a headline, the root cause, then the failures that followed it."""
    bar = "=" * 72
    cause = root_cause(failures)
    lines = [
        bar,
        f"{name} FAILED (restarts used: {restarts} of {max_restarts})",
        f"Root cause: {headline(failures)}",
        "-" * 72,
        "Root Cause (the failure the others follow from):",
    ]
    if cause is not None:
        lines.append(f"[{cause.rank}]:")
        lines.extend(_entry(cause))
    else:
        lines.append("  <unknown>")
    lines.append("-" * 72)
    others = [f for f in failures if f is not cause]
    if others:
        lines.append("Followed by (peer-loss errors are consequences of the root cause):")
        for failure in sorted(others, key=lambda f: (cause_class(f), f.timestamp, f.rank)):
            lines.append(f"[{failure.rank}]:")
            lines.extend(_entry(failure))
    else:
        lines.append("Followed by:\n  <NO_OTHER_FAILURES>")
    lines.append(bar)
    return "\n".join(lines)
