"""Root cause first: a SIGKILLed worker is named as the cause, its peers' errors under it.

The job trains a small fastcomm DDP model on the shm backend; on the first attempt rank 1
SIGKILLs itself between two steps, so rank 0 is inside the next step's allreduce and fails
with a peer-loss error (``CommAbortedError: ... exited without joining it``), which may be
recorded before the agent sees rank 1's exit. Whatever the order, the restart announcement
(``--max-restarts 1``) and the final report (``--max-restarts 0``) must name rank 1 and
SIGKILL. (Before the fix the headline named rank 0's consequence in about half the runs.)
"""

from __future__ import annotations

import pytest

from fastcomm.launch.errors import Failure, format_report, headline, is_peer_loss, root_cause

from ._util import clean_env, run, script

SHM_JOB = """
    import os, signal, sys
    import torch
    import fastcomm
    from fastcomm.ddp import DDP

    out = sys.argv[1]
    comm = fastcomm.init("shm", timeout=20)
    rank = comm.rank
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(40):
        if rank == 1 and attempt == "0" and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        model.clip_grad_norm_(1.0)
        opt.step()
    open(os.path.join(out, f"ok_{rank}_{attempt}"), "w").close()
    fastcomm.shutdown()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_restarts", [1, 0])
def test_sigkilled_rank_is_the_root_cause(tmp_path, max_restarts):
    path = script(tmp_path, "shm_job.py", SHM_JOB)
    args = ["--nproc-per-node", "2", "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.05", path, tmp_path]
    result = run(args, tmp_path, env=clean_env(TMPDIR=str(tmp_path)), timeout=110)
    err = result.stderr
    # the failed job's temporary folder is gone too (the report carries the error files)
    assert sorted(tmp_path.glob("fastcomm_launch_*")) == [], err
    if max_restarts == 1:
        assert result.returncode == 0, err
        assert sorted(p.name for p in tmp_path.glob("ok_*")) == ["ok_0_1", "ok_1_1"], err
        line = next(x for x in err.splitlines() if "restarting the workers" in x)
        assert "rank 1 (local_rank 1" in line and "killed by signal 9 (SIGKILL)" in line, line
    else:
        assert result.returncode == 1, err
        report = err[err.index("shm_job.py FAILED") :]
        head = report.splitlines()[1]
        assert head.startswith("Root cause: rank 1 (local_rank 1"), report
        assert "killed by signal 9 (SIGKILL)" in head, report
        cause = report[report.index("Root Cause") : report.index("Followed by")]
        assert "rank      : 1 (local_rank: 1" in cause and "SIGKILL" in cause, report


def _failure(rank, *, exitcode=1, timestamp=0.0, message=None):
    return Failure(rank=rank, local_rank=rank, group_rank=0, host="h", pid=100 + rank,
                   exitcode=exitcode, timestamp=timestamp, message=message)


def test_peer_loss_errors_never_outrank_the_cause():
    aborted = _failure(0, timestamp=1.0, message=(
        "CommAbortedError: rank 0: shm all_reduce aborted: rank 1 (pid 7) exited without "
        "joining it"))
    killed = _failure(1, exitcode=-9, timestamp=2.0)
    own = _failure(2, timestamp=3.0, message="ValueError: corrupt batch")
    assert is_peer_loss(aborted) and not is_peer_loss(killed) and not is_peer_loss(own)
    assert root_cause([aborted, killed, own]) is killed
    assert root_cause([aborted, own]) is own  # an error of its own beats a consequence
    assert root_cause([aborted]) is aborted  # nothing better known: the earliest
    line = headline([aborted, killed])
    assert line.startswith("rank 1 (local_rank 1, host h) was killed by signal 9 (SIGKILL)")
    assert "then 1 more: rank(s) 0" in line
    report = format_report("train.py", [aborted, killed], restarts=0, max_restarts=0)
    cause, after = report.split("Followed by")
    assert "rank      : 1" in cause and "rank      : 0" in after
    assert "exited without joining" in after and "exited without joining" not in cause
