"""A launcher killed with SIGKILL cannot remove its temporary folder; the next launch does
(``specs.sweep_stale_folders``), and only folders whose launcher provably no longer runs."""

from __future__ import annotations

import os
import subprocess
import sys

from fastcomm.launch.specs import TEMP_PATTERN, _temp_prefix, sweep_stale_folders
from fastcomm.launch.workers import pid_namespace, start_time

from ._util import clean_env, run, script


def _gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_folders_of_launchers_that_are_gone_are_swept(tmp_path):
    ns, me = pid_namespace(), os.getpid()
    gone = _gone_pid()
    names = {
        "dead": f"fastcomm_launch_{ns}-{gone}-12345_abc",
        "reused": f"fastcomm_launch_{ns}-{me}-{start_time(me) + 1}_abc",  # pid of another process
        "live": f"fastcomm_launch_{ns}-{me}-{start_time(me)}_abc",
        "other_namespace": f"fastcomm_launch_{ns + 1}-{gone}-12345_abc",
        "old_form": "fastcomm_launch_abc",
        "unknown_start": f"fastcomm_launch_{ns}-{gone}-0_abc",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "error.json").write_text("{}")
    removed = sweep_stale_folders(str(tmp_path))
    assert sorted(removed) == sorted(str(tmp_path / names[k]) for k in ("dead", "reused"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names[k] for k in ("live", "other_namespace", "old_form", "unknown_start"))
    assert TEMP_PATTERN.fullmatch(_temp_prefix() + "x1y2")


def test_a_launch_sweeps_what_a_killed_launcher_left(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    stale = tmp / f"fastcomm_launch_{pid_namespace()}-{_gone_pid()}-12345_abc"
    (stale / "attempt_0" / "0").mkdir(parents=True)
    path = script(tmp_path, "ok.py", "print('ok')")
    result = run(["--nproc-per-node", "1", path], tmp_path, env={**clean_env(), "TMPDIR": str(tmp)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert list(tmp.iterdir()) == [], list(tmp.iterdir())  # the stale one and its own: gone
