"""Signals to the launcher reach every worker, and no process outlives the launcher -- also
when the launcher is SIGKILLed (workers notice and take their own children down). A stopped
launcher removes its temporary folder."""

from __future__ import annotations

import os
import signal
import time

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
    files = wait_files(tmp_path, "pids_*", nproc, proc=proc, written=True)
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


SETUP_FOREVER = """
    import os, signal, sys
    from datetime import timedelta
    from fastcomm.comm import Store
    from fastcomm.comm.shm.segment import Segment

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops it: no cleanup runs
    out, rank = sys.argv[1], os.environ["RANK"]
    with open(os.path.join(out, "pid_" + rank), "w") as fh:
        fh.write(str(os.getpid()))
    # rank 0 of a two-rank shm communicator whose peer never comes: its segment file stays in
    # /dev/shm until every rank mapped it
    Segment.setup(Store(is_server=True, timeout=120), 0, 2, 4096, 4096, timedelta(seconds=120))
"""


def _segments_of(pids: list[int]) -> list[str]:
    return sorted(
        n for n in os.listdir("/dev/shm") if n.startswith(tuple(f"fastcomm-{p}-" for p in pids))
    )


@pytest.mark.timeout(90)
def test_sigterm_mid_setup_removes_the_workers_segments(tmp_path):
    """SIGTERM to the launcher while its workers hold a shm segment file they cannot remove
    (they ignore SIGTERM and are SIGKILLed after --shutdown-timeout): the launcher removes the
    files, which are named after its reaped workers."""
    path = script(tmp_path, "setup_forever.py", SETUP_FOREVER)
    proc = start(
        ["--nproc-per-node", "2", "--shutdown-timeout", "1", path, tmp_path],
        tmp_path,
        env=clean_env(TMPDIR=str(tmp_path)),
    )
    pids = []
    try:
        files = wait_files(tmp_path, "pid_*", 2, proc=proc, written=True)
        pids = [int(f.read_text()) for f in files]
        deadline = time.monotonic() + 30
        while len(_segments_of(pids)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_segments_of(pids)) == 2, "the workers did not create their segments"
        proc.send_signal(signal.SIGTERM)
        result = finish(proc, timeout=30)
        assert result.returncode == 128 + signal.SIGTERM, result.stderr
        assert wait_gone(pids, timeout=5) == []
        assert _segments_of(pids) == []
        assert sorted(tmp_path.glob("fastcomm_launch_*")) == []
    finally:
        kill_all(pids)
        for name in _segments_of(pids):
            os.unlink(os.path.join("/dev/shm", name))
