"""Reduction straight out of peers' buffers: the data kernel of the kernel collectives.

`peer_reduce(srcs, dsts, op=..., scale=...)` reads every buffer of `srcs` elementwise (views of
peers' memory mapped into this process: POSIX shm on CPU, CUDA IPC on GPU), reduces them (sum,
max, min; ``avg``), applies `scale` and writes the result to every buffer of `dsts`, in one
launch over a table of int64 addresses. `peer_reduce_table` takes a transport's own tables and
per-round byte offsets, so nothing is built or uploaded per call.

Invariants: synchronization between ranks is the transport's job, not this kernel's; operands
are combined in fp32 (fp64 for fp64) in the order of `srcs`, rank order on every rank, so every
rank computes the same bits; a `dsts` buffer may alias one of `srcs` (each program reads its
range before writing it).

One-shot and two-shot schedules, numerics: docs/kernels.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ._launch import (
    check_tensor,
    compute_dtype,
    fp32_scale,
    kernel_backend,
    runnable,
    tl,
    tl_dtype,
    triton,
)

__all__ = [
    "PEER_REDUCE_OPS", "launch_peer_reduce_table", "peer_reduce", "peer_reduce_reference",
    "peer_reduce_table", "reduce_unchecked",
]

#: Operations `peer_reduce` accepts.
PEER_REDUCE_OPS = ("sum", "avg", "max", "min")
#: dtypes the peer buffers may have.
PEER_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: Most buffers on either side of one launch (the kernel unrolls its loops over them).
MAX_PEERS = 16

BLOCK = 2048
NUM_WARPS = 4

_OP_CODE = {"sum": 0, "avg": 0, "max": 1, "min": 2}


@triton.jit
def _peer_reduce_kernel(
    src_table,  # *int64 [N_SRC]: address (bytes) of each source buffer
    dst_table,  # *int64 [N_DST]: address (bytes) of each destination buffer
    src_offset,  # bytes added to every source address
    dst_offset,  # bytes added to every destination address
    numel,  # elements per buffer
    scale,  # fp32 factor, used when APPLY_SCALE
    N_SRC: tl.constexpr,  # number of source buffers
    N_DST: tl.constexpr,  # number of destination buffers
    DTYPE: tl.constexpr,  # element type of every buffer
    COMPUTE: tl.constexpr,  # fp32, or fp64 for fp64 buffers
    OP: tl.constexpr,  # 0 sum, 1 max, 2 min
    APPLY_SCALE: tl.constexpr,  # multiply the result by `scale`
    BLOCK: tl.constexpr,  # elements per program
):
    # int64 offsets: a workspace may pass 2**31 elements.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    first = (tl.load(src_table) + src_offset).to(tl.pointer_type(DTYPE))
    acc = tl.load(first + offs, mask=mask, other=0).to(COMPUTE)
    for r in tl.static_range(1, N_SRC):
        src = (tl.load(src_table + r) + src_offset).to(tl.pointer_type(DTYPE))
        x = tl.load(src + offs, mask=mask, other=0).to(COMPUTE)
        if OP == 0:
            acc = acc + x
        elif OP == 1:
            acc = tl.maximum(acc, x, propagate_nan=tl.PropagateNan.ALL)
        else:
            acc = tl.minimum(acc, x, propagate_nan=tl.PropagateNan.ALL)
    if APPLY_SCALE:
        acc = acc * scale
    out = acc.to(DTYPE)
    for d in tl.static_range(N_DST):
        dst = (tl.load(dst_table + d) + dst_offset).to(tl.pointer_type(DTYPE))
        tl.store(dst + offs, out, mask=mask)


def _check(srcs, dsts, op: str, scale) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """Validates the operands; returns them as lists and the effective fp32 scale."""
    if op not in PEER_REDUCE_OPS:
        raise ValueError(f"op={op!r} is not supported; allowed: {', '.join(PEER_REDUCE_OPS)}")
    lists = []
    for name, tensors in (("srcs", srcs), ("dsts", dsts)):
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
            raise TypeError(
                f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}"
            )
        if not 1 <= len(tensors) <= MAX_PEERS:
            raise ValueError(f"{name} has {len(tensors)} buffers; allowed: 1..{MAX_PEERS}")
        lists.append(list(tensors))
    srcs, dsts = lists
    first = srcs[0]
    check_tensor("srcs[0]", first, dtypes=PEER_DTYPES)
    for name, tensors in (("srcs", srcs), ("dsts", dsts)):
        for i, t in enumerate(tensors):
            check_tensor(f"{name}[{i}]", t, dtypes=(first.dtype,), device=first.device)
            if t.numel() != first.numel():
                raise ValueError(
                    f"{name}[{i}] has {t.numel()} elements; every buffer must have "
                    f"srcs[0]'s {first.numel()}"
                )
    if op in ("max", "min") and scale != 1.0:
        raise ValueError(f"scale={scale!r} applies to sum and avg only; {op} takes scale=1.0")
    scale = fp32_scale(scale)
    if op == "avg":
        scale = fp32_scale(scale / len(srcs))
    return srcs, dsts, scale


def peer_reduce(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    *,
    op: str = "sum",
    scale: float = 1.0,
) -> None:
    """Reduces `srcs` elementwise and writes the result into every buffer of `dsts`.

    Args:
        srcs: 1 to 16 contiguous buffers of one floating dtype, device and size (peers'
            slots mapped into this process, in rank order).
        dsts: 1 to 16 buffers like them to receive the result.
        op: ``"sum"``, ``"avg"`` (sum times ``1 / len(srcs)``), ``"max"`` or ``"min"``.
        scale: factor applied to a sum or average (rounded to fp32).

    Raises:
        TypeError: not lists of tensors, or a dtype other than fp32/fp16/bf16/fp64 or one
            that differs from ``srcs[0]``'s.
        ValueError: unknown op, a scale with max/min, buffers of different sizes or devices,
            non-contiguous buffers, or more than 16 on a side.
    """
    srcs, dsts, scale = _check(srcs, dsts, op, scale)
    numel = srcs[0].numel()
    if numel == 0:
        return
    if kernel_backend(srcs[0]) == "torch":
        reduce_unchecked(srcs, dsts, op, scale)
        return
    dtype, device = srcs[0].dtype, srcs[0].device
    src_table = _address_table(tuple(t.data_ptr() for t in srcs), device)
    dst_table = _address_table(tuple(t.data_ptr() for t in dsts), device)
    launch_peer_reduce_table(src_table, dst_table, 0, 0, numel, dtype, op, scale)


def peer_reduce_table(
    src_table: torch.Tensor,
    dst_table: torch.Tensor,
    *,
    numel: int,
    dtype: torch.dtype,
    src_offset: int = 0,
    dst_offset: int = 0,
    op: str = "sum",
    scale: float = 1.0,
) -> None:
    """`peer_reduce` over address tables the caller keeps (a transport's mapped workspaces).

    Reduces ``numel`` elements at ``src_table[i] + src_offset`` (bytes) over every ``i`` and
    writes the result at ``dst_table[j] + dst_offset`` for every ``j``: one table per set of
    mappings, uploaded once, and the round's position passed as offsets, so a chunked
    collective launches without building or uploading a table per call. No torch path: the
    addresses are followed by the kernel (on CPU only in Triton's interpreter).

    Args:
        src_table: int64 ``[n_src]`` addresses on the device the kernel runs on.
        dst_table: int64 ``[n_dst]`` addresses on the same device.
        numel: elements to reduce.
        dtype: element type behind every address (fp32/fp16/bf16/fp64).
        src_offset: bytes added to every source address (a multiple of the element size).
        dst_offset: bytes added to every destination address (likewise).
        op: ``"sum"``, ``"avg"`` (sum times ``1 / n_src``), ``"max"`` or ``"min"``.
        scale: factor applied to a sum or average (rounded to fp32).

    Raises:
        TypeError: tables that are not int64 tensors, or an unsupported dtype.
        ValueError: unknown op, a scale with max/min, offsets or sizes out of range, tables on
            different devices or with more than 16 entries.
        RuntimeError: the kernels cannot run on the tables' device.
    """
    if op not in PEER_REDUCE_OPS:
        raise ValueError(f"op={op!r} is not supported; allowed: {', '.join(PEER_REDUCE_OPS)}")
    if dtype not in PEER_DTYPES:
        allowed = ", ".join(str(d) for d in PEER_DTYPES)
        raise TypeError(f"dtype {dtype} is not supported; allowed: {allowed}")
    for name, table in (("src_table", src_table), ("dst_table", dst_table)):
        check_tensor(name, table, dtypes=(torch.int64,), device=src_table.device)
        if not 1 <= table.numel() <= MAX_PEERS:
            raise ValueError(f"{name} has {table.numel()} entries; allowed: 1..{MAX_PEERS}")
    itemsize = dtype.itemsize
    for name, value in (("src_offset", src_offset), ("dst_offset", dst_offset)):
        if value < 0 or value % itemsize:
            raise ValueError(
                f"{name}={value} must be a non-negative multiple of {dtype}'s {itemsize} bytes"
            )
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if op in ("max", "min") and scale != 1.0:
        raise ValueError(f"scale={scale!r} applies to sum and avg only; {op} takes scale=1.0")
    scale = fp32_scale(scale)
    if op == "avg":
        scale = fp32_scale(scale / src_table.numel())
    if numel == 0:
        return
    if kernel_backend(src_table) != "triton":
        raise RuntimeError(
            "peer_reduce_table follows raw addresses and has no torch path: it needs CUDA "
            "tables, or FASTCOMM_KERNELS=triton with TRITON_INTERPRET=1 for CPU ones"
        )
    launch_peer_reduce_table(src_table, dst_table, src_offset, dst_offset, numel, dtype, op, scale)


def launch_peer_reduce_table(
    src_table, dst_table, src_offset, dst_offset, numel, dtype, op, scale
) -> None:
    """`peer_reduce_table` with no argument checks, for a transport whose tables, dtype and op
    were checked once and whose offsets come from its own plan: ``numel > 0``, ``scale`` the
    effective fp32 factor (AVG's ``1 / n_src`` included)."""
    grid = (triton.cdiv(numel, BLOCK),)
    runnable(_peer_reduce_kernel)[grid](
        src_table,
        dst_table,
        src_offset,
        dst_offset,
        numel,
        scale,
        N_SRC=src_table.numel(),
        N_DST=dst_table.numel(),
        DTYPE=tl_dtype(dtype),
        COMPUTE=tl_dtype(compute_dtype(dtype)),
        OP=_OP_CODE[op],
        APPLY_SCALE=scale != 1.0,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )


def peer_reduce_reference(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    *,
    op: str = "sum",
    scale: float = 1.0,
) -> None:
    """The pure-torch `peer_reduce` (same arguments, same numerics)."""
    srcs, dsts, scale = _check(srcs, dsts, op, scale)
    if srcs[0].numel():
        reduce_unchecked(srcs, dsts, op, scale)


def reduce_unchecked(
    srcs: list[torch.Tensor], dsts: list[torch.Tensor], op: str, scale: float
) -> None:
    """`peer_reduce_reference`'s arithmetic on operands already known to be valid (``scale``
    already the effective fp32 factor, AVG's ``1 / len(srcs)`` included), for a caller that
    checked them once rather than per call (the ipc communicator's reduction).

    One fp32/fp64 destination of ``srcs[0]``'s shape that aliases at most ``srcs[0]`` or
    ``srcs[1]`` accumulates in place, allocating nothing; otherwise a compute-dtype
    accumulator is rounded once into every destination. Same bits either way.
    """
    first = srcs[0]
    out = dsts[0]
    in_place = (
        len(dsts) == 1
        and first.dtype in (torch.float32, torch.float64)
        and out.shape == first.shape
        and all(out.data_ptr() != x.data_ptr() for x in srcs[2:])
    )
    binary = torch.maximum if op == "max" else torch.minimum if op == "min" else torch.add
    if in_place:
        acc, rest = out, srcs[1:]
        if rest:
            binary(first, rest[0], out=acc)
            rest = rest[1:]
        elif acc.data_ptr() != first.data_ptr():
            acc.copy_(first)
    else:
        acc, rest = first.to(compute_dtype(first.dtype), copy=True), srcs[1:]
    for x in rest:
        binary(acc, x, out=acc)
    if scale != 1.0:
        acc.mul_(scale)
    if not in_place:
        result = acc.to(first.dtype)
        for d in dsts:
            d.copy_(result.view(d.shape))


@functools.lru_cache(maxsize=256)
def _address_table(ptrs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # A transport maps its peers once, so the same tables come back every call.
    return torch.tensor(ptrs, dtype=torch.int64).to(device)
