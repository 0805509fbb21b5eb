"""What the DDP training-step benchmarks share (``test_ddp.py``, ``test_health.py``).

The model (a stack of ``Linear(width, width) + ReLU``), each rank's data, the rank pool (2 CPU
ranks with one intra-op thread each, or one rank on a GPU), quick mode, and the statistic every
figure is read from: the median over steps of the slowest rank's step time (a synchronized
step lasts as long as its slowest rank).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

import torch

from tests.harness import RankPool

ON_GPU = torch.cuda.is_available()
BATCH = 64
QUICK_SHAPE = (256, 4)  # width, depth: a smoke test that finishes in seconds


def quick(config) -> bool:
    """Quick mode: ``--benchmark-disable`` or ``FASTCOMM_BENCH_QUICK=1``."""
    return bool(os.environ.get("FASTCOMM_BENCH_QUICK")) or config.getoption("benchmark_disable")


def mlp_shape(quick_mode: bool) -> tuple[int, int]:
    """(width, depth) of the MLP: ``FASTCOMM_BENCH_DDP_MLP=WIDTHxDEPTH``, default 1024x10."""
    if quick_mode:
        return QUICK_SHAPE
    spec = os.environ.get("FASTCOMM_BENCH_DDP_MLP", "1024x10")
    try:
        width, depth = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise ValueError(
            f"FASTCOMM_BENCH_DDP_MLP={spec!r}; expected WIDTHxDEPTH, e.g. 512x6"
        ) from None
    return width, depth


def rank_pool() -> RankPool:
    """The benchmark's ranks: one on a GPU, else two CPU ranks (compiled kernels)."""
    if ON_GPU:
        env = {"CUDA_VISIBLE_DEVICES": "0", "FASTCOMM_TEST_DEVICE": "0"}
        return RankPool(1, env=env, timeout=300)
    return RankPool(2, env={"TRITON_INTERPRET": "0"}, timeout=300)


# ---------------------------------------------------------------------- rank side
def init_rank(gpu: bool) -> torch.device:
    """One intra-op thread (one rank per core) and torch's default group; the device."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if gpu else "gloo")
    return torch.device("cuda", 0) if gpu else torch.device("cpu")


def build_mlp(width: int, depth: int, device: torch.device) -> torch.nn.Module:
    """The benchmark MLP, with the same initial weights on every call."""
    from torch import nn

    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*layers).to(device)


def rank_batch(batch: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (input, target): rank ``r`` draws from seed ``r``."""
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    x = torch.randn(batch, width, generator=gen)
    y = torch.randn(batch, width, generator=gen)
    return x.to(device), y.to(device)


# ---------------------------------------------------------------------- pytest side
def slowest_rank_median(per_rank: Sequence[Sequence[float]]) -> float:
    """Median over steps of the slowest rank's time (``per_rank[r][i]``: rank r, step i)."""
    return statistics.median(max(ts) for ts in zip(*per_rank, strict=True))
