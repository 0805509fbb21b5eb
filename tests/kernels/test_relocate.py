"""RelocatablePlan: the pack and measured unpack of a bucket whose addresses may move, and
PackPlan.unpack_measured (the eager path's measured unpack)."""

import pytest
import torch

from fastcomm.kernels import (
    PackPlan,
    RelocatablePlan,
    pack_reference,
    unpack_with_stats_reference,
)

from .helpers import needs_cuda
from .test_pack import BLOCK, F32, F64, make

SHAPES = [(3, 5), (0,), (BLOCK + 3,), (7, 1, 3), (128,), (2 * BLOCK,)]


def _ptrs(tensors):
    return [t.data_ptr() for t in tensors]


def _stream(device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_pack_follows_the_addresses_it_is_given(device, dtype, scale):
    plan = RelocatablePlan([t.numel() for t in make(SHAPES, dtype, "cpu")], dtype, device)
    flat = torch.full((plan.total,), float("nan"), dtype=dtype, device=device)
    for seed in (0, 1, 1):  # new tensors, other tensors, the same ones again
        grads = make(SHAPES, dtype, device, seed=seed)
        assert plan.set_addresses(_ptrs(grads), _stream(device))
        assert plan.ptrs == _ptrs(grads)
        plan.relocate()
        plan.pack(flat, scale)
        expected = pack_reference([g.cpu() for g in grads], scale=scale)
        torch.testing.assert_close(flat.cpu(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_unpack_writes_the_tensors_and_their_stats(device, dtype):
    plan = RelocatablePlan([t.numel() for t in make(SHAPES, dtype, "cpu")], dtype, device)
    finite = torch.cat([t.reshape(-1) for t in make(SHAPES, dtype, "cpu", seed=5)])
    poisoned = finite.clone()
    poisoned[7] = float("inf")
    for seed, source in ((0, finite), (1, poisoned)):
        flat = source.to(device)
        targets = make(SHAPES, dtype, device, seed=seed)
        stats = torch.full((2,), 123.0, device=device)  # written, not added to
        assert plan.set_addresses(_ptrs(targets), _stream(device))
        plan.relocate()
        plan.unpack_measured(flat, stats)
        expected = [t.cpu().clone() for t in targets]
        want = unpack_with_stats_reference(source, expected)
        for got, ref in zip(targets, expected, strict=True):
            torch.testing.assert_close(got.cpu(), ref, atol=0, rtol=0)
        assert stats[1].item() == want[1].item() == (source is poisoned)
        if source is finite:
            sum_sq = finite.to(torch.float64).square().sum().item()
            assert stats[0].item() == pytest.approx(sum_sq, rel=1e-5)
        else:
            assert stats[0].item() == float("inf")


def test_a_misaligned_address_is_refused(device):
    plan = RelocatablePlan([4, 8], F32, device)
    base = torch.zeros(16, device=device)
    assert plan.set_addresses([base.data_ptr(), base[4:].data_ptr()], _stream(device))
    shifted = [base[1:].data_ptr(), base[8:].data_ptr()]  # 4 bytes past a 16-byte boundary
    assert not plan.aligned(shifted)
    assert not plan.set_addresses(shifted, _stream(device))
    assert plan.ptrs == [base.data_ptr(), base[4:].data_ptr()]  # what the device still holds
    assert not plan.set_addresses([base.data_ptr()], _stream(device))  # one address too few


def test_bad_construction(device):
    with pytest.raises(ValueError, match="at least one tensor"):
        RelocatablePlan([], F32, device)


def test_a_device_the_kernels_do_not_run_on():
    with pytest.raises(ValueError, match="do not run on meta"):
        RelocatablePlan([4], F32, "meta")


@pytest.mark.parametrize(
    "dtype", [F32, F64, pytest.param(torch.bfloat16, marks=needs_cuda)]
)
def test_plan_unpack_measured_writes_stats(device, dtype):
    shapes = [(3, 5), (0,), (BLOCK + 3,), (9,)]
    targets = make(shapes, dtype, device, seed=1)
    plan = PackPlan(targets)
    flat = torch.cat([t.reshape(-1) for t in make(shapes, dtype, "cpu", seed=2)])
    flat[2] = float("nan")
    flat = flat.to(device)
    for _ in range(2):  # the second call reuses the plan's scratch
        stats = torch.full((2,), -7.0, device=device)
        plan.unpack_measured(flat, targets, stats)
        expected = [t.cpu().clone() for t in targets]
        want = unpack_with_stats_reference(flat.cpu(), expected)
        for got, ref in zip(targets, expected, strict=True):
            torch.testing.assert_close(got.cpu(), ref, atol=0, rtol=0, equal_nan=True)
        assert stats[1].item() == want[1].item() == 1.0


def test_plan_unpack_measured_on_the_torch_path():
    targets = make([(4, 4), (0,), (9,)], F32, "cpu")
    plan = PackPlan(targets)
    assert plan.backend == "torch"
    flat = torch.arange(25, dtype=F32)
    stats = torch.full((2,), 5.0)
    plan.unpack_measured(flat, targets, stats)
    assert torch.equal(torch.cat([t.reshape(-1) for t in targets]), flat)
    assert stats.tolist() == [float(flat.square().sum()), 0.0]
    with pytest.raises(ValueError, match="expected float32 of shape"):
        plan.unpack_measured(flat, targets, torch.zeros(3))
    with pytest.raises(ValueError, match="expected float32 of shape"):
        plan.unpack_measured(flat, targets, "stats")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_captured_graph_follows_new_addresses(monkeypatch):
    """The point of the plan: one captured graph, tensors allocated elsewhere each replay."""
    monkeypatch.setenv("FASTCOMM_KERNELS", "triton")
    device = torch.device("cuda", 0)
    plan = RelocatablePlan([t.numel() for t in make(SHAPES, F32, "cpu")], F32, device)
    flat = torch.zeros(plan.total, device=device)
    stats = torch.zeros(2, device=device)
    side = torch.cuda.Stream(device)
    grads = make(SHAPES, F32, device)
    with torch.cuda.stream(side):
        assert plan.set_addresses(_ptrs(grads), side)
        plan.relocate()  # warm: compile before the capture
        plan.pack(flat, 1.0)
        plan.unpack_measured(flat, stats)
        plan.pack(flat, 0.5)
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        plan.relocate()
        plan.pack(flat, 0.5)
        flat.mul_(4.0)
        plan.unpack_measured(flat, stats)
        graph.capture_end()
    side.synchronize()
    for seed in (3, 4, 4):
        grads = make(SHAPES, F32, device, seed=seed)
        before = [g.clone() for g in grads]
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream(device))
            assert plan.set_addresses(_ptrs(grads), side)
            graph.replay()
        side.synchronize()
        for got, old in zip(grads, before, strict=True):
            torch.testing.assert_close(got, old * 2.0, atol=0, rtol=0)
        want = sum(float((2 * o.double()).square().sum()) for o in before)
        assert stats[0].item() == pytest.approx(want, rel=1e-5)
