"""The write-back that hands a reduced CPU bucket over as ``.grad`` instead of copying it.

Without bucket views, a packed bucket's reduced flat buffer is copied into every ``.grad`` at
the end of backward. `hand_over` makes each ``.grad`` that autograd created in this backward
(version 0, not a view, laid out as its bucket view: a tensor the caller cannot have held
before) a view of the reduced buffer instead; the other targets (gradients that existed before
backward) take a copy, as torch DDP's write-back does.

Invariant: the buffer is written again only once nothing but the reducer holds its storage.
`hand_over` counts the storage's uses before it gives any view out; `take_back`, when the next
backward (or a joined rank's shadow) starts, compares: ``zero_grad(set_to_none=True)`` dropped
the gradients and the buffer is reused; gradients someone still holds keep it, and the bucket
takes a new one. Taken only for the buckets in ``Reducer.hands_over`` (no comm hook, bucket
views, shared buckets; ``DDPConfig.hand_over_grads``; gradients averaging
``DDPConfig.shared_min_mean_bytes`` or more), on CPU, without ``create_graph`` or recovery.
"""

from __future__ import annotations

import torch

from .bucket import Bucket

__all__ = ["COUNTS_USES", "hand_over", "take_back", "uses"]

COUNTS_USES = hasattr(torch._C, "_storage_Use_Count")
"""Whether this torch counts a storage's uses (else nothing is handed over)."""


def uses(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) hold `t`'s storage."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def hand_over(reducer, bucket: Bucket, targets: list[torch.Tensor | None]) -> bool:
    """Writes `bucket`'s reduced flat buffer into its parameters' ``.grad`` (`targets`, from
    ``Bucket.grad_targets``) with as few copies as it can (see the module docstring); whether
    it did (else the caller unpacks as usual)."""
    if (
        bucket.index not in reducer.hands_over or reducer.create_graph
        or reducer.keeper is not None or bucket.device.type != "cpu"
    ):
        return False
    views = bucket.views
    fresh = [
        type(t) is torch.Tensor and t._version == 0 and t._base is None
        and t.dtype is v.dtype and t.stride() == v.stride() and t.shape == v.shape
        for t, v in zip(targets, views, strict=True)
    ]
    if not any(fresh):
        return False
    flat = bucket.flat
    reducer.handed[bucket.index] = uses(flat)
    written: list[torch.Tensor | None] = []
    into, out_of = [], []
    for p, t, v, offset, new in zip(
        bucket.params, targets, views, bucket.offsets, fresh, strict=True
    ):
        if new:  # a view of its own: the bucket's views stay the bucket's
            t = p.grad = flat[offset : offset + v.numel()].view(v.shape)
        elif t is not None:
            into.append(t)
            out_of.append(v)
        written.append(t)
    if into:
        torch._foreach_copy_(into, out_of)
    if reducer.health is not None:
        reducer.health.written(bucket, written)
    return True


def take_back(reducer, handed: dict[int, int]) -> None:
    """Before a backward writes the buckets: each bucket whose buffer the last write-back
    handed over (`handed`: bucket index -> its storage's uses then, the reducer's, which it
    clears) keeps it where only the reducer holds it now, else takes a new one."""
    if reducer.health is not None:
        reducer.health.begin_step()  # its records of the last step hold those gradients
    arrival_views = reducer._arrival_views
    for bucket in reducer.buckets:
        own = handed.get(bucket.index)
        if own is None or bucket.sparse or uses(bucket.flat) <= own:
            continue
        bucket.use_flat(torch.zeros_like(bucket.flat))
        for i, view in zip(bucket.param_indices, bucket.views, strict=True):
            if arrival_views[i] is not None:
                arrival_views[i] = view
