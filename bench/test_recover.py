"""Losing a rank: ``fastcomm-run --recover in-process`` against the restart and torchft.

    PYTHONPATH=. python -m pytest bench/test_recover.py -q -s   # recover.json, recover.png
    PYTHONPATH=. python -m pytest bench/test_recover.py -q -s -k shrink  # recover_shrink.json

3 shm ranks under the real launcher train a 1.38M-parameter MLP (batch 64, SGD + momentum);
rank 1 SIGKILLs itself at step 20, inside its backward (before its last bucket launches) or
between steps. Figures: ms from the kill until every survivor completed a step without the
victim (the restarted job's first step under ``restart``), and steps lost (work thrown away:
under ``restart`` every step before the kill and the one in flight). torchft 0.2.0 runs the
same job from its own interpreter (``FASTCOMM_BENCH_TORCHFT_PYTHON``). Each scenario runs
``FASTCOMM_BENCH_RECOVER_REPEATS`` (3) times; the row is the median run's. The A/B cost when
nothing fails: two DDP models in the same 3 processes, recovery on and off, steps interleaved
(order swapped every step); the slowest rank's median step time of each. Quick mode
(``--benchmark-disable``, as the test suite runs it): one in-process loss, nothing written.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
STEPS, KILL_STEP, VICTIM = 30, 20, 1
REPEATS = int(os.environ.get("FASTCOMM_BENCH_RECOVER_REPEATS", "3"))
QUICK = bool(os.environ.get("FASTCOMM_BENCH_QUICK")) or "--benchmark-disable" in sys.argv

JOB = """
import json, os, signal, sys, time
import torch
from torch import nn
import fastcomm
from fastcomm.ddp import DDP

out, point, steps, kill_step, victim = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
comm = fastcomm.init(timeout=60)
me = comm.rank
log = open(os.path.join(out, f"steps_{me}_{attempt}.jsonl"), "w")
state = {"step": -1}

def kill():
    with open(os.path.join(out, "kill.json"), "w") as fh:
        json.dump({"time": time.time(), "step": state["step"], "point": point}, fh)
    os.kill(os.getpid(), signal.SIGKILL)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 256))
doomed = me == victim and attempt == 0
if doomed and point == "backward":  # before DDP's own hook: its last bucket never launches
    def hook(param):
        if state["step"] == kill_step:
            kill()
    model[0].weight.register_post_accumulate_grad_hook(hook)
ddp = DDP(model)
def changed(change):
    with open(os.path.join(out, f"change_{me}.json"), "w") as fh:
        json.dump({"seconds": change.seconds, "where": change.where,
                   "seen_at": change.seen_at,
                   "detected_by": getattr(change, "detected_by", "?"),
                   "detected_at": getattr(change, "detected_at", None),
                   "phases": dict(getattr(change, "phases", ()))}, fh)
ddp.on_membership_change(changed)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
gen = torch.Generator().manual_seed(me)
x, y = torch.randn(64, 64, generator=gen), torch.randn(64, 256, generator=gen)
for step in range(steps):
    state["step"] = step
    if doomed and point == "between" and step == kill_step:
        kill()
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    log.write(json.dumps([step, time.time(), ddp.world_size]) + "\\n")
    log.flush()
fastcomm.shutdown()
"""

AB_JOB = """
import json, os, sys, time
import torch
from torch import nn
import fastcomm
from fastcomm.ddp import DDP

out, steps = sys.argv[1], int(sys.argv[2])
comm = fastcomm.init(timeout=60)
def make(recover):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 256))
    os.environ["FASTCOMM_RECOVER"] = "in-process" if recover else ""
    ddp = DDP(model, comm=comm)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
models = {"off": make(False), "on": make(True)}
assert models["on"][0]._recovery is not None and models["off"][0]._recovery is None
gen = torch.Generator().manual_seed(comm.rank)
x, y = torch.randn(64, 64, generator=gen), torch.randn(64, 256, generator=gen)
times = {"off": [], "on": []}
for step in range(steps):
    order = ("off", "on") if step % 2 == 0 else ("on", "off")
    for name in order:
        ddp, opt = models[name]
        comm.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        times[name].append(time.perf_counter() - start)
