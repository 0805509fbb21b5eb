"""Training health on 2 real ranks: clip_grad_norm_ against torch's, NaN/Inf, named hangs.

``clip_grad_norm_`` is compared with ``torch.nn.utils.clip_grad_norm_`` applied to copies of
the very gradients DDP produced, so the only difference is the summation order of the
squares: norms and clipped gradients agree to rtol=1e-5 (fp32 sums of a few thousand
squares in another order differ by a few ulps). Each check also asserts which source the
norm came from, so a silent fallback to torch's computation cannot pass for the fast path.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fastcomm.ddp import DDP
from tests.ddp.common import batches, build, loss_of, rank
from tests.harness import fresh_comm, pool_fixture, rank_comm

LAYOUTS = {  # bucket caps: one bucket, a few, one per parameter
    "one": {"bucket_cap_mb": 25},
    "few": {"bucket_cap_mb": 0.004},
    "each": {"bucket_cap_mb_list": [1e-6]},
}
HOOKS = ["none", "fp16", "bf16", "int8", "fp8", "powersgd"]


def _hook_and_state(name: str, comm):
    from fastcomm.ddp import hooks

    if name == "none":
        return None, None
    if name in ("int8", "fp8"):
        return getattr(hooks, f"{name}_compress_hook"), hooks.QuantizeState(comm)
    if name == "powersgd":
        # start at iteration 1: the compressed path runs from the second step on
        state = hooks.PowerSGDState(comm, matrix_approximation_rank=2, start_powerSGD_iter=1)
        return hooks.powersgd_hook, state
    return getattr(hooks, f"{name}_compress_hook"), None


def _torch_clip(model: nn.Module, max_norm: float, norm_type: float = 2.0):
    """torch's clip_grad_norm_ on copies of `model`'s gradients: (norm, clipped grads)."""
    copies = []
    for p in model.parameters():
        c = nn.Parameter(p.detach().clone())
        c.grad = None if p.grad is None else p.grad.detach().clone()
        copies.append(c)
    norm = torch.nn.utils.clip_grad_norm_(copies, max_norm, norm_type)
    return norm, [c.grad for c in copies]


def _compare(ddp: DDP, max_norm: float, source: str, norm_type: float = 2.0):
    expected_norm, expected_grads = _torch_clip(ddp.module, max_norm, norm_type)
    norm = ddp.clip_grad_norm_(max_norm, norm_type)
    assert ddp.reducer.health.last_norm_source == source
    assert isinstance(norm, torch.Tensor) and norm.dtype == expected_norm.dtype
    torch.testing.assert_close(norm, expected_norm, rtol=1e-5, atol=0)
    for p, g in zip(ddp.module.parameters(), expected_grads, strict=True):
        if g is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-12)
    return float(norm)


# ---------------------------------------------------------------------- checks (every rank)
def check_clip_matches_torch(layout: str, bucket_view: bool, hook_name: str, eager: bool):
    comm = rank_comm("gloo")
    ddp = DDP(
        build("mlp", sizes=(16, 64, 64, 4)),
        comm=comm,
        gradient_as_bucket_view=bucket_view,
        **LAYOUTS[layout],
    )
    ddp.reducer.health.eager = eager  # eager: what CUDA does (statistics in the unpack)
    hook, state = _hook_and_state(hook_name, comm)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    source = "buckets" if bucket_view else "unpack"
    norms = []
    for i, (x, y) in enumerate(batches("mlp", 3)):
        opt.zero_grad(set_to_none=not bucket_view)
        loss_of("mlp", ddp(x), y).backward()
        # clip on steps 0 and 2, a norm far above the limit on step 1 (no scaling)
        norms.append(_compare(ddp, 1e9 if i == 1 else 0.05, source))
        opt.step()
    return norms, len(ddp.reducer.buckets)


def check_clip_fallbacks():
    """no_sync steps, grads changed in place, norm_type != 2, parameters outside DDP."""
    comm = rank_comm("gloo")
    ddp = DDP(build("mlp"), comm=comm, bucket_cap_mb=0.002)
    (x, y), (x2, y2) = batches("mlp", 2)
    with ddp.no_sync():
        loss_of("mlp", ddp(x), y).backward()
    _compare(ddp, 0.1, "torch")  # local gradients only: nothing was unpacked
    loss_of("mlp", ddp(x2), y2).backward()
    _compare(ddp, 0.1, "unpack")
    _compare(ddp, 0.01, "torch")  # the first clip scaled the gradients in place
    ddp.zero_grad(set_to_none=True)
    loss_of("mlp", ddp(x2), y2).backward()
    _compare(ddp, 0.1, "torch", norm_type=1.0)
    _compare(ddp, 0.1, "torch", norm_type=math.inf)
    ddp.zero_grad(set_to_none=True)
    loss_of("mlp", ddp(x2), y2).backward()
    ddp.module.layers[0].weight.grad.mul_(2.0)  # what GradScaler.unscale_ does
    _compare(ddp, 0.1, "torch")

    # a parameter DDP ignores but that gets a gradient
    model = build("mlp")
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["layers.0.bias"])
    ignoring = DDP(model, comm=comm)
    loss_of("mlp", ignoring(x), y).backward()
    _compare(ignoring, 0.1, "torch")
    return True


def check_nonfinite(check_finite: bool, eager: bool):
    comm = rank_comm("gloo")
    ddp = DDP(build("mlp"), comm=comm, bucket_cap_mb=0.002, check_finite=check_finite)
    ddp.reducer.health.eager = eager
    target = ddp.module.layers[2].weight

    def poison(grad):  # rank 1 only: one NaN in one gradient
        grad = grad.clone()
        grad.view(-1)[3] = math.nan
        return grad

    handle = target.register_hook(poison) if rank() == 1 else None
    (x, y), (x2, y2) = batches("mlp", 2)
    error = None
    try:
        loss_of("mlp", ddp(x), y).backward()
    except FloatingPointError as exc:
        error = str(exc)
    names = None if check_finite else ddp.nonfinite_grads()
    norm_is_nan = bool(ddp.clip_grad_norm_(1.0).isnan())
    if handle is not None:
        handle.remove()
    ddp.zero_grad(set_to_none=True)
    loss_of("mlp", ddp(x2), y2).backward()  # a clean step: nothing to report
    return error, names, norm_is_nan, ddp.nonfinite_grads()


class Fork(nn.Module):
    """``branch`` runs only when asked: a data-dependent branch."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x, use_branch: bool):
        h = torch.tanh(self.inp(x))
        if use_branch:
            h = h + self.branch(h)
        return self.out(h)


