"""Two real nodes on one machine (``_nodes.Nodes``): each in its own network, UTS, mount and PID
namespace, joined by a bridge with no route out (10.213.34.1 and .2), each with its own
hostname (``node0``, ``node1``), ``/dev/shm``, ``/tmp`` and a Debian-style ``/etc/hosts``;
``FASTCOMM_HOST_ID`` is unset, so fastcomm tells the hosts apart as it would two machines.
Root, ``ip netns`` (iproute2), ``unshare`` and ``mount`` (util-linux) are needed: skipped
elsewhere. Everything made here goes when the module ends, also on failure (``Nodes.remove``).
"""

from __future__ import annotations

import re
import shutil
import time

import pytest

from ._nodes import Nodes, why_not
from ._util import LAUNCHED_DDP, REPO, script

PORT = 29534  # inside the namespaces only: nothing else listens there
# short heartbeats keep the losses quick; the behaviour under test is the same at 5 s x 3
FAST = "keep_alive_interval=0.5,keep_alive_max_attempt=4,last_call_timeout=1"

_REASON = why_not()
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
    pytest.mark.timeout(120),
]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    shared = tmp_path_factory.mktemp("two_nodes")
    shared.chmod(0o755)
    made = Nodes(shared, count=2)
    try:
        made.build()
        yield made
    finally:
        made.remove()
        made.check_removed()


def _job(*extra: str, nproc: int = 2, conf: str = FAST) -> list[str]:
    return [
        "--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"node0:{PORT}", "--rdzv-id", "two", "--job-secret-file",
        "/mnt/secret", "--rdzv-conf", conf, *extra,
    ]


@pytest.fixture(autouse=True)
def _secret(nodes):
    (nodes.shared / "secret").write_text("two-nodes-secret\n")
    yield
    nodes.end_test()


def _run_both(nodes, args, name, timeout=90, late: float = 0.0):
    """Runs the job on node1 then (after ``late`` s) node0; returns both (code, stderr)."""
    second = nodes.start(1, args, f"{name}1")
    if late:
        time.sleep(late)
    first = nodes.start(0, args, f"{name}0")
    return [nodes.result(first, f"{name}0", timeout), nodes.result(second, f"{name}1", timeout)]


def test_the_readme_example_runs_on_two_nodes_with_hier(nodes):
    shutil.copy(REPO / "examples" / "train.py", nodes.shared / "train.py")
    results = _run_both(nodes, _job("train.py", "--steps", "5"), "train")
    for code, err in results:
        assert code == 0, err
    out = nodes.out("train0")
    assert "ranks=4" in out and "backend=hier" in out, out


TORCH_OPS = """
import os, socket, torch, torch.distributed as dist
import fastcomm  # registers the "fastcomm" backend
dist.init_process_group("fastcomm")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.arange(5, dtype=torch.int64) + 10 * rank
dist.all_reduce(t)
assert t.tolist() == [sum(k + 10 * r for r in range(world)) for k in range(5)], t
out = [torch.empty(2, dtype=torch.float32) for _ in range(world)]
dist.all_gather(out, torch.tensor([rank, rank + 0.5]))
assert [o.tolist() for o in out] == [[r, r + 0.5] for r in range(world)], out
b = torch.full((3,), float(rank))
dist.broadcast(b, src=world - 1)
assert b.tolist() == [world - 1.0] * 3
print("host", socket.gethostname(), "rank", rank, "ok", flush=True)
dist.destroy_process_group()
"""


def test_torch_backend_ops_are_exact_across_the_nodes(nodes):
    script(nodes.shared, "ops.py", TORCH_OPS)
    results = _run_both(nodes, _job("ops.py"), "ops")
    for code, err in results:
        assert code == 0, err
    assert nodes.out("ops0").count(" ok") == 2 and "host node1" in nodes.out("ops1")


FAULT = """
import os, sys, time
if os.environ["RANK"] == "3" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(30)  # stands for a collective stuck on the failed rank
print("rank", os.environ["RANK"], "restart", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
"""


