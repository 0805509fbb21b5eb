"""Training-step time with gradient clipping: what the norm adds to a DDP step.

A sibling of ``bench/test_ddp.py`` (same model, data and rank pool, from ``_ddp_common``): a
stack of ``Linear(1024, 1024) + ReLU`` layers, ~10.5M parameters, batch 64, SGD (the shape
follows ``FASTCOMM_BENCH_DDP_MLP`` too). Four providers:

- ``fastcomm`` / ``fastcomm-clip``: fastcomm DDP (shm on CPU, NCCL on a GPU) without and with
  ``model.clip_grad_norm_(1.0)`` after backward, which takes the norm from the sums of
  squares the unpack already produced;
- ``torch`` / ``torch-clip``: torch DDP without and with
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` (one more pass over every
  gradient).

2 CPU ranks with one intra-op thread each, or one rank on a GPU. Every timed round of one
provider is preceded (untimed) by a step of the provider before it, so they alternate. A
round's time is one training step as seen from the parent; ``extra_info`` holds the median
of the ranks' own step times (slowest rank per step) and, on the clipped providers, the
clipped/unclipped ratio and the median time of the clip call alone (timed on the ranks, so
less exposed to a busy machine than the step). The goal: ``fastcomm-clip`` costing what
``fastcomm`` costs. (Both clip calls scale the gradients in place when the norm is above
``MAX_NORM``; with this model and data it is not, and torch still multiplies by 1.0.)

Quick mode (``--benchmark-disable`` or ``FASTCOMM_BENCH_QUICK=1``): 4 layers of 256, a few
steps -- a smoke test that finishes in seconds.
"""

from __future__ import annotations

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

PROVIDERS = ["fastcomm", "fastcomm-clip", "torch", "torch-clip"]
MAX_NORM = 1.0
_MEDIANS: dict[str, float] = {}


# ---------------------------------------------------------------------- rank side
def setup_models(width: int, depth: int, batch: int, gpu: bool) -> int:
    from torch import nn

    from fastcomm.ddp import DDP
    from tests.harness import rank_comm

    device = init_rank(gpu)
    comm = rank_comm("nccl" if gpu else "shm")
    ours = DDP(build_mlp(width, depth, device), comm=comm)
    theirs = nn.parallel.DistributedDataParallel(
        build_mlp(width, depth, device), device_ids=[0] if gpu else None
    )
    models = {"fastcomm": ours, "fastcomm-clip": ours, "torch": theirs, "torch-clip": theirs}
    x, y = rank_batch(batch, width, device)
    STATE["health_bench"] = {
        "models": models,
        "opts": {
            "fastcomm": torch.optim.SGD(ours.parameters(), lr=1e-3),
            "torch": torch.optim.SGD(theirs.parameters(), lr=1e-3),
        },
        "x": x,
        "y": y,
        "times": {k: [] for k in PROVIDERS},
        "clip_times": {k: [] for k in PROVIDERS if k.endswith("-clip")},
        "sources": [],
        "gpu": gpu,
    }
    for name in PROVIDERS:  # warm-up: the first step also rebuilds the buckets
        for _ in range(2):
            train_step(name)
    for times in (*STATE["health_bench"]["times"].values(),
                  *STATE["health_bench"]["clip_times"].values()):
        times.clear()
    STATE["health_bench"]["sources"].clear()
    return sum(p.numel() for p in theirs.parameters())


def train_step(name: str) -> float:
    b = STATE["health_bench"]
    model, opt = b["models"][name], b["opts"][name.removesuffix("-clip")]
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(b["x"]), b["y"]).backward()
    clip_start = time.perf_counter()
    if name == "fastcomm-clip":
        model.clip_grad_norm_(MAX_NORM)
        b["sources"].append(model.reducer.health.last_norm_source)
    elif name == "torch-clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    if name.endswith("-clip"):
        if b["gpu"]:
            torch.cuda.synchronize()
        b["clip_times"][name].append(time.perf_counter() - clip_start)
    opt.step()
    if b["gpu"]:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    b["times"][name].append(elapsed)
    return elapsed


def collect() -> tuple[dict[str, list[float]], list[str], dict[str, list[float]]]:
    b = STATE["health_bench"]
    return b["times"], sorted(set(b["sources"])), b["clip_times"]


def teardown_models() -> None:
    STATE.pop("health_bench", None)


# ---------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def ranks(request):
    quick_mode = quick(request.config)
    width, depth = mlp_shape(quick_mode)
    with rank_pool() as pool:
        params = pool.run(setup_models, width, depth, BATCH, ON_GPU)[0]
        yield pool, params, quick_mode
        pool.run(teardown_models)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_clipped_train_step(benchmark, ranks, provider):
    pool, params, quick = ranks
    other = PROVIDERS[PROVIDERS.index(provider) - 1]
    rounds = 3 if quick else 30

    def step():
        return max(pool.run(train_step, provider))

    def alternate():
        pool.run(train_step, other)

    benchmark.pedantic(step, setup=alternate, rounds=rounds, iterations=1, warmup_rounds=1)
    results = pool.run(collect)
    median = slowest_rank_median([r[0][provider] for r in results])
    _MEDIANS[provider] = median
    device = "cuda" if ON_GPU else "cpu"
    benchmark.extra_info.update(
        provider=provider,
        params=params,
        ranks=pool.world_size,
        device=device,
        rank_median_step_ms=round(1e3 * median, 3),
    )
    if provider == "fastcomm-clip":
        # the norm must come from the unpack's sums or, where every .grad is its bucket's view
        # (shared buckets), from the flat buckets: never torch's fallback pass over the grads
        assert all(r[1] and set(r[1]) <= {"unpack", "buckets"} for r in results), results
    if provider.endswith("-clip"):
        base = _MEDIANS[provider.removesuffix("-clip")]
        # the clip call alone, timed on the ranks: far less exposed to machine noise
        clip = slowest_rank_median([r[2][provider] for r in results])
        benchmark.extra_info["ratio_clip_over_unclipped"] = round(median / base, 4)
        benchmark.extra_info["rank_median_clip_call_ms"] = round(1e3 * clip, 3)
        print(
            f"\n{provider} ({params / 1e6:.1f}M params, {pool.world_size} ranks, {device}): "
            f"{1e3 * base:.2f} ms unclipped, {1e3 * median:.2f} ms clipped, "
            f"ratio {median / base:.3f}; the clip call alone {1e3 * clip:.3f} ms"
        )
    if provider == "torch-clip":
        ratio = _MEDIANS["fastcomm-clip"] / median
        benchmark.extra_info["ratio_fastcomm_clip_over_torch_clip"] = round(ratio, 4)
        print(f"fastcomm-clip / torch-clip: {ratio:.3f}")
    assert median > 0
