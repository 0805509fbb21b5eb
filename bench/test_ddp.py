"""Training-step time: fastcomm DDP against torch DDP on the same model, same data.

Model: a stack of ``Linear(1024, 1024) + ReLU`` layers, ~10.5M parameters (42 MB of fp32
gradients: a 1 MiB first bucket, a 25 MiB one and the rest after the rebuild), batch 64,
SGD. Providers: ``fastcomm-shm`` and ``fastcomm-gloo`` (fastcomm DDP on the shared-memory and
the Gloo communicator) and ``torch`` (torch DDP on its Gloo group), 2 CPU ranks with one
intra-op thread each (this machine has 2 cores); on a GPU, one rank, ``fastcomm-nccl`` against
torch over NCCL. All models live in the same rank processes; every timed round of one provider
is preceded (untimed, in ``setup``) by a step of the provider before it, so they alternate and
see the same machine. A round's time is one training step as seen from the parent
(``pool.run`` round trip included, ~1 ms); ``extra_info`` also holds the median of the ranks'
own step times and, on ``torch``, each fastcomm provider's ratio to it.

Quick mode (``--benchmark-disable`` or ``FASTCOMM_BENCH_QUICK=1``): 4 layers of 256, a few
steps -- a smoke test that finishes in seconds.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from tests.harness import STATE, RankPool

ON_GPU = torch.cuda.is_available()
_MEDIANS: dict[str, float] = {}


def _quick(config) -> bool:
    return bool(os.environ.get("FASTCOMM_BENCH_QUICK")) or config.getoption("benchmark_disable")


# ---------------------------------------------------------------------- rank side
def setup_models(width: int, depth: int, batch: int, gpu: bool) -> int:
    import torch.distributed as dist
    from torch import nn

    from fastcomm.ddp import DDP

    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if gpu else "gloo")
    comm = None
    if gpu:
        from tests.harness import rank_comm

        comm = rank_comm("nccl")

    def build():
        torch.manual_seed(0)
        layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
        return nn.Sequential(*layers).to(device)

    if gpu:
        models = {"fastcomm-nccl": DDP(build(), comm=comm)}
    else:
        from tests.harness import rank_comm

        models = {
            "fastcomm-shm": DDP(build(), comm=rank_comm("shm")),
            "fastcomm-gloo": DDP(build(), comm=rank_comm("gloo")),
        }
    models["torch"] = nn.parallel.DistributedDataParallel(
        build(), device_ids=[0] if gpu else None
    )
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    STATE["bench"] = {
        "models": models,
        "opts": {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()},
        "x": torch.randn(batch, width, generator=gen).to(device),
        "y": torch.randn(batch, width, generator=gen).to(device),
        "times": {k: [] for k in models},
        "gpu": gpu,
    }
    for name in models:  # warm-up: the first step also rebuilds the buckets
        for _ in range(2):
            train_step(name)
    for times in STATE["bench"]["times"].values():
        times.clear()
    return sum(p.numel() for p in models["torch"].parameters())


def train_step(name: str) -> float:
    b = STATE["bench"]
    model, opt = b["models"][name], b["opts"][name]
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(b["x"]), b["y"]).backward()
    opt.step()
    if b["gpu"]:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    b["times"][name].append(elapsed)
    return elapsed


def collect_times() -> dict[str, list[float]]:
    return STATE["bench"]["times"]


def teardown_models() -> None:
    STATE.pop("bench", None)


# ---------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def ranks(request):
    quick = _quick(request.config)
    width, depth = (256, 4) if quick else (1024, 10)
    if ON_GPU:
        env = {"CUDA_VISIBLE_DEVICES": "0", "FASTCOMM_TEST_DEVICE": "0"}
        pool = RankPool(1, env=env, timeout=300)
    else:
        pool = RankPool(2, env={"TRITON_INTERPRET": "0"}, timeout=300)
    with pool:
        params = pool.run(setup_models, width, depth, 64, ON_GPU)[0]
        yield pool, params, quick
        pool.run(teardown_models)


PROVIDERS = ["fastcomm-nccl", "torch"] if ON_GPU else ["fastcomm-shm", "fastcomm-gloo", "torch"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_ddp_train_step(benchmark, ranks, provider):
    pool, params, quick = ranks
    # every timed round follows an untimed step of the provider before it, so the providers
    # alternate and see the same machine
    other = PROVIDERS[PROVIDERS.index(provider) - 1]
    rounds = 3 if quick else 30

    def step():
        return max(pool.run(train_step, provider))

    def alternate():
        pool.run(train_step, other)

    benchmark.pedantic(step, setup=alternate, rounds=rounds, iterations=1, warmup_rounds=1)
    times = pool.run(collect_times)
    # a step takes as long as its slowest rank
    per_step = [max(ts) for ts in zip(*(t[provider] for t in times), strict=True)]
    median = statistics.median(per_step)
    _MEDIANS[provider] = median
    benchmark.extra_info.update(
        provider=provider,
        params=params,
        ranks=pool.world_size,
        device="cuda" if ON_GPU else "cpu",
        rank_median_step_ms=round(1e3 * median, 3),
    )
    if provider == "torch":
        device = "cuda" if ON_GPU else "cpu"
        for name in PROVIDERS[:-1]:
            ratio = _MEDIANS[name] / median
            benchmark.extra_info[f"ratio_{name}_over_torch"] = round(ratio, 4)
            print(
                f"\nDDP step ({params / 1e6:.1f}M params, {pool.world_size} ranks, {device}): "
                f"{name} {1e3 * _MEDIANS[name]:.1f} ms, torch {1e3 * median:.1f} ms, "
                f"ratio {ratio:.3f}"
            )
    assert median > 0
