"""``--recover in-process`` on the launcher's side: a lost worker is reported and the others go
on (no restart); below ``--min-ranks`` the job stops with today's report; an elastic job's late
node joins the running round."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch

from fastcomm.launch.cli import get_parser, parse_config
from tests.harness import free_port

from ._util import (
    LAUNCH,
    clean_env,
    finish,
    run,
    script,
    spares_left,
    start,
    wait_files,
    wait_gone,
    wait_output,
)

pytestmark = pytest.mark.timeout(90)
HOST_ID = "FASTCOMM_HOST_ID"  # "": this host's own; a name: a node of its own, as fastcomm sees it

JOB = """
    import os, signal, sys, time
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    assert os.environ.get("FASTCOMM_RECOVER", "") == sys.argv[2], os.environ.get("FASTCOMM_RECOVER")
    if rank == 1:
        if os.environ.get("FASTCOMM_RECOVER_JOIN"):  # a replacement: which way it started
            spare = "FASTCOMM_SPARE_ACTIVATED" in os.environ and "torch" in sys.modules
            print("replacement", os.environ["FASTCOMM_RECOVER_JOIN"],
                  "from a spare" if spare else "cold", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    # The others go on once the launcher has absorbed rank 1's loss: the test writes "go" when
    # the launcher says so (an event, not a fixed sleep the launcher had to beat). Without
    # --recover in-process the launcher stops them first; one that neither absorbed the loss
    # nor stopped them would let them finish after 30 s, leaving done files.
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
        time.sleep(0.02)
    if rank == 2 and sys.argv[3] == "2":
        raise ValueError("a second loss")
    open(os.path.join(out, f"done_{rank}_{os.environ['TORCHELASTIC_RESTART_COUNT']}"),
         "w").close()
"""
GOES_ON = "the job goes on with 2 of 3 ranks"


def _go_once_absorbed(proc: subprocess.Popen, out) -> None:
    """Lets JOB's other ranks go on once the launcher reported rank 1's loss absorbed."""
    wait_output(proc, GOES_ON)
    (out / "go").touch()


def test_loss_reported_and_the_others_go_on(tmp_path):
    path = script(tmp_path, "job.py", JOB)
    proc = start(["--nproc-per-node", "3", "--recover", "in-process", "--max-restarts", "2",
                  path, tmp_path, "in-process", "1"], tmp_path, err_file=tmp_path / "err")
    try:
        _go_once_absorbed(proc, tmp_path)
    finally:
        result = finish(proc)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.glob("done_*")) == ["done_0_0", "done_2_0"]
    assert "rank 1 (local_rank 1, host" in result.stderr
    assert f"was lost: killed by signal 9 (SIGKILL); {GOES_ON}" in result.stderr
    assert "restarting" not in result.stderr
    # each replacement (rank 1 again) dies as well; the budget is spent, the others finish
    assert result.stderr.count("starting a replacement for rank 1") == 2
    # both started from a warm spare (torch imported ahead), their output pumped as a worker's
    for k in (1, 2):
        assert f"[rank 1]: replacement {k} from a spare" in result.stdout, result.stdout


def test_no_spare_starts_the_replacement_cold(tmp_path):
    """``--no-spare``: no warm spare runs beside the workers; the replacement is a new
    interpreter that imports torch itself."""
    path = script(tmp_path, "job.py", JOB)
    proc = start(["--nproc-per-node", "3", "--recover", "in-process", "--max-restarts", "1",
                  "--no-spare", path, tmp_path, "in-process", "1"], tmp_path,
                 err_file=tmp_path / "err")
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("done_*")) and time.monotonic() < deadline:
            assert not spares_left(proc.pid, kinds=("--spare",))  # none while the workers run
            if GOES_ON in (tmp_path / "err").read_text():
                (tmp_path / "go").touch()
            time.sleep(0.1)
    finally:
        result = finish(proc, timeout=60)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.glob("done_*")) == ["done_0_0", "done_2_0"]
    assert "[rank 1]: replacement 1 cold" in result.stdout, result.stdout


def test_an_unused_spare_goes_with_the_job(tmp_path):
    """No loss: the warm spare (--max-restarts 1) never runs the script and is killed with
    the workers; the job's output is the workers' only."""
    path = script(tmp_path, "job.py", """
        import os
        print("worker", os.environ["RANK"], flush=True)
    """)
    result = run(["--nproc-per-node", "2", "--recover", "in-process", "--max-restarts", "1",
                  path], tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(line for line in result.stdout.splitlines() if "worker" in line) == [
        "[rank 0]: worker 0", "[rank 1]: worker 1"]
    assert not spares_left(cwd=tmp_path)


def test_below_min_ranks_stops_with_the_report(tmp_path):
    path = script(tmp_path, "job.py", JOB)
    proc = start(["--nproc-per-node", "3", "--recover", "in-process", "--min-ranks", "2",
                  path, tmp_path, "in-process", "2"], tmp_path, err_file=tmp_path / "err")
    try:
        _go_once_absorbed(proc, tmp_path)  # rank 2's loss comes second
    finally:
        result = finish(proc)
    assert result.returncode == 1, result.stderr
    assert GOES_ON in result.stderr  # the first loss
    assert "fewer than the minimum 2: stopping" in result.stderr
    report = result.stderr[result.stderr.index("FAILED"):]
    assert "Root cause: rank 1 (local_rank 1" in report and "SIGKILL" in report
    assert "ValueError: a second loss" in report


def test_restart_stays_the_default(tmp_path):
    """Rank 1's loss ends the round: the others, waiting for a "go" that never comes, are
    stopped (no done files), not left to go on."""
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
    result = run([*flags, path], tmp_path, timeout=60)
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


# The start of a job whose nodes join while it runs: a joining node's second rank asks
# sys.argv[2] seconds after its first, or, where sys.argv[2] is "admitted", once its first has
# been admitted (the admitted_<group rank>_<local rank> file its first writes as DDP() returns,
# which a joiner's DDP() does once the running ranks admitted it); `last` holds the step the
# last join happened at.
JOINING = """
    import json, os, sys, time
    import torch
    from torch import nn
    import fastcomm
    from fastcomm.ddp import DDP

    out = sys.argv[1]
    fastcomm.init(timeout=60)
    joining, local = os.environ.get("FASTCOMM_RECOVER_JOIN"), os.environ["LOCAL_RANK"]
    if joining and local == "1" and sys.argv[2] == "admitted":
        first = os.path.join(out, f"admitted_{os.environ['GROUP_RANK']}_0")
        start = time.monotonic()
        while not os.path.exists(first):
            waited = time.monotonic() - start
            if waited > 90:
                raise TimeoutError(f"rank {os.environ['RANK']}: waited {waited:.1f} s for "
                                   f"local rank 0's admission ({first})")
            time.sleep(0.02)
    elif joining and local == "1":
        time.sleep(float(sys.argv[2]))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    ddp = DDP(model)
    if joining:
        open(os.path.join(out, f"admitted_{os.environ['GROUP_RANK']}_{local}"), "w").close()
    membership = ddp._recovery.membership
    me = membership.me  # the original rank
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ddp.register_state("opt", opt)
    last = [ddp.join_step]
    ddp.on_membership_change(
        lambda c: last.__setitem__(0, int(c.where.split()[1])) if c.where.startswith("join")
        else None)
"""

ELASTIC = JOINING + """
    done, step, deadline = [], ddp.join_step, time.monotonic() + 100
    while ddp.world_size < 4 or step < last[0] + 5:
        assert time.monotonic() < deadline, "the late node's ranks never joined"
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1000 * me + step))
        opt.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        opt.step()
        done.append(step)
        step += 1
        if step == 3:
            open(os.path.join(out, f"training_{me}"), "w").close()
        time.sleep(0.02)
    torch.save([p.detach() for p in model.parameters()], os.path.join(out, f"p{me}.pt"))
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                      "TORCHELASTIC_RESTART_COUNT")}
    with open(os.path.join(out, f"r{me}.json"), "w") as fh:
        json.dump({"done": done, "join_step": ddp.join_step, "rank": ddp.rank,
                   "backend": ddp.comm.backend,
                   "world_size": ddp.world_size, "env": env}, fh)
    fastcomm.shutdown()
