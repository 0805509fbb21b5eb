"""clip_grad_norm_ and NaN counting on a GPU: the statistics come from the Triton unpack.

World size 1 over NCCL (as ``test_gpu.py``), fastcomm's norm against
``torch.nn.utils.clip_grad_norm_`` on copies of the same gradients, rtol=1e-5 (summation
order). Skipped without CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.ddp.common import batches, build, loss_of
from tests.harness import RankPool

pytestmark = pytest.mark.gpu

_ENV = {"CUDA_VISIBLE_DEVICES": "0", "FASTCOMM_TEST_DEVICE": "0"}


def check_gpu_clip(bucket_view: bool, hook: str | None):
    import torch.distributed as dist

    from fastcomm.ddp import DDP, hooks
    from tests.ddp.test_health import _compare
    from tests.harness import rank_comm

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device)
    ddp = DDP(
        build("convbn").to(device),
        comm=rank_comm("nccl"),
        gradient_as_bucket_view=bucket_view,
        bucket_cap_mb=0.001,
    )
    assert ddp.reducer.health.eager, "CUDA gradients are measured in the Triton unpack"
    if hook is not None:
        ddp.register_comm_hook(None, getattr(hooks, hook))
    norms = []
    for i, (x, y) in enumerate(batches("convbn", 3)):
        ddp.zero_grad(set_to_none=not bucket_view)
        loss_of("convbn", ddp(x.to(device)), y.to(device)).backward()
        norms.append(_compare(ddp, 1e9 if i == 1 else 0.05, "buckets" if bucket_view else "unpack"))
    ddp.zero_grad(set_to_none=True)
    ddp.module.head.bias.register_hook(lambda g: torch.full_like(g, math.inf))
    x, y = batches("convbn", 1)[0]
    loss_of("convbn", ddp(x.to(device)), y.to(device)).backward()
    return norms, ddp.nonfinite_grads()


@pytest.mark.parametrize("hook", [None, "fp16_compress_hook", "bf16_compress_hook"])
@pytest.mark.parametrize("bucket_view", [False, True], ids=["copy", "view"])
def test_gpu_clip_matches_torch(bucket_view, hook):
    with RankPool(1, env=_ENV, timeout=300) as pool:
        ((norms, nonfinite),) = pool.run(check_gpu_clip, bucket_view, hook)
    assert all(math.isfinite(n) and n > 0 for n in norms)
    assert nonfinite == ["head.bias"]
