"""Losing a node under ``fastcomm-run --rdzv-backend etcd``, and the rendezvous on etcd against
c10d.

    PYTHONPATH=. python -m pytest bench/test_etcd_launch.py -q -s   # etcd_*.json

Power-off: three namespaced nodes (``tests/launch/_nodes.py``: root and ``ip netns``), an etcd
member on each, one rank each training a 0.27M-parameter MLP with ``--recover in-process``,
heartbeat limit 2 s (0.5 s x 4); the node of rank 0 (the first node: group rank 0) or of rank
1 is powered off mid-backward (its link down, every process killed, its etcd member too). The
figure: seconds from the power-off to the survivors' next completed step
(``tests/launch/test_etcd_nodes.py``'s ``power_off``). Rendezvous: three agents on 127.0.0.1
started at once (``--nnodes 3``, a script that only writes the time), on etcd (a 3-member
cluster on 127.0.0.1) and on c10d (the ``TCPStore`` of the agent that binds the port first).
The figures: the agents' ``RENDEZVOUS`` events (torch's: joining the round until it closes
and its ranks are known): the last agent to join (the protocol's own cost: it finds the others
there) and the first (who also waits for the others to start), and from starting the agents to
the last worker running. Each power-off runs ``FASTCOMM_BENCH_ETCD_REPEATS`` (3) times, each
rendezvous 3 x as many; a row is the median run's, with every run's figure. Results:
``bench/results/etcd_power_off.json``, ``etcd_rendezvous.json``.
Steady step: the same DDP training (2 ranks on 127.0.0.1, shm, ``--recover in-process``, so
the liveness watch polls the store) launched on etcd and on c10d, alternating, the median step
of each run after its first 30: nothing on the step's path touches the store.
Result: ``etcd_step.json``.
Quick mode (``--benchmark-disable``, as the test suite runs it): one rendezvous and one short
training on etcd, nothing written (the power-off runs in ``tests/launch/test_etcd_nodes.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
REPEATS = int(os.environ.get("FASTCOMM_BENCH_ETCD_REPEATS", "3"))
QUICK = bool(os.environ.get("FASTCOMM_BENCH_QUICK")) or "--benchmark-disable" in sys.argv
NO_ETCD = shutil.which("etcd") is None

STARTED = """
import json, os, sys, time
with open(os.path.join(sys.argv[1], "w%s.json" % os.environ["RANK"]), "w") as fh:
    json.dump({"time": time.time()}, fh)
"""


def _env() -> dict[str, str]:
    sys.path.insert(0, str(REPO))
    from tests.launch._util import clean_env

    return clean_env()


def measure_rendezvous(out: Path, backend: str, etcd=None) -> dict:
    """Three agents of a 3-node job started at once on ``backend``: the last and the first
    agent's ``RENDEZVOUS`` (ms), and from their start to the last worker running (ms)."""
    from tests.harness import free_port

    out.mkdir(parents=True, exist_ok=True)
    path = out / "started.py"
    path.write_text(STARTED)
    endpoint = etcd.endpoints if backend == "etcd" else f"127.0.0.1:{free_port()}"
    flags = ["--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", backend,
             "--rdzv-endpoint", endpoint, "--rdzv-id", f"rdzv-{out.name}",
             "--monitor-interval", "0.05", "--event-log-handler", "console"]
    start = time.time()
    agents = [subprocess.Popen([sys.executable, "-m", "fastcomm.launch", *flags, str(path),
                                str(out)], cwd=out, env=_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True) for _ in range(3)]
    errs = []
    try:
        for agent in agents:
            errs.append(agent.communicate(timeout=120)[1])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()
    rendezvous = []
    for agent, err in zip(agents, errs, strict=True):
        assert agent.returncode == 0, err[-3000:]
        for line in err.splitlines():
            if line.startswith("{") and ".RENDEZVOUS" in line:
                rendezvous.append(float(json.loads(line)["metadata"]["duration_ms"]))
    started = max(json.loads((out / f"w{r}.json").read_text())["time"] for r in range(3))
    return {"backend": backend, "last_agent_ms": round(min(rendezvous), 1),
            "first_agent_ms": round(max(rendezvous), 1),
            "start_to_workers_ms": round((started - start) * 1e3, 1)}


STEPS = """
import json, os, statistics, sys, time
import torch
import fastcomm
from fastcomm.ddp import DDP

torch.set_num_threads(1)
comm = fastcomm.init(backend="shm")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]), comm=comm,
            bucket_cap_mb=0.25)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 256)
times = []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    times.append(time.perf_counter() - start)
if comm.rank == 0:
    with open(os.path.join(sys.argv[1], "steps.json"), "w") as fh:
        json.dump({"median_ms": statistics.median(times[30:]) * 1e3}, fh)
fastcomm.shutdown()
"""


def measure_step(out: Path, backend: str, etcd, steps: int = 400) -> float:
    """The median DDP step (ms) of 2 ranks launched with ``backend`` (see the docstring)."""
    from tests.harness import free_port

    out.mkdir(parents=True, exist_ok=True)
    path = out / "steps.py"
    path.write_text(STEPS)
    endpoint = etcd.endpoints if backend == "etcd" else f"127.0.0.1:{free_port()}"
    flags = ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", backend,
             "--rdzv-endpoint", endpoint, "--rdzv-id", f"step-{out.name}",
             "--recover", "in-process"]
    run = subprocess.run([sys.executable, "-m", "fastcomm.launch", *flags, str(path), str(out),
                          str(steps)], cwd=out, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "steps.json").read_text())["median_ms"]


