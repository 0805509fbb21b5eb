"""Fused unpack with gradient statistics: flat buffer -> tensors, plus their health, one pass.

`unpack_with_stats` does what `fastcomm.kernels.unpack` does and, from the same registers,
sums the squares of the values written and counts the NaN/+-Inf ones, so a DDP reducer gets
the norm for ``clip_grad_norm_`` without another pass.

Invariants: ``stats`` is a float32 ``[sum of squares, non-finite count]`` on the flat buffer's
device, *added* to (one ``stats`` can collect a bucket unpacked in several runs); values are
squared as stored (after the cast); counts are exact up to 2**24; sums agree with torch's to
fp32 rounding (another summation order). CPU tensors run the unpack reference, then one norm.

The kernel's partial sums and the CPU path: docs/kernels.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._launch import compute_dtype, kernel_backend
from ._pack import block_tables, launch_unpack, prepare_unpack, unpack_scan_torch

__all__ = ["unpack_with_stats", "unpack_with_stats_reference"]


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
    scan, flat, scale, _ = prepare_unpack(flat, tensors, scale, False)
    stats = _check_stats(stats, flat.device)
    if scan.total == 0:  # nothing to write or measure: no backend to choose
        return stats
    if kernel_backend(flat) == "torch":
        _unpack_stats_torch(flat, scan, scale, stats, lazy_count=True)
        return stats
    launch_unpack(block_tables(scan, flat), flat, scale, False, stats)
    return stats


def unpack_with_stats_reference(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    *,
    scale: float = 1.0,
    stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch `unpack_with_stats` (the test oracle); same arguments and result."""
    scan, flat, scale, _ = prepare_unpack(flat, tensors, scale, False)
    stats = _check_stats(stats, flat.device)
    _unpack_stats_torch(flat, scan, scale, stats, lazy_count=False)
    return stats


def _unpack_stats_torch(flat, scan, scale: float, stats: torch.Tensor, *, lazy_count) -> None:
    if not scan.tensors:
        return
    unpack_scan_torch(flat, scan, scale, False)
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