"""


@pytest.mark.timeout(180)
def test_elastic_node_joins_the_running_round(tmp_path):
    """--nnodes 1:2 --recover in-process: a second agent arriving while the job runs is
    admitted into the running round (no restart); its two workers join the running ranks with
    rank 0's state, and all four end bitwise equal. Its second worker asks only once the first
    has been admitted, which the running ranks do alone once the recovery timeout (2 s here)
    has passed without the second: rank 0 names the missing one, and the second joins at a
    later boundary (within the timeout both join at one boundary:
    ``test_a_node_lost_then_back_is_admitted_into_the_running_round``). No margin between the
    two workers' speeds: the second waits for the event itself."""
    path = script(tmp_path, "elastic.py", ELASTIC)
    flags = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "grow",
             "--monitor-interval", "0.05", "--rdzv-conf", "last_call_timeout=0.5",
             "--recover", "in-process"]
    env = clean_env(FASTCOMM_RECOVER_JOIN_EVERY="4", FASTCOMM_RECOVER_TIMEOUT="2")
    first = start([*flags, path, tmp_path, "admitted"], tmp_path, env)
    wait_files(tmp_path, "training_*", 2, proc=first, timeout=90)
    late = start([*flags, path, tmp_path, "admitted"], tmp_path, env)
    results = [finish(first, timeout=150), finish(late, timeout=150)]
    for r in results:
        assert r.returncode == 0, r.stderr[-4000:]
    assert "node 1 joins the running round 0" in results[0].stderr
    assert "admitted to the running round 0 as group rank 1" in results[1].stderr or (
        "joined the running round 0" in results[1].stderr)
    assert "restarting" not in results[0].stderr + results[1].stderr
    reports = {r: json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(4)}
    params = {r: torch.load(tmp_path / f"p{r}.pt") for r in range(4)}
    end = reports[0]["done"][-1] + 1
    for r in range(4):
        assert reports[r]["world_size"] == 4 and reports[r]["done"][-1] == end - 1
        assert reports[r]["backend"] == "shm"
        for a, b in zip(params[r], params[0], strict=True):
            assert torch.equal(a, b), f"rank {r} differs from rank 0"
    assert reports[0]["done"] == reports[1]["done"] == list(range(end))
    joins = {r: reports[r]["join_step"] for r in (2, 3)}
    for r in (2, 3):
        assert reports[r]["done"] == list(range(joins[r], end))
    assert 3 <= joins[2] < joins[3] < end, joins
    warned = "without node1's local ranks [1] (1 of 2 asked)"
    assert warned in results[0].stderr, results[0].stderr[-3000:]
    late_env = reports[2]["env"]
    assert (late_env["GROUP_RANK"], late_env["GROUP_WORLD_SIZE"], late_env["WORLD_SIZE"],
            late_env["TORCHELASTIC_RESTART_COUNT"]) == ("1", "2", "4", "0")
    assert sorted(reports[r]["env"]["RANK"] for r in (2, 3)) == ["2", "3"]


