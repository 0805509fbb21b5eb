"""How DDP reduces each bucket: every choice made here, from three inputs.

Inputs: the parameters, the communicator's :class:`~fastcomm.comm.types.Capabilities` (and its
size), and the :class:`~.config.DDPConfig` (every threshold and environment variable, read
once). The reducer calls this module when it is built, when it (re)builds its buckets and when
a comm hook is registered, then only executes what it returned. In order: buckets in shared
memory or not (`shared_request`), ``.grad`` as bucket views or not (`grads_are_views`), each
bucket's strategy (`choose_strategy`, first match wins: comm hook, sparse, shared view, view,
in place via `in_place_plan`, replayed from a CUDA graph (``graphs.py``), packed on arrival,
packed), which gradients are staged into a shared bucket (`stages`), and which buckets'
write-back may hand the reduced buffer over as ``.grad`` (`hands_over`).

Invariant: every rank takes the same decisions: they depend on the parameters' sizes, dtypes
and devices, the config and the capabilities, never on this rank's gradients.

Each decision's conditions and thresholds: docs/ddp.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from fastcomm.comm.graph_lane import GraphLane
from fastcomm.comm.types import Capabilities

from .bucket import CPU_VIEW_DTYPES, Bucket
from .config import DDPConfig
from .graphs import GraphedAllReduce
from .hand_over import COUNTS_USES
from .in_place import InPlaceAllReduce, InPlacePlan
from .shared import SHARED_VIEW, eligible
from .sparse import SPARSE
from .strategy import (
    ARRIVAL_PACKED,
    PACKED,
    VIEW,
    ArrivalPackedAllReduce,
    BucketStrategy,
    CommHook,
)

__all__ = [
    "BucketPlan",
    "SharedRequest",
    "choose_strategy",
    "grads_are_views",
    "hands_over",
    "in_place_plan",
    "packs_on_arrival",
    "plan_buckets",
    "shared_request",
    "stages",
]

# dtypes whose CPU pack is the same torch multiply as the in-place scaling (fp16/bf16 packs go
# through the kernels' fp32 arithmetic, which may round twice where the multiply rounds once)
_SAME_SCALING_DTYPES = (torch.float32, torch.float64)


# ---------------------------------------------------------------------- the whole model
class SharedRequest(NamedTuple):
    """What to ask the communicator's ``bucket_region`` for.

    Attributes:
        device: the device of the shared buckets.
        params: the parameters whose buckets go there.
    """

    device: torch.device
    params: list[torch.Tensor]


def shared_request(
    params: Sequence[torch.Tensor],
    sparse: frozenset[int],
    capabilities: Capabilities,
    world_size: int,
    config: DDPConfig,
) -> SharedRequest | None:
    """Whether the model's buckets go into shared memory (decision 1 of the module docstring):
    what to ask for, or ``None``."""
    view = config.gradient_as_bucket_view
    if not config.shared_buckets or view is False or world_size <= 1:
        return None
    dense = [p for i, p in enumerate(params) if i not in sparse]
    devices = [p.device for p in dense if p.device.type in capabilities.shared_buckets]
    if not devices:
        return None
    device = devices[0]
    chosen = [p for p in dense if eligible(p, device)]
    if not chosen:
        return None
    if view is None:  # by default only where the gradients are large enough to pay for it
        sizes = [p.numel() * p.element_size() for p in chosen]
        if sum(sizes) < config.shared_min_mean_bytes * len(sizes):
            return None
    return SharedRequest(device, chosen)


def grads_are_views(config: DDPConfig, shared: bool) -> bool:
    """Whether each ``.grad`` is its bucket view (decision 2)."""
    view = config.gradient_as_bucket_view
    return shared if view is None else view


# ---------------------------------------------------------------------- each bucket
class BucketPlan(NamedTuple):
    """What the reducer executes, per bucket and per parameter.

    Attributes:
        strategies: each bucket's strategy, in bucket order.
        on_arrival: per bucket, whether its strategy packs each gradient as it arrives.
        stage_in: per parameter, the shared bucket whose staging takes its fresh gradient, or
            ``None``: copied whole into its view (or no bucket view at all).
        arrival_views: per parameter, its view where its bucket is an
            `ArrivalPackedAllReduce` (the reducer's plain hook path makes that strategy's
            ``pack_one`` multiply itself, a call fewer per gradient), else ``None``.
    """

    strategies: list[BucketStrategy]
    on_arrival: list[bool]
    stage_in: list[Bucket | None]
    arrival_views: list[torch.Tensor | None]


def plan_buckets(
    buckets: Sequence[Bucket],
    n_params: int,
    capabilities: Capabilities,
    config: DDPConfig,
    hook: Callable | None,
    bucket_view: bool,
    staged: bool = False,
    graph_lane: GraphLane | None = None,
) -> BucketPlan:
    """Decisions 3 and 4 for every bucket of a reducer (`staged`: its shared region stages
    fresh gradients, ``SharedRequest.staged``; `graph_lane`: the communicator's
    ``graph_lane()`` where it offers one and ``config.cuda_graphs`` is on)."""
    graphed = None if graph_lane is None else GraphedAllReduce(graph_lane)
    strategies = [
        choose_strategy(b, capabilities, config, hook, bucket_view, graphed) for b in buckets
    ]
    stage_in: list[Bucket | None] = [None] * n_params
    arrival_views: list[torch.Tensor | None] = [None] * n_params
    for bucket, strategy in zip(buckets, strategies, strict=True):
        if staged and strategy is SHARED_VIEW:
            for i, view in zip(bucket.param_indices, bucket.views, strict=True):
                if stages(view, config):
                    stage_in[i] = bucket
        if type(strategy) is ArrivalPackedAllReduce:
            for i, view in zip(bucket.param_indices, bucket.views, strict=True):
                arrival_views[i] = view
    on_arrival = [s.packs_on_arrival for s in strategies]
    return BucketPlan(strategies, on_arrival, stage_in, arrival_views)


def choose_strategy(
    bucket: Bucket,
    capabilities: Capabilities,
    config: DDPConfig,
    hook: Callable | None,
    bucket_view: bool,
    graphed: GraphedAllReduce | None = None,
) -> BucketStrategy:
    """How `bucket` is reduced (decision 3 of the module docstring; `graphed`: the reducer's
    CUDA-graph strategy, taken by its packed CUDA buckets)."""
    if hook is not None:
        return CommHook(hook, SPARSE if bucket.sparse else VIEW if bucket_view else PACKED)
    if bucket.sparse:
        return SPARSE
    if bucket_view:  # no pack or unpack to save by reducing in place
        return VIEW if bucket.shared is None else SHARED_VIEW
    plan = in_place_plan(bucket, capabilities, config)
    if plan is not None:
        return InPlaceAllReduce(plan)
    if graphed is not None and bucket.device.type == "cuda":
        return graphed
    return ARRIVAL_PACKED if packs_on_arrival(bucket, config) else PACKED


def in_place_plan(
    bucket: Bucket, capabilities: Capabilities, config: DDPConfig
) -> InPlacePlan | None:
    """Which of `bucket`'s gradients are reduced in place, or ``None`` when it is packed as a
    whole (sparse, CUDA, fp16/bf16, a layout-dependent reduction, no gradient of
    ``config.in_place_min_bytes``, or, where the communicator does not fold the multiply, less
    than ``config.unfolded_min_bytes_per_extra`` reduced in place per collective beyond the
    packed bucket's one)."""
    if (
        bucket.sparse
        or bucket.device.type != "cpu"
        or bucket.dtype not in _SAME_SCALING_DTYPES
        or not capabilities.layout_free
    ):
        return None
    esize = bucket.flat.element_size()
    large = [
        k for k, p in enumerate(bucket.params)
        if p.numel() * esize >= config.in_place_min_bytes
    ]
    if not large:
        return None
    extra = len(large) - (len(large) == len(bucket.params))  # collectives beyond one
    if extra and bucket.dtype not in capabilities.premul_dtypes:
        in_place_bytes = sum(bucket.params[k].numel() for k in large) * esize
        if in_place_bytes < config.unfolded_min_bytes_per_extra * extra:
            return None
    return InPlacePlan(bucket, large)


def hands_over(
    buckets: Sequence[Bucket], config: DDPConfig, hook: Callable | None, bucket_view: bool,
    shared: bool,
) -> frozenset[int]:
    """The buckets whose write-back may hand the reduced buffer over as ``.grad``
    (``hand_over.py``): not where ``.grad`` already is a bucket view or the buckets are shared,
    nor under a comm hook (it may keep the buffer), nor where the gradients are so small that
    its per-gradient check costs more than the copy it saves (the shared buckets'
    threshold)."""
    if not (config.hand_over_grads and hook is None and not bucket_view and not shared
            and COUNTS_USES):
        return frozenset()
    return frozenset(
        b.index for b in buckets
        if not b.sparse and b.flat.nbytes >= len(b.params) * config.shared_min_mean_bytes
    )


def packs_on_arrival(bucket: Bucket, config: DDPConfig) -> bool:
    """Whether a packed `bucket` packs its gradients as they arrive: a CPU fp32/fp64 bucket of
    at most ``config.arrival_pack_max_grads`` gradients."""
    return (
        bucket.device.type == "cpu"
        and bucket.dtype in CPU_VIEW_DTYPES
        and len(bucket.params) <= config.arrival_pack_max_grads
    )


def stages(view: torch.Tensor, config: DDPConfig) -> bool:
    """Whether a fresh gradient for `view`, in a shared bucket of a region that stages, is
    staged (decision 4) rather than copied whole."""
    return view.numel() * view.element_size() >= config.stage_min_bytes
