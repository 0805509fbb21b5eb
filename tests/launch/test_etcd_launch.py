"""``fastcomm-run --rdzv-backend etcd`` on one machine: agents on 127.0.0.1, each a host of its
own to fastcomm (``FASTCOMM_HOST_ID``), a real 3-member etcd cluster on free ports
(tests/etcd_cluster.py). The workers' store is in etcd (``fastcomm.init()``,
``init_process_group`` and torch's own ``env://`` all work), the first node may be lost with a
restart or in place (and a node then joins, admitted by the lowest node left, its state from
the new rank 0), and a finished job leaves no key in etcd. Skipped without etcd (the install
command in the reason). The three nodes on separate networks: test_etcd_nodes.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from fastcomm.comm.etcd import EtcdClient
from tests.etcd_cluster import etcd_cluster_fixture

from ._util import LAUNCH, clean_env, finish, kill_all, script, start, wait_files, wait_gone

pytestmark = pytest.mark.timeout(150)
etcd3 = etcd_cluster_fixture(3)
HOST_ID = "FASTCOMM_HOST_ID"
# a liveness lease of 2 s (the heartbeat limit): shorter ones expire on a loaded 2-core machine
FAST = "keep_alive_interval=0.5,keep_alive_max_attempt=4"


def _flags(etcd, job: str, nnodes: str, *extra: str, conf: str = FAST) -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "etcd-v2",
            "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", job, "--monitor-interval", "0.05",
            "--rdzv-conf", conf, *extra]


def _keys(etcd, job: str) -> list[bytes]:
    """The keys of run id ``job`` in the cluster, its stores' receipts included (a finished job
    leaves none)."""
    client = EtcdClient(etcd.endpoints, timeout=10)
    try:
        return [kv.key for kv in client.get_prefix(f"fastcomm-run/{job}/")]
    finally:
        client.close()


# torch's backend through env:// (fastcomm imported: the store in etcd), fastcomm.init() on it,
# and torch's own env:// in a fresh interpreter that does not import fastcomm (worker rank 0
# serves MASTER_ADDR:MASTER_PORT, as under torchrun's etcd backend)
STORES = """
import json, os, subprocess, sys
import torch
import torch.distributed as dist
import fastcomm

out = sys.argv[1]
dist.init_process_group("fastcomm")
store = dist.distributed_c10d._get_default_store()
while isinstance(store, dist.PrefixStore):
    store = store.underlying_store
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
comm = fastcomm.init(timeout=60)
u = torch.tensor([comm.rank + 1.0])
comm.all_reduce(u)
plain = subprocess.run([sys.executable, "-c", (
    "import torch, torch.distributed as dist; dist.init_process_group('gloo'); "
    "t = torch.ones(1); dist.all_reduce(t); print(int(t.item()))")],
    capture_output=True, text=True, timeout=60)
