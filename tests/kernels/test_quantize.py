"""quantize/dequantize kernels against their torch references, error bounds, error feedback."""

import pytest
import torch

from fastcomm.kernels import (
    DEFAULT_BLOCK,
    dequantize,
    dequantize_reference,
    quantize,
    quantize_reference,
)
from fastcomm.kernels._quantize import QMAX, TILE

from .helpers import assert_equal_or_1ulp

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
I8, FP8 = torch.int8, torch.float8_e4m3fn
QDTYPES = [I8, FP8]

# Sizes: empty, tiny, one short block, exact blocks, block+1, more than one program's tile.
SIZES = [0, 1, 15, 256, 257, 1000, TILE + 3]


def make(n, dtype=F32, device="cpu", seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    if n > 300:  # zeros (whole blocks of them for small blocks) and an outlier
        x[:32] = 0
        x[n // 2] = 50 * scale
    return x.to(dtype).to(device)


def assert_same_codes(q, q_ref):
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape
    # Compare values: fp8 -0.0 and +0.0 are the same code value.
    assert torch.equal(q.cpu().float(), q_ref.float())


@pytest.mark.parametrize("block", [16, DEFAULT_BLOCK, 1024])
@pytest.mark.parametrize("x_dtype", [F32, BF16, F16, F64], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("n", SIZES)
def test_quantize_matches_reference(device, n, qdtype, x_dtype, block):
    x = make(n, x_dtype, device)
    q, scales = quantize(x, dtype=qdtype, block=block)
    q_ref, scales_ref = quantize_reference(x.cpu(), dtype=qdtype, block=block)
    assert scales.dtype == F32 and scales.shape == (-(-n // block),)
    # Exact: divisions are correctly rounded, codes are rounded in fp32 the same way.
    assert_same_codes(q, q_ref)
    assert torch.equal(scales.cpu(), scales_ref)


@pytest.mark.parametrize("err_dtype", [F32, BF16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("n", [1, 257, TILE + 3])
def test_error_feedback_matches_reference(device, interpreted, n, qdtype, err_dtype):
    x = make(n, BF16, device)
    error = (make(n, F32, device, seed=1) * 0.01).to(err_dtype)
    error_ref = error.cpu().clone()
    q, scales = quantize(x, dtype=qdtype, block=64, error=error)
    q_ref, scales_ref = quantize_reference(x.cpu(), dtype=qdtype, block=64, error=error_ref)
    assert_same_codes(q, q_ref)
    assert torch.equal(scales.cpu(), scales_ref)
    # The fp32 residual is stored exactly; a bf16 one is truncated by the interpreter.
    assert_equal_or_1ulp(error, error_ref, interpreted)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("out_dtype", [F32, BF16, F64], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("n", [1, 257, TILE + 3])
def test_dequantize_matches_reference(device, interpreted, n, qdtype, out_dtype, accumulate):
    q, scales = quantize_reference(make(n), dtype=qdtype, block=128)
    out = make(n, out_dtype, device, seed=4)
    out_ref = out.cpu().clone()
    assert dequantize(q.to(device), scales.to(device), out=out, accumulate=accumulate) is out
    dequantize_reference(q, scales, out=out_ref, accumulate=accumulate)
    assert_equal_or_1ulp(out, out_ref, interpreted)


def test_dequantize_defaults_to_fp32_shaped_like_q(device):
    q, scales = quantize(make(300, BF16, device).view(3, 100), dtype=I8)
    assert q.shape == (3, 100) and scales.shape == (2,)
    out = dequantize(q, scales)
    assert out.dtype == F32 and out.shape == (3, 100)
    assert torch.equal(out.cpu(), dequantize_reference(q.cpu(), scales.cpu()))


@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
def test_roundtrip_error_within_block_bound(device, qdtype):
    block = 128
    x = make(10 * block + 5, F32, device, seed=7)
    q, scales = quantize(x, dtype=qdtype, block=block)
    err = (dequantize(q, scales) - x).abs().cpu()
    x, s = x.cpu(), scales.cpu().repeat_interleave(block)[: x.numel()]
    if qdtype == I8:
        # Half a code step of the block's own scale, plus fp32 rounding of the product.
        bound = 0.5 * s + 2**-22 * x.abs()
    else:
        # e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 relative; below 2**-6 (in code
        # units) the step is 2**-9 absolute.
        bound = torch.maximum(2**-4 * x.abs(), 2**-10 * s) * (1 + 2**-20) + 2**-22 * x.abs()
    assert bool((err <= bound).all()), float((err - bound).max())


def test_zero_blocks_get_zero_scale_and_codes(device):
    x = torch.zeros(3 * 64, device=device)
    x[64:128] = torch.linspace(-1, 1, 64)
    for qdtype in QDTYPES:
        q, scales = quantize(x, dtype=qdtype, block=64)
        assert scales.cpu().tolist()[0] == 0 and scales.cpu().tolist()[2] == 0
        assert not bool(q.cpu().float()[:64].any()) and not bool(q.cpu().float()[128:].any())
        assert scales.cpu()[1] == pytest.approx(1 / QMAX[qdtype])


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")  # numpy's
@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
def test_blocks_too_small_for_the_reciprocal_stay_in_the_error(device, qdtype):
    """amax so small that QMAX / amax overflows fp32 (1e-37 and a subnormal here, beside
    zeros): codes 0, no NaN, the values kept whole in the error buffer; the same as the
    reference. (The reciprocal was inf and 0 * inf turned the residual NaN: int8 DDP training
    went NaN within 15 steps.)"""
    x = torch.zeros(3 * 64)
    x[0], x[1], x[64], x[128:192] = 1e-37, -3e-38, 1e-40, torch.linspace(-1, 1, 64)
    x = x.to(device)
    error, error_ref = torch.zeros_like(x), torch.zeros(3 * 64)
    q, scales = quantize(x, dtype=qdtype, block=64, error=error)
    q_ref, scales_ref = quantize_reference(x.cpu(), dtype=qdtype, block=64, error=error_ref)
    assert_same_codes(q, q_ref)
    assert torch.equal(scales.cpu(), scales_ref) and torch.equal(error.cpu(), error_ref)
    assert not bool(q.cpu().float()[:128].any()) and bool(q.cpu().float()[128:].any())
    assert torch.equal(error.cpu()[:128], x.cpu()[:128])  # kept whole, finite
    assert bool(torch.isfinite(error).all())


def test_int8_rounds_half_to_even(device):
    # amax 127 makes the code scale exactly 1, so codes are the rounded inputs.
    x = [127.0, 0.5, -0.5, 1.5, -2.5, 0.49999997, -126.5, 3.2, 2.5000002]
    x = torch.tensor(x, device=device)
    q, scales = quantize(x, dtype=I8, block=16)
    assert scales.cpu().tolist() == [1.0]
    assert q.cpu().tolist() == [127, 0, 0, 2, -2, 0, -126, 3, 3]


def test_fp8_rounds_half_to_even_like_torch(device):
    # amax 448 makes the scale exactly 1: codes are the inputs rounded onto e4m3's grid.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    mid = (grid[:-1] + grid[1:]) / 2  # ties, including subnormal ones
    near = torch.cat([mid * (1 - 2**-20), mid * (1 + 2**-20)])
    values = torch.cat([grid, mid, near, -mid, torch.rand(1000) * 448])
    x = torch.cat([torch.tensor([448.0]), values])
    q, scales = quantize(x.to(device), dtype=FP8, block=8192)
    assert scales.cpu().tolist() == [1.0]
    assert torch.equal(q.cpu().float(), x.to(FP8).float())


@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
def test_error_feedback_tracks_running_sum(device, qdtype):
    n, block, steps = 1000, 64, 60
    g = torch.Generator().manual_seed(11)
    error = torch.zeros(n, device=device)
    sum_x = torch.zeros(n, dtype=F64)
    sum_deq = torch.zeros(n, dtype=F64)
    sum_plain = torch.zeros(n, dtype=F64)  # the same without error feedback
    max_step = 0.0
    for _ in range(steps):
        # A small persistent bias that plain rounding keeps throwing away.
        x = (torch.randn(n, generator=g) + 0.2) * 1e-2
        x[::block] = 1.0  # one large element per block makes the code step coarse
        q, scales = quantize(x.to(device), dtype=qdtype, block=block, error=error)
        sum_deq += dequantize(q, scales).cpu().double()
        qp, sp = quantize(x.to(device), dtype=qdtype, block=block)
        sum_plain += dequantize(qp, sp).cpu().double()
        sum_x += x.double()
        max_step = max(max_step, float(scales.max()))
    drift = (sum_deq - sum_x).abs()
    # sum(deq) = sum(x) + e_0 - e_T: the drift is the last residual, at most half a code step
    # of the last scale (int8), or half an fp8 ulp of the block maximum.
    bound = 0.5 * max_step if qdtype == I8 else QMAX[FP8] * max_step / 16
    assert float(drift.max()) <= bound * 1.01
    torch.testing.assert_close(drift, error.cpu().double().abs(), atol=1e-5, rtol=0)
    # Without feedback the bias is lost every step and the drift grows with the step count.
    assert float((sum_plain - sum_x).abs().max()) > 5 * float(drift.max())


def test_quantize_into_out_views(device):
    x = make(300, F32, device)
    buf_q = torch.zeros(400, dtype=I8, device=device)
    buf_s = torch.zeros(10, device=device)
    q, scales = quantize(x, dtype=I8, out=(buf_q[50:350], buf_s[1:4]), block=128)
    q_ref, s_ref = quantize_reference(x.cpu(), dtype=I8, block=128)
    assert torch.equal(buf_q[50:350].cpu(), q_ref) and torch.equal(buf_s[1:4].cpu(), s_ref)
    assert not bool(buf_q[:50].any()) and buf_s[0] == 0 and buf_s[4] == 0


def test_dequantize_infers_block():
    x = torch.randn(1000)
    for block in (16, 64, 256, 512, 8192):
        q, scales = quantize_reference(x, block=block)
        torch.testing.assert_close(
            dequantize_reference(q, scales), dequantize_reference(q, scales, block=block),
            atol=0, rtol=0,
        )


# --------------------------------------------------------------------------- bad input

def _bad_quant_cases(dev):
    x = torch.randn(100, device=dev)
    q, s = quantize_reference(x.cpu(), block=16)
    q, s = q.to(dev), s.to(dev)
    meta = torch.empty(100, device="meta")
    return [
        (TypeError, "x must be a torch.Tensor", lambda: quantize([1.0])),
        (TypeError, "x has dtype torch.int32", lambda: quantize(x.int())),
        (ValueError, "not contiguous", lambda: quantize(x.view(10, 10).t())),
        (TypeError, "dtype=torch.float16", lambda: quantize(x, dtype=F16)),
        (TypeError, "block must be an int", lambda: quantize(x, block=64.0)),
        (ValueError, "block=100", lambda: quantize(x, block=100)),
        (ValueError, "block=8", lambda: quantize(x, block=8)),
        (ValueError, "block=16384", lambda: quantize(x, block=16384)),
        (ValueError, "error has 99 elements", lambda: quantize(x, error=x.new_zeros(99))),
        (TypeError, "error has dtype torch.int64", lambda: quantize(x, error=x.long())),
        (ValueError, "error is on meta", lambda: quantize(x, error=meta)),
        (TypeError, r"out must be a \(q, scales\) pair", lambda: quantize(x, out=q)),
        (TypeError, r"out\[0\] has dtype torch.float8", lambda: quantize(x, out=(q.to(FP8), s))),
        (ValueError, r"out\[1\] has shape \(6,\)", lambda: quantize(x, block=16, out=(q, s[:6]))),
        (TypeError, "q.dtype=torch.float32", lambda: dequantize(x, s)),
        (TypeError, "scales has dtype torch.float16", lambda: dequantize(q, s.half())),
        (ValueError, "scales has shape", lambda: dequantize(q, s.view(7, 1))),
        (ValueError, "no block size", lambda: dequantize(q, s[:3])),
        (ValueError, "blocks of 32 need 4", lambda: dequantize(q, s, block=32)),
        (ValueError, "accumulate=True needs an out", lambda: dequantize(q, s, accumulate=True)),
        (ValueError, "out has 99 elements", lambda: dequantize(q, s, out=x[:99])),
        (TypeError, "out has dtype torch.int8", lambda: dequantize(q, s, out=q.clone())),
        (ValueError, "out is on meta", lambda: dequantize(q, s, out=meta)),
        (ValueError, "scales is on meta", lambda: dequantize(q, torch.empty(7, device="meta"))),
    ]


@pytest.mark.parametrize("case", range(len(_bad_quant_cases("cpu"))))
def test_bad_input_raises_before_launch(device, launches, case):
    error, match, call = _bad_quant_cases(device)[case]
    with pytest.raises(error, match=match):
        call()
    assert launches.count == 0
