"""The launcher's failure report names a hang: the flight recorder's first line.

Three shm workers under ``fastcomm-run``; rank 1 sleeps in its data loader (``next_batch``)
before all_reduce #6, the others time out after 6 s. The report must carry, under its root
cause, ``Hang report: rank 1 never entered all_reduce #6 of world ... rank 1 is at
job.py:<line> in next_batch``, and ``python -m fastcomm.trace`` must print the same first line
offline from ``--log-dir``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ._util import REPO, clean_env, run, script

JOB = """
    import sys, time
    import torch
    import fastcomm

    def next_batch(seconds):
        time.sleep(seconds)

    comm = fastcomm.init("shm", timeout=6)
    x = torch.ones(1024)
    for _ in range(5):
        comm.all_reduce(x)
    if comm.rank == 1:
        next_batch(60)
    comm.all_reduce(x)
    fastcomm.shutdown()
"""


@pytest.mark.timeout(120)
def test_report_names_the_rank_in_its_data_loader(tmp_path):
    path = script(tmp_path, "job.py", JOB)
    logs = tmp_path / "logs"
    args = ["--nproc-per-node", "3", "--max-restarts", "0", "--monitor-interval", "0.1",
            "--log-dir", logs, path]
    env = clean_env(TMPDIR=str(tmp_path), FASTCOMM_SUSPECT_S="2", FASTCOMM_FLIGHT_POLL_S="0.5")
    result = run(args, tmp_path, env=env, timeout=110)
    err = result.stderr
    assert result.returncode == 1, err
    line = next((x for x in err.splitlines() if x.startswith("Hang report: ")), None)
    assert line is not None, err
    assert line.startswith("Hang report: rank 1 never entered all_reduce #6 of world "
                           "(ranks 0,2 waiting since "), line
    assert "rank 1 is at job.py:" in line and "in next_batch" in line, line
    # the early warning came before the timeout, in the waiting ranks' output
    assert "has waited" in err and "still waiting" in err, err
    flight = next(logs.glob("*/attempt_0/flight"))
    offline = subprocess.run([sys.executable, "-m", "fastcomm.trace", str(flight)], cwd=REPO,
                             env=clean_env(), capture_output=True, text=True, timeout=60)
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout.startswith("rank 1 never entered all_reduce #6 of world"), offline.stdout


ASKED_JOB = """
    import time
    import torch
    import fastcomm

    def next_batch(seconds):
        time.sleep(seconds)

    comm = fastcomm.init("gloo", timeout=60)
    x = torch.ones(1024)
    for _ in range(5):
        comm.all_reduce(x)
    if comm.rank == 2:
        raise RuntimeError("corrupt batch")
    if comm.rank == 1:
        next_batch(60)
    comm.all_reduce(x)
"""


@pytest.mark.timeout(120)
def test_launcher_asks_the_running_workers(tmp_path):
    """Rank 2 raises; rank 1 sits in its loader, rank 0 in all_reduce #6 (timeout 60 s): the
    launcher asks the running workers for their records (SIGUSR1) before it stops them."""
    path = script(tmp_path, "asked.py", ASKED_JOB)
    args = ["--nproc-per-node", "3", "--max-restarts", "0", "--monitor-interval", "0.1", path]
    env = clean_env(TMPDIR=str(tmp_path), FASTCOMM_FLIGHT_POLL_S="0.5")
    result = run(args, tmp_path, env=env, timeout=110)
    err = result.stderr
    assert result.returncode == 1, err
    assert "Root cause: rank 2" in err, err
    line = next((x for x in err.splitlines() if x.startswith("Hang report: ")), None)
    assert line is not None, err
    assert line.startswith("Hang report: rank 2 (host "), line
    assert "rank 0 waiting in all_reduce #6 of world" in line, line
