"""Zero-copy buckets (``fastcomm/ddp/shared.py``): DDP's buckets in shared memory, all-reduced
in place out of the peers' buckets, on 2 CPU ranks over shm.

Each check trains fastcomm DDP (the default on an shm communicator: shared buckets) and torch
DDP over Gloo on identical models and compares the parameters with ``atol=0`` (two ranks: one
addition per element, see ``tests/ddp/common.py``). It also proves that the shared path ran and
that nothing was staged: the gradients live in the region, the communicator's ``all_reduce``
was not called for them (``CommStats``), and the region's counters show ``B`` bytes written and
``B`` read from the peer per gradient byte ``B`` (today's two-step schedule writes ``2 B``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.ddp.common import assert_same_state, batches, build, init_torch_dist, loss_of, step
from tests.harness import RankPool, rank_comm


# ---------------------------------------------------------------------- checks (every rank)
def _pair(model_name: str = "mlp", *, comm=None, model_kwargs=None, **kwargs):
    from fastcomm.ddp import DDP

    init_torch_dist()
    torch_kwargs = {k: v for k, v in kwargs.items() if k not in ("shared_bucket_cap_mb",)}
    comm = rank_comm("shm") if comm is None else comm
    ours = DDP(build(model_name, **(model_kwargs or {})), comm=comm, **kwargs)
    theirs = nn.parallel.DistributedDataParallel(
        build(model_name, **(model_kwargs or {})), **torch_kwargs
    )
    return ours, theirs


def _in_region(ddp, tensor: torch.Tensor) -> bool:
    region = ddp.reducer.shared.region
    base = region._u8.data_ptr()
    return base <= tensor.data_ptr() < base + region.nbytes


def check_trains_like_torch(model_name: str, steps: int, set_to_none: bool, **kwargs):
    ours, theirs = _pair(model_name, **kwargs)
    assert ours.reducer.shared is not None and ours.grads_are_bucket_views
    comm = ours.comm
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (ours, theirs)]
    comm.stats.reset()
    ours.reducer.shared.stats.reset()
    for x, y in batches(model_name, steps):
        for model, opt in opts:
            opt.zero_grad(set_to_none=set_to_none)
            loss_of(model_name, model(x), y).backward()
            opt.step()
    assert_same_state(ours, theirs)
    for p, q in zip(ours.module.parameters(), theirs.module.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
        assert _in_region(ours, p.grad)  # .grad is the shared bucket: nothing unpacked
    stats = ours.reducer.shared.stats
    grad_bytes = sum(p.numel() * p.element_size() for p in ours.module.parameters())
    calls = dict(comm.stats.calls)
    return stats.gradient_bytes, grad_bytes * steps, stats.per_gradient_byte(), calls


def check_fallback_under_cap():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, theirs = _pair("mlp", shared_bucket_cap_mb=0.001)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not ours.shared_buckets and not ours.grads_are_bucket_views
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (ours, theirs)]
    for x, y in batches("mlp", 3):
        for model, opt in opts:
            step(model, opt, "mlp", x, y)
    assert_same_state(ours, theirs)
    return messages


# ---------------------------------------------------------------------- tests (pytest side)
@pytest.fixture(scope="module")
def pool():
    with RankPool(2, timeout=120) as pool:
        yield pool


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("model_name", ["mlp", "convbn", "tied"])
def test_trains_like_torch_without_staging(pool, model_name, set_to_none):
    results = pool.run(check_trains_like_torch, model_name, 4, set_to_none)
    for reduced, expected, per_byte, calls in results:
        assert reduced == expected  # every gradient byte went through the region
        assert per_byte["written"] == pytest.approx(1.0, abs=0.02)
        assert per_byte["peer_read"] == pytest.approx(1.0, abs=0.02)
        assert per_byte["moved"] <= 2.0 + 0.02
        assert "all_reduce" not in calls  # no collective staged the buckets


def test_cap_falls_back_with_a_warning(pool):
    for messages in pool.run(check_fallback_under_cap):
        assert any("no shared-memory buckets" in m and "cap" in m for m in messages), messages
