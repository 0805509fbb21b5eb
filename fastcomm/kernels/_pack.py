"""Fused multi-tensor pack and unpack: a bucket of tensors <-> one flat buffer, one launch.

`pack` flattens a list of tensors into one 1-D buffer (optionally scaled and cast); `unpack`
writes (or adds) slices of a flat buffer back into the tensors (optionally scaled: a DDP
reducer's ``1/world``). One launch per source dtype, through a block table (``_launch.py``).
The torch path (`pack_torch`, `unpack_torch`) serves the references, CPU tensors and
`PackPlan` alike, through a `TorchLayout`, so all give the same bits.

Invariants: each element is computed in fp32 (fp64 when an operand is fp64), scaled by `scale`
rounded to fp32, and rounded once to the target dtype; without scale or cast the data is
copied bit for bit. `out`/`flat` must not overlap the tensors (undefined result if they do).

Numerics in detail: docs/kernels.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ._launch import (
    FLOAT_DTYPES,
    TensorList,
    block_table,
    check_out,
    check_tensor,
    compute_dtype,
    fp32_scale,
    kernel_backend,
    runnable,
    scan_tensors,
    tl,
    tl_dtype,
    triton,
)

__all__ = ["pack", "unpack", "pack_reference", "unpack_reference"]

#: Elements per program; a tensor's blocks start at its first element.
BLOCK = 4096
#: Warps per program. On one H200 (bench/results/gpu-h200-2026-11-28-4138442/probe.log), 4096
#: elements with 16 warps ran the scaled pack and unpack of 8 x 1M fp32 at 3.0-3.1 TB/s (a
#: flat copy of the same size: 3.2), against 2.1-2.2 with 4 warps; the plain pack was at
#: 2.8-3.1 in every setting tried (1K to 16K elements, 4 to 16 warps).
NUM_WARPS = 16


@triton.jit
def _pack_kernel(
    table,  # *int64 [3, n_blocks]: source address (bytes), flat offset, element count
    flat,  # *OUT flat destination buffer
    scale,  # fp32 factor, used when APPLY_SCALE
    n_blocks,  # number of blocks: the row stride of `table`
    SRC: tl.constexpr,  # element type of the source tensors
    COMPUTE: tl.constexpr,  # fp32, or fp64 when an operand is fp64
    MID: tl.constexpr,  # type the result passes through before the final cast
    CAST: tl.constexpr,  # False: same dtype and no scale, a plain copy
    APPLY_SCALE: tl.constexpr,  # multiply by `scale`
    SRC_ALIGN: tl.constexpr,  # bytes every source address is a multiple of
    FLAT_VEC: tl.constexpr,  # elements every flat offset is a multiple of
    BLOCK: tl.constexpr,  # elements per program
):
    pid = tl.program_id(0)
    src = tl.load(table + pid).to(tl.pointer_type(SRC))
    flat_off = tl.load(table + n_blocks + pid)
    count = tl.load(table + 2 * n_blocks + pid)
    # Alignment promises let the compiler use 128-bit accesses.
    if SRC_ALIGN > 1:
        src = tl.multiple_of(src, SRC_ALIGN)
    if FLAT_VEC > 1:
        flat_off = tl.multiple_of(flat_off, FLAT_VEC)
    dst = flat + flat_off
    offs = tl.arange(0, BLOCK)
    # Full blocks go unmasked: a mask against an unknown count would defeat vectorization.
    if count == BLOCK:
        x = tl.load(src + offs)
    else:
        x = tl.load(src + offs, mask=offs < count)
    if CAST:
        if APPLY_SCALE:
            x = x.to(COMPUTE) * scale
        x = x.to(MID).to(flat.dtype.element_ty)
    if count == BLOCK:
        tl.store(dst + offs, x)
    else:
        tl.store(dst + offs, x, mask=offs < count)


@triton.jit
def _unpack_kernel(
    table,  # *int64 [3, n_blocks]: destination address (bytes), flat offset, element count
    flat,  # *IN flat source buffer
    partials,  # *COMPUTE [2, n_blocks]: per block, sum of squares and non-finite count (STATS)
    scale,  # fp32 factor, used when APPLY_SCALE
    n_blocks,  # number of blocks: the row stride of `table` and `partials`
    DST: tl.constexpr,  # element type of the destination tensors
    COMPUTE: tl.constexpr,  # fp32, or fp64 when an operand is fp64
    MID: tl.constexpr,  # type the result passes through before the final cast
    CAST: tl.constexpr,  # False: same dtype, no scale, no accumulation, a plain copy
    APPLY_SCALE: tl.constexpr,  # multiply by `scale`
    ACCUMULATE: tl.constexpr,  # add into the destination instead of overwriting it
    STATS: tl.constexpr,  # also write the block's statistics of what it stored
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
        x = tl.load(src + offs, mask=offs < count, other=0.0)  # 0: adds nothing to STATS
    if CAST:
        x = x.to(COMPUTE)
        if APPLY_SCALE:
            x = x * scale
        if ACCUMULATE:
            if full:
                acc = tl.load(dst + offs)
            else:
                acc = tl.load(dst + offs, mask=offs < count)
            x = acc.to(COMPUTE) + x
        x = x.to(MID).to(DST)
    if full:
        tl.store(dst + offs, x)
    else:
        tl.store(dst + offs, x, mask=offs < count)
    if STATS:
        # Statistics of the value as stored (see `unpack_with_stats`).
        v = x.to(COMPUTE)
        sum_sq = tl.sum(v * v, axis=0)
        # v - v is 0 for every finite v, NaN for NaN and +-Inf: one test for both.
        bad = tl.sum(((v - v) != 0).to(COMPUTE), axis=0)
        tl.store(partials + pid, sum_sq)
        tl.store(partials + n_blocks + pid, bad)


# --------------------------------------------------------------------------- host side


def _mid_dtype(target: torch.dtype) -> torch.dtype:
    # torch rounds fp64 -> 16-bit through fp32; so do the kernels, to match it bit for bit.
    return torch.float32 if target in (torch.float16, torch.bfloat16) else target


def _groups(scan: TensorList):
    """(dtype, ptrs, numels, flat offsets) per dtype present: one launch each."""
    kinds = set(scan.dtypes)
    if len(kinds) == 1:  # the usual bucket: no per-tensor work
        return [(scan.dtypes[0], scan.ptrs, scan.numels, scan.offsets)]
    groups = {}
    rows = zip(scan.dtypes, scan.ptrs, scan.numels, scan.offsets, strict=True)
    for dtype, ptr, numel, off in rows:
        g = groups.setdefault(dtype, ([], [], []))
        g[0].append(ptr)
        g[1].append(numel)
        g[2].append(off)
    return [(dtype, *g) for dtype, g in groups.items()]


def _prepare_pack(tensors, out, scale, dtype):
    scan = scan_tensors("tensors", tensors)
    if dtype is None:
        kinds = set(scan.dtypes)
        if len(kinds) > 1:
            names = ", ".join(sorted(str(d) for d in kinds))
            raise TypeError(f"tensors mix dtypes ({names}); pass dtype= to say what to pack into")
        if kinds:
            dtype = kinds.pop()
        else:
            dtype = out.dtype if isinstance(out, torch.Tensor) else torch.get_default_dtype()
    elif dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype={dtype}; allowed: {', '.join(str(d) for d in FLOAT_DTYPES)}")
    device = scan.device
    if device is None:
        device = out.device if isinstance(out, torch.Tensor) else torch.device("cpu")
    scale = fp32_scale(scale)
    if out is None:
        out = torch.empty(scan.total, dtype=dtype, device=device)
    else:
        check_out("out", out, numel=scan.total, dtype=dtype, device=device)
    return scan, out, scale


def pack(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Flatten `tensors` into one 1-D buffer, in list order, scaled and cast, in one launch.

    Args:
        tensors: contiguous floating tensors (any shapes, including empty) on one device.
            Mixed dtypes are allowed with an explicit `dtype`; they cost one launch per dtype.
        out: 1-D contiguous buffer of ``sum(t.numel())`` elements of `dtype` to write into;
            may be a view into a larger buffer (a bucket). Allocated when None.
        scale: every element is multiplied by it (rounded to fp32) before the cast.
        dtype: dtype of the result; default: the inputs' dtype.

    Returns:
        `out`, or the new buffer.

    Raises:
        TypeError: a non-tensor or non-floating input, mixed input dtypes without `dtype`,
            `out` of the wrong dtype, or a non-numeric `scale`.
        ValueError: inputs or `out` on different devices, non-contiguous, or `out` of the
            wrong shape.
    """
    scan, out, scale = _prepare_pack(tensors, out, scale, dtype)
    if scan.total == 0:  # nothing to move: no kernel, so no device it must run on
        return out
    if kernel_backend(out) == "torch":
        _pack_torch(scan, out, scale)
        return out
    launch_pack(block_tables(scan, out), out, scale)
    return out