with open(os.path.join(out, f"ab_{comm.rank}.json"), "w") as fh:
    json.dump(times, fh)
fastcomm.shutdown()
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "FASTCOMM_RECOVER")) and k not in (
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _launch(out: Path, body: str, flags: list[str], args: list) -> tuple[float, str]:
    path = out / "job.py"
    path.write_text(body)
    start = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastcomm.launch", "--nproc-per-node", "3", *flags, path,
         out, *map(str, args)],
        cwd=out, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        _, err = proc.communicate(timeout=300)
    except BaseException:  # a timeout, pytest's included: SIGTERM lets the launcher clean up
        proc.terminate()
        try:
            proc.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    assert proc.returncode == 0, err[-4000:]
    return start, err


def _records(out: Path) -> dict[tuple[int, int], list]:
    found = {}
    for path in out.glob("steps_*_*.jsonl"):
        _, rank, attempt = path.stem.split("_")
        found[(int(rank), int(attempt))] = [json.loads(line) for line in path.read_text()
                                            .splitlines() if line]
    return found


def _step_costs(survivors: list[list]) -> dict:
    """The survivors' healthy step (median of steps 5 to the kill, end to end, the slowest
    survivor's) and their step across the loss (from the end of the step before the kill to
    the end of the first step without the victim, the slowest survivor's), in ms."""
    healthy = max(statistics.median(b[1] - a[1] for a, b in zip(
        rows[4 : KILL_STEP - 1], rows[5:KILL_STEP], strict=True))
                  for rows in survivors)
    across = max(next(t for _, t, w in rows if w == 2) - rows[KILL_STEP - 1][1]
                 for rows in survivors)
    return {"healthy_step_ms": round(healthy * 1e3, 1), "loss_step_ms": round(across * 1e3, 1),
            "loss_cost_ms": round((across - healthy) * 1e3, 1)}


def measure_loss(out: Path, mode: str, point: str) -> dict:
    """One job under ``--recover mode``, rank 1 killed at step 20 (`point`); the figures."""
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--recover", "in-process"] if mode == "in-process" else ["--max-restarts", "1"]
    _launch(out, JOB, flags, [point, STEPS, KILL_STEP, VICTIM])
    kill = json.loads((out / "kill.json").read_text())
    records = _records(out)
    survivors = [r for r in range(3) if r != VICTIM]
    if mode == "in-process":
        after = [min(t for _, t, w in records[(r, 0)] if w == 2) for r in survivors]
        done = {r: [s for s, _, _ in records[(r, 0)]] for r in survivors}
        lost = max(len(d) - len(set(d)) for d in done.values())
        assert all(d == list(range(STEPS)) for d in done.values()), done
        sizes = [w for _, _, w in records[(survivors[0], 0)]]
        changes = [json.loads((out / f"change_{r}.json").read_text()) for r in survivors]
        extra = {"seen_ms": round((max(c["seen_at"] for c in changes) - kill["time"]) * 1e3, 1),
                 "rebuild_ms": round(max(c["seconds"] for c in changes) * 1e3, 1),
                 "failed_at": changes[0]["where"],
                 "detected_by": sorted({c.get("detected_by", "?") for c in changes}),
                 # the first survivor's wait that saw the loss (the recovery starts later,
                 # once its backward is over: seen_ms)
                 "detected_ms": round((min(c["detected_at"] for c in changes) - kill["time"])
                                      * 1e3, 1) if all(c.get("detected_at") for c in changes)
                 else None,
                 # each part of rebuild_ms, the slower survivor's
                 **{f"{name}_ms": round(max(c["phases"].get(name, 0.0) for c in changes) * 1e3,
                                        1) for name in ("agree", "successor", "replan")},
                 **_step_costs([records[(r, 0)] for r in survivors])}
    else:
        extra = {}
        after = [records[(r, 1)][0][1] for r in range(3)]
        # every step done before the kill is done again, and so is the one in flight
        lost = len(records[(VICTIM, 0)]) + (1 if point == "backward" else 0)
        sizes = [w for _, _, w in records[(0, 1)]]
    return {
        "mode": mode, "point": point, "kill_step": KILL_STEP,
        "kill_to_next_step_ms": round((max(after) - kill["time"]) * 1e3, 1),
        "steps_lost": lost, "world_sizes_after": sorted(set(sizes)), **extra,
    }


