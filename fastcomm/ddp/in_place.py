"""Large gradients reduced where autograd left them: no pack, no unpack.

The default reduction of a bucket costs two passes over its gradients besides the collective:
the pack into the bucket's flat buffer (averaging folded in) and the unpack back into ``.grad``.
For a gradient of ``IN_PLACE_MIN_BYTES`` or more, a collective of its own costs less than the
unpack's pass, so a CPU bucket that holds such gradients reduces each of them in place (scaled
by a ``PremulSum`` all-reduce: the multiply the pack would fold in, which a communicator that
declares the dtype in ``capabilities.premul_dtypes`` folds into its reduction, and every other
runs as ``mul_`` before a ``SUM``) and packs only its small gradients, into a staging buffer of
their own reduced by one collective. The unpack then copies only the small ones.

That trade pays where the communicator folds the multiply into its reduction (shm: the large
gradients cost no pass at all) and its collectives cost tens of microseconds. Elsewhere (Gloo:
``mul_`` first, hundreds of microseconds a collective) in place saves only the unpack's copy, so
a bucket goes in place there only as a single collective (one large gradient alone in its
bucket): a weight and its bias in one bucket are packed, as torch DDP packs them.

Same results: every element is still ``sum over ranks of (grad * scale)`` with the same scale
and the same reduction order, because the in-place path is taken only where the communicator
declares ``capabilities.layout_free``: the reduced value of an element does not depend on where
it sits in the buffer (two ranks: one addition, which commutes; shm at any size: the ranks'
terms in rank order whatever the layout). Gloo at three or more ranks sums in an order that
depends on the element's place in the ring's chunks, so there the bucket is packed as torch DDP
packs it, keeping its results bit-identical to torch's.

Same collectives on every rank: which ones a bucket issues, and their ops, depend only on its
parameters' sizes, never on this rank's gradients or scale (a joined rank's zeros go out as a
``PremulSum`` too). A gradient that cannot be reduced in place here (none this iteration,
non-contiguous, another dtype, part of a ``create_graph`` graph) is staged, scaled, in its bucket
view instead and copied back after the collective.

A gradient being reduced in place holds partial values until the end of backward: code that
reads ``.grad`` from a hook of its own during backward sees them (as with
``gradient_as_bucket_view``).

A bucket with a plan takes the `InPlaceAllReduce` strategy (see ``strategy.py``); a comm hook
replaces it, since the hook reduces the packed bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastcomm.comm.types import PremulSum
from fastcomm.kernels._launch import fp32_scale

from .bucket import Bucket, scale_into_views
from .strategy import BucketStrategy

__all__ = [
    "IN_PLACE_MIN_BYTES",
    "InPlaceAllReduce",
    "InPlacePlan",
    "InPlaceReduction",
    "in_place_plan",
]

# A collective costs tens of microseconds of sequencing; one pass over a MiB, a few hundred.
IN_PLACE_MIN_BYTES = 1 << 20
# On a communicator that does not fold the PremulSum into its reduction (Gloo), the large
# gradients take a ``mul_`` pass anyway, so in place saves only the unpack's copy, while each
# collective beyond the packed bucket's one costs 100-700 us of issue, wake-ups and round trip
# on two cores. A bucket goes in place there when it stays one collective, or when every extra
# collective brings at least this many bytes reduced in place. Measured, interleaved with torch
# DDP: a 1.6M-parameter MLP (1 MiB weights, each with a 2 KiB bias) went from 1.17x to 1.06x
# packed; a 10.5M one (4 MiB weights) was 5 to 8% faster in place.
UNFOLDED_MIN_BYTES_PER_EXTRA = 4 << 20
# dtypes whose CPU pack is the same torch multiply as the in-place scaling (fp16/bf16 packs go
# through the kernels' fp32 arithmetic, which may round twice where the multiply rounds once)
_SAME_SCALING_DTYPES = (torch.float32, torch.float64)


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


def in_place_plan(bucket: Bucket, comm) -> InPlacePlan | None:
    """The plan of `bucket` on `comm`, or ``None`` when it is packed as a whole (sparse, CUDA,
    fp16/bf16, a layout-dependent reduction, no gradient of ``IN_PLACE_MIN_BYTES``, or, where
    `comm` does not fold the multiply, less than ``UNFOLDED_MIN_BYTES_PER_EXTRA`` reduced in
    place per collective beyond the packed bucket's one)."""
    if (
        bucket.sparse
        or bucket.device.type != "cpu"
        or bucket.dtype not in _SAME_SCALING_DTYPES
        or not comm.capabilities.layout_free
    ):
        return None
    esize = bucket.flat.element_size()
    large = [
        k for k, p in enumerate(bucket.params) if p.numel() * esize >= IN_PLACE_MIN_BYTES
    ]
    if not large:
        return None
    extra = len(large) - (len(large) == len(bucket.params))  # collectives beyond one
    if extra and bucket.dtype not in comm.capabilities.premul_dtypes:
        in_place_bytes = sum(bucket.params[k].numel() for k in large) * esize
        if in_place_bytes < UNFOLDED_MIN_BYTES_PER_EXTRA * extra:
            return None
    return InPlacePlan(bucket, large)


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
        plan: the bucket's plan (from :func:`in_place_plan`).
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
        targets = reducer.grad_targets(bucket, unused)
        write_back(value, targets)  # only what was not reduced in place
        if reducer.health is not None:
            reducer.health.written(bucket, targets)

    def shadow(self, reducer, bucket: Bucket) -> InPlaceReduction:
        return launch_in_place(bucket, self.plan, None, 1.0, reducer.comm, False)

    def __repr__(self) -> str:
        return f"InPlaceAllReduce(large={self.plan.large}, small={self.plan.small})"