def test_a_late_rendezvous_host_and_a_rank_fault_restarted(nodes):
    """node1 starts 10 s before node0 (nothing listens yet: it retries, it used to quit after
    about 8 s calling the port 'not a store'); then rank 3 fails once and is restarted."""
    script(nodes.shared, "fault.py", FAULT)
    results = _run_both(nodes, _job("--max-restarts", "1", "fault.py"), "fault", late=10)
    for code, err in results:
        assert code == 0, err
    assert "not a store" not in results[1][1]
    assert "restart 1" in nodes.out("fault0") and "restart 1" in nodes.out("fault1")
    # the nodes' group ranks follow the order they join in, which the late host may win
    assert re.search(r"rank 3 \(local_rank 1, host node[01]\) failed with exit code 3",
                     results[0][1] + results[1][1]), results


HANG = """
import os, time
open("/mnt/up_%s" % os.environ["RANK"], "w").close()
time.sleep(60)
"""


def test_a_lost_node_is_named_within_the_heartbeat_limit(nodes):
    script(nodes.shared, "hang.py", HANG)
    for stale in nodes.shared.glob("up_*"):
        stale.unlink()
    node1 = nodes.start(1, _job("hang.py", nproc=1), "lost1")
    node0 = nodes.start(0, _job("hang.py", nproc=1), "lost0")
    deadline = time.monotonic() + 60
    while len(list(nodes.shared.glob("up_*"))) < 2:
        assert time.monotonic() < deadline and node0.poll() is None, nodes.err("lost0")
        time.sleep(0.1)
    nodes.kill(node1)  # node1 powered off: its agent and worker die at once
    lost = time.monotonic()
    code, err = nodes.result(node0, "lost0", 40)
    elapsed = time.monotonic() - lost
    assert code == 1, err
    assert "node 1 (node1) was lost: no heartbeat from the agent of node 1" in err, err
    assert elapsed < 2 + 20, (elapsed, err)  # the limit is 0.5 s x 4 (room for a loaded machine)


# srun's part on one node (what slurmstepd does): 2 tasks with srun's variables for a step of
# 2 nodes x 2 tasks; the rendezvous comes from the node list and the job id alone
SRUN_NODE = """
import os, subprocess, sys
node, ifname = int(sys.argv[1]), sys.argv[2]
procs = []
for local in range(2):
    env = dict(os.environ, SLURM_PROCID=str(2 * node + local), SLURM_NTASKS="4",
               SLURM_LOCALID=str(local), SLURM_NODEID=str(node), SLURM_TASKS_PER_NODE="2(x2)",
               SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_ID="4321", SLURM_STEP_ID="0",
               SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)",
               SLURM_STEP_NODELIST="node[0-1]",
               # the hosts name themselves 127.0.1.1 (as Debian does): Gloo needs the interface
               GLOO_SOCKET_IFNAME=ifname)
    procs.append(subprocess.Popen([sys.executable, "/mnt/srun_train.py",
                                  "/mnt/srun_result_%d.json"], env=env))
sys.exit(max(p.wait() for p in procs))
"""



def test_srun_variables_train_across_the_nodes(nodes):
    """No launcher of fastcomm's: srun's variables alone (2 nodes x 2 tasks) bring up the
    torch backend, fastcomm.init() (hier: shm in a node, Gloo between) and DDP."""
    import json

    script(nodes.shared, "srun_node.py", SRUN_NODE)
    script(nodes.shared, "srun_train.py", LAUNCHED_DDP)
    for stale in nodes.shared.glob("srun_result_*.json"):
        stale.unlink()
    procs = [nodes.start(i, ["/mnt/srun_node.py", str(i), nodes.veth[i]], f"srun{i}",
                         program=()) for i in (1, 0)]
    for proc, name in zip(procs, ("srun1", "srun0"), strict=True):
        code, err = nodes.result(proc, name, 90)
        assert code == 0, err
    rows = [json.loads((nodes.shared / f"srun_result_{r}.json").read_text()) for r in range(4)]
    assert [(r["rank"], r["host"]) for r in rows] == [(0, "node0"), (1, "node0"),
                                                      (2, "node1"), (3, "node1")]
    assert {(r["size"], r["backend"], r["torch_sum"], r["fastcomm_sum"]) for r in rows} == {
        (4, "hier", 10.0, 10.0)}
    assert all(r["weights"] == rows[0]["weights"] for r in rows)  # the replicas stayed equal


# rank 3 (node1) sleeps in its data loader before all_reduce #6; the other three time out
STALL = """
import os, time
os.environ.update(FASTCOMM_SUSPECT_S="2", FASTCOMM_FLIGHT_POLL_S="0.5")
import torch
import fastcomm

def next_batch(seconds):
    time.sleep(seconds)

comm = fastcomm.init("hier", timeout=8)
x = torch.ones(1024)
for _ in range(5):
    comm.all_reduce(x)
if comm.rank == 3:
    next_batch(60)
comm.all_reduce(x)
fastcomm.shutdown()
"""