GROW_JOB = """
import json, os, signal, sys, time
import torch
from torch import nn
import fastcomm
from fastcomm.ddp import DDP

def process_start():
    with open("/proc/self/stat") as fh:
        ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as fh:
        boot = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")

imported = time.time()
out, kill_step, victim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
comm = fastcomm.init(timeout=60)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 256))
before_ddp = time.time()
ddp = DDP(model)
after_ddp = time.time()
me = ddp._recovery.membership.me
opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
ddp.register_state("opt", opt)
joined = [ddp.join_step or None]
ddp.on_membership_change(
    lambda c: joined.__setitem__(0, int(c.where.split()[1])) if c.where.startswith("join")
    else None)
gen = torch.Generator().manual_seed(me)
x, y = torch.randn(64, 64, generator=gen), torch.randn(64, 256, generator=gen)
step, first, deadline = ddp.join_step, None, time.monotonic() + 120
while joined[0] is None or step < joined[0] + 10:
    assert time.monotonic() < deadline, "no replacement joined"
    if me == victim and step == kill_step:
        with open(os.path.join(out, "kill.json"), "w") as fh:
            json.dump({"time": time.time()}, fh)
        os.kill(os.getpid(), signal.SIGKILL)
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    first = first or time.time()
    step += 1
if ddp.join_step:
    with open(os.path.join(out, "joiner.json"), "w") as fh:
        # a replacement started from a warm spare starts where the spare was handed its rank
        activated = os.environ.get("FASTCOMM_SPARE_ACTIVATED")
        json.dump({"start": float(activated) if activated else process_start(),
                   "spare": bool(activated), "imported": imported, "before_ddp": before_ddp,
                   "after_ddp": after_ddp, "first_step": first, "join_step": ddp.join_step,
                   "change_s": ddp._recovery.changes[-1].seconds if ddp._recovery.changes
                   else None}, fh)
fastcomm.shutdown()
"""


def measure_regrow(out: Path, spare: bool = True) -> dict:
    """Rank 1 killed at step 20, a replacement started (``--max-restarts 1``; from a warm
    spare, or cold with ``--no-spare``): from the replacement's process start (a warm spare's
    activation) to its first step, from the kill to it, and the step it joined at."""
    out.mkdir(parents=True, exist_ok=True)
    _launch(out, GROW_JOB, ["--recover", "in-process", "--max-restarts", "1",
                            *([] if spare else ["--no-spare"])], [KILL_STEP, VICTIM])
    joiner = json.loads((out / "joiner.json").read_text())
    start, kill = joiner["start"], json.loads((out / "kill.json").read_text())["time"]
    return {
        "joiner_start_to_first_step_s": round(joiner["first_step"] - start, 2),
        "kill_to_joiner_first_step_s": round(joiner["first_step"] - kill, 2),
        "spare": joiner["spare"],
        "imports_s": round(joiner["imported"] - start, 2),
        "init_and_model_s": round(joiner["before_ddp"] - joiner["imported"], 2),
        "ddp_join_s": round(joiner["after_ddp"] - joiner["before_ddp"], 2),
        "join_step": joiner["join_step"],
    }


TORCHFT_PYTHON = Path(os.environ.get("FASTCOMM_BENCH_TORCHFT_PYTHON",
                                     "/work/venv-torchft/bin/python"))
LIGHTHOUSE = """
import sys
from torchft.coordination import LighthouseServer
server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000,
                          quorum_tick_ms=20, heartbeat_timeout_ms=500)
print(server.address(), flush=True)
sys.stdin.read()
server.shutdown()
"""
TORCHFT_JOB = (Path(__file__).parent / "_torchft_replica.py")


