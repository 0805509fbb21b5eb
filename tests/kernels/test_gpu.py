"""GPU-only checks: buffers over 2**31 elements (int64 offsets end to end), side streams.

Each case compares with small pieces computed independently (blocks are independent), so
the references never materialize fp32 copies of the multi-GB buffers.
"""

import pytest
import torch

from fastcomm.kernels import dequantize, pack, quantize, quantize_reference, unpack

from .helpers import needs_cuda

pytestmark = needs_cuda

BIG = 2**31 + 4102  # elements: past the int32 range


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    from fastcomm.kernels import _launch

    if _launch._interpreting():
        pytest.skip("triton was imported in interpreter mode")
    monkeypatch.setenv("FASTCOMM_KERNELS", "triton")
    yield
    torch.cuda.empty_cache()


def test_pack_unpack_over_2_31_elements():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(2**30 + 5, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(BIG - a.numel(), device="cuda", dtype=torch.bfloat16, generator=g)
    flat = pack([a, b])
    assert flat.numel() == BIG
    assert torch.equal(flat[: a.numel()], a) and torch.equal(flat[a.numel() :], b)
    del a
    b2 = torch.zeros_like(b)
    tail = torch.zeros(2**30 + 5, device="cuda", dtype=torch.bfloat16)
    unpack(flat, [tail, b2], scale=2.0)
    assert torch.equal(b2, b * 2)  # exact: scaling by 2 does not round


def test_quantize_over_2_31_elements():
    block = 256
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(BIG, device="cuda", dtype=torch.bfloat16, generator=g)
    error = torch.zeros(BIG, device="cuda", dtype=torch.bfloat16)
    q, scales = quantize(x, dtype=torch.int8, block=block, error=error)
    assert scales.numel() == -(-BIG // block)
    # Pieces at the start, across the 2**31 boundary and at the (partial) end.
    for start in (0, 2**31 - 8 * block, (BIG // block) * block - 4 * block):
        end = min(start + 16 * block, BIG)
        q_ref, s_ref = quantize_reference(x[start:end].cpu(), dtype=torch.int8, block=block)
        assert torch.equal(q[start:end].cpu(), q_ref)
        assert torch.equal(scales[start // block : -(-end // block)].cpu(), s_ref)
        assert bool(error[start:end].any())
    del error, x
    out = dequantize(q, scales, out=torch.empty(BIG, device="cuda", dtype=torch.bfloat16))
    for start in (0, 2**31 - 8 * block, BIG - 1000):
        s = scales[start // block : -(-(start + 1000) // block)].repeat_interleave(block)
        offset = start % block
        want = (q[start : start + 1000].float() * s[offset : offset + 1000]).bfloat16()
        assert torch.equal(out[start : start + 1000], want)


def test_side_stream_and_cached_tables():
    tensors = [torch.randn(n, device="cuda") for n in (10, 5000, 3)]
    out = torch.empty(5013, device="cuda")
    expected = torch.cat(tensors)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for _ in range(3):  # first call builds the block table, the others reuse it
        with torch.cuda.stream(side):
            pack(tensors, out=out)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(out, expected)
        out.zero_()
        side.wait_stream(torch.cuda.current_stream())