def block_tables(scan: TensorList, flat: torch.Tensor) -> list:
    """(dtype, block table) of each dtype group of `scan` placed in `flat`."""
    return [
        (dtype, block_table(ptrs, numels, offsets, dtype.itemsize, flat, BLOCK))
        for dtype, ptrs, numels, offsets in _groups(scan)
    ]


def launch_pack(tables, out: torch.Tensor, scale: float) -> None:
    """One `_pack_kernel` launch per (source dtype, block table) of `tables` into `out`."""
    kernel = runnable(_pack_kernel)
    for src_dtype, bt in tables:
        if bt.n_blocks == 0:  # a dtype group of zero-size tensors
            continue
        kernel[(bt.n_blocks,)](
            bt.table,
            out,
            scale,
            bt.n_blocks,
            SRC=tl_dtype(src_dtype),
            COMPUTE=tl_dtype(compute_dtype(src_dtype, out.dtype)),
            MID=tl_dtype(_mid_dtype(out.dtype)),
            CAST=src_dtype != out.dtype or scale != 1.0,
            APPLY_SCALE=scale != 1.0,
            SRC_ALIGN=bt.tab_align,
            FLAT_VEC=bt.flat_vec,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
            enable_fp_fusion=False,
        )


def unpack(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    *,
    scale: float = 1.0,
    accumulate: bool = False,
) -> None:
    """Write consecutive slices of `flat` into `tensors`, scaled and cast, in one launch.

    Tensor ``i`` receives ``flat[o_i : o_i + numel_i] * scale`` (``o_i`` the running sum of
    the previous numels) cast to its own dtype, or that value added to it when
    `accumulate` (the sum taken in the compute dtype and rounded once).

    Args:
        flat: contiguous 1-D floating buffer of exactly ``sum(t.numel())`` elements.
        tensors: contiguous floating tensors on `flat`'s device, updated in place; mixed
            dtypes cost one launch per dtype.
        scale: factor (rounded to fp32), e.g. ``1 / world_size`` to average.
        accumulate: add into `tensors` instead of overwriting them.

    Raises:
        TypeError: a non-tensor or non-floating operand, or a non-numeric `scale`.
        ValueError: operands on different devices, non-contiguous, or `flat` of the wrong
            shape.
    """
    scan, flat, scale, accumulate = prepare_unpack(flat, tensors, scale, accumulate)
    if scan.total == 0:  # nothing to move: no kernel, so no device it must run on
        return
    if kernel_backend(flat) == "torch":
        unpack_scan_torch(flat, scan, scale, accumulate)
        return
    launch_unpack(block_tables(scan, flat), flat, scale, accumulate)