def check_branch_skipped_on_one_rank(name: str):
    """Rank 1 skips the branch: rank 0 times out in its bucket; both name rank 1 and it."""
    comm = fresh_comm("gloo", name, timeout=3.0)
    torch.manual_seed(0)
    ddp = DDP(Fork(), comm=comm, bucket_cap_mb_list=[1e-6])
    x = torch.randn(4, 8)
    messages = []
    try:
        ddp(x, use_branch=rank() == 0).sum().backward()
    except Exception as exc:  # noqa: BLE001 - rank 0: the bucket's wait times out
        messages.append(f"{type(exc).__name__}: {exc}")
    if rank() == 1:
        try:
            ddp(x, use_branch=True)  # the previous iteration left a bucket unreduced
        except RuntimeError as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    comm.close()
    return messages


# ---------------------------------------------------------------------- pytest side
pool = pool_fixture(2, timeout=120)


@pytest.mark.parametrize("hook_name", HOOKS)
@pytest.mark.parametrize("bucket_view", [False, True], ids=["copy", "view"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_clip_grad_norm_matches_torch(pool, layout, bucket_view, hook_name):
    (norms0, n_buckets), (norms1, _) = pool.run(
        check_clip_matches_torch, layout, bucket_view, hook_name, True
    )
    assert norms0 == norms1, "every rank holds the same averaged gradients, the same norm"
    assert n_buckets == {"one": 1, "few": 2, "each": 6}[layout]
    assert all(math.isfinite(n) and n > 0 for n in norms0)


@pytest.mark.parametrize("hook_name", ["none", "bf16", "powersgd"])
@pytest.mark.parametrize("layout", ["one", "each"])
def test_clip_grad_norm_measured_on_demand(pool, layout, hook_name):
    """The CPU default: the unpack only records what it wrote; the norm measures that."""
    (norms0, _), (norms1, _) = pool.run(check_clip_matches_torch, layout, False, hook_name, False)
    assert norms0 == norms1


def test_clip_grad_norm_falls_back_to_torch(pool):
    assert pool.run(check_clip_fallbacks) == [True, True]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "on-demand"])
def test_check_finite_raises_on_every_rank(pool, eager):
    for error, names, norm_is_nan, clean in pool.run(check_nonfinite, True, eager):
        assert error is not None and names is None
        assert "layers.2.weight" in error and "synchronized step 1" in error
        assert "1 parameter(s)" in error and "layers.0.weight" not in error
        assert norm_is_nan and clean == []


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "on-demand"])
def test_nonfinite_grads_names_the_parameter(pool, eager):
    for error, names, norm_is_nan, clean in pool.run(check_nonfinite, False, eager):
        assert error is None and names == ["layers.2.weight"]
        assert norm_is_nan and clean == []


def test_hang_names_the_rank_and_the_parameters(pool, unique_name):
    rank0, rank1 = pool.run(check_branch_skipped_on_one_rank, unique_name, timeout=60)
    assert len(rank0) == 1 and len(rank1) == 1, (rank0, rank1)
    assert rank0[0].startswith("CommTimeoutError") and rank1[0].startswith("RuntimeError")
    for message in (rank0[0], rank1[0]):
        assert "never launched on rank(s) 1" in message, message
        assert "branch.weight" in message and "branch.bias" in message, message
        assert "rank(s) 0 launched it" in message
        assert "inp.weight" not in message.split("never launched")[1]
