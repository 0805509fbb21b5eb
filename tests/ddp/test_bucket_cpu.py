"""CPU buckets pack and unpack through their own views: bit for bit what the kernels' torch
reference computes, for every layout a gradient may have (missing, transposed, many or few)."""

from __future__ import annotations

import pytest
import torch

from fastcomm import kernels
from fastcomm.ddp.bucket import Bucket, pack_bucket, unpack_bucket, unpack_grads


def make_bucket(count: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(count)
    shapes = [(3 + i % 5, 2 + i % 3) if i % 2 == 0 else (7 + i % 4,) for i in range(count)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen, dtype=dtype)) for s in shapes]
    grads = [torch.randn(*s, generator=gen, dtype=dtype) for s in shapes]
    return Bucket(0, list(range(count)), params, [f"p{i}" for i in range(count)]), grads


# few tensors take one multiply per tensor, many a foreach copy then one multiply
@pytest.mark.parametrize("count", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_pack_matches_the_reference(count, dtype, scale):
    bucket, grads = make_bucket(count, dtype)
    expected = kernels.pack_reference(grads, scale=scale, dtype=dtype)
    out = pack_bucket(bucket, grads, bucket.flat, scale=scale)
    assert out is bucket.flat
    assert torch.equal(out, expected)


@pytest.mark.parametrize("count", [5, 40])
def test_pack_with_missing_and_transposed_gradients(count):
    bucket, grads = make_bucket(count, torch.float32)
    grads[1] = None  # a parameter that got no gradient: zeros
    grads[2] = grads[2].t().contiguous().t()  # same values, column-major
    expected = torch.cat(
        [torch.zeros(p.numel()) if g is None else g.reshape(-1) * 0.25
         for g, p in zip(grads, bucket.params, strict=True)]
    )
    bucket.flat.fill_(7.0)  # stale values from a previous step must not survive
    pack_bucket(bucket, grads, bucket.flat, scale=0.25)
    assert torch.equal(bucket.flat, expected)


@pytest.mark.parametrize("count", [5, 40])
def test_unpack_matches_unpack_grads(count):
    bucket, grads = make_bucket(count, torch.float32)
    bucket.flat.copy_(torch.randn(bucket.numel, generator=torch.Generator().manual_seed(1)))
    targets = [torch.full_like(g, -1.0) for g in grads]
    targets[0] = None  # an unused parameter's slice stays unread
    targets[2] = torch.full_like(grads[2].t(), -1.0).t()  # a non-contiguous .grad
    expected = [None if t is None else torch.full_like(t, -1.0) for t in targets]
    unpack_grads(bucket.flat, expected, bucket.offsets, bucket.numel)
    unpack_bucket(bucket, bucket.flat, targets)
    for got, want in zip(targets, expected, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)
    # a flat view of the whole buffer (what a comm hook's future may resolve to) takes the
    # same path; another buffer goes through the kernels
    other = bucket.flat * 2
    unpack_bucket(bucket, other, targets)
    assert torch.equal(targets[1], (other[bucket.offsets[1] : bucket.offsets[2]]).view_as(
        targets[1]))