def launch_unpack(
    tables,
    flat: torch.Tensor,
    scale: float,
    accumulate: bool,
    stats: torch.Tensor | None = None,
    *,
    partials: torch.Tensor | None = None,
    set_stats: bool = False,
) -> None:
    """One `_unpack_kernel` launch per (destination dtype, block table) of `tables`.

    With `stats` (float32 ``[sum of squares, non-finite count]``), each launch also measures
    the values it stores and adds its blocks' partial sums into `stats` (with `set_stats`,
    the first launch writes them instead: no zeroing launch before). `partials` is the
    kernel's per-block scratch (``[2, n_blocks]`` of the compute dtype, for a single table,
    reused by a caller that launches it again; allocated per launch when None).
    """
    kernel = runnable(_unpack_kernel)
    assign = stats is not None and set_stats  # the next measured launch writes `stats`
    for dst_dtype, bt in tables:
        if bt.n_blocks == 0:  # a dtype group of zero-size tensors
            continue
        compute = compute_dtype(dst_dtype, flat.dtype)
        scratch = bt.table  # not read unless STATS
        if stats is not None:
            scratch = partials
            if scratch is None:
                scratch = torch.empty(2, bt.n_blocks, dtype=compute, device=flat.device)
        kernel[(bt.n_blocks,)](
            bt.table,
            flat,
            scratch,
            scale,
            bt.n_blocks,
            DST=tl_dtype(dst_dtype),
            COMPUTE=tl_dtype(compute),
            MID=tl_dtype(_mid_dtype(dst_dtype)),
            CAST=dst_dtype != flat.dtype or scale != 1.0 or accumulate,
            APPLY_SCALE=scale != 1.0,
            ACCUMULATE=accumulate,
            STATS=stats is not None,
            DST_ALIGN=bt.tab_align,
            FLAT_VEC=bt.flat_vec,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
            enable_fp_fusion=False,
        )
        if stats is None:
            continue
        if assign:
            torch.sum(scratch, dim=1, dtype=torch.float32, out=stats)
            assign = False
        else:
            stats.add_(scratch.sum(dim=1, dtype=torch.float32))
    if assign:  # nothing was measured: the tensors hold no element
        stats.zero_()