with open(os.path.join(out, f"r{comm.rank}.json"), "w") as fh:
    json.dump({"store": type(store).__name__, "torch_sum": t.item(), "fastcomm_sum": u.item(),
               "plain": plain.stdout.strip() or plain.stderr[-2000:],
               "env": {k: os.environ.get(k) for k in ("FASTCOMM_STORE", "MASTER_ADDR",
                       "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "WORLD_SIZE")}}, fh)
fastcomm.shutdown()
dist.destroy_process_group()
"""


def test_the_job_store_is_in_etcd_and_nothing_is_left(etcd3, tmp_path):
    path = script(tmp_path, "stores.py", STORES)
    agents = [start([*_flags(etcd3, "stores", "2"), path, tmp_path], tmp_path,
                    clean_env(**{HOST_ID: f"h{i}"})) for i in range(2)]
    for agent in agents:
        result = finish(agent, timeout=120)
        assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    for row in rows:
        assert row["store"] == "EtcdStore" and row["plain"] == "2", row
        assert (row["torch_sum"], row["fastcomm_sum"]) == (3.0, 3.0), row
        env = row["env"]
        assert env["FASTCOMM_STORE"].startswith(f"etcd://{etcd3.endpoints}/fastcomm-run/stores/g")
        assert env["FASTCOMM_STORE"].endswith("/w0") and env["WORLD_SIZE"] == "2"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert rows[0]["env"] == rows[1]["env"]  # one store, one MASTER_ADDR:MASTER_PORT
    assert _keys(etcd3, "stores") == []  # the last agent out deleted them, receipts included


# attempt 0: every rank says where it runs and waits (a collective that never completes);
# attempt 1: the two left train a step's all_reduce and report
RESTART = """
import json, os, sys, time
out, attempt = sys.argv[1], os.environ["TORCHELASTIC_RESTART_COUNT"]
if attempt == "0":
    with open(os.path.join(out, "up_%s" % os.environ["RANK"]), "w") as fh:
        json.dump({"pid": os.getpid(), "host": os.environ["FASTCOMM_HOST_ID"]}, fh)
    time.sleep(60)
import torch, fastcomm
comm = fastcomm.init(timeout=60)
t = torch.ones(1)
comm.all_reduce(t)
with open(os.path.join(out, "done_%d.json" % comm.rank), "w") as fh:
    json.dump({k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK",
               "TORCHELASTIC_RESTART_COUNT", "FASTCOMM_HOST_ID")} | {"sum": t.item()}, fh)
fastcomm.shutdown()
"""


def _kill_node(agents: dict, up: dict) -> str:
    """SIGKILLs the agent and the worker of the node that runs rank 0; returns its host."""
    host = up["host"]
    agents[host].send_signal(signal.SIGKILL)
    kill_all([up["pid"]])
    agents[host].communicate()
    return host


def test_a_restart_goes_on_after_the_first_node_is_lost(etcd3, tmp_path):
    """No --recover: the node of rank 0 (group rank 0) is killed whole; the other two see its
    liveness lease expire, end the round, and restart the workers in round 1 without it,
    renumbered 0 and 1 (the rendezvous and the store were in etcd, not on that node)."""
    path = script(tmp_path, "restart.py", RESTART)
    flags = _flags(etcd3, "restart", "2:3", "--max-restarts", "1",
                   conf=f"{FAST},last_call_timeout=20")
    agents = {f"h{i}": start([*flags, path, tmp_path], tmp_path, clean_env(**{HOST_ID: f"h{i}"}))
              for i in range(3)}
    try:
        wait_files(tmp_path, "up_*", 3, timeout=90)
        first = json.loads((tmp_path / "up_0").read_text())
        lost = _kill_node(agents, first)
        results = {h: finish(a, timeout=120) for h, a in agents.items() if h != lost}
    finally:
        kill_all([a.pid for a in agents.values()])
    for result in results.values():
        assert result.returncode == 0, result.stderr[-4000:]
        assert "restarting the workers (restart 1 of 1)" in result.stderr, result.stderr[-3000:]
    assert any("was lost: no heartbeat from the agent of node 0: its liveness lease in etcd"
               in r.stderr for r in results.values())
    rows = [json.loads((tmp_path / f"done_{r}.json").read_text()) for r in range(2)]
    assert sorted(r["FASTCOMM_HOST_ID"] for r in rows) == sorted(results)
    for r in rows:
        assert (r["WORLD_SIZE"], r["TORCHELASTIC_RESTART_COUNT"], r["sum"]) == ("2", "1", 2.0)
        assert r["GROUP_RANK"] == r["RANK"]
    assert _keys(etcd3, "restart") == []


# --recover in-process, elastic: the ranks train until a joiner is in (4 members ever) and 5
# steps after its join; each writes its members, world size and parameters
REGROW = """
import json, os, sys, time
import torch
from torch import nn
import fastcomm
from fastcomm.ddp import DDP

out = sys.argv[1]
fastcomm.init(timeout=60)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
ddp = DDP(model)
membership = ddp._recovery.membership
me = membership.me
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
ddp.register_state("opt", opt)
joined = [ddp.join_step]
ddp.on_membership_change(
    lambda c: joined.__setitem__(0, int(c.where.split()[1])) if c.where.startswith("join")
    else None)
step, deadline = ddp.join_step, time.monotonic() + 100
while len(membership.identity) < 4 or ddp.world_size < 3 or step < joined[0] + 5:
    assert time.monotonic() < deadline, f"rank {me}: no node joined"
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1000 * me + step))
    opt.zero_grad(set_to_none=True)
    ddp(x).square().mean().backward()
    opt.step()
    step += 1
    if step == ddp.join_step + 3:
        with open(os.path.join(out, f"up_{me}"), "w") as fh:
            json.dump({"pid": os.getpid(), "host": os.environ["FASTCOMM_HOST_ID"]}, fh)
    time.sleep(0.02)
torch.save([p.detach() for p in model.parameters()], os.path.join(out, f"p{me}.pt"))
with open(os.path.join(out, f"r{me}.json"), "w") as fh:
    json.dump({"world_size": ddp.world_size, "rank": ddp.rank, "step": step,
               "members": membership.members, "join_step": ddp.join_step}, fh)
fastcomm.shutdown()
"""


def test_the_first_node_lost_in_place_then_a_node_joins(etcd3, tmp_path):
    """--recover in-process: the node of rank 0 is killed whole; the survivors (ranks 1, 2)
    shrink and renumber 0 and 1. A new node then asks the running round to admit it: group
    rank 0 is gone, so the lowest node left answers; its rank joins the running ranks at a step
    boundary with the state of the new rank 0 (original rank 1), and all three end equal."""
    import torch

    path = script(tmp_path, "regrow.py", REGROW)
    flags = _flags(etcd3, "regrow", "2:3", "--recover", "in-process",
                   conf=f"{FAST},last_call_timeout=20")
    env = clean_env(FASTCOMM_RECOVER_JOIN_EVERY="4")
    errs = {f"h{i}": tmp_path / f"h{i}.err" for i in range(3)}
    agents = {}
    for host, err in errs.items():
        with open(err, "w") as fh:  # read while they run: the loss must be absorbed first
            agents[host] = subprocess.Popen([*LAUNCH, *map(str, [*flags, path, tmp_path])],
                                            cwd=tmp_path, env={**env, HOST_ID: host},
                                            stdout=subprocess.DEVNULL, stderr=fh, text=True)
    try:
        wait_files(tmp_path, "up_*", 3, timeout=90)
        lost = _kill_node(agents, json.loads((tmp_path / "up_0").read_text()))
        deadline = time.monotonic() + 60
        while not any("its ranks 0 are lost" in e.read_text() for e in errs.values()):
            assert time.monotonic() < deadline, {h: e.read_text()[-2000:] for h, e in
                                                 errs.items()}
            time.sleep(0.05)
        late = finish(start([*flags, path, tmp_path], tmp_path, {**env, HOST_ID: "h3"}),
                      timeout=120)
        codes = {h: a.wait(timeout=60) for h, a in agents.items() if h != lost}
    finally:
        kill_all([a.pid for a in agents.values()])
    logs = {h: e.read_text() for h, e in errs.items()}
    assert late.returncode == 0 and codes == {h: 0 for h in codes}, (late.stderr[-3000:], logs)
    assert "[fastcomm-run node 3] joined the running round 0" in late.stderr
    # group rank 0 was lost: the node of group rank 1 admitted the joiner
    assert sum("node 3 joins the running round 0" in log for log in logs.values()) == 1, logs
    reports = {r: json.loads((tmp_path / f"r{r}.json").read_text()) for r in (1, 2, 3)}
    params = {r: torch.load(tmp_path / f"p{r}.pt") for r in (1, 2, 3)}
    for r, got in reports.items():
        assert got["world_size"] == 3 and got["members"] == [1, 2, 3], got
        assert got["step"] == reports[1]["step"] and got["rank"] == r - 1, got
        for a, b in zip(params[r], params[1], strict=True):
            assert torch.equal(a, b), f"rank {r} differs from the new rank 0"
    assert reports[3]["join_step"] > 0
    assert not wait_gone([json.loads((tmp_path / "up_0").read_text())["pid"]])
    assert _keys(etcd3, "regrow") == []


def test_a_stale_generation_is_swept_and_the_cluster_must_be_reachable(etcd3, tmp_path):
    """A run id whose earlier job died without cleaning up (its keys there, its lease gone):
    the next job of that id starts a generation of its own and deletes the old one's keys.
    An agent whose etcd cannot be reached says so after the join timeout."""
    client = EtcdClient(etcd3.endpoints, timeout=10)
    try:
        client.put("fastcomm-run/stale/g00000000000000aa/w0/fastcomm/lost/0", "x")
        client.put("fastcomm-run/stale/g00000000000000aa/rdzv.receipts/r", "1")
    finally:
        client.close()
    path = script(tmp_path, "ok.py", "print('ok', flush=True)\n")
    result = finish(start([*_flags(etcd3, "stale", "1"), path], tmp_path), timeout=60)
    assert result.returncode == 0, result.stderr
    assert "deleted 2 key(s) an earlier job of run id 'stale' left in etcd" in result.stderr
    assert _keys(etcd3, "stale") == []
    from tests.harness import free_port

    flags = ["--rdzv-backend", "etcd", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
             "--rdzv-conf", "join_timeout=2"]
    started = time.monotonic()
    result = finish(start([*flags, path], tmp_path), timeout=60)
    assert result.returncode == 1 and time.monotonic() - started < 30, result.stderr
    assert "could not use the etcd cluster at 127.0.0.1:" in result.stderr
    assert "within the join timeout (2 s)" in result.stderr and "ok" not in result.stdout