def test_a_hang_across_the_nodes_is_named_in_one_line(nodes):
    """The hang report of a hier job: the stalled rank on node1, the call and its number, the
    frame, in the launchers' first lines; the early warning before the timeout."""
    script(nodes.shared, "stall.py", STALL)
    args = _job("--max-restarts", "0", "--monitor-interval", "0.1", "stall.py")
    results = _run_both(nodes, args, "stall", timeout=90)
    reports = []
    for code, err in results:
        assert code == 1, err
        reports += [x for x in err.splitlines() if x.startswith("Hang report: ")]
    assert reports, results
    for line in reports:
        assert line.startswith("Hang report: rank 3 never entered all_reduce #6 of world "
                               "(ranks 0,1,2 waiting since "), line
        assert "rank 3 is at stall.py:" in line and "in next_batch" in line, line
    warned = nodes.err("stall0") + nodes.err("stall1")
    assert "has waited" in warned and "still waiting" in warned, warned


# 2 nodes x 2 ranks on hier under --recover in-process; rank 3 (node1) stops in its gradient
# hook at step KILL (mid-backward: its peers' buckets are in flight) and says so; the test
# powers node1 off. argv: out dir. Each survivor writes its steps, their end times and params.
RECOVER = """
import json, os, socket, sys, time
import torch
from torch import nn
import fastcomm
from fastcomm.ddp import DDP

out, STEPS, KILL = sys.argv[1], {steps}, {kill}
comm = fastcomm.init(timeout={timeout})
me = comm.rank
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                      nn.Linear(512, 4))
state = {{"step": -1}}
if me == 3:
    def hook(param):
        if state["step"] == KILL:
            with open(os.path.join(out, "stopped.tmp"), "w") as fh:
                fh.write(socket.gethostname())
            os.replace(os.path.join(out, "stopped.tmp"), os.path.join(out, "stopped"))
            time.sleep(120)  # node1 is powered off meanwhile
    model[0].weight.register_post_accumulate_grad_hook(hook)
ddp = DDP(model, bucket_cap_mb=0.25)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
done, sizes, ends = [], [], []
for step in range(STEPS):
    state["step"] = step
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * me + step))
    opt.zero_grad(set_to_none=True)
    ddp(x).square().mean().backward()
    ends.append(time.time())
    opt.step()
    sizes.append([ddp.world_size, list(ddp._recovery.membership.members)])
    done.append(step)
torch.save([p.detach().clone() for p in model.parameters()], os.path.join(out, f"p{{me}}.pt"))
with open(os.path.join(out, f"r{{me}}.json"), "w") as fh:
    json.dump({{"done": done, "sizes": sizes, "ends": ends, "host": socket.gethostname(),
               "backend": comm.backend, "changes": [[list(c.lost), c.where, c.seconds, c.seen_at]
                                                    for c in ddp._recovery.changes]}}, fh)
fastcomm.shutdown()
"""
RECOVER_STEPS, RECOVER_KILL = 8, 3
# the collective timeout: the survivors must not wait it out (a Gloo call to the lost node is
# still pending in the old group when they exit)
RECOVER_TIMEOUT = 90
HEARTBEAT_LIMIT_S = 0.5 * 4  # FAST


