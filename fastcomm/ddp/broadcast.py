"""Broadcasts of parameters and buffers from one rank, packed into flat buffers, and the
construction-time check that every rank wraps the same parameters.

DDP's construction broadcasts rank 0's parameters and buffers, each forward (with
``broadcast_buffers``) rank 0's buffers, and ``join`` the buffers of the rank still training.

`broadcast_tensors` moves any mix of tensors (float parameters, int64 BatchNorm counters, bool
masks) from one rank to all in one collective per ~256 MiB: the source packs them into a byte
buffer -- one segment per dtype, 16-byte aligned, float segments filled by the fused pack
kernel -- and the receivers unpack the same segments. `verify_same_parameters` compares every
rank's parameter list and raises the same error on every rank, naming the first mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastcomm import kernels
from fastcomm.comm.base import Communicator
from fastcomm.kernels._launch import FLOAT_DTYPES

__all__ = ["ParameterMismatchError", "broadcast_tensors", "verify_same_parameters"]


class ParameterMismatchError(ValueError, RuntimeError):
    """Ranks wrap different parameters: a ``RuntimeError`` as torch DDP raises, and a
    ``ValueError`` as fastcomm always did, so either ``except`` catches it."""


_ALIGN = 16
CHUNK_BYTES = 256 * 1024 * 1024


def _describe(name: str, t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    return name, tuple(t.shape), str(t.dtype).removeprefix("torch.")


def verify_same_parameters(
    comm: Communicator, names: Sequence[str], params: Sequence[torch.Tensor]
) -> None:
    """Checks that every rank has the same number, shapes and dtypes of parameters.

    Raises:
        ParameterMismatchError: on every rank, with the first mismatch (rank 0 is the
            reference); a ``RuntimeError`` (torch's type) and a ``ValueError``.
    """
    mine = [_describe(n, p) for n, p in zip(names, params, strict=True)]
    everyone = comm.all_gather_object(mine)
    ref = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for k, (a, b) in enumerate(zip(ref, theirs, strict=False)):
            if a[1:] != b[1:]:
                raise ParameterMismatchError(
                    f"fastcomm DDP: parameters differ across ranks: parameter #{k} is "
                    f"{a[0]!r} with shape {a[1]} and dtype {a[2]} on rank 0 but {b[0]!r} with "
                    f"shape {b[1]} and dtype {b[2]} on rank {rank}; every rank must wrap the "
                    "same model"
                )
        if len(ref) != len(theirs):
            k = min(len(ref), len(theirs))
            extra = ref[k] if len(ref) > k else theirs[k]
            raise ParameterMismatchError(
                f"fastcomm DDP: parameters differ across ranks: rank 0 has {len(ref)} "
                f"parameters but rank {rank} has {len(theirs)}; the first one only one of them "
                f"has is #{k} {extra[0]!r} (shape {extra[1]}, dtype {extra[2]}); every rank must "
                "wrap the same model"
            )


def _chunks(tensors: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    chunks: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if chunks[-1] and size + nbytes > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(t)
        size += nbytes + _ALIGN
    return chunks


def _layout(tensors: Sequence[torch.Tensor]):
    """Segments ``(dtype, tensors, byte_offset, numel)`` and the total bytes."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    segments, offset = [], 0
    for dtype, ts in groups.items():
        numel = sum(t.numel() for t in ts)
        segments.append((dtype, ts, offset, numel))
        offset += -(-numel * ts[0].element_size() // _ALIGN) * _ALIGN
    return segments, offset


@torch.no_grad()
def broadcast_tensors(
    comm: Communicator,
    tensors: Sequence[torch.Tensor],
    src: int = 0,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Overwrites `tensors` on every rank with those of rank `src`, in place.

    One ``broadcast`` of a byte buffer per ``chunk_bytes`` of data; float tensors are packed
    and unpacked with the fused kernels, other dtypes with ``torch.cat``/``copy_``.
    """
    tensors = [t.detach() for t in tensors if t.numel()]
    if comm.size == 1 or not tensors:
        return
    device = tensors[0].device
    for chunk in _chunks(tensors, chunk_bytes):
        segments, total = _layout(chunk)
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        views = [
            buf[off : off + numel * ts[0].element_size()].view(dtype)
            for dtype, ts, off, numel in segments
        ]
        if comm.rank == src:
            for (dtype, ts, _, _), view in zip(segments, views, strict=True):
                if dtype in FLOAT_DTYPES:
                    kernels.pack([t.contiguous() for t in ts], view, dtype=dtype)
                else:
                    torch.cat([t.reshape(-1) for t in ts], out=view)
        comm.broadcast(buf, src=src)
        if comm.rank == src:
            continue
        for (dtype, ts, _, _), view in zip(segments, views, strict=True):
            if dtype in FLOAT_DTYPES and all(t.is_contiguous() for t in ts):
                kernels.unpack(view, ts)
                continue
            offset = 0
            for t in ts:
                t.copy_(view[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
