"""Fused unpack with gradient statistics: flat buffer -> tensors, plus their health, one pass.

`unpack_with_stats` does what `fastcomm.kernels.unpack` does (slices of a flat buffer written
into tensors, scaled and cast) and, from the same registers, the two numbers a training loop
otherwise spends two more passes on: the sum of squares of the values written (the squared
L2 norm that ``clip_grad_norm_`` needs) and how many of them are NaN or +-Inf. A DDP reducer
unpacks every averaged gradient once anyway, so the statistics cost no extra memory traffic.

Layout of the result: ``stats`` is a float32 tensor of 2 elements on the flat buffer's device,
``[sum of squares, non-finite count]``; the results are *added* to it, so one ``stats`` can
collect a bucket unpacked in several runs. The count is exact up to 2**24 values.

Numerics: each value is squared as stored (after the cast to its tensor's dtype), in the
compute dtype (fp32, fp64 when an operand is fp64); the Triton kernel sums each block in
registers, writes one partial per block into a ``[2, n_blocks]`` buffer and one small torch
reduction adds the partials into ``stats``. The sum order differs from torch's, so sums of
squares agree to fp32 rounding (relative ~1e-6), counts exactly.

CPU tensors run the torch path: the unpack reference, then one norm over the written values;
the non-finite count is taken only when the sum of squares is not finite (a finite sum of
squares proves every value finite).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._launch import (
    block_table,
    compute_dtype,
    kernel_backend,
    runnable,
    tl,
    tl_dtype,
    triton,
)
from ._pack import _groups, _mid_dtype, _prepare_unpack, _unpack_torch

__all__ = ["unpack_with_stats", "unpack_with_stats_reference"]

#: Elements per program (as the plain unpack: the same block tables are reused).
BLOCK = 4096
NUM_WARPS = 4


@triton.jit
def _unpack_stats_kernel(
    table,  # *int64 [3, n_blocks]: destination address (bytes), flat offset, element count
    flat,  # *IN flat source buffer
    partials,  # *COMPUTE [2, n_blocks]: per block, sum of squares and non-finite count
    scale,  # fp32 factor, used when APPLY_SCALE
    n_blocks,  # number of blocks: the row stride of `table` and `partials`
    DST: tl.constexpr,  # element type of the destination tensors
    COMPUTE: tl.constexpr,  # fp32, or fp64 when an operand is fp64
    MID: tl.constexpr,  # type the result passes through before the final cast
    APPLY_SCALE: tl.constexpr,  # multiply by `scale`
    DST_ALIGN: tl.constexpr,  # bytes every destination address is a multiple of
    FLAT_VEC: tl.constexpr,  # elements every flat offset is a multiple of
    BLOCK: tl.constexpr,  # elements per program
):
    pid = tl.program_id(0)
    dst = tl.load(table + pid).to(tl.pointer_type(DST))
    flat_off = tl.load(table + n_blocks + pid)
    count = tl.load(table + 2 * n_blocks + pid)
    if DST_ALIGN > 1:
        dst = tl.multiple_of(dst, DST_ALIGN)
    if FLAT_VEC > 1:
        flat_off = tl.multiple_of(flat_off, FLAT_VEC)
    src = flat + flat_off
    offs = tl.arange(0, BLOCK)
    full = count == BLOCK
    if full:
        x = tl.load(src + offs)
    else:
        x = tl.load(src + offs, mask=offs < count, other=0.0)
    x = x.to(COMPUTE)
    if APPLY_SCALE:
        x = x * scale
    y = x.to(MID).to(DST)
    if full:
        tl.store(dst + offs, y)
    else:
        tl.store(dst + offs, y, mask=offs < count)
    # Statistics of the value as stored; masked lanes loaded 0 and add nothing.
    v = y.to(COMPUTE)
    sum_sq = tl.sum(v * v, axis=0)
    # v - v is 0 for every finite v, NaN for NaN and +-Inf: one test for both.
    bad = tl.sum(((v - v) != 0).to(COMPUTE), axis=0)
    tl.store(partials + pid, sum_sq)
    tl.store(partials + n_blocks + pid, bad)


def _new_stats(device: torch.device) -> torch.Tensor:
    return torch.zeros(2, dtype=torch.float32, device=device)


def _check_stats(stats, device: torch.device) -> torch.Tensor:
    if stats is None:
        return _new_stats(device)
    if not isinstance(stats, torch.Tensor):
        raise TypeError(f"stats must be a torch.Tensor, got {type(stats).__name__}")
    if stats.dtype != torch.float32 or stats.shape != (2,) or stats.device != device:
        raise ValueError(
            f"stats is a {stats.dtype} tensor of shape {tuple(stats.shape)} on {stats.device}; "
            f"expected float32 of shape (2,) on {device} (the flat buffer's device)"
        )
    return stats


def unpack_with_stats(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    *,
    scale: float = 1.0,
    stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """`unpack` (flat slices -> tensors, scaled and cast) that also measures what it wrote.

    Args:
        flat: contiguous 1-D floating buffer of exactly ``sum(t.numel())`` elements.
        tensors: contiguous floating tensors on `flat`'s device, overwritten in place.
        scale: factor (rounded to fp32) applied before the cast.
        stats: float32 tensor of 2 elements on `flat`'s device to add the results into
            (``[sum of squares, non-finite count]``); a new zeroed one when None.

    Returns:
        `stats`, updated on the device without a host synchronization (CUDA).

    Raises:
        TypeError: a non-tensor or non-floating operand, a non-numeric `scale`, or `stats`
            not a tensor.
        ValueError: operands on different devices, non-contiguous, `flat` of the wrong
            shape, or `stats` not a float32 (2,) tensor on `flat`'s device.
    """
    scan, flat, scale, _ = _prepare_unpack(flat, tensors, scale, False)
    stats = _check_stats(stats, flat.device)
    if scan.total == 0:  # nothing to write or measure: no backend to choose
        return stats
    if kernel_backend(flat) == "torch":
        _unpack_stats_torch(flat, scan, scale, stats, lazy_count=True)
        return stats
    kernel = runnable(_unpack_stats_kernel)
    for dst_dtype, ptrs, numels, offsets in _groups(scan):
        bt = block_table(ptrs, numels, offsets, dst_dtype.itemsize, flat, BLOCK)
        if bt.n_blocks == 0:  # a dtype group of zero-size tensors
            continue
        compute = compute_dtype(dst_dtype, flat.dtype)
        partials = torch.empty(2, bt.n_blocks, dtype=compute, device=flat.device)
        kernel[(bt.n_blocks,)](
            bt.table,
            flat,
            partials,
            scale,
            bt.n_blocks,
            DST=tl_dtype(dst_dtype),
            COMPUTE=tl_dtype(compute),
            MID=tl_dtype(_mid_dtype(dst_dtype)),
            APPLY_SCALE=scale != 1.0,
            DST_ALIGN=bt.tab_align,
            FLAT_VEC=bt.flat_vec,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
            enable_fp_fusion=False,
        )
        stats.add_(partials.sum(dim=1, dtype=torch.float32))
    return stats


def unpack_with_stats_reference(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    *,
    scale: float = 1.0,
    stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch `unpack_with_stats` (the test oracle); same arguments and result."""
    scan, flat, scale, _ = _prepare_unpack(flat, tensors, scale, False)
    stats = _check_stats(stats, flat.device)
    _unpack_stats_torch(flat, scan, scale, stats, lazy_count=False)
    return stats


def _unpack_stats_torch(flat, scan, scale: float, stats: torch.Tensor, *, lazy_count) -> None:
    if not scan.tensors:
        return
    _unpack_torch(flat, scan, scale, False)
    compute = compute_dtype(flat.dtype, *set(scan.dtypes))
    if scale == 1.0 and set(scan.dtypes) == {flat.dtype}:
        values = flat  # a plain copy: the tensors hold exactly the flat buffer's values
    else:
        values = torch.cat([t.reshape(-1) for t in scan.tensors if t.numel()] or [flat[:0]])
    # One vectorized norm (half the time of a dot product here), squared: a few ulps off
    # the exact sum of squares, as any other summation order is.
    sum_sq = torch.linalg.vector_norm(values, dtype=compute).square()
    if lazy_count and math.isfinite(sum_sq.item()):
        bad = 0  # a finite sum of squares proves every value finite
    else:
        bad = values.numel() - int(torch.isfinite(values).sum())  # only on a bad step
    stats[0] += sum_sq.to(torch.float32)
    stats[1] += bad
