"""Large gradients reduced where autograd left them: no pack, no unpack.

A CPU bucket holding gradients of ``config.in_place_min_bytes`` or more reduces each of them
in place with a ``PremulSum`` all-reduce (the pack's multiply, folded in where the
communicator declares it in ``capabilities.premul_dtypes``) and packs only its small
gradients, into a staging buffer of their own; the unpack copies only those.

Invariants: taken only where ``capabilities.layout_free`` (the reduced bits do not depend on
where an element sits, so they equal the packed path's); which collectives a bucket issues
depends only on its parameters' sizes, never on this rank's gradients; a gradient reduced in
place holds partial values until the end of backward. Which buckets go in place is decided in
``plan.py`` (``in_place_plan``); a comm hook replaces this strategy.

Why the trade pays, and where it does not: docs/ddp.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastcomm.comm.types import PremulSum
from fastcomm.kernels._launch import fp32_scale

from .bucket import Bucket, scale_into_views
from .strategy import BucketStrategy

__all__ = ["InPlaceAllReduce", "InPlacePlan", "InPlaceReduction"]

class InPlacePlan:
    """Which of a bucket's gradients are reduced in place, and the staging of the others.

    Args:
        bucket: a dense CPU bucket.
        large: positions in the bucket of the gradients reduced in place.
    """

    __slots__ = ("large", "small", "staging", "staging_views")

    def __init__(self, bucket: Bucket, large: list[int]) -> None:
        self.large = large
        chosen = set(large)
        self.small = [k for k in range(len(bucket.params)) if k not in chosen]
        sizes = [bucket.params[k].numel() for k in self.small]
        self.staging = torch.zeros(sum(sizes), dtype=bucket.dtype, device=bucket.device)
        self.staging_views = [
            view.view(bucket.params[k].shape)
            for k, view in zip(self.small, self.staging.split(sizes), strict=True)
        ]


class InPlaceReduction:
    """One bucket's in-flight collectives and where each reduced gradient must end up.

    Attributes:
        works: the collectives, in issue order.
        reduced: per bucket position, the tensor holding its reduced gradient (the gradient
            itself, its bucket view, or its staging view).
    """

    __slots__ = ("works", "reduced")

    def __init__(self, works: list, reduced: list[torch.Tensor]) -> None:
        self.works = works
        self.reduced = reduced

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def launch_in_place(
    bucket: Bucket,
    plan: InPlacePlan,
    grads: Sequence[torch.Tensor | None],
    scale: float,
    comm,
    create_graph: bool,
) -> InPlaceReduction:
    """Scales and reduces `bucket`'s large gradients in place and its small ones staged.

    ``grads`` is ``None`` for a joined rank's shadow of the bucket (zeros everywhere).
    """
    views = bucket.views
    reduced: list[torch.Tensor] = [None] * len(views)  # type: ignore[list-item]
    works = []
    # Every rank passes a PremulSum, whatever its scale and gradients (the ops must match);
    # each rank's factor applies to its own term, so terms already scaled (or zero) take 1.0.
    premul, scaled = PremulSum(scale), PremulSum(1.0)
    for k in plan.large:
        g = None if grads is None else grads[k]
        view = views[k]
        op = scaled
        if g is None:
            target = view.zero_()
        elif create_graph or not _reducible_in_place(g, view):
            target = view
            torch.mul(g.detach(), scale, out=target)
        else:
            target, op = g, premul
        reduced[k] = target
        works.append(comm.all_reduce(target, op, async_op=True))
    if plan.small:
        staged = plan.staging_views
        small = None if grads is None else [grads[k] for k in plan.small]
        if small is None:
            plan.staging.zero_()
        elif not create_graph and all(g is not None for g in small):
            scale_into_views(staged, small, scale, plan.staging)  # the bucket pack's own way
        else:
            for g, view in zip(small, staged, strict=True):
                if g is None:
                    view.zero_()
                else:
                    torch.mul(g.detach(), scale, out=view)
        for k, view in zip(plan.small, staged, strict=True):
            reduced[k] = view
        works.append(comm.all_reduce(plan.staging, async_op=True))
    return InPlaceReduction(works, reduced)


def _reducible_in_place(g: torch.Tensor, view: torch.Tensor) -> bool:
    return (
        type(g) is torch.Tensor
        and not g.is_sparse
        and g.dtype == view.dtype
        and g.device == view.device
        and g.is_contiguous()
        and g.shape == view.shape
    )


def write_back(
    reduction: InPlaceReduction, targets: Sequence[torch.Tensor | None]
) -> None:
    """Copies every reduced gradient not already in its target (``None``: leave it)."""
    dst, src = [], []
    for target, value in zip(targets, reduction.reduced, strict=True):
        if target is not None and target is not value:
            dst.append(target)
            src.append(value)
    if dst:
        torch._foreach_copy_(dst, src)


class InPlaceAllReduce(BucketStrategy):
    """A bucket reduced by its `InPlacePlan`: large gradients in place, small ones staged.

    Args:
        plan: the bucket's plan (from ``plan.in_place_plan``).
    """

    __slots__ = ("plan",)

    def __init__(self, plan: InPlacePlan) -> None:
        self.plan = plan

    def launch(self, reducer, bucket: Bucket, grads) -> InPlaceReduction:
        return launch_in_place(
            bucket, self.plan, grads, fp32_scale(reducer.scale), reducer.comm,
            reducer.create_graph,
        )

    def wait(self, reducer, bucket: Bucket, result: InPlaceReduction) -> InPlaceReduction:
        result.wait()
        return result

    def write_back(
        self, reducer, bucket: Bucket, value: InPlaceReduction, unused: frozenset[int]
    ) -> None:
        targets = bucket.grad_targets(unused, reducer.create_graph)
        write_back(value, targets)  # only what was not reduced in place
        if reducer.health is not None:
            reducer.health.written(bucket, targets)

    def shadow(self, reducer, bucket: Bucket) -> InPlaceReduction:
        return launch_in_place(bucket, self.plan, None, 1.0, reducer.comm, False)

    def __repr__(self) -> str:
        return f"InPlaceAllReduce(large={self.plan.large}, small={self.plan.small})"
