"""Three real nodes (``_nodes.Nodes``: network, UTS, mount and PID namespaces, a bridge between
them) with an etcd member on each, running ``fastcomm-run --rdzv-backend etcd --recover
in-process``: any node may be powered off, etcd's own members may be lost.

The job trains a small DDP model on one rank per node (``TRAIN``). A node powered off mid-
backward (its link down, every process of it killed, its etcd member with it) is absorbed the
same way whichever it is: the first node (group rank 0, rank 0's host) or another; the two
survivors finish every step with equal parameters (the replay of the steps over the ranks each
was reduced over), renumbered from 0. One etcd member killed (the leader) slows no step past
twice the median; two of three killed stop every agent with one line naming the lost majority.
Skipped without root and ``ip netns`` (``_nodes.why_not``) or without etcd (the install
command in the reason). The members' data lie in the module's folder; everything goes with
the module (``Nodes.remove``).
"""

from __future__ import annotations

import json
import shutil
import statistics
import time

import pytest

from tests.etcd_cluster import INSTALL

from ._nodes import Nodes, why_not
from ._util import script

_REASON = why_not() or (None if shutil.which("etcd") else f"needs the etcd server: {INSTALL}")
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
    pytest.mark.timeout(150),
]
# short heartbeats keep the losses quick (a liveness lease of 2 s); the round closes once the
# three nodes joined (MAX), whatever order they start in
FAST = "keep_alive_interval=0.5,keep_alive_max_attempt=4,last_call_timeout=30"
STEPS, KILL, PAUSE_S = 16, 5, 0.1

# One rank per node. argv: out dir, steps, kill step, victim rank (-1: none), pause per step.
# The victim stops in its gradient hook at the kill step (mid-backward: its peers' buckets are
# in flight) and says so. Each rank writes its steps, their end times, sizes and parameters.
TRAIN = """
import json, os, socket, sys, time
import torch
from torch import nn
import fastcomm
from fastcomm.ddp import DDP

out, steps, kill, victim, pause = sys.argv[1], *map(int, sys.argv[2:5]), float(sys.argv[5])
comm = fastcomm.init(timeout=90)
me = comm.rank
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                      nn.Linear(512, 4))
state = {"step": -1}
if me == victim:
    def hook(param):
        if state["step"] == kill:
            with open(os.path.join(out, "stopped.tmp"), "w") as fh:
                fh.write(socket.gethostname())
            os.replace(os.path.join(out, "stopped.tmp"), os.path.join(out, "stopped"))
            time.sleep(120)  # its node is powered off meanwhile
    model[0].weight.register_post_accumulate_grad_hook(hook)
ddp = DDP(model, bucket_cap_mb=0.25)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
done, sizes, ends = [], [], []
log = open(os.path.join(out, f"ends{me}"), "w")
for step in range(steps):
    state["step"] = step
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * me + step))
    opt.zero_grad(set_to_none=True)
    ddp(x).square().mean().backward()
    ends.append(time.time())
    opt.step()
    sizes.append([ddp.world_size, list(ddp._recovery.membership.members)])
    done.append(step)
    log.write(f"{ends[-1]!r}\\n")
    log.flush()
    time.sleep(pause)
torch.save([p.detach().clone() for p in model.parameters()], os.path.join(out, f"p{me}.pt"))
with open(os.path.join(out, f"r{me}.json"), "w") as fh:
    json.dump({"done": done, "sizes": sizes, "ends": ends, "host": socket.gethostname(),
               "rank": ddp.rank, "store": os.environ["FASTCOMM_STORE"],
               "changes": [[list(c.lost), c.where, c.seconds] for c in ddp._recovery.changes]},
              fh)
fastcomm.shutdown()
"""


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    shared = tmp_path_factory.mktemp("etcd_nodes")
    shared.chmod(0o755)
    made = Nodes(shared, count=3)
    try:
        made.build()
        (shared / "secret").write_text("three-nodes-secret\n")
        script(shared, "train.py", TRAIN)
        made.etcd_up()
        yield made
    finally:
        made.remove()
        made.check_removed()


@pytest.fixture
def cluster(nodes):
    """Every node up and every etcd member running again (a test before may have killed
    some), with a leader."""
    for i in range(nodes.count):
        nodes.link(i, True)
    nodes.etcd_up()
    yield nodes
    nodes.end_test()


def _start(nodes, name: str, victim: int, steps: int = STEPS, pause: float = PAUSE_S) -> list:
    """The job on the three nodes (node0 first); ``/mnt/<name>`` its folder."""
    out = nodes.shared / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    out.chmod(0o777)
    args = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", nodes.etcd_endpoints, "--rdzv-id", name,
            "--job-secret-file", "/mnt/secret", "--rdzv-conf", FAST, "--recover", "in-process",
            "--monitor-interval", "0.1",
            "train.py", f"/mnt/{name}", str(steps), str(KILL), str(victim), str(pause)]
    procs = []
    for i in range(nodes.count):
        procs.append(nodes.start(i, args, f"{name}{i}"))
        time.sleep(0.3)
    return procs