def prepare_unpack(flat, tensors, scale, accumulate):
    check_tensor("flat", flat, dtypes=FLOAT_DTYPES)
    scan = scan_tensors("tensors", tensors)
    if scan.device is not None and scan.device != flat.device:
        raise ValueError(f"tensors[0] is on {scan.device}; expected {flat.device} like flat")
    if flat.dim() != 1 or flat.numel() != scan.total:
        raise ValueError(
            f"flat has shape {tuple(flat.shape)}; expected ({scan.total},), the tensors' total"
        )
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
    return scan, flat, fp32_scale(scale), accumulate


# --------------------------------------------------------------------------- references


def pack_reference(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pure-torch `pack` (what CPU tensors run, and the test oracle); same arguments."""
    scan, out, scale = _prepare_pack(tensors, out, scale, dtype)
    _pack_torch(scan, out, scale)
    return out


def unpack_reference(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    *,
    scale: float = 1.0,
    accumulate: bool = False,
) -> None:
    """Pure-torch `unpack` (what CPU tensors run, and the test oracle); same arguments."""
    scan, flat, scale, accumulate = prepare_unpack(flat, tensors, scale, accumulate)
    unpack_scan_torch(flat, scan, scale, accumulate)


def _pack_torch(scan: TensorList, out: torch.Tensor, scale: float) -> None:
    """`pack_torch` for one call of `pack` or `pack_reference`."""
    pack_torch(scan.tensors, out, scale, _CallLayout(scan))


def unpack_scan_torch(flat: torch.Tensor, scan: TensorList, scale: float, accumulate: bool) -> None:
    """`unpack_torch` for one call of `unpack`, `unpack_reference` or `unpack_with_stats`."""
    unpack_torch(flat, scan.tensors, scale, accumulate, _CallLayout(scan))


# --------------------------------------------------------------------------- torch path

#: Dtypes in which ``x * scale`` (and ``acc + x``) rounds once without a wider compute type,
#: so whole-buffer torch ops give the kernel's bits.
_WIDE = (torch.float32, torch.float64)


class TorchLayout(Protocol):
    """What the torch pack and unpack need of a bucket besides its tensors.

    `PackPlan` keeps it across calls (views per buffer, a scratch buffer per dtype); for
    `pack`/`unpack` and the references, `_CallLayout` makes it per call.
    """

    #: Distinct dtypes of the tensors, in first-seen order.
    dtypes: list[torch.dtype]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` (the bucket's length) shaped like the tensors, back to back."""

    def cat_inputs(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """`tensors` as 1-D tensors for one ``torch.cat``, or None: copy through `views`."""

    def scratch(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of `flat`'s length and device in `dtype`, free to overwrite until the
        next call."""


class _CallLayout:
    """`TorchLayout` of a single call: nothing is kept, so each piece is what costs least
    to make once (``torch.cat`` of flattened tensors to gather; views only where a per-tensor
    cast needs them)."""

    __slots__ = ("tensors", "dtypes")

    def __init__(self, scan: TensorList) -> None:
        self.tensors = scan.tensors
        dtypes = scan.dtypes
        if len(dtypes) > 1:
            # The usual bucket has one dtype: counting it is a C loop of identity checks,
            # several times cheaper than hashing every dtype into a dict or a set.
            uniform = dtypes.count(dtypes[0]) == len(dtypes)
            dtypes = dtypes[:1] if uniform else list(dict.fromkeys(dtypes))
        self.dtypes = dtypes

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        # One C++ loop, not 500 slicings in Python.
        return list(torch._utils._unflatten_dense_tensors(flat, self.tensors))

    def cat_inputs(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # 1-D tensors go in as they are: a Python-made view costs host time per tensor here
        # (docs/kernels.md), which is most of a 500-tensor bucket of small gradients.
        # (`scan_tensors` checked that every tensor is contiguous, so `view` cannot fail.)
        return [t if t.dim() == 1 else t.view(-1) for t in tensors]

    def scratch(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(flat.numel(), dtype=dtype, device=flat.device)


def pack_torch(
    tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float, layout: TorchLayout
) -> None:
    """The torch pack: `tensors` back to back into `out`, scaled and cast as the kernel does.

    What CPU tensors run (through `pack`, `pack_reference` and `PackPlan`), and the small
    CUDA copies a `PackPlan` makes without a launch.

    Args:
        tensors: the bucket's floating tensors; any strides where `layout` gathers through
            views (a `PackPlan`'s).
        out: contiguous 1-D buffer of the tensors' total length.
        scale: factor, already rounded to fp32 (`fp32_scale`).
        layout: views, 1-D inputs and scratch for these tensors.
    """
    if not tensors:
        return
    dtypes = layout.dtypes
    if dtypes == [out.dtype] and (scale == 1.0 or out.dtype in _WIDE):
        # One gather (and one multiply) for the whole bucket: x * scale rounds once either
        # way in fp32/fp64.
        _gather(tensors, out, layout)
        if scale != 1.0:
            out.mul_(scale)
        return
    mid = _mid_dtype(out.dtype)
    if len(dtypes) == 1 and len(tensors) > 1:
        # One source dtype: gather it flat and convert the bucket at once, three torch ops in
        # all instead of up to four per tensor, for one more pass over the source bytes (which
        # a single tensor, e.g. a whole bucket cast for a compression hook, does not pay).
        y = layout.scratch(out, dtypes[0])
        _gather(tensors, y, layout)
        y = y.to(compute_dtype(y.dtype, out.dtype))
        if scale != 1.0:
            y.mul_(scale)  # the scratch or a fresh conversion: ours to overwrite
        out.copy_(y.to(mid))
        return
    for v, t in zip(layout.views(out), tensors, strict=True):
        if t.dtype != out.dtype or scale != 1.0:
            t = t.to(compute_dtype(t.dtype, out.dtype))
            if scale != 1.0:
                t = t * scale
            t = t.to(mid)
        v.copy_(t)


def _gather(tensors: Sequence[torch.Tensor], flat: torch.Tensor, layout: TorchLayout) -> None:
    """Copies `tensors` (of `flat`'s dtype) back to back into `flat`."""
    inputs = layout.cat_inputs(tensors)
    if inputs is not None:
        torch.cat(inputs, out=flat)
    else:
        torch._foreach_copy_(layout.views(flat), tensors)


def unpack_torch(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    scale: float,
    accumulate: bool,
    layout: TorchLayout,
) -> None:
    """The torch unpack: slices of `flat` into `tensors`, scaled, cast, maybe added, as the
    kernel does.

    What CPU tensors run (through `unpack`, `unpack_reference`, `unpack_with_stats` and
    `PackPlan`), and the small CUDA copies a `PackPlan` makes without a launch.

    Args:
        flat: contiguous 1-D buffer of the tensors' total length.
        tensors: the floating tensors to write, in place (any strides).
        scale: factor, already rounded to fp32 (`fp32_scale`).
        accumulate: add into `tensors` instead of overwriting them.
        layout: views and scratch for these tensors.
    """
    if not tensors:
        return
    if layout.dtypes == [flat.dtype] and (
        flat.dtype in _WIDE or (scale == 1.0 and not accumulate)
    ):
        # One multiply, then one foreach op: every element still rounds once.
        if scale != 1.0:
            flat = torch.mul(flat, scale, out=layout.scratch(flat, flat.dtype))
        views = layout.views(flat)
        if accumulate:
            torch._foreach_add_(tensors, views)
        else:
            torch._foreach_copy_(tensors, views)
        return
    for t, v in zip(tensors, layout.views(flat), strict=True):
        compute = compute_dtype(t.dtype, flat.dtype)
        y = v.to(compute)
        if scale != 1.0:
            y = y * scale
        if accumulate:
            y = t.to(compute) + y
        t.copy_(y.to(_mid_dtype(t.dtype)))
