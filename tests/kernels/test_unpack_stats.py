"""unpack_with_stats: the Triton kernel against its torch reference (interpreter on CPU).

The unpacked values must equal the plain unpack's bit for bit (same cast, same rounding).
Sums of squares are compared with rtol=1e-5: the kernel sums per block and then across
blocks, the reference in one dot product, and fp32 sums in different orders differ by a few
ulps times log2(n). Non-finite counts are exact.
"""

import math

import pytest
import torch

from fastcomm.kernels import unpack_reference, unpack_with_stats, unpack_with_stats_reference
from fastcomm.kernels._pack import BLOCK

from .helpers import assert_equal_or_1ulp

# The interpreter computes with numpy, which warns on the NaN/Inf these tests inject.
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:overflow encountered:RuntimeWarning",
)

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64

BUCKETS = {
    "empty-list": [],
    "zero-size": [(0,), (3, 0)],
    "one": [(1,)],
    "one-block": [(BLOCK,)],
    "block+1": [(BLOCK + 1,)],
    "mixed": [(3, 5), (0,), (BLOCK + 3,), (7, 1, 3), (128,), (2, 2, 2, 2)],
}
# (flat dtype, tensor dtype): the DDP cases (same dtype; half-precision hooks cast back up).
DTYPE_PAIRS = [(F32, F32), (BF16, BF16), (F16, F16), (F16, F32), (BF16, F32), (F64, F64),
               (F32, BF16)]


def make_flat(shapes, dtype, seed=0, poison=()):
    n = sum(math.prod(s) for s in shapes)
    g = torch.Generator().manual_seed(seed)
    flat = (torch.randn(n, generator=g) * 3).to(dtype)
    for i, value in poison:
        if i < n:
            flat[i] = value
    return flat


def targets(shapes, dtype, device):
    return [torch.full(s, 7.0, dtype=dtype, device=device) for s in shapes]


def check_stats(got, expected):
    assert got.dtype == F32 and got.shape == (2,)
    got, expected = got.cpu(), expected.cpu()
    if math.isfinite(expected[0]):
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-30)
    else:
        assert not math.isfinite(got[0]), (got, expected)
    assert got[1] == expected[1], (got, expected)


@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
@pytest.mark.parametrize("src,dst", DTYPE_PAIRS, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("bucket", list(BUCKETS))
def test_unpack_with_stats_matches_reference(device, interpreted, bucket, src, dst, scale):
    shapes = BUCKETS[bucket]
    flat = make_flat(shapes, src)
    out = targets(shapes, dst, device)
    stats = unpack_with_stats(flat.to(device), out, scale=scale)
    ref_out = targets(shapes, dst, "cpu")
    ref_stats = unpack_with_stats_reference(flat, ref_out, scale=scale)
    plain = targets(shapes, dst, "cpu")
    unpack_reference(flat, plain, scale=scale)
    rounds = interpreted and dst == BF16 and (src != BF16 or scale != 1.0)
    for a, b, c in zip(out, ref_out, plain, strict=True):
        assert_equal_or_1ulp(a.cpu(), c, rounds)
        assert torch.equal(b, c)
    if not rounds:  # a truncating interpreter cast changes the squares: compare only exact runs
        check_stats(stats, ref_stats)
    # The reference measures what it wrote.
    values = [t.double().reshape(-1) for t in ref_out]
    total = sum(float((v * v).sum()) for v in values)
    assert ref_stats[0].item() == pytest.approx(total, rel=1e-5, abs=1e-30)
    assert ref_stats[1] == 0


POISONS = {
    "nan": [(5, math.nan)],
    "inf": [(0, math.inf)],
    "-inf+nan": [(BLOCK, -math.inf), (BLOCK + 2, math.nan), (17, math.nan)],
}


@pytest.mark.parametrize("src,dst", [(F32, F32), (BF16, F32), (F16, F16)], ids=str)
@pytest.mark.parametrize("poison", list(POISONS))
def test_nonfinite_counted(device, src, dst, poison):
    shapes = BUCKETS["mixed"]
    flat = make_flat(shapes, src, poison=POISONS[poison])
    out = targets(shapes, dst, device)
    stats = unpack_with_stats(flat.to(device), out)
    ref_stats = unpack_with_stats_reference(flat, targets(shapes, dst, "cpu"))
    expected = len(POISONS[poison])
    assert ref_stats[1] == expected and stats[1].item() == expected
    assert not math.isfinite(stats[0].item())


def test_overflowing_squares_are_not_nonfinite(device):
    # 3e38 squared overflows fp32: the norm is inf but every value is finite.
    flat = torch.tensor([3e38, 1.0, -3e38], dtype=F32)
    out = targets([(3,)], F32, device)
    stats = unpack_with_stats(flat.to(device), out).cpu()
    assert stats[0] == math.inf and stats[1] == 0


def test_stats_accumulate_across_calls(device):
    flat = make_flat([(10,), (BLOCK + 5,)], F32)
    a, b = targets([(10,)], F32, device), targets([(BLOCK + 5,)], F32, device)
    stats = torch.zeros(2, dtype=F32, device=device)
    unpack_with_stats(flat[:10].to(device), a, stats=stats)
    unpack_with_stats(flat[10:].to(device), b, stats=stats)
    whole = unpack_with_stats_reference(flat, targets([(10,), (BLOCK + 5,)], F32, "cpu"))
    check_stats(stats, whole)


def test_torch_backend_on_cpu():
    """Without FASTCOMM_KERNELS=triton, CPU tensors take the torch path (lazy count)."""
    flat = make_flat([(100,), (3, 3)], F32, poison=[(4, math.nan)])
    out = targets([(100,), (3, 3)], F32, "cpu")
    stats = unpack_with_stats(flat, out)
    assert stats[1] == 1 and math.isnan(stats[0])
    clean = make_flat([(100,)], F32)
    stats = unpack_with_stats(clean, targets([(100,)], F32, "cpu"))
    assert stats[0].item() == pytest.approx(float((clean.double() ** 2).sum()), rel=1e-6)
    assert stats[1] == 0


@pytest.mark.parametrize(
    "stats,err",
    [("x", TypeError), (torch.zeros(3), ValueError), (torch.zeros(2, dtype=F64), ValueError)],
)
def test_bad_stats(stats, err):
    with pytest.raises(err, match="stats"):
        unpack_with_stats(torch.zeros(4), [torch.zeros(4)], stats=stats)


def test_bad_operands():
    with pytest.raises(ValueError, match="expected \\(5,\\)"):
        unpack_with_stats(torch.zeros(4), [torch.zeros(5)])
    with pytest.raises(TypeError, match="dtype"):
        unpack_with_stats(torch.zeros(4, dtype=torch.int32), [torch.zeros(4)])