def measure_torchft(out: Path) -> dict | None:
    """The same job on torchft 0.2.0 (its Lighthouse, Manager, DDP and Optimizer wrappers,
    ``ProcessGroupGloo``): 3 replicas of one process each, replica 1 SIGKILLed right before
    its step 20 (torchft's survivors crash on a kill inside a step). ``None`` where torchft's
    interpreter (``FASTCOMM_BENCH_TORCHFT_PYTHON``, a venv of its own) is missing."""
    if not TORCHFT_PYTHON.exists():
        return None
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    lighthouse = subprocess.Popen([TORCHFT_PYTHON, "-c", LIGHTHOUSE], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        address = lighthouse.stdout.readline().strip()
        replicas = [
            subprocess.Popen([TORCHFT_PYTHON, TORCHFT_JOB, out, address, str(r), str(STEPS),
                              str(KILL_STEP), str(VICTIM)], env=env, cwd=out,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for r in range(3)
        ]
        errors = [p.communicate(timeout=300)[1] for p in replicas]
    finally:
        lighthouse.stdin.close()
        lighthouse.wait(timeout=30)
    kill = json.loads((out / "kill.json").read_text())
    survivors = [r for r in range(3) if r != VICTIM]
    rows = {r: [json.loads(line) for line in (out / f"tft_{r}.jsonl").read_text().splitlines()]
            for r in survivors}
    for r in survivors:
        assert rows[r] and rows[r][-1][2] >= STEPS, errors[r][-3000:]
    # the first step committed without the victim (not one before the third replica joined)
    after = [min(t for s, t, now, n in rows[r] if n == 2 and now > s and t > kill["time"])
             for r in survivors]
    thrown = max(sum(1 for s, t, now, _ in rows[r] if t > kill["time"] and now == s)
                 for r in survivors)
    return {
        "mode": "torchft", "point": "between", "kill_step": KILL_STEP,
        "kill_to_next_step_ms": round((max(after) - kill["time"]) * 1e3, 1),
        "steps_lost": thrown,
        "world_sizes_after": sorted({n for r in survivors for _, _, _, n in rows[r]}),
    }


def measure_ab(out: Path, steps: int = 80) -> dict:
    """The interleaved A/B of the DDP step, recovery on against off, no failure."""
    out.mkdir(parents=True, exist_ok=True)
    _launch(out, AB_JOB, [], [steps])
    per_rank = [json.loads((out / f"ab_{r}.json").read_text()) for r in range(3)]
    warm = 5
    med = {name: max(statistics.median(t[name][warm:]) for t in per_rank)
           for name in ("off", "on")}
    # each step of one model next to the other's, paired: robust to the load drifting
    paired = statistics.median(
        statistics.median(b / a - 1 for a, b in zip(t["off"][warm:], t["on"][warm:],
                                                    strict=True))
        for t in per_rank
    )
    return {
        "steps": steps, "off_ms": round(med["off"] * 1e3, 3), "on_ms": round(med["on"] * 1e3, 3),
        "overhead_pct": round(100 * (med["on"] / med["off"] - 1), 2),
        "paired_overhead_pct": round(100 * paired, 2),
    }


def plot(result: dict, path: Path) -> Path | None:
    """Bar chart: kill -> next step (ms) and steps lost per mode and kill point."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["loss"]
    labels = [f"{r['mode']}\n{r['point']}" for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    ms = [r["kill_to_next_step_ms"] for r in rows]
    left.bar(labels, ms, color="tab:blue")
    left.set_ylabel("ms, SIGKILL -> survivors' next step")
    left.set_yscale("log")
    for k, value in enumerate(ms):
        left.annotate(f"{value:.0f}", (k, value), ha="center", va="bottom", fontsize=8)
    right.bar(labels, [r["steps_lost"] for r in rows], color="tab:red")
    right.set_ylabel("steps lost")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    ab = result["ab"]
    cost = ab.get("paired_overhead_pct", ab["overhead_pct"])
    title = (f"3 shm ranks, 1.38M MLP, rank 1 SIGKILLed at step {KILL_STEP}; recovery on costs "
             f"{cost:+.2f}% of the step (paired with off; {ab['on_ms']} vs {ab['off_ms']} ms)")
    grow = sorted(result.get("regrow", []), key=lambda r: r["joiner_start_to_first_step_s"])
    if grow:
        mid = grow[len(grow) // 2]
        title += (f"\na replacement's first step {mid['joiner_start_to_first_step_s']} s after "
                  f"its process started ({mid['imports_s']} s of it importing, "
                  f"{mid['ddp_join_s']} s in DDP() joining)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _median_row(runs: list[dict]) -> dict:
    """The row of the run with the median kill -> next step, with every run's figures."""
    ordered = sorted(runs, key=lambda r: r["kill_to_next_step_ms"])
    row = dict(ordered[len(ordered) // 2])
    row["runs_ms"] = [r["kill_to_next_step_ms"] for r in runs]
    row["runs_steps_lost"] = [r["steps_lost"] for r in runs]
    return row


@pytest.mark.timeout(1800)
def test_recover_quick(tmp_path):
    """Quick mode (``--benchmark-disable``, the test suite): one in-process loss in backward,
    checked, nothing written to bench/results."""
    if not QUICK:
        pytest.skip("the full benchmark is test_recover")
    row = measure_loss(tmp_path / "quick", "in-process", "backward")
    assert row["steps_lost"] == 0 and row["world_sizes_after"] == [2, 3], row


SHRINK_FIGURES = ("healthy_step_ms", "loss_step_ms", "loss_cost_ms", "seen_ms", "rebuild_ms",
                  "agree_ms", "successor_ms", "replan_ms")


@pytest.mark.timeout(1800)
def test_recover_shrink(tmp_path):
    """The in-place loss alone, in detail (``recover_shrink.json``): per kill point, the medians
    over the runs of the survivors' healthy step, their step across the loss, the loss seen
    after the kill, the new communicator after that, and how the loss was seen."""
    if QUICK:
        pytest.skip("quick mode runs test_recover_quick; the figures need the full run")
    result = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "repeats": REPEATS,
              "shrink": []}
    for point in ("backward", "between"):
        runs = [measure_loss(tmp_path / f"shrink-{point}-{k}", "in-process", point)
                for k in range(REPEATS)]
        row = {"point": point, "detected_by": sorted({d for r in runs for d in r["detected_by"]})}
        for name in SHRINK_FIGURES:
            row[name] = round(statistics.median(r[name] for r in runs), 1)
            row[f"runs_{name}"] = [r[name] for r in runs]
        result["shrink"].append(row)
        print(row)
        assert all(r["steps_lost"] == 0 for r in runs)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "recover_shrink.json").write_text(json.dumps(result, indent=1) + "\n")


@pytest.mark.timeout(1800)
def test_recover(tmp_path):
    if QUICK:
        pytest.skip("quick mode runs test_recover_quick; the figures need the full run")
    result = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "repeats": REPEATS,
              "loss": []}
    for mode in ("in-process", "restart"):
        for point in ("backward", "between"):
            runs = [measure_loss(tmp_path / f"{mode}-{point}-{k}", mode, point)
                    for k in range(REPEATS)]
            result["loss"].append(_median_row(runs))
            print(result["loss"][-1])
    runs = [measure_torchft(tmp_path / f"torchft-{k}") for k in range(REPEATS)]
    if runs[0] is None:
        print("torchft: not measured (no interpreter with torchft)")
    else:
        result["loss"].append(_median_row(runs))
        print(result["loss"][-1])
    result["regrow"] = [measure_regrow(tmp_path / f"regrow-{k}") for k in range(REPEATS)]
    print(result["regrow"])
    result["regrow_cold"] = [measure_regrow(tmp_path / f"regrow-cold-{k}", spare=False)
                             for k in range(REPEATS)]
    print(result["regrow_cold"])
    runs = [measure_ab(tmp_path / f"ab-{k}", steps=200) for k in range(REPEATS)]
    result["ab"] = sorted(runs, key=lambda r: r["paired_overhead_pct"])[len(runs) // 2]
    result["ab"]["runs_paired_overhead_pct"] = [r["paired_overhead_pct"] for r in runs]
    result["ab"]["runs_overhead_pct"] = [r["overhead_pct"] for r in runs]
    print(result["ab"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "recover.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, RESULTS / "recover.png")
    fast = [r for r in result["loss"] if r["mode"] == "in-process"]
    assert all(r["steps_lost"] == 0 for r in fast)
