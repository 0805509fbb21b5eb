"""Fixtures shared by the communicator tests."""

from __future__ import annotations

import pytest
import torch

from tests.harness import RankPool

#: Every rank of a GPU test on GPU 0 (the transports' case: ranks sharing one GPU).
GPU_ENV = {"CUDA_VISIBLE_DEVICES": "0"}


@pytest.fixture(scope="module")
def gpu_pool():
    """2 ranks on GPU 0, started once per module; skips without CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with RankPool(2, env=GPU_ENV, timeout=300) as p:
        yield p