WAITER = """
    import json, os, sys, time
    out = sys.argv[1]
    keys = ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "FASTCOMM_RECOVER_JOIN")
    with open(os.path.join(out, "w" + os.environ["RANK"] + ".json"), "w") as fh:
        json.dump({k: os.environ.get(k) for k in keys}, fh)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "stop")) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


@pytest.mark.timeout(120)
def test_a_node_beyond_max_waits_and_the_job_ends_without_it(tmp_path):
    """--nnodes 1:2: the second node is admitted into the running round (its workers get
    the grown world and FASTCOMM_RECOVER_JOIN); a third finds the round full, waits for a
    next round, and leaves with exit 0 when the job ends without one."""
    path = script(tmp_path, "waiter.py", WAITER)
    flags = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "full",
             "--monitor-interval", "0.05", "--rdzv-conf", "last_call_timeout=0.5",
             "--recover", "in-process"]
    agents = [start([*flags, path, tmp_path], tmp_path)]
    wait_files(tmp_path, "w*.json", 2, proc=agents[0])
    agents.append(start([*flags, path, tmp_path], tmp_path))
    wait_files(tmp_path, "w*.json", 4, proc=agents[1])
    # the third's log goes to a file, read until it has asked the running round
    with open(tmp_path / "third.err", "w") as err:
        third = subprocess.Popen([*LAUNCH, *map(str, [*flags, path, tmp_path])], cwd=tmp_path,
                                 env={**clean_env(), "LOGLEVEL": "INFO"},
                                 stdout=subprocess.DEVNULL, stderr=err,
                                 text=True)
    deadline = time.monotonic() + 60
    while "asking it to admit" not in (tmp_path / "third.err").read_text():
        assert third.poll() is None and time.monotonic() < deadline, \
            (tmp_path / "third.err").read_text()[-3000:]
        time.sleep(0.05)
    (tmp_path / "stop").touch()
    results = [finish(a, timeout=60) for a in agents]
    assert third.wait(timeout=60) == 0, (tmp_path / "third.err").read_text()[-3000:]
    results.append(subprocess.CompletedProcess(third.args, 0, "",
                                               (tmp_path / "third.err").read_text()))
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    assert "node 1 joins the running round 0" in results[0].stderr
    assert "the job finished before this node was admitted" in results[2].stderr
    grown = [json.loads((tmp_path / f"w{r}.json").read_text()) for r in (2, 3)]
    for env in grown:
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["WORLD_SIZE"],
                env["FASTCOMM_RECOVER_JOIN"]) == ("1", "2", "4", "node1"), env
    first = json.loads((tmp_path / "w0.json").read_text())
    assert (first["WORLD_SIZE"], first["FASTCOMM_RECOVER_JOIN"]) == ("2", None)
    assert not list(tmp_path.glob("w4.json"))  # the third node's workers never started


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
    from fastcomm.launch.recovery import RoundLosses

    workers = Store(is_server=True, timeout=10, _secret=None)
    server, info = _round(workers.port)
    cfg = LaunchConfig(entrypoint="train.py", min_nodes=1, max_nodes=3, nproc_per_node=2,
                       recover="in-process", min_ranks=2, rdzv_port=29999)
    lines: list[str] = []
    _, info2 = _round(workers.port, seen_by=2, server=server)
    losses = [RoundLosses(cfg, info, lines.append), RoundLosses(cfg, info2, lines.append)]
    assert all(w.take_node(_node_lost(1)) for w in losses)
    assert info.store.add("lost", 0) == 2
    assert info.store.add("lost-nodes", 0) == info.store.add("exited", 0) == 1
    assert info.store.add("done", 0) == 0  # a node waiting to join may still be admitted
    for rank in (2, 3):
        assert workers.get(lost_rank_key(rank)).decode().startswith(
            "node 1 (node1) was lost: no heartbeat")
    assert not workers.check([lost_rank_key(r) for r in (0, 1, 4, 5)])
    assert "its ranks 2, 3 are lost; the job goes on with 4 of 6 ranks" in lines[0], lines
    # node 2 as well: 2 ranks left, the minimum; then node 0's own worker: below it
    assert losses[0].take_node(_node_lost(2))
    assert "the job goes on with 2 of 6 ranks" in lines[-1]
    from fastcomm.launch.errors import Failure

    worker = Failure(rank=0, local_rank=0, group_rank=0, host="node0", pid=7, exitcode=-9,
                     timestamp=0.0)
    assert not losses[0].take(worker)
    assert "fewer than the minimum 2: stopping" in lines[-1]


def test_a_lost_node_below_the_minimum_is_not_absorbed():
    from fastcomm.comm.store import Store, lost_rank_key
    from fastcomm.launch.config import LaunchConfig
    from fastcomm.launch.recovery import RoundLosses

    workers = Store(is_server=True, timeout=10, _secret=None)
    server, info = _round(workers.port)
    cfg = LaunchConfig(entrypoint="train.py", min_nodes=1, max_nodes=3, nproc_per_node=2,
                       recover="in-process", min_ranks=5, rdzv_port=29999)
    lines: list[str] = []
    assert not RoundLosses(cfg, info, lines.append).take_node(_node_lost(1))
    assert "4 live rank(s) are fewer than the minimum 5: stopping" in lines[-1]
    assert not workers.check([lost_rank_key(2)])  # the round fails: nobody is told to go on


# me: 0, 1 the first node's; 2, 3 the node lost; 4, 5 the node back
REJOIN = JOINING + """
    step, deadline = ddp.join_step, time.monotonic() + 100
    while len(membership.identity) < 6 or ddp.world_size < 4 or step < last[0] + 5:
        assert time.monotonic() < deadline, f"rank {me}: the node never came back"
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1000 * me + step))
        opt.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        opt.step()
        step += 1
        if step == ddp.join_step + 3:
            (open(os.path.join(out, f"training_{me}"), "w")).write(str(os.getpid()))
        time.sleep(0.02)
    torch.save([p.detach() for p in model.parameters()], os.path.join(out, f"p{me}.pt"))
    with open(os.path.join(out, f"r{me}.json"), "w") as fh:
        json.dump({"join_step": ddp.join_step, "world_size": ddp.world_size, "step": step,
                   "backend": ddp.comm.backend,
                   "lost": [list(c.lost) for c in ddp._recovery.changes],
                   "members": membership.members, "RANK": os.environ["RANK"],
                   "GROUP_RANK": os.environ["GROUP_RANK"]}, fh)
    fastcomm.shutdown()
