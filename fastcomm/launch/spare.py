"""A warm spare worker for ``--recover in-process --max-restarts N``: an interpreter started
ahead of need that has imported torch and fastcomm already (``_bootstrap.py --spare``), so a
replacement for a lost worker starts in a fraction of a second instead of paying the imports.

The spare waits on its stdin; :meth:`Spare.activate` writes the replacement's bootstrap
arguments and environment there (one JSON line) and the spare becomes that worker, its output
pumped from then on like any worker's. A spare never activated is killed with the workers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

from fastcomm import settings

__all__ = ["Spare", "spare_command"]


def spare_command(cmd: list[str], bootstrap: str) -> list[str] | None:
    """A spare's command line from a worker's ``python [-u] BOOTSTRAP ARGS...``: the same
    interpreter and bootstrap with ``--spare`` (the arguments come at activation); ``None``
    for a command the bootstrap does not run as Python (``--no-python``)."""
    if bootstrap not in cmd or "--exec" in cmd:
        return None
    return [*cmd[: cmd.index(bootstrap) + 1], "--spare"]


class Spare:
    """One started spare.

    Args:
        cmd: its command line (:func:`spare_command`).
        env: the environment it imports in (a worker's of this round; replaced at activation).
    """

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def activate(self, args: list[str], env: dict[str, str], now: float) -> subprocess.Popen | None:
        """Hands the spare its worker: `args` (the bootstrap's, after the script path) and `env`
        (plus ``FASTCOMM_SPARE_ACTIVATED=now``). ``None`` if it is gone (then it is reaped)."""
        if self.proc.poll() is not None:
            self.kill()
            return None
        env = {**env, settings.SPARE_ACTIVATED.name: repr(now)}
        line = json.dumps({"args": args, "env": env}) + "\n"
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.close()
        except OSError:  # it died meanwhile
            self.kill()
            return None
        return self.proc

    def kill(self) -> None:
        """Kills the spare's process group and reaps it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone already
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except OSError:
                pass  # closing what the dead process held; nothing to keep
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
            pass
