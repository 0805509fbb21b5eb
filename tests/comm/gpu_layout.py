"""Can this machine run N NCCL ranks, and how: the decision shared by the multi-rank GPU tests.

Built on :func:`fastcomm.comm.world.nccl_fit`, the rule ``fastcomm.init()`` itself follows: a GPU
per rank where there are enough, else every rank on GPU 0, which NCCL accepts only from 2.30 on
with ``NCCL_MULTI_RANK_GPU_ENABLE=1``. Evaluated inside the tests (not at collection), so a CPU
machine never loads libnccl for it.
"""

from __future__ import annotations

import pytest

from fastcomm.comm import world

SHARED_GPU_ENV = {
    "NCCL_MULTI_RANK_GPU_ENABLE": "1",
    "NCCL_NVLS_ENABLE": "0",  # NVLink SHARP needs one GPU per rank
    "CUDA_VISIBLE_DEVICES": "0",
    "FASTCOMM_TEST_DEVICE": "0",  # tests.harness.rank_comm: every rank on device 0
}


def nccl_ranks_env(world_size: int) -> tuple[dict[str, str] | None, str]:
    """The environment under which ``world_size`` NCCL ranks run here, or ``None`` and why not.

    Returns:
        ``({}, reason)`` when each rank owns a GPU (rank ``r`` takes device ``r``),
        ``(SHARED_GPU_ENV, reason)`` when they must share GPU 0, ``(None, reason)`` when NCCL
        refuses that (or there is no GPU, or no loadable NCCL).
    """
    own = world.nccl_fit(world_size - 1, world_size, env={})
    if own.ok:
        return {}, own.reason
    if own.device_count == 0:
        return None, f"{world_size} NCCL ranks cannot run here: {own.reason}"
    shared = world.nccl_fit(world_size - 1, world_size, device_count=1, env=SHARED_GPU_ENV)
    if shared.ok:
        return dict(SHARED_GPU_ENV), shared.reason
    return None, f"{world_size} NCCL ranks cannot run here: {shared.reason}"


def nccl_ranks_env_or_skip(world_size: int) -> dict[str, str]:
    """:func:`nccl_ranks_env`, skipping the calling test (with the reason) where it cannot run."""
    env, reason = nccl_ranks_env(world_size)
    if env is None:
        pytest.skip(reason)
    return env