"""


@pytest.mark.timeout(180)
def test_a_node_lost_then_back_is_admitted_into_the_running_round(tmp_path):
    """--nnodes 1:2, each node a host of its own to fastcomm (FASTCOMM_HOST_ID): node 1 joins
    the running round, its agent is SIGKILLed (its workers go with it), the first agent
    absorbs the node's loss (no heartbeat) and names its ranks lost, and the survivors, on
    hier since node 1 joined, shrink; a new agent for that node is then admitted like any
    joining node (a lost node makes room under MAX) and its two ranks, the second asking a
    second after the first, join at one step boundary (the agent said the node brings two);
    all four end bitwise equal."""
    path = script(tmp_path, "rejoin.py", REJOIN)
    flags = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "rejoin",
             "--monitor-interval", "0.05", "--rdzv-conf",
             "last_call_timeout=0.5,keep_alive_interval=0.25,keep_alive_max_attempt=4",
             "--recover", "in-process"]
    env = clean_env(FASTCOMM_RECOVER_JOIN_EVERY="4")
    err = tmp_path / "first.err"
    with open(err, "w") as fh:  # read while it runs: the loss must be absorbed first
        first = subprocess.Popen([*LAUNCH, *map(str, [*flags, path, tmp_path, 1.0])],
                                 cwd=tmp_path, env={**env, HOST_ID: "hosta"},
                                 stdout=subprocess.DEVNULL, stderr=fh, text=True)
    lost = None
    try:
        try:  # the agent's stderr goes to a file: a failure shows it
            wait_files(tmp_path, "training_*", 2, proc=first, timeout=90)
            lost = start([*flags, path, tmp_path, 1.0], tmp_path, {**env, HOST_ID: "hostb"})
            wait_files(tmp_path, "training_*", 4, proc=first, timeout=90)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\nthe first agent's stderr:\n{err.read_text()[-4000:]}"
            ) from None
        lost.kill()  # the node goes: its agent, and with it its workers
        lost.communicate()
        pids = [int((tmp_path / f"training_{r}").read_text()) for r in (2, 3)]
        deadline = time.monotonic() + 60
        while "node 1 (" not in err.read_text():
            assert first.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.05)
        back = finish(start([*flags, path, tmp_path, 1.0], tmp_path, {**env, HOST_ID: "hostc"}),
                      timeout=120)
        assert first.wait(timeout=60) == 0, err.read_text()[-4000:]
    finally:
        for proc in (first, lost):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert back.returncode == 0, back.stderr[-4000:]
    assert not wait_gone(pids)
    log = err.read_text()
    assert "its ranks 2, 3 are lost; the job goes on with 2 of 4 ranks" in log, log[-3000:]
    assert "node 2 joins the running round 0" in log, log[-3000:]
    reports = {r: json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1, 4, 5)}
    params = {r: torch.load(tmp_path / f"p{r}.pt") for r in (0, 1, 4, 5)}
    for r in (0, 1, 4, 5):
        assert reports[r]["world_size"] == 4 and reports[r]["members"] == [0, 1, 4, 5]
        assert reports[r]["backend"] == "hier"
        assert reports[r]["step"] == reports[0]["step"]
        for a, b in zip(params[r], params[0], strict=True):
            assert torch.equal(a, b), f"rank {r} differs from rank 0"
    assert reports[4]["join_step"] == reports[5]["join_step"] > 0
    assert reports[0]["lost"] == [[], [2, 3], []]  # node 1 joined, was lost, node 2 joined
    assert [reports[r]["GROUP_RANK"] for r in (4, 5)] == ["2", "2"]
    assert sorted(reports[r]["RANK"] for r in (4, 5)) == ["4", "5"]


def test_a_lost_node_makes_room_and_the_agents_learn_the_nodes_admitted():
    """Round 0 of 2 nodes under MAX 2 (a real rendezvous store): a node asking to join is
    answered full; once node 1 is counted lost (``lost-nodes``) the next is admitted as group
    rank 2, and node 1's agent learns of it (``grown_nodes``: its nodes and ranks grow, the
    world size it counts stays)."""
    from fastcomm.comm.store import Store
    from fastcomm.launch.config import LaunchConfig
    from fastcomm.launch.rendezvous import NodeInfo, Rendezvous, RoundInfo, to_record

    cfg = LaunchConfig(entrypoint="train.py", min_nodes=1, max_nodes=2, nproc_per_node=2,
                       recover="in-process", rdzv_port=29999, run_id="room")
    server = Store(is_server=True, timeout=10, _secret=None)
    nodes = [NodeInfo(f"agent{g}", f"node{g}", "127.0.0.1", 2, "default", 100 + g)
             for g in range(2)]
    views = []
    for g in range(2):
        rdzv = Rendezvous(server, cfg, nodes[g], lambda: None)
        store = rdzv.round_store(0)
        views.append((rdzv, RoundInfo(round=0, group_rank=g, nodes=list(nodes), restart_count=0,
                                      master_addr="127.0.0.1", master_port=1, store=store)))
    (rdzv0, info0), (rdzv1, info1) = views
    info0.store.set("closed", info0.store.encode("closed", 2))
    asking = NodeInfo("agent2", "node2", "127.0.0.1", 2, "default", 102)

    def ask(j):
        info0.store.add("grow/asked", 1)
        info0.store.set(f"grow/ask/{j}", info0.store.encode(f"grow/ask/{j}", to_record(asking)))
        return rdzv0.admit_waiting(info0)

    assert ask(0) == []  # full: 2 of MAX 2
    assert "full" in info0.store.get("grow/answer/0").decode()
    info0.store.add("lost-nodes", 1)  # as RoundLosses.take_node counts node 1's loss
    assert ask(1) == [2]
    assert rdzv1.grown_nodes(info1) == [asking]
    assert [n.host for n in info1.nodes] == ["node0", "node1", "node2"]
    assert info1.world_size == 6 and info1.world_size_now() == 6
    assert rdzv1.grown_nodes(info1) == []  # read once
