"""fastcomm DDP against torch DDP on a GPU: world size 1 over NCCL, and 2 ranks sharing the
one GPU over NCCL (NCCL >= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``) and over Gloo.

Both wrappers train the same model on the same per-rank batches; parameters must agree to
``atol=1e-6`` (cuBLAS may pick different kernels for the two copies' matmuls, so bit equality
is not guaranteed on a GPU, unlike the CPU checks). Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.ddp.common import assert_same_state, batches, build, loss_of
from tests.harness import RankPool

pytestmark = pytest.mark.gpu


def check_gpu_against_torch(backend: str, bucket_view: bool, hook: str | None):
    import os

    import torch.distributed as dist

    from fastcomm.ddp import DDP, hooks
    from tests.harness import rank_comm

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    comm = rank_comm(backend)
    ours = DDP(build("convbn").to(device), comm=comm, gradient_as_bucket_view=bucket_view)
    theirs = torch.nn.parallel.DistributedDataParallel(
        build("convbn").to(device), device_ids=[0], gradient_as_bucket_view=bucket_view
    )
    if hook is not None:
        ours.register_comm_hook(None, getattr(hooks, hook))
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        theirs.register_comm_hook(None, getattr(default_hooks, hook))
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.1)
    for x, y in batches("convbn", 5):
        x, y = x.to(device), y.to(device)
        for model, opt in ((ours, opt_a), (theirs, opt_b)):
            opt.zero_grad()
            loss_of("convbn", model(x), y).backward()
            opt.step()
    torch.cuda.synchronize()
    assert_same_state(ours, theirs, atol=1e-6 if hook is None else 1e-4, rtol=0)
    return os.environ["RANK"], torch.cuda.get_device_name(device)


_ENV = {
    "NCCL_MULTI_RANK_GPU_ENABLE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "CUDA_VISIBLE_DEVICES": "0",
    "FASTCOMM_TEST_DEVICE": "0",
}


@pytest.mark.parametrize(
    "world, backend",
    [(1, "nccl"), (2, "nccl"), (2, "gloo")],
    ids=["world1-nccl", "world2-nccl-shared-gpu", "world2-gloo-shared-gpu"],
)
def test_gpu_against_torch_ddp(world, backend):
    with RankPool(world, env=_ENV, timeout=300) as pool:
        for bucket_view in (False, True):
            assert len(pool.run(check_gpu_against_torch, backend, bucket_view, None)) == world
        if backend == "nccl":
            pool.run(check_gpu_against_torch, backend, False, "fp16_compress_hook")
