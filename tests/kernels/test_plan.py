"""PackPlan: the same bits as pack/unpack, with the planning done once."""

import pytest
import torch

from fastcomm.kernels import PackPlan, pack, pack_reference, unpack, unpack_reference
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


# ---------------------------------------------------------------- one torch path, two layouts
# `pack`/`unpack` make the torch path's views and scratch per call, a plan keeps them: the same
# bits for every branch, signed zeros, infinities and subnormals included, and NaN payloads
# where nothing is converted (torch's casts give a NaN's bits by the source's contiguity:
# 0xFFFF from a contiguous fp32 NaN to bf16, 0x7FC0 from a strided one).
SPECIALS = [float("nan"), -0.0, float("inf"), float("-inf"), 1e-40, 7e4, -3e38, 5e-8]
ONE_PATH_BUCKETS = {
    "empty-list": [],
    "zero-size": [(0,), (3, 0)],
    "one": [(7, 3)],  # a single tensor: cast per tensor, no gather
    "flat-1d": PLAN_BUCKETS["flat-1d"],  # the plan gathers with torch.cat
    "mixed": BUCKETS["mixed"],  # the plan gathers through its views
}
# (source dtypes, packed dtype, scale): one case per branch of the torch pack.
PACK_BRANCHES = {
    "copy": ([F32], F32, 1.0),
    "copy-bf16": ([BF16], BF16, 1.0),
    "scaled-f32": ([F32], F32, 0.37),  # gather, then one multiply of the buffer
    "scaled-f64": ([F64], F64, 0.37),
    "scaled-bf16": ([BF16], BF16, 0.37),  # 16 bits: gather, then convert the buffer
    "f32-to-bf16": ([F32], BF16, 1.0),
    "f64-to-f16": ([F64], F16, 0.37),
    "bf16-to-f32": ([BF16], F32, 0.37),
    "mixed": ([F32, BF16, F64], F16, 0.37),  # per tensor
    "mixed-to-f32": ([F32, BF16], F32, 1.0),
}
# (flat dtype, target dtypes): one foreach op, or per tensor (16-bit scale or sum, casts).
UNPACK_BRANCHES = {
    "f32": (F32, [F32]),
    "f64": (F64, [F64]),
    "bf16": (BF16, [BF16]),
    "f32-to-bf16": (F32, [BF16]),
    "f16-to-f64": (F16, [F64]),
    "mixed": (F32, [F32, BF16, F16]),
}


def _bucket(shapes, dtypes, seed=0):
    """Tensors of `shapes`, dtypes taken in turn from `dtypes`, the specials in the first."""
    tensors = [make([s], dtypes[i % len(dtypes)], "cpu", seed=seed + i)[0]
               for i, s in enumerate(shapes)]
    for t in tensors[:1]:
        n = min(t.numel(), len(SPECIALS))
        t.view(-1)[:n] = torch.tensor(SPECIALS[:n], dtype=F64).to(t.dtype)
    return tensors


def _strided(t):
    """`t`'s values in a non-contiguous tensor (every other element of a wider buffer)."""
    s = torch.empty(*t.shape, 2, dtype=t.dtype)[..., 0]
    return s.copy_(t)


def _assert_same_bits(actual, expected, nan_payload=True):
    """Bit for bit; without `nan_payload`, NaNs only need to be NaNs in the same places."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    a, e = actual.view(as_int), expected.view(as_int)
    if not nan_payload:
        nan = expected.isnan()
        assert torch.equal(actual.isnan(), nan)
        a, e = a[~nan], e[~nan]
    assert torch.equal(a, e)


def _converts(src_dtypes, dst, scale, accumulate=False):
    """Whether a value passes through another dtype (a plain copy, or fp32/fp64 arithmetic in
    place, keeps NaN payloads)."""
    return src_dtypes != [dst] or (dst not in (F32, F64) and (scale != 1.0 or accumulate))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("branch", list(PACK_BRANCHES))
@pytest.mark.parametrize("bucket", list(ONE_PATH_BUCKETS))
def test_plan_and_one_shot_pack_give_the_same_bits(bucket, branch, strided):
    dtypes, dst, scale = PACK_BRANCHES[branch]
    tensors = _bucket(ONE_PATH_BUCKETS[bucket], dtypes)
    expected = pack(tensors, scale=scale, dtype=dst)  # one-shot needs contiguous tensors
    plan = PackPlan(tensors)
    assert plan.backend == "torch"
    inputs = [_strided(t) for t in tensors] if strided else tensors  # the plan takes strides
    payload = not _converts(dtypes, dst, scale)
    for _ in range(2):  # the second call runs on the kept views and scratch
        out = torch.full((plan.total,), float("nan"), dtype=dst)
        plan.pack(inputs, out, scale=scale)
        _assert_same_bits(out, expected, payload)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("branch", list(UNPACK_BRANCHES))
@pytest.mark.parametrize("bucket", list(ONE_PATH_BUCKETS))
def test_plan_and_one_shot_unpack_give_the_same_bits(bucket, branch, strided, scale, accumulate):
    flat_dtype, dtypes = UNPACK_BRANCHES[branch]
    shapes = ONE_PATH_BUCKETS[bucket]
    flat = pack(_bucket(shapes, [F64], seed=7), dtype=flat_dtype)
    expected = _bucket(shapes, dtypes, seed=1)
    targets = [_strided(t) if strided else t.clone() for t in expected]
    plan = PackPlan(expected)
    payload = not _converts([flat_dtype], dtypes[0], scale, accumulate) and len(dtypes) == 1
    for _ in range(2):  # kept views and scratch; with `accumulate`, sums of sums
        unpack(flat, expected, scale=scale, accumulate=accumulate)
        plan.unpack(flat, targets, scale=scale, accumulate=accumulate)
        for got, want in zip(targets, expected, strict=True):
            _assert_same_bits(got, want, payload)


def test_plan_scratch_serves_pack_and_unpack_in_turn():
    """A cast pack gathers into the plan's fp32 scratch, a scaled unpack multiplies into it."""
    tensors = _bucket(BUCKETS["mixed"], [F32])
    plan = PackPlan(tensors)
    flat = pack(_bucket(BUCKETS["mixed"], [F32], seed=3))
    for _ in range(2):
        out = torch.empty(plan.total, dtype=BF16)
        _assert_same_bits(plan.pack(tensors, out, scale=0.5), pack(tensors, scale=0.5, dtype=BF16))
        got, want = [t.clone() for t in tensors], [t.clone() for t in tensors]
        plan.unpack(flat, got, scale=0.25)
        unpack(flat, want, scale=0.25)
        for g, w in zip(got, want, strict=True):
            _assert_same_bits(g, w)
    assert list(plan._scratch) == [F32]  # one buffer for both


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