def _wait_for(nodes, procs, name: str, path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        assert time.monotonic() < deadline and not dead, "\n".join(
            nodes.err(f"{name}{i}") for i in range(nodes.count))
        time.sleep(0.02)


def _progress(out, rank: int) -> int:
    """Steps rank ``rank`` completed so far."""
    path = out / f"ends{rank}"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _step_times(out, warmup: int = 3) -> list[tuple[float, float]]:
    """Every rank's steps after the first ``warmup``: ``(end time, seconds since the step
    before ended)``."""
    rows = []
    for path in out.glob("ends*"):
        ends = [float(t) for t in path.read_text().split()]
        rows += [(b, b - a) for a, b in zip(ends[warmup:], ends[warmup + 1:], strict=False)]
    return rows


def _keys_left(nodes, node: int) -> list[str]:
    text = nodes.etcdctl(node, "get", "--prefix", "fastcomm-run/", "--keys-only")
    return [line for line in text.splitlines() if line]


def power_off(nodes, name: str, victim: int) -> dict:
    """Runs the job, powers off the node of rank ``victim`` once it stopped mid-backward (its
    link down, then every process of it killed, its etcd member too), waits for the other two
    agents and returns what they and their ranks left: ``lost`` (the node), ``results``
    (agent -> exit code, stderr), ``reports`` and ``params`` (survivor rank -> its json and
    parameters), ``resumed`` (seconds from the power-off to the survivors' next step)."""
    import torch

    procs = _start(nodes, name, victim)
    out = nodes.shared / name
    _wait_for(nodes, procs, name, out / "stopped")
    lost = int((out / "stopped").read_text().removeprefix("node"))
    powered_off = time.time()
    try:
        nodes.link(lost, False)
        nodes.kill(procs[lost])
        nodes.kill_etcd(lost)
        results = {i: nodes.result(procs[i], f"{name}{i}", 120) for i in range(3) if i != lost}
    finally:
        nodes.link(lost, True)
    for code, err in results.values():
        assert code == 0, err
    survivors = sorted({0, 1, 2} - {victim})
    reports = {r: json.loads((out / f"r{r}.json").read_text()) for r in survivors}
    params = {r: torch.load(out / f"p{r}.pt") for r in survivors}
    ends = reports[survivors[0]]["ends"]
    resumed = min(t for t in ends if t > powered_off) - powered_off
    return {"lost": lost, "results": results, "reports": reports, "params": params,
            "resumed": resumed, "survivors": survivors}


@pytest.mark.parametrize("victim", [0, 1], ids=["first-node", "another-node"])
def test_any_node_powered_off_is_recovered_in_place(cluster, victim, record_property):
    """The node of rank ``victim`` is powered off mid-backward at step KILL: its link goes
    down, then every process of it dies, its etcd member too. The other two agents see its
    liveness key expire and name its rank lost in the workers' store (in etcd: it is there
    whichever node went); the survivors agree, renumber (the lowest survivor is rank 0) and
    finish every step with equal parameters, the job's keys are gone from etcd after."""
    import torch

    from tests.ddp.test_recover import _replay

    nodes, name = cluster, f"off{victim}"
    run = power_off(nodes, name, victim)
    lost, reports, params, survivors = run["lost"], run["reports"], run["params"], run["survivors"]
    errs = "".join(err for _, err in run["results"].values())
    assert f"(node{lost}) was lost: no heartbeat from the agent of node" in errs, errs
    assert "its liveness lease in etcd expired" in errs, errs
    for new_rank, r in enumerate(survivors):
        got = reports[r]
        assert got["done"] == list(range(STEPS)), got  # no step lost, none twice
        assert [s[0] for s in got["sizes"]] == [3] * KILL + [2] * (STEPS - KILL), got
        assert got["sizes"][-1][1] == survivors and got["rank"] == new_rank, got
        assert got["changes"][0][:2] == [[victim], f"backward {KILL}"], got
        # the job's store in etcd, the node's own member listed first
        host = f"10.213.34.{int(got['host'].removeprefix('node')) + 1}:"
        assert got["store"].startswith(f"etcd://{host}") and f"/fastcomm-run/{name}/" in (
            got["store"]), got
    for a, b in zip(params[survivors[0]], params[survivors[1]], strict=True):
        assert torch.equal(a, b)
    for got, want in zip(params[survivors[0]], _replay(reports[survivors[0]]["sizes"]),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    resumed = run["resumed"]
    record_property("power_off_to_next_step_s", round(resumed, 3))
    print(f"\nnode{lost} (rank {victim}) powered off -> survivors' next step: {resumed:.2f} s")
    assert resumed < 2 + 20, resumed  # the liveness TTL is 2 s (room for a loaded machine)
    assert _keys_left(nodes, survivors[0]) == []


def test_etcd_members_lost(cluster):
    """The etcd leader's member killed mid-training: no step slower than twice the median
    (nothing in the step path waits for the election). A second member killed: the cluster
    has no majority, and every agent stops its workers and exits 1 with one line saying so."""
    nodes, name = cluster, "members"
    # steps mostly a pause: the machine's own noise (2 cores, shared) stays well under 2x
    procs = _start(nodes, name, victim=-1, steps=400, pause=0.4)
    out = nodes.shared / name
    _wait_for(nodes, procs, name, out / "ends0")
    deadline = time.monotonic() + 60
    while _progress(out, 0) < 10:
        assert time.monotonic() < deadline, nodes.err(f"{name}0")
        time.sleep(0.05)
    leader = nodes.leader()
    assert leader is not None
    first_kill = time.time()
    nodes.kill_etcd(leader)
    time.sleep(5)  # the election and ~10 steps
    second = next(i for i in range(3) if i != leader)
    second_kill = time.time()
    nodes.kill_etcd(second)
    results = [nodes.result(p, f"{name}{i}", 60) for i, p in enumerate(procs)]
    stopped = time.time() - second_kill
    for code, err in results:
        own = [line for line in err.splitlines() if line.startswith("[fastcomm-run")
               and "error" in line]
        assert code == 1 and len(own) == 1, err
        assert "error: lost the etcd cluster" in own[0] and "majority" in own[0], own
    print(f"\nmajority lost -> every agent stopped: {stopped:.1f} s")
    steps = _step_times(out)
    base = statistics.median(d for t, d in steps if t < second_kill)
    after = [d for t, d in steps if first_kill <= t < second_kill]
    assert after and max(after) < 2 * base, (base, sorted(after)[-5:])
