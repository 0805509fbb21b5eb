"""``--recover in-process`` on the launcher's side: a lost worker is reported and the others go
on (no restart); below ``--min-ranks`` the job stops with today's report."""

from __future__ import annotations

import pytest

from fastcomm.launch.cli import get_parser, parse_config

from ._util import run, script

pytestmark = pytest.mark.timeout(90)

JOB = """
    import os, signal, sys, time
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    assert os.environ.get("FASTCOMM_RECOVER", "") == sys.argv[2], os.environ.get("FASTCOMM_RECOVER")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2 and sys.argv[3] == "2":
        time.sleep(0.5)
        raise ValueError("a second loss")
    time.sleep(1.5)  # the others are not stopped meanwhile
    open(os.path.join(out, f"done_{rank}_{os.environ['TORCHELASTIC_RESTART_COUNT']}"),
         "w").close()
"""


def test_loss_reported_and_the_others_go_on(tmp_path):
    path = script(tmp_path, "job.py", JOB)
    result = run(["--nproc-per-node", "3", "--recover", "in-process", "--max-restarts", "2",
                  path, tmp_path, "in-process", "1"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.glob("done_*")) == ["done_0_0", "done_2_0"]
    assert "rank 1 (local_rank 1, host" in result.stderr
    assert "was lost: killed by signal 9 (SIGKILL); the job goes on with 2 of 3 ranks" in (
        result.stderr)
    assert "restarting" not in result.stderr
    # each replacement (rank 1 again) dies as well; the budget is spent, the others finish
    assert result.stderr.count("starting a replacement for rank 1") == 2


def test_below_min_ranks_stops_with_the_report(tmp_path):
    path = script(tmp_path, "job.py", JOB)
    result = run(["--nproc-per-node", "3", "--recover", "in-process", "--min-ranks", "2",
                  path, tmp_path, "in-process", "2"], tmp_path)
    assert result.returncode == 1, result.stderr
    assert "the job goes on with 2 of 3 ranks" in result.stderr  # the first loss
    assert "fewer than the minimum 2: stopping" in result.stderr
    report = result.stderr[result.stderr.index("FAILED"):]
    assert "Root cause: rank 1 (local_rank 1" in report and "SIGKILL" in report
    assert "ValueError: a second loss" in report


def test_restart_stays_the_default(tmp_path):
    path = script(tmp_path, "job.py", JOB)
    result = run(["--nproc-per-node", "3", path, tmp_path, "", "1"], tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Root cause: rank 1" in result.stderr
    assert not list(tmp_path.glob("done_*"))


@pytest.mark.parametrize("flags, message", [
    (["--recover", "later"], "invalid choice"),
    (["--recover", "in-process", "--min-ranks", "0"], "--min-ranks must be an int >= 1"),
])
def test_bad_flags(tmp_path, flags, message):
    path = script(tmp_path, "job.py", "pass\n")
    result = run([*flags, path], tmp_path, timeout=30)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_config_carries_the_mode(tmp_path):
    path = script(tmp_path, "job.py", "pass\n")
    args = get_parser().parse_args(["--recover", "in-process", "--min-ranks", "3", str(path)])
    config = parse_config(args)
    assert (config.recover, config.min_ranks) == ("in-process", 3)
    assert parse_config(get_parser().parse_args([str(path)])).recover == "restart"


def test_every_rank_lost_fails_the_job(tmp_path):
    """The last live rank failing is a failure of the job (exit 1, the report), not a success
    of the ranks left, of which there are none."""
    path = script(tmp_path, "job.py", """
        import os, time
        time.sleep(0.2 * int(os.environ["RANK"]))
        raise RuntimeError("rank " + os.environ["RANK"] + " gives up")
    """)
    result = run(["--nproc-per-node", "2", "--recover", "in-process", path], tmp_path)
    assert result.returncode == 1, result.stderr
    assert "the job goes on with 1 of 2 ranks" in result.stderr
    assert "FAILED" in result.stderr and "rank 1 gives up" in result.stderr
