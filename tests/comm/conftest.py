"""Fixtures shared by the communicator tests."""

from __future__ import annotations

from tests.harness import pool_fixture

#: Every rank of a GPU test on GPU 0 (the transports' case: ranks sharing one GPU).
GPU_ENV = {"CUDA_VISIBLE_DEVICES": "0"}


# 2 ranks on GPU 0, started once per module; skips without CUDA.
gpu_pool = pool_fixture(2, env=GPU_ENV, timeout=300, needs_cuda=True)
