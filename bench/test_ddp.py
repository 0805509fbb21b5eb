"""Training-step time: fastcomm DDP against torch DDP and against no DDP at all, same data.

Three groups of providers, every one a model of its own in the same 2 rank processes:

- ``test_ddp_train_step``: a stack of ``Linear(width, width) + ReLU`` layers (default 10 x
  1024, ~10.5M parameters, 42 MB of fp32 gradients; ``FASTCOMM_BENCH_DDP_MLP=512x6`` gives
  the 6.3 MB model of the host-cost measurements), batch 64, SGD. Providers: ``no-comm`` (the
  same step without DDP: the limit), ``fastcomm-shm`` (fastcomm DDP on the shared-memory
  communicator, as a drop-in user on one host gets it: shared buckets reduced in place),
  ``fastcomm-shm-staged`` (the same with ``shared_buckets=False``: the path before shared
  buckets, for the A/B), ``fastcomm-gloo`` (on fastcomm's Gloo communicator) and ``torch``
  (torch DDP on its Gloo group). Each rank also reports the bytes its shared reductions moved
  per gradient byte (``extra_info["shared_bytes_per_gradient_byte"]``).
- ``test_ddp_dropin_step``: the drop-in user, ``fastcomm.ddp.DDP(model,
  process_group=<torch's Gloo group>, bucket_cap_mb=cap)`` against torch DDP at the same cap,
  for caps of 0.25, 1 and 25 MiB.
- ``test_ddp_tiny_params_step``: 200 x ``Linear(16, 16)`` (400 tiny parameters: the
  per-parameter host cost), fastcomm DDP on shm against torch DDP on Gloo and no DDP.

2 CPU ranks with one intra-op thread each; on a GPU, one rank, ``fastcomm-nccl`` against torch
over NCCL and no DDP (the other groups are CPU-only); model, data and pool in ``_ddp_common``.
Every timed round of a provider is preceded (untimed, in ``setup``) by a step of the provider
before it in its group. A round's time is one training step as seen from the parent
(``pool.run`` round trip included, ~1 ms); ``extra_info`` also holds the median of the ranks'
own step times (a step lasts as long as its slowest rank) and the median CPU time a rank's
process spends per step (every thread: compute, communication and polling; on a shared machine
it stays put while wall times swing). The ratios (to torch DDP at the same bucket cap, and to
no DDP) come from a separate run on the group's last provider in which every round steps each
provider once, a barrier before each step: the per-provider rounds are minutes apart on a long
run, the interleaved steps seconds apart.

Quick mode (``--benchmark-disable`` or ``FASTCOMM_BENCH_QUICK=1``): 4 layers of 256, a few
steps -- a smoke test that finishes in seconds.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from _ddp_common import (
    BATCH,
    ON_GPU,
    build_mlp,
    init_rank,
    mlp_shape,
    quick,
    rank_batch,
    rank_pool,
    slowest_rank_median,
)

from tests.harness import STATE

CAPS = (0.25, 1, 25)  # bucket_cap_mb of the drop-in group
_MEDIANS: dict[str, float] = {}
_CPU: dict[str, float] = {}


# ---------------------------------------------------------------------- rank side
def setup_models(width: int, depth: int, batch: int, gpu: bool) -> int:
    import torch.distributed as dist
    from torch import nn

    from fastcomm.ddp import DDP
    from tests.harness import rank_comm

    device = init_rank(gpu)

    def mlp():
        return build_mlp(width, depth, device)

    def tiny():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(16, 16) for _ in range(200)])

    def torch_ddp(model, **kwargs):
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[0] if gpu else None, **kwargs
        )

    models = {"no-comm": mlp()}
    if gpu:
        models["fastcomm-nccl"] = DDP(mlp(), comm=rank_comm("nccl"))
    else:
        models["fastcomm-shm"] = DDP(mlp(), comm=rank_comm("shm"))
        # the same communicator without shared buckets: the path before them (A/B)
        models["fastcomm-shm-staged"] = DDP(mlp(), comm=rank_comm("shm"), shared_buckets=False)
        models["fastcomm-gloo"] = DDP(mlp(), comm=rank_comm("gloo"))
    models["torch"] = torch_ddp(mlp())
    if not gpu:
        for cap in CAPS:
            models[f"fastcomm-dropin-{cap}"] = DDP(
                mlp(), process_group=dist.group.WORLD, bucket_cap_mb=cap
            )
            models[f"torch-{cap}"] = torch_ddp(mlp(), bucket_cap_mb=cap)
        models["tiny-no-comm"] = tiny()
        models["tiny-fastcomm-shm"] = DDP(tiny(), comm=rank_comm("shm"))
        models["tiny-fastcomm-shm-staged"] = DDP(
            tiny(), comm=rank_comm("shm"), shared_buckets=False
        )
        models["tiny-torch"] = torch_ddp(tiny())
    inputs = {"mlp": rank_batch(batch, width, device), "tiny": rank_batch(batch, 16, device)}
    STATE["bench"] = {
        "models": models,
        "opts": {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()},
        "inputs": {k: inputs["tiny" if k.startswith("tiny") else "mlp"] for k in models},
        "times": {k: [] for k in models},
        "cpu": {k: [] for k in models},
        "gpu": gpu,
    }
    for name in models:  # warm-up: the first step also rebuilds the buckets
        for _ in range(2):
            train_step(name)
    _clear_times()
    return sum(p.numel() for p in models["torch"].parameters())


def _clear_times() -> None:
    for times in (*STATE["bench"]["times"].values(), *STATE["bench"]["cpu"].values()):
        times.clear()


def train_step(name: str) -> float:
    b = STATE["bench"]
    model, opt, (x, y) = b["models"][name], b["opts"][name], b["inputs"][name]
    start, cpu_start = time.perf_counter(), time.process_time()
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if b["gpu"]:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    b["times"][name].append(elapsed)
    b["cpu"][name].append(time.process_time() - cpu_start)
    return elapsed


def collect_times() -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    return STATE["bench"]["times"], STATE["bench"]["cpu"]


def interleaved_steps(group: list[str], rounds: int):
    """`rounds` rounds of one step of every provider of `group` in turn, each step started by
    a barrier (both ranks start together); the (times, CPU times) of those steps alone."""
    import torch.distributed as dist

    _clear_times()
    for _ in range(rounds):
        for name in group:
            dist.barrier()
            train_step(name)
    times, cpu = collect_times()
    result = {k: list(times[k]) for k in group}, {k: list(cpu[k]) for k in group}
    _clear_times()
    return result


def shared_traffic(name: str) -> dict[str, float] | None:
    """Bytes the shared reductions of model `name` moved per gradient byte (None: not shared)."""
    shared = getattr(getattr(STATE["bench"]["models"][name], "reducer", None), "shared", None)
    return None if shared is None else shared.stats.per_gradient_byte()


def teardown_models() -> None:
    STATE.pop("bench", None)


# ---------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def ranks(request):
    quick_mode = quick(request.config)
    width, depth = mlp_shape(quick_mode)
    with rank_pool() as pool:
        params = pool.run(setup_models, width, depth, BATCH, ON_GPU)[0]
        yield pool, params, quick_mode
        pool.run(teardown_models)


MAIN = ["no-comm", "fastcomm-nccl", "torch"] if ON_GPU else [
    "no-comm", "fastcomm-shm", "fastcomm-shm-staged", "fastcomm-gloo", "torch"
]
DROPIN = [name for cap in CAPS for name in (f"fastcomm-dropin-{cap}", f"torch-{cap}")]
TINY = ["tiny-no-comm", "tiny-fastcomm-shm", "tiny-fastcomm-shm-staged", "tiny-torch"]
# each fastcomm provider's reference: torch DDP with the same bucket cap
REFERENCE = {
    **{name: "torch" for name in MAIN if name.startswith("fastcomm")},
    **{f"fastcomm-dropin-{cap}": f"torch-{cap}" for cap in CAPS},
    "tiny-fastcomm-shm": "tiny-torch",
    "tiny-fastcomm-shm-staged": "tiny-torch",
}
NO_COMM = {name: "no-comm" for name in MAIN if name != "no-comm"}
NO_COMM.update({name: "tiny-no-comm" for name in TINY if name != "tiny-no-comm"})


def _measure(benchmark, ranks, group: list[str], provider: str) -> None:
    pool, params, quick_mode = ranks
    # every timed round follows an untimed step of the provider before it
    other = group[group.index(provider) - 1]
    rounds = 3 if quick_mode else 30

    def step():
        return max(pool.run(train_step, provider))

    def alternate():
        pool.run(train_step, other)

    benchmark.pedantic(step, setup=alternate, rounds=rounds, iterations=1, warmup_rounds=1)
    collected = pool.run(collect_times)
    pool.run(_clear_times)
    median = slowest_rank_median([t[provider] for t, _ in collected])
    cpu = statistics.median(c for _, cpus in collected for c in cpus[provider])
    device = "cuda" if ON_GPU else "cpu"
    benchmark.extra_info.update(
        provider=provider,
        params=params,
        ranks=pool.world_size,
        device=device,
        rank_median_step_ms=round(1e3 * median, 3),
        rank_median_cpu_ms=round(1e3 * cpu, 3),
    )
    traffic = pool.run(shared_traffic, provider)[0] if provider.startswith("fastcomm") else None
    if traffic is not None:
        benchmark.extra_info["shared_bytes_per_gradient_byte"] = {
            k: round(v, 3) for k, v in traffic.items()
        }
    assert median > 0
    if provider == group[-1]:
        _report_interleaved(benchmark, pool, group, 2 if quick_mode else 15, device)


def _report_interleaved(benchmark, pool, group: list[str], rounds: int, device: str) -> None:
    """The group's ratios, from steps of all its providers interleaved round by round.

    The per-provider rounds above run one provider after another, minutes apart on a long
    run; on a shared machine the load changes in between. Here every round steps each
    provider once, so each ratio compares steps taken seconds apart.
    """
    collected = pool.run(interleaved_steps, group, rounds)
    for name in group:
        _MEDIANS[name] = slowest_rank_median([t[name] for t, _ in collected])
        _CPU[name] = statistics.median(c for _, cpus in collected for c in cpus[name])
    # read by bench/plot.py in preference to the per-provider medians
    benchmark.extra_info["interleaved_median_step_ms"] = {
        name: round(1e3 * _MEDIANS[name], 3) for name in group
    }
    for name in group:
        for label, ref in (("torch", REFERENCE.get(name)), ("no_comm", NO_COMM.get(name))):
            if ref is None or ref not in _MEDIANS:
                continue
            ratio = _MEDIANS[name] / _MEDIANS[ref]
            cpu_ratio = _CPU[name] / _CPU[ref]
            benchmark.extra_info[f"ratio_{name}_over_{label}"] = round(ratio, 4)
            benchmark.extra_info[f"cpu_ratio_{name}_over_{label}"] = round(cpu_ratio, 4)
            print(
                f"\nDDP step ({device}, {pool.world_size} ranks, {rounds} interleaved rounds): "
                f"{name} {1e3 * _MEDIANS[name]:.2f} ms, {ref} {1e3 * _MEDIANS[ref]:.2f} ms, "
                f"ratio {ratio:.3f}; CPU per rank {1e3 * _CPU[name]:.2f} ms against "
                f"{1e3 * _CPU[ref]:.2f} ms (ratio {cpu_ratio:.3f})"
            )


@pytest.mark.parametrize("provider", MAIN)
def test_ddp_train_step(benchmark, ranks, provider):
    _measure(benchmark, ranks, MAIN, provider)


@pytest.mark.skipif(ON_GPU, reason="the drop-in group is torch's Gloo group on CPU")
@pytest.mark.parametrize("provider", DROPIN)
def test_ddp_dropin_step(benchmark, ranks, provider):
    _measure(benchmark, ranks, DROPIN, provider)


@pytest.mark.skipif(ON_GPU, reason="CPU ranks: shm against torch DDP on Gloo")
@pytest.mark.parametrize("provider", TINY)
def test_ddp_tiny_params_step(benchmark, ranks, provider):
    _measure(benchmark, ranks, TINY, provider)