def measure_power_off(nodes, name: str, victim: int) -> dict:
    """One power-off of the node of rank ``victim`` (0: the first node); its figures."""
    from tests.launch.test_etcd_nodes import power_off

    nodes.etcd_up()
    run = power_off(nodes, name, victim)
    reports = run["reports"]
    assert all(r["done"] == reports[run["survivors"][0]]["done"] for r in reports.values())
    return {"victim_rank": victim, "node": f"node{run['lost']}",
            "power_off_to_next_step_s": round(run["resumed"], 3),
            "shrink_s": round(max(r["changes"][0][2] for r in reports.values()), 3)}


def _median_row(runs: list[dict], key: str) -> dict:
    ordered = sorted(runs, key=lambda r: r[key])
    row = dict(ordered[len(ordered) // 2])
    row["runs"] = [r[key] for r in runs]
    return row


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    if NO_ETCD:
        from tests.etcd_cluster import INSTALL

        pytest.skip(f"needs the etcd server: {INSTALL}")
    from tests.etcd_cluster import EtcdCluster

    with EtcdCluster(3, str(tmp_path_factory.mktemp("etcd"))) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    sys.path.insert(0, str(REPO))
    from tests.launch._nodes import Nodes, why_not
    from tests.launch.test_etcd_nodes import TRAIN

    reason = why_not()
    if reason is not None or NO_ETCD:
        pytest.skip(reason or "needs the etcd server")
    shared = tmp_path_factory.mktemp("bench_nodes")
    shared.chmod(0o755)
    made = Nodes(shared, count=3)
    try:
        made.build()
        (shared / "secret").write_text("three-nodes-secret\n")
        (shared / "train.py").write_text(TRAIN.lstrip())
        made.etcd_up()
        yield made
    finally:
        made.remove()


@pytest.mark.timeout(600)
def test_etcd_launch_quick(etcd, tmp_path):
    """Quick mode: one rendezvous and one short training on etcd (c10d's run in the launcher's
    tests); checked, nothing written."""
    if not QUICK:
        pytest.skip("the full benchmark is test_etcd_launch")
    got = measure_rendezvous(tmp_path / "etcd", "etcd", etcd)
    assert 0 < got["last_agent_ms"] <= got["first_agent_ms"], got
    assert measure_step(tmp_path / "step-etcd", "etcd", etcd, steps=40) > 0


def _write(name: str, result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / name).write_text(json.dumps(result, indent=1) + "\n")


@pytest.mark.timeout(3600)
def test_etcd_power_off(nodes, tmp_path):
    """The first node's power-off against another's: to the survivors' next step."""
    if QUICK:
        pytest.skip("quick mode runs test_etcd_launch_quick; the figures need the full run")
    result = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "repeats": REPEATS,
              "heartbeat_limit_s": 2.0, "power_off": []}
    for victim in (0, 1):
        runs = [measure_power_off(nodes, f"off{victim}-{k}", victim) for k in range(REPEATS)]
        result["power_off"].append(_median_row(runs, "power_off_to_next_step_s"))
        print(result["power_off"][-1])
    _write("etcd_power_off.json", result)


@pytest.mark.timeout(3600)
def test_etcd_rendezvous(etcd, tmp_path):
    """The rendezvous of a 3-node job on etcd against c10d."""
    if QUICK:
        pytest.skip("quick mode runs test_etcd_launch_quick; the figures need the full run")
    repeats = 3 * REPEATS
    result = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "repeats": repeats,
              "rendezvous": []}
    for backend in ("etcd", "c10d"):
        runs = [measure_rendezvous(tmp_path / f"{backend}{k}", backend, etcd)
                for k in range(repeats)]
        row = _median_row(runs, "last_agent_ms")
        for key in ("first_agent_ms", "start_to_workers_ms"):
            row[f"{key}_runs"] = [r[key] for r in runs]
            row[key] = statistics.median(row[f"{key}_runs"])
        result["rendezvous"].append(row)
        print(row)
    _write("etcd_rendezvous.json", result)


@pytest.mark.timeout(3600)
def test_etcd_step(etcd, tmp_path):
    """The DDP step of a job launched on etcd against c10d (alternating runs)."""
    if QUICK:
        pytest.skip("quick mode runs test_etcd_launch_quick; the figures need the full run")
    runs: dict[str, list[float]] = {"etcd": [], "c10d": []}
    for k in range(2 * REPEATS):
        for backend in (("etcd", "c10d") if k % 2 == 0 else ("c10d", "etcd")):
            runs[backend].append(round(measure_step(tmp_path / f"{backend}{k}", backend, etcd),
                                       3))
    etcd_ms, c10d_ms = (statistics.median(runs[b]) for b in ("etcd", "c10d"))
    result = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "repeats": 2 * REPEATS,
              "ranks": 2, "model": "6 x Linear(256, 256), batch 32, shm, --recover in-process",
              "etcd_step_ms": etcd_ms, "c10d_step_ms": c10d_ms,
              "etcd_over_c10d": round(etcd_ms / c10d_ms, 3), "runs": runs}
    print(result)
    _write("etcd_step.json", result)
