"""fastcomm-run, a torchrun-compatible launcher that restarts failed jobs (usage: docs/launch.md).

One agent per node (``agent``) runs the job in rounds: it joins a rendezvous round
(``rendezvous``), starts its workers with torchrun's environment (``specs``, ``workers``),
watches them and its peers until the round ends (``monitor``, ``heartbeat``), then exits,
restarts, or reports the root cause of every node's failures (``failures``, ``errors``).
The module map and the invariants: docs/launch.md.

Exit status: 0 success, 1 job failed (or rendezvous/store error), 2 usage error (a bad flag or
environment variable, a port in use), 128+N stopped by signal N. Of fastcomm, the launcher
imports only ``fastcomm.comm.store`` (and ``.errors``), never a backend.
"""

__all__ = ["main", "launch", "LaunchConfig"]


def __getattr__(name: str):
    if name == "main":
        from .cli import main

        return main
    if name == "launch":
        from .agent import launch

        return launch
    if name == "LaunchConfig":
        from .config import LaunchConfig

        return LaunchConfig
    raise AttributeError(f"module 'fastcomm.launch' has no attribute {name!r}")
