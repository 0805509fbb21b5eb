"""Allreduce hooks: plain, fp16 and bf16 compression.

Each follows torch's contract ``hook(state, bucket) -> Future[Tensor]``. ``state`` names the
group to reduce over: ``None`` (the DDP's own communicator), a fastcomm communicator, or a
torch ``ProcessGroup``. The compression hooks pack the gradients straight into a half-precision
buffer with the averaging applied (one fused kernel) and resolve to that buffer; the reducer's
unpack casts it back into ``.grad`` (one more kernel). torch's hooks take two passes each way
(``buffer()`` then ``.to(dtype).div_()``; ``copy_`` then unpack).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from fastcomm.comm import Communicator, group_communicator

from ..bucket import GradBucket

__all__ = [
    "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook", "hook_comm", "successor",
]

# group -> its communicator, for every hook of the process; an entry goes with its group
_ADAPTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hook_comm(group: object, bucket: GradBucket) -> Communicator:
    """The communicator a hook reduces over: `group` if it names one, else the DDP's. A
    communicator that in-place recovery replaced (a lost rank, a joiner) stands for its
    successor (``replaced_by``): a state made with the failed one follows the DDP's, and so
    does a torch ``ProcessGroup`` of the members the DDP had before it changed
    (``first_members``; a torch group cannot be rebuilt over the survivors, and one spanning
    the lost rank would fail). Any other torch group is its own, whatever its size."""
    if group is None:
        return bucket.comm
    if isinstance(group, Communicator):
        return successor(group)
    if isinstance(group, dist.ProcessGroup):
        own = bucket.comm
        members = getattr(own, "first_members", None)
        if members is not None and _global_ranks(group) == members:
            return own
        comm = _ADAPTED.get(group)
        if comm is None or comm.closed:
            comm = _ADAPTED[group] = group_communicator(group)
        return comm
    raise TypeError(
        f"hook state must be None, a fastcomm Communicator or a torch ProcessGroup, got "
        f"{type(group).__name__}"
    )


def _global_ranks(group: dist.ProcessGroup) -> tuple[int, ...] | None:
    """`group`'s members in torch's global numbering; ``None`` for a group torch does not
    know (made by hand, not by ``new_group``)."""
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (ValueError, RuntimeError):
        return None


def successor(comm: Communicator) -> Communicator:
    """`comm`, or the communicator that replaced it after a shrink or a regrow (the last of
    a chain of them)."""
    while getattr(comm, "replaced_by", None) is not None:
        comm = comm.replaced_by
    return comm


def average_scale(comm: Communicator, bucket: GradBucket) -> float:
    """``1 / size`` of `comm`; the DDP's own factor (which ``join`` may change) for its comm."""
    return bucket.scale() if comm is bucket.comm else 1.0 / comm.size


def _reduce_as(dtype: torch.dtype | None, group: object, bucket: GradBucket):
    comm = hook_comm(group, bucket)
    flat = bucket.packed(dtype, average_scale(comm, bucket))
    return comm.all_reduce(flat, async_op=True).get_future()


def allreduce_hook(state: object, bucket: GradBucket) -> torch.futures.Future:
    """Averages the bucket with one allreduce: what DDP does without a hook."""
    return _reduce_as(None, state, bucket)


def fp16_compress_hook(state: object, bucket: GradBucket) -> torch.futures.Future:
    """Communicates in float16: averaged while packing, cast back while unpacking."""
    return _reduce_as(torch.float16, state, bucket)


def bf16_compress_hook(state: object, bucket: GradBucket) -> torch.futures.Future:
    """Communicates in bfloat16: averaged while packing, cast back while unpacking."""
    return _reduce_as(torch.bfloat16, state, bucket)


def make_cast_hook(dtype: torch.dtype):
    """The hook a DDP with ``mixed_precision.reduce_dtype`` installs: reduce in `dtype`."""

    def cast_hook(state: object, bucket: GradBucket) -> torch.futures.Future:
        return _reduce_as(dtype, state, bucket)

    cast_hook.__name__ = f"reduce_in_{str(dtype).removeprefix('torch.')}_hook"
    return cast_hook
