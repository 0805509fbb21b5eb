"""fastcomm DDP against torch DDP on a GPU, with CUDA parameters.

- world size 1 over NCCL;
- 2 ranks over NCCL: a GPU each where there are two, else sharing GPU 0 where NCCL allows it
  (>= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``), else skipped with the reason
  (``tests/comm/gpu_layout.py``);
- 2 ranks sharing GPU 0 (what works with any NCCL): fastcomm's Gloo communicator, the shm
  communicator (CUDA tensors go through its Gloo fallback) and ``fastcomm.init()`` (which picks
  ``ipc`` there, NCCL refusing a shared GPU: CUDA all-reduces by its kernels over CUDA IPC, the
  other CUDA ops through Gloo) against torch DDP on Gloo.

Both wrappers train the same model on the same per-rank batches; parameters must agree to
``atol=1e-6`` (cuBLAS may pick different kernels for the two copies' matmuls, so bit equality
is not guaranteed on a GPU, unlike the CPU checks), ``1e-4`` through compression hooks. torch's
own PowerSGD hook runs on both wrappers too (on CPU parameters it calls
``torch.cuda.synchronize(cpu)`` wherever CUDA is available, a torch limitation; on CUDA
parameters it works). Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.ddp.common import assert_same_state, batches, build, loss_of
from tests.harness import RankPool

pytestmark = pytest.mark.gpu


def _comm(backend: str, device: torch.device):
    import fastcomm
    from tests.harness import rank_comm

    if backend != "init":
        return rank_comm(backend)
    comm = fastcomm.init(timeout=120)
    # two ranks on one GPU without NCCL sharing (fastcomm.comm.world.shared_gpu_backend): ipc,
    # its CUDA all_reduce its own, every other CUDA op through its Gloo fallback
    assert comm.backend == "ipc", comm
    assert comm.route(device, "all_reduce") is comm
    assert comm.route(device) is comm.fallback
    return comm


def _hooks(hook: str, ours, theirs) -> None:
    import torch.distributed as dist

    from fastcomm.ddp import hooks

    if hook == "torch_powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

        for model in (ours, theirs):
            state = torch_psgd.PowerSGDState(
                process_group=dist.group.WORLD, matrix_approximation_rank=1, start_powerSGD_iter=2
            )
            model.register_comm_hook(state, torch_psgd.powerSGD_hook)
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ours.register_comm_hook(None, getattr(hooks, hook))
    theirs.register_comm_hook(None, getattr(default_hooks, hook))


def check_gpu_against_torch(backend: str, bucket_view: bool, hook: str | None):
    import os

    import torch.distributed as dist

    import fastcomm
    from fastcomm.ddp import DDP

    index = int(os.environ.get("FASTCOMM_TEST_DEVICE", os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    torch_backend = "nccl" if backend == "nccl" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(torch_backend, device_id=device if backend == "nccl" else None)
    comm = _comm(backend, device)
    try:
        ours = DDP(build("convbn").to(device), comm=comm, gradient_as_bucket_view=bucket_view)
        theirs = torch.nn.parallel.DistributedDataParallel(
            build("convbn").to(device), device_ids=[index], gradient_as_bucket_view=bucket_view
        )
        if hook is not None:
            _hooks(hook, ours, theirs)
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
    finally:
        if backend == "init":
            fastcomm.shutdown()
    return os.environ["RANK"], torch.cuda.get_device_name(device), comm.backend


# every rank on GPU 0, and no NCCL sharing: what a 1-GPU machine with NCCL < 2.30 offers
_SHARED_GPU0 = {
    "CUDA_VISIBLE_DEVICES": "0",
    "FASTCOMM_TEST_DEVICE": "0",
    "NCCL_MULTI_RANK_GPU_ENABLE": "",
}


@pytest.mark.parametrize(
    "world, backend",
    [(1, "nccl"), (2, "nccl"), (2, "gloo"), (2, "shm"), (2, "init")],
    ids=["world1-nccl", "world2-nccl", "world2-gloo-shared-gpu", "world2-shm-shared-gpu",
         "world2-init-shared-gpu"],
)
def test_gpu_against_torch_ddp(world, backend):
    if backend == "nccl":
        from tests.comm.gpu_layout import nccl_ranks_env_or_skip

        env = nccl_ranks_env_or_skip(world)
    else:
        env = dict(_SHARED_GPU0)
    with RankPool(world, env=env, timeout=300) as pool:
        for bucket_view in (False, True):
            results = pool.run(check_gpu_against_torch, backend, bucket_view, None)
            assert len(results) == world
        if backend == "init":  # the choice init() made on a shared GPU
            assert {b for _, _, b in results} == {"ipc"}, results
        if backend == "nccl":
            pool.run(check_gpu_against_torch, backend, False, "fp16_compress_hook")
        pool.run(check_gpu_against_torch, backend, False, "torch_powersgd")
