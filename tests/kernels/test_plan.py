"""PackPlan: the same bits as pack/unpack, with the planning done once."""

import pytest
import torch

from fastcomm.kernels import PackPlan, pack_reference, unpack_reference
from fastcomm.kernels import _plan as plan_mod

from .helpers import assert_equal_or_1ulp
from .test_pack import BF16, BUCKETS, DTYPE_PAIRS, F16, F32, F64, make, rounds_to_bf16

PLAN_BUCKETS = {**BUCKETS, "flat-1d": [(5,), (0,), (300,), (1,)]}


def _flat_of(shapes, dtype, device, seed=2):
    parts = [t.reshape(-1) for t in make(shapes, F32, "cpu", seed=seed)]
    return torch.cat(parts or [torch.ones(0)]).to(dtype).to(device)


# ---------------------------------------------------------------- torch path (CPU)
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("src,dst", DTYPE_PAIRS, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("bucket", list(PLAN_BUCKETS))
def test_cpu_pack_is_bit_identical_to_reference(bucket, src, dst, scale):
    tensors = make(PLAN_BUCKETS[bucket], src, "cpu")
    plan = PackPlan(tensors)
    assert plan.backend == "torch"
    expected = pack_reference(tensors, scale=scale, dtype=dst)
    for _ in range(2):  # the second call runs on the cached views
        out = torch.full((plan.total,), float("nan"), dtype=dst)
        assert plan.pack(tensors, out, scale=scale) is out
        torch.testing.assert_close(out, expected, atol=0, rtol=0, equal_nan=False)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
@pytest.mark.parametrize("flat_dtype,dst", DTYPE_PAIRS, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("bucket", ["zero-size", "mixed", "flat-1d"])
def test_cpu_unpack_is_bit_identical_to_reference(bucket, flat_dtype, dst, scale, accumulate):
    shapes = PLAN_BUCKETS[bucket]
    flat = _flat_of(shapes, flat_dtype, "cpu")
    targets = make(shapes, dst, "cpu", seed=1)
    expected = [t.clone() for t in targets]
    plan = PackPlan(targets)
    for _ in range(2):
        plan.unpack(flat, targets, scale=scale, accumulate=accumulate)
        unpack_reference(flat, expected, scale=scale, accumulate=accumulate)
        for got, want in zip(targets, expected, strict=True):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_mixed_source_dtypes_pack_like_the_reference():
    tensors = make([(4, 3), (7,)], F32, "cpu") + make([(5,)], BF16, "cpu")
    tensors += make([(2,)], F64, "cpu")
    plan = PackPlan(tensors)
    for dst, scale in [(F32, 1.0), (F16, 0.5), (F64, 3.0)]:
        out = torch.empty(plan.total, dtype=dst)
        plan.pack(tensors, out, scale=scale)
        torch.testing.assert_close(out, pack_reference(tensors, scale=scale, dtype=dst),
                                   atol=0, rtol=0)


def test_new_tensors_of_the_same_layout_reuse_the_plan():
    plan = PackPlan(make([(3, 4), (5,)], F32, "cpu"))
    out = torch.empty(plan.total)
    for seed in range(3):  # gradients reallocated every step: new objects, same layout
        tensors = make([(3, 4), (5,)], F32, "cpu", seed=seed)
        plan.pack(tensors, out)
        torch.testing.assert_close(out, pack_reference(tensors), atol=0, rtol=0)


def test_views_are_cached_per_buffer_and_alias_it():
    plan = PackPlan(make([(2, 3), (4,)], F32, "cpu"))
    buffers = [torch.zeros(plan.total) for _ in range(plan_mod._VIEW_CACHE + 1)]
    first = plan.views(buffers[0])
    assert plan.views(buffers[0]) is first
    assert [v.shape for v in first] == [(2, 3), (4,)]
    first[1].fill_(7.0)
    assert buffers[0][6:].eq(7.0).all()
    for b in buffers[1:]:
        plan.views(b)
    assert plan.views(buffers[0]) is not first  # evicted: the cache holds a few buffers only
    # A view of the same memory (another tensor object) finds the cached views.
    assert plan.views(buffers[0][:]) is plan.views(buffers[0])


def _bad_calls():
    good = make([(3, 4), (5,)], F32, "cpu")
    out = torch.empty(17)
    return [
        ("shape", lambda p: p.pack([good[0], torch.zeros(6)], out), ValueError, "tensors\\[1\\]"),
        ("reshaped", lambda p: p.pack([good[0].view(4, 3), good[1]], out), ValueError,
         "shape \\(4, 3\\)"),
        ("dtype", lambda p: p.pack([good[0], good[1].double()], out), ValueError, "float64"),
        ("count", lambda p: p.pack(good[:1], out), ValueError, "made for 2"),
        ("none", lambda p: p.pack([good[0], None], out), TypeError, "tensors\\[1\\]"),
        ("not-list", lambda p: p.pack(good[0], out), TypeError, "list or tuple"),
        ("out-length", lambda p: p.pack(good, torch.empty(16)), ValueError, "\\(17,\\)"),
        ("out-int", lambda p: p.pack(good, torch.empty(17, dtype=torch.int32)), TypeError,
         "int32"),
        ("scale", lambda p: p.pack(good, out, scale="x"), TypeError, "scale"),
        ("flat-2d", lambda p: p.unpack(torch.empty(17, 1), good), ValueError, "shape"),
        ("accumulate", lambda p: p.unpack(out, good, accumulate=1), TypeError, "bool"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[c[0] for c in _bad_calls()])
def test_bad_calls_raise_naming_the_problem(case):
    _, call, exc, match = _bad_calls()[case]
    plan = PackPlan(make([(3, 4), (5,)], F32, "cpu"))
    with pytest.raises(exc, match=match):
        call(plan)


def test_torch_backend_packs_strided_tensors_correctly():
    strided = [torch.arange(12.0).view(4, 3).t(), torch.arange(10.0)[::2]]
    plan = PackPlan([t.contiguous() for t in strided])
    out = torch.empty(plan.total)
    plan.pack(strided, out, scale=0.5)
    torch.testing.assert_close(out, pack_reference([t.contiguous() for t in strided], scale=0.5),
                               atol=0, rtol=0)
    targets = [torch.zeros(4, 3).t(), torch.zeros(10)[::2]]
    plan.unpack(out, targets)
    for got, want in zip(targets, strided, strict=True):
        torch.testing.assert_close(got, want * 0.5, atol=0, rtol=0)


def test_kernel_backend_refuses_strided_tensors(device):
    good = make([(3, 4), (5,)], F32, device)
    plan = PackPlan(good)
    with pytest.raises(ValueError, match="contiguous"):
        plan.pack([torch.zeros(4, 3, device=device).t(), good[1]], torch.empty(17, device=device))


def test_empty_plan_takes_empty_buffers():
    plan = PackPlan([])
    out = torch.empty(0, dtype=F16)
    assert plan.pack([], out) is out
    plan.unpack(out, [])
    with pytest.raises(ValueError, match="made for 0"):
        plan.pack([torch.zeros(0)], out)


def test_foreach_is_only_chosen_for_small_cuda_copies_that_round_like_the_kernel():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    decide = plan_mod.foreach_on_device
    assert decide(cuda, 16, 1 << 20, F16, 1.0)
    assert decide(cuda, 16, 1 << 20, F32, 0.5)  # copy, then one mul_: one rounding in fp32
    assert not decide(cpu, 16, 1 << 20, F32, 1.0)  # CPU: the torch backend, not this choice
    assert not decide(cuda, 16, 1 << 20, None, 1.0)  # a cast: fused
    assert not decide(cuda, 16, 1 << 20, BF16, 0.5)  # a scale in 16 bits: fused
    assert not decide(cuda, 16, plan_mod.FOREACH_SCALED_MAX_BYTES + 1, F32, 0.5)
    assert not decide(cuda, plan_mod.FOREACH_MAX_TENSORS + 1, 1 << 20, F32, 1.0)
    assert not decide(cuda, 4, plan_mod.FOREACH_MAX_BYTES + 1, F32, 1.0)


# ---------------------------------------------------------------- kernel path (interpreter / GPU)
@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("src,dst", [(F32, F32), (F32, BF16), (BF16, F32), (F64, F16)],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("bucket", ["zero-size", "block+1", "mixed"])
def test_kernel_pack_matches_reference(device, interpreted, launches, bucket, src, dst, scale):
    tensors = make(BUCKETS[bucket], src, device)
    plan = PackPlan(tensors)
    assert plan.backend == "triton"
    expected = pack_reference([t.cpu() for t in tensors], scale=scale, dtype=dst)
    out = torch.empty(plan.total, dtype=dst, device=device)
    plan.pack(tensors, out, scale=scale)
    assert_equal_or_1ulp(out, expected, interpreted and rounds_to_bf16(src, dst, scale))
    nbytes = plan.total * src.itemsize
    kernel = not plan_mod.foreach_on_device(
        device, len(tensors), nbytes, src if src == dst else None, scale
    )
    assert launches.count == (1 if kernel and plan.total else 0)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("flat_dtype,dst", [(F32, F32), (F32, BF16), (F16, F64)],
                         ids=lambda d: str(d)[6:])
def test_kernel_unpack_matches_reference(device, interpreted, flat_dtype, dst, accumulate):
    shapes = BUCKETS["mixed"]
    flat = _flat_of(shapes, flat_dtype, "cpu")
    targets = make(shapes, dst, device, seed=1)
    expected = [t.cpu().clone() for t in targets]
    PackPlan(targets).unpack(flat.to(device), targets, scale=0.25, accumulate=accumulate)
    unpack_reference(flat, expected, scale=0.25, accumulate=accumulate)
    rounds = dst == BF16
    for got, want in zip(targets, expected, strict=True):
        assert_equal_or_1ulp(got, want, interpreted and rounds)


def test_kernel_tables_are_kept_until_an_address_changes(device, launches):
    tensors = make([(3, 5), (7,), (2, 2)], F32, device)
    plan = PackPlan(tensors)
    out = torch.empty(plan.total, dtype=F16, device=device)
    plan.pack(tensors, out, scale=0.5)
    tables = plan._tables[out.element_size()]
    plan.pack(tensors, out, scale=2.0)
    assert plan._tables[out.element_size()] is tables  # same addresses: nothing rebuilt
    moved = [t.clone() * 3 for t in tensors]  # reallocated, values changed
    plan.pack(moved, out, scale=0.5)
    assert plan._tables[out.element_size()] is not tables
    expected = pack_reference([t.cpu() for t in moved], scale=0.5, dtype=F16)
    assert_equal_or_1ulp(out, expected, False)
    assert launches.count == 3
