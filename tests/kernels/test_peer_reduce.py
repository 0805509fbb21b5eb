"""`peer_reduce` (the data kernel of the kernel collectives) against its torch reference.

Here the peers' buffers are tensors of this process; `test_peer_reduce_shm.py` runs the same
kernel on buffers that other processes mapped. Exact wherever no rounding to a narrower type
happens; bf16 results may sit 1 ulp toward zero in the interpreter (see helpers).
"""

import pytest
import torch

from fastcomm.kernels import kernel_backend, peer_reduce, peer_reduce_reference

from .helpers import assert_equal_or_1ulp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# 1 element, a partial block, several blocks with a partial last one
SIZES = [1, 1000, 2 * 2048 + 3]


def _buffers(n: int, numel: int, dtype, device, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen).to(dtype).to(device) for _ in range(n)]


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("n_src", [1, 2, 3, 4])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(device, interpreted, dtype, op, n_src, numel):
    srcs = _buffers(n_src, numel, dtype, device)
    got = torch.full((numel,), float("nan"), dtype=dtype, device=device)
    want = torch.empty(numel, dtype=dtype)
    peer_reduce(srcs, [got], op=op)
    peer_reduce_reference([s.cpu() for s in srcs], [want], op=op)
    # sums and averages round to bf16 once at the end; max/min pick an input exactly
    assert_equal_or_1ulp(got, want, interpreted and op in ("sum", "avg"))


def test_fp32_sum_is_the_rank_order_sum(device):
    """Every rank adds its peers in rank order: the result is that fp32 sum, bit for bit."""
    srcs = _buffers(3, 5000, torch.float32, device, seed=3)
    assert kernel_backend(srcs[0]) == "triton"  # the kernel itself runs, not the reference
    got = torch.empty(5000, device=device)
    peer_reduce(srcs, [got], op="sum")
    want = (srcs[0].cpu() + srcs[1].cpu()) + srcs[2].cpu()
    torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_is_folded_in(device, interpreted, dtype):
    srcs = _buffers(2, 3000, dtype, device, seed=1)
    got = torch.empty(3000, dtype=dtype, device=device)
    want = torch.empty(3000, dtype=dtype)
    peer_reduce(srcs, [got], op="sum", scale=0.125)
    peer_reduce_reference([s.cpu() for s in srcs], [want], op="sum", scale=0.125)
    assert_equal_or_1ulp(got, want, interpreted)
    # avg is the sum times 1/n, both rounded once
    avg = torch.empty(3000, dtype=dtype, device=device)
    half = torch.empty(3000, dtype=dtype, device=device)
    peer_reduce(srcs, [avg], op="avg")
    peer_reduce(srcs, [half], op="sum", scale=0.5)
    torch.testing.assert_close(avg.cpu(), half.cpu(), atol=0, rtol=0)


def test_writes_every_destination(device):
    srcs = _buffers(3, 4100, torch.float32, device, seed=2)
    dsts = [torch.zeros(4100, device=device) for _ in range(4)]
    peer_reduce(srcs, dsts, op="sum")
    want = torch.empty(4100)
    peer_reduce_reference([s.cpu() for s in srcs], [want])
    for d in dsts:
        torch.testing.assert_close(d.cpu(), want, atol=0, rtol=0)


def test_in_place_into_a_source(device):
    """A rank may reduce into its own slot: each program reads its range before writing it."""
    srcs = _buffers(3, 4500, torch.float32, device, seed=4)
    want = torch.empty(4500)
    peer_reduce_reference([s.cpu() for s in srcs], [want])
    peer_reduce(srcs, [srcs[1]], op="sum")
    torch.testing.assert_close(srcs[1].cpu(), want, atol=0, rtol=0)


