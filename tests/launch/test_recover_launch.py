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


def _round(workers_port: int, nproc: int = 2, seen_by: int = 0, server=None):
    """Round 0 of 3 nodes x ``nproc`` as node ``seen_by`` sees it: a real round store and the
    workers' store at ``workers_port``."""
    from fastcomm.comm.store import Store
    from fastcomm.launch.rendezvous import NodeInfo, RoundInfo

    server = server or Store(is_server=True, timeout=10, _secret=None)
    nodes = [NodeInfo(f"agent{g}", f"node{g}", "127.0.0.1", nproc, "default", 100 + g)
             for g in range(3)]
    return server, RoundInfo(round=0, group_rank=seen_by, nodes=nodes, restart_count=0,
                             master_addr="127.0.0.1", master_port=workers_port,
                             store=server.prefixed("round0"))


def _node_lost(g: int):
    from fastcomm.launch.errors import Failure

    return Failure(rank=-1, local_rank=-1, group_rank=g, host=f"node{g}", pid=100 + g,
                   exitcode=1, timestamp=0.0, message=f"no heartbeat from the agent of node {g}")


def test_a_lost_node_is_absorbed_once_and_named_in_the_workers_store():
    """Two agents absorb the loss of node 1 (ranks 2, 3): counted once, counted out of the
    round (lost-nodes, exited), each rank named lost in the workers' store (real TCPStores)."""
    from fastcomm.comm.store import Store, lost_rank_key
    from fastcomm.launch.config import LaunchConfig
    from fastcomm.launch.recovery import LossWatch

    workers = Store(is_server=True, timeout=10, _secret=None)
    server, info = _round(workers.port)
    cfg = LaunchConfig(entrypoint="train.py", min_nodes=1, max_nodes=3, nproc_per_node=2,
                       recover="in-process", min_ranks=2, rdzv_port=29999)
    lines: list[str] = []
    _, info2 = _round(workers.port, seen_by=2, server=server)
    watches = [LossWatch(cfg, info, lines.append), LossWatch(cfg, info2, lines.append)]
    assert all(w.take_node(_node_lost(1)) for w in watches)
    assert info.store.add("lost", 0) == 2
    assert info.store.add("lost-nodes", 0) == info.store.add("exited", 0) == 1
    assert info.store.add("done", 0) == 0  # a node waiting to join may still be admitted
    for rank in (2, 3):
        assert workers.get(lost_rank_key(rank)).decode().startswith(
            "node 1 (node1) was lost: no heartbeat")
    assert not workers.check([lost_rank_key(r) for r in (0, 1, 4, 5)])
    assert "its ranks 2, 3 are lost; the job goes on with 4 of 6 ranks" in lines[0], lines
    # node 2 as well: 2 ranks left, the minimum; then node 0's own worker: below it
    assert watches[0].take_node(_node_lost(2))
    assert "the job goes on with 2 of 6 ranks" in lines[-1]
    from fastcomm.launch.errors import Failure

    worker = Failure(rank=0, local_rank=0, group_rank=0, host="node0", pid=7, exitcode=-9,
                     timestamp=0.0)
    assert not watches[0].take(worker)
    assert "fewer than the minimum 2: stopping" in lines[-1]


def test_a_lost_node_below_the_minimum_is_not_absorbed():
    from fastcomm.comm.store import Store, lost_rank_key
    from fastcomm.launch.config import LaunchConfig
    from fastcomm.launch.recovery import LossWatch

    workers = Store(is_server=True, timeout=10, _secret=None)
    server, info = _round(workers.port)
    cfg = LaunchConfig(entrypoint="train.py", min_nodes=1, max_nodes=3, nproc_per_node=2,
                       recover="in-process", min_ranks=5, rdzv_port=29999)
    lines: list[str] = []
    assert not LossWatch(cfg, info, lines.append).take_node(_node_lost(1))
    assert "4 live rank(s) are fewer than the minimum 5: stopping" in lines[-1]
    assert not workers.check([lost_rank_key(2)])  # the round fails: nobody is told to go on