def test_a_node_powered_off_mid_backward_is_recovered_in_place(nodes, record_property):
    """node1 (ranks 2, 3) is powered off in the middle of a backward: its link goes down first
    (nothing it sends arrives any more, no connection is closed), then every process of it
    dies. node0's agent misses its heartbeat and names ranks 2 and 3 lost; the survivors'
    collectives stop waiting, they agree, rebuild hier over node0 and finish the step among
    the two of them: every step done, parameters bitwise equal, the time from the power-off to
    their next step recorded."""
    import json

    import torch

    from tests.ddp.test_recover import _replay

    out = nodes.shared / "recover"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    out.chmod(0o777)
    script(nodes.shared, "recover.py",
           RECOVER.format(steps=RECOVER_STEPS, kill=RECOVER_KILL, timeout=RECOVER_TIMEOUT))
    # 1:2 nodes: the job may go on with one; node0 joins first (group rank 0: it serves the
    # workers' store) and waits for node1 (the last call)
    args = _job("--recover", "in-process", "--monitor-interval", "0.1", "recover.py",
                "/mnt/recover", conf=FAST.replace("last_call_timeout=1", "last_call_timeout=20"))
    args[1] = "1:2"
    node0 = nodes.start(0, args, "recover0")
    nodes.wait_joined(0, PORT, "two", node0, "recover0")  # not a fixed head start: node0 is first
    node1 = nodes.start(1, args, "recover1")
    deadline = time.monotonic() + 60
    while not (out / "stopped").exists():
        assert time.monotonic() < deadline and node0.poll() is None, nodes.err("recover0")
        time.sleep(0.02)
    assert (out / "stopped").read_text() == "node1"
    powered_off = time.time()
    try:
        nodes.link(1, False)
        nodes.kill(node1)
        code, err = nodes.result(node0, "recover0", 120)
        exited = time.time()
    finally:
        nodes.link(1, True)
    assert code == 0, err
    assert "node 1 (node1) was lost: no heartbeat from the agent of node 1" in err, err
    assert "its ranks 2, 3 are lost; the job goes on with 2 of 4 ranks" in err, err
    reports = {r: json.loads((out / f"r{r}.json").read_text()) for r in (0, 1)}
    params = {r: torch.load(out / f"p{r}.pt") for r in (0, 1)}
    for r in (0, 1):
        got = reports[r]
        assert got["host"] == "node0" and got["backend"] == "hier", got
        assert got["done"] == list(range(RECOVER_STEPS)), got  # no step lost, none twice
        assert [s[0] for s in got["sizes"]] == [4] * RECOVER_KILL + [2] * (
            RECOVER_STEPS - RECOVER_KILL), got
        assert got["changes"][0][:2] == [[2, 3], f"backward {RECOVER_KILL}"], got
    for a, b in zip(params[0], params[1], strict=True):
        assert torch.equal(a, b)
    for got, want in zip(params[0], _replay(reports[0]["sizes"]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    resumed = min(t for t in reports[0]["ends"] if t > powered_off) - powered_off
    record_property("power_off_to_next_step_s", round(resumed, 3))
    print(f"\npower-off -> survivors' next step: {resumed:.2f} s (heartbeat limit "
          f"{HEARTBEAT_LIMIT_S:g} s)")
    assert resumed < HEARTBEAT_LIMIT_S + 20, resumed  # room for a loaded machine
    lag = exited - reports[0]["ends"][-1]
    record_property("last_step_to_exit_s", round(lag, 3))
    print(f"survivors' last step -> exit: {lag:.2f} s")
    assert lag < RECOVER_TIMEOUT / 2, lag  # the pending call to node1 is not waited out


def test_a_node_joins_the_running_round_across_the_link(nodes):
    """--nnodes 1:2 --recover in-process: node0 trains alone on shm; node1, started later,
    is admitted into the running round and its two ranks join at one step boundary over the
    link: the running ranks go from shm to hier, all four end bitwise equal."""
    import json

    import torch

    from .test_recover_launch import ELASTIC

    out = nodes.shared / "join"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    out.chmod(0o777)
    script(nodes.shared, "elastic.py", ELASTIC)
    args = _job("--recover", "in-process", "--monitor-interval", "0.1", "elastic.py",
                "/mnt/join", "1.0")
    args[1] = "1:2"
    node0 = nodes.start(0, args, "join0")
    deadline = time.monotonic() + 60
    while len(list(out.glob("training_*"))) < 2:
        assert time.monotonic() < deadline and node0.poll() is None, nodes.err("join0")
        time.sleep(0.05)
    node1 = nodes.start(1, args, "join1")
    for proc, name in ((node0, "join0"), (node1, "join1")):
        code, err = nodes.result(proc, name, 90)
        assert code == 0, err
    assert "node 1 joins the running round 0" in nodes.err("join0")
    reports = {r: json.loads((out / f"r{r}.json").read_text()) for r in range(4)}
    params = {r: torch.load(out / f"p{r}.pt") for r in range(4)}
    assert reports[2]["join_step"] == reports[3]["join_step"] > 0
    for r in range(4):
        assert reports[r]["world_size"] == 4 and reports[r]["backend"] == "hier", reports[r]
        for a, b in zip(params[r], params[0], strict=True):
            assert torch.equal(a, b), f"rank {r} differs from rank 0"
