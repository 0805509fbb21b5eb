"""Signals to the launcher reach every worker, and no process outlives the launcher -- also
when the launcher is SIGKILLed (workers notice and take their own children down). A stopped
launcher removes its temporary folder."""

from __future__ import annotations

import signal

import pytest

from ._util import clean_env, finish, kill_all, script, start, wait_files, wait_gone

WORKER = """
    import os, signal, subprocess, sys, time
    out = sys.argv[1]
    rank = os.environ["RANK"]
    # a child of the worker: it must not survive the launcher either
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def on_signal(signum, frame):
        with open(os.path.join(out, f"got_{rank}_{signum}"), "w"):
            pass
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with open(os.path.join(out, f"pids_{rank}"), "w") as fh:
        fh.write(f"{os.getpid()} {child.pid}")
    time.sleep(60)
"""


def _start_job(tmp_path, nproc=2):
    path = script(tmp_path, "worker.py", WORKER)
    # TMPDIR: a SIGKILLed launcher cannot remove its temporary directory
    proc = start(
        ["--nproc-per-node", str(nproc), "--shutdown-timeout", "5", path, tmp_path],
        tmp_path,
        env=clean_env(TMPDIR=str(tmp_path)),
    )
    files = wait_files(tmp_path, "pids_*", nproc, proc=proc)
    pids = [int(p) for f in files for p in f.read_text().split()]
    return proc, pids


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_reaches_every_worker_and_nothing_survives(tmp_path, sig):
    proc, pids = _start_job(tmp_path)
    try:
        proc.send_signal(sig)
        result = finish(proc, timeout=30)
        assert result.returncode == 128 + sig, result.stderr
        assert sorted(p.name for p in tmp_path.glob("got_*")) == [
            f"got_0_{int(sig)}",
            f"got_1_{int(sig)}",
        ]
        assert wait_gone(pids, timeout=5) == []
        assert sorted(tmp_path.glob("fastcomm_launch_*")) == []
    finally:
        kill_all(pids)


@pytest.mark.timeout(60)
def test_workers_exit_when_the_launcher_is_killed(tmp_path):
    proc, pids = _start_job(tmp_path)
    try:
        proc.kill()  # SIGKILL: the agent cannot clean up
        finish(proc, timeout=10)
        assert wait_gone(pids, timeout=5) == []
    finally:
        kill_all(pids)


@pytest.mark.timeout(60)
def test_nothing_survives_a_normal_exit(tmp_path):
    """A worker that leaves a child running when it returns: the agent kills the child."""
    path = script(
        tmp_path,
        "leaky.py",
        """
        import os, subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        with open(os.path.join(sys.argv[1], "pid_" + os.environ["RANK"]), "w") as fh:
            fh.write(str(child.pid))
    """,
    )
    proc = start(["--nproc-per-node", "2", path, tmp_path], tmp_path)
    result = finish(proc, timeout=30)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid_*")]
    try:
        assert result.returncode == 0, result.stderr
        assert len(pids) == 2 and wait_gone(pids, timeout=5) == []
    finally:
        kill_all(pids)