def test_views_at_offsets(device):
    """Chunks of larger buffers (the two-shot schedule) at unaligned element offsets."""
    big = _buffers(2, 10_000, torch.float16, device, seed=5)
    out = torch.zeros(10_000, dtype=torch.float16, device=device)
    lo, hi = 3333, 6667
    peer_reduce([b[lo:hi] for b in big], [out[lo:hi]], op="max")
    want = torch.maximum(big[0].cpu(), big[1].cpu())[lo:hi]
    torch.testing.assert_close(out.cpu()[lo:hi], want, atol=0, rtol=0)
    assert not out.cpu()[:lo].any() and not out.cpu()[hi:].any()


@pytest.mark.parametrize("op", ["max", "min"])
def test_nan_propagates_through_max_and_min(device, op):
    a = torch.tensor([1.0, float("nan"), 3.0, -1.0], device=device)
    b = torch.tensor([float("nan"), 2.0, 0.0, float("inf")], device=device)
    got = torch.empty(4, device=device)
    peer_reduce([a, b], [got], op=op)
    want = (torch.maximum if op == "max" else torch.minimum)(a.cpu(), b.cpu())
    torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0, equal_nan=True)


def test_empty_buffers_are_a_no_op(device):
    """Empty views into filled buffers: the call returns and no byte around them changes (a
    launch at their addresses would write the neighbours); their arguments are still checked."""
    src_base = torch.arange(8.0, device=device)
    dst_base = torch.full((8,), 7.0, device=device)
    srcs, dst = [src_base[2:2], src_base[5:5]], dst_base[4:4]
    assert peer_reduce(srcs, [dst]) is None
    assert peer_reduce(srcs, [dst], op="max") is None
    torch.testing.assert_close(dst_base.cpu(), torch.full((8,), 7.0), atol=0, rtol=0)
    torch.testing.assert_close(src_base.cpu(), torch.arange(8.0), atol=0, rtol=0)
    with pytest.raises(ValueError, match="op"):
        peer_reduce(srcs, [dst], op="product")


def test_fp64_computes_in_fp64(device):
    srcs = [torch.full((10,), 1e20, dtype=torch.float64, device=device),
            torch.full((10,), 1.0, dtype=torch.float64, device=device),
            torch.full((10,), -1e20, dtype=torch.float64, device=device)]
    got = torch.empty(10, dtype=torch.float64, device=device)
    peer_reduce(srcs, [got])
    want = torch.empty(10, dtype=torch.float64)
    peer_reduce_reference([s.cpu() for s in srcs], [want])
    torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0)


def _bad_cases():
    f = torch.zeros(8)
    return [
        (TypeError, "list or tuple", lambda: peer_reduce(f, [f])),
        (ValueError, "allowed: 1..16", lambda: peer_reduce([], [f])),
        (ValueError, "allowed: 1..16", lambda: peer_reduce([f] * 17, [f])),
        (ValueError, "op='prod'", lambda: peer_reduce([f], [f], op="prod")),
        (TypeError, "dtype torch.int32", lambda: peer_reduce([f.int()], [f.int()])),
        (TypeError, "dtype torch.float16", lambda: peer_reduce([f, f.half()], [f])),
        (ValueError, "9 elements", lambda: peer_reduce([f, torch.zeros(9)], [f])),
        (ValueError, "not contiguous", lambda: peer_reduce([torch.zeros(16)[::2]], [f])),
        (ValueError, "scale=0.5 applies to sum and avg", lambda: peer_reduce([f], [f], op="max",
                                                                              scale=0.5)),
        (ValueError, "finite", lambda: peer_reduce([f], [f], scale=float("inf"))),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
@pytest.mark.parametrize("fn", ["kernel", "reference"])
def test_bad_input_raises_before_writing(case, fn):
    error, text, call = _bad_cases()[case]
    if fn == "reference":  # same validation: swap the function the lambda calls
        import fastcomm.kernels._peer_reduce as mod

        call.__globals__["peer_reduce"] = mod.peer_reduce_reference
        try:
            with pytest.raises(error, match=_escape(text)):
                call()
        finally:
            call.__globals__["peer_reduce"] = mod.peer_reduce
        return
    with pytest.raises(error, match=_escape(text)):
        call()


def _escape(text: str) -> str:
    import re

    return re.escape(text)
