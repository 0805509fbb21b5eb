"""How one bucket is reduced: a small strategy object per bucket.

- `PackedAllReduce` (and `ArrivalPackedAllReduce`, packing each gradient as it arrives): pack
  into ``flat`` with the averaging folded in, SUM all-reduce, unpack into ``.grad``.
- `ViewAllReduce`: ``.grad`` is its view of ``flat``, a ``PremulSum`` all-reduce, no unpack.
- ``InPlaceAllReduce`` (``in_place.py``), ``SparseAllReduce`` (``sparse.py``), and `CommHook`,
  the hook on a `GradBucket` around the bucket's plain strategy.

Each strategy is chosen once, in ``plan.py``; during an iteration the reducer only calls it
(launch, wait, write-back, a joined rank's shadow). Strategies hold nothing per iteration:
what a launch returns is kept by the reducer and handed back to ``wait``; the scale and
``create_graph`` are read from the reducer at launch, since ``join`` changes the scale.

Each strategy's steps: docs/ddp.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from fastcomm.comm.types import PremulSum, ReduceOp
from fastcomm.comm.work import Work
from fastcomm.kernels._launch import fp32_scale

from .bucket import Bucket, GradBucket, pack_bucket, unpack_bucket
from .hand_over import hand_over

#: A bucket's gradients in bucket order (``None``: that parameter has none).
Grads = list[torch.Tensor | None]

__all__ = [
    "ArrivalPackedAllReduce",
    "BucketStrategy",
    "CommHook",
    "PackedAllReduce",
    "ReducerLike",
    "ViewAllReduce",
    "pack_into",
]


class ReducerLike(Protocol):
    """What a strategy reads of its reducer (strategy.py does not import reducer.py)."""

    comm: Any
    scale: float  # this iteration's averaging factor (join may change it)
    create_graph: bool  # this backward runs with create_graph=True
    buckets: list
    hook_state: Any
    health: Any  # a fastcomm.ddp.health.GradHealth, or None
    keeper: Any  # in-place recovery's copies of the gradients, or None

    def packed_on_arrival(self, bucket: Bucket) -> bool: ...


class BucketStrategy(ABC):
    """How one bucket's gradients are reduced and written back (see the module docstring).

    Attributes:
        grads_in_flat: the bucket's flat buffer *is* its gradients (``gradient_as_bucket_view``):
            a comm hook's ``GradBucket`` must not pack into it.
        hook_value_kind: what a comm hook's future must resolve to, for error messages.
    """

    __slots__ = ()
    grads_in_flat = False
    hook_value_kind = "the reduced flat tensor"
    #: the reducer hands each gradient to :meth:`pack_one` as it arrives
    packs_on_arrival = False

    def pack_one(self, reducer: ReducerLike, bucket: Bucket, k: int, grad) -> bool:
        """Puts gradient `grad` of bucket position `k` where :meth:`launch` wants it, as it
        arrives; whether it did (else :meth:`launch` does it)."""
        return False

    @abstractmethod
    def launch(self, reducer: ReducerLike, bucket: Bucket, grads: Grads) -> Any:
        """Starts the bucket's reduction; returns what :meth:`wait` takes.

        Args:
            reducer: the reducer (its communicator, scale and ``create_graph`` this iteration).
            bucket: the bucket, every gradient ready.
            grads: its parameters' gradients in bucket order (detached under ``create_graph``;
                ``None`` for a parameter without one).
        """

    @abstractmethod
    def wait(self, reducer: ReducerLike, bucket: Bucket, result: Any) -> Any:
        """Waits for :meth:`launch`'s `result`; the reduced value :meth:`write_back` takes."""

    @abstractmethod
    def write_back(
        self, reducer: ReducerLike, bucket: Bucket, value: Any, unused: frozenset[int]
    ) -> None:
        """Puts the reduced `value` into ``.grad`` (not for the parameter indices in `unused`:
        no rank produced their gradient)."""

    @abstractmethod
    def shadow(self, reducer: ReducerLike, bucket: Bucket) -> Any:
        """A joined rank's side of the bucket's collectives, zeros for gradients; something
        with ``wait()``."""

    # what a comm hook wrapping this strategy needs ------------------------------------
    def hook_gradients(self, bucket: Bucket, grads: Grads) -> Grads:
        """The gradients the hook's ``GradBucket`` holds."""
        return grads

    def hook_value(self, bucket: Bucket, value: object) -> torch.Tensor:
        """A hook future's `value`, checked and shaped for :meth:`write_back`."""
        if not isinstance(value, torch.Tensor) or value.numel() != bucket.numel:
            got = (
                f"a tensor of {value.numel()} elements"
                if isinstance(value, torch.Tensor)
                else type(value).__name__
            )
            raise ValueError(
                f"comm hook future of bucket {bucket.index} resolved to {got}; expected a flat "
                f"tensor of the bucket's {bucket.numel} elements"
            )
        return value.reshape(-1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class PackedAllReduce(BucketStrategy):
    """The default: pack the gradients into ``flat`` scaled, SUM all-reduce it, unpack it."""

    __slots__ = ()

    def launch(self, reducer: ReducerLike, bucket: Bucket, grads: Grads) -> Work:
        flat = bucket.flat
        pack_bucket(bucket, grads, flat, scale=reducer.scale)
        return reducer.comm.all_reduce(flat, ReduceOp.SUM, async_op=True)

    def wait(self, reducer: ReducerLike, bucket: Bucket, result: Work) -> torch.Tensor:
        result.wait()
        return bucket.flat

    def write_back(
        self, reducer: ReducerLike, bucket: Bucket, value: torch.Tensor, unused: frozenset[int]
    ) -> None:
        targets = bucket.grad_targets(unused, reducer.create_graph)
        if value is bucket.flat and hand_over(reducer, bucket, targets):
            return
        if reducer.health is not None:
            reducer.health.unpack(bucket, value, targets)  # also measures norm and NaN/Inf
        else:
            unpack_bucket(bucket, value, targets)

    def shadow(self, reducer: ReducerLike, bucket: Bucket) -> Work:
        bucket.flat.zero_()
        return reducer.comm.all_reduce(bucket.flat, async_op=True)


class ArrivalPackedAllReduce(PackedAllReduce):
    """`PackedAllReduce` with the pack done gradient by gradient as each arrives: ``view =
    grad * scale``, the pack's own multiply (same bits). A bucket with a gradient that was
    not packed so (none yet, another dtype, ``create_graph``) is packed whole at launch."""

    __slots__ = ()
    packs_on_arrival = True

    def pack_one(self, reducer: ReducerLike, bucket: Bucket, k: int, grad) -> bool:
        if reducer.create_graph:
            return False
        return pack_into(bucket.views[k], grad, fp32_scale(reducer.scale))

    def launch(self, reducer: ReducerLike, bucket: Bucket, grads: Grads) -> Work:
        if not reducer.packed_on_arrival(bucket):
            pack_bucket(bucket, grads, bucket.flat, scale=reducer.scale)
        return reducer.comm.all_reduce(bucket.flat, ReduceOp.SUM, async_op=True)


class ViewAllReduce(PackedAllReduce):
    """``gradient_as_bucket_view``: the gradients already sit in ``flat``, so the scale goes
    into the collective (folded into the reduction where the communicator declares the dtype
    in ``capabilities.premul_dtypes``, ``flat.mul_(scale)`` first elsewhere)."""

    __slots__ = ()
    grads_in_flat = True

    def launch(self, reducer: ReducerLike, bucket: Bucket, grads: Grads) -> Work:
        return reducer.comm.all_reduce(bucket.flat, PremulSum(reducer.scale), async_op=True)

    def write_back(
        self, reducer: ReducerLike, bucket: Bucket, value: torch.Tensor, unused: frozenset[int]
    ) -> None:
        flat = bucket.flat
        if value.data_ptr() != flat.data_ptr():  # a hook's buffer (another dtype, say)
            flat.copy_(value)
        for i, p, view in zip(bucket.param_indices, bucket.params, bucket.views, strict=True):
            if p.grad is None and i not in unused:
                p.grad = view


class CommHook(BucketStrategy):
    """A registered comm hook, ``hook(state, GradBucket) -> Future``, in place of the
    collective of `inner` (the bucket's plain strategy, which still says what the hook's
    bucket holds and how the future's value reaches ``.grad``).

    Args:
        hook: the comm hook; its state is read from the reducer at each call.
        inner: the strategy the bucket would have without a hook (packed, view or sparse).
    """

    __slots__ = ("hook", "inner")

    def __init__(self, hook: Callable, inner: BucketStrategy) -> None:
        self.hook = hook
        self.inner = inner

    def _grad_bucket(
        self, reducer: ReducerLike, bucket: Bucket, grads: Sequence[torch.Tensor | None] | None
    ) -> GradBucket:
        return GradBucket(
            bucket,
            grads,
            is_last=bucket.index == len(reducer.buckets) - 1,
            scale=reducer.scale,
            bucket_view=self.inner.grads_in_flat,
            comm=reducer.comm,
        )

    def launch(self, reducer: ReducerLike, bucket: Bucket, grads: Grads) -> Any:
        grad_bucket = self._grad_bucket(reducer, bucket, self.inner.hook_gradients(bucket, grads))
        return self.hook(reducer.hook_state, grad_bucket)

    def wait(self, reducer: ReducerLike, bucket: Bucket, result: Any) -> torch.Tensor:
        if isinstance(result, Work):  # a hook that returned the all_reduce of bucket.buffer()
            result.wait()
            return self.inner.hook_value(bucket, bucket.flat)
        if not isinstance(result, torch._C.Future):
            raise TypeError(
                f"comm hook {getattr(self.hook, '__name__', self.hook)!r} returned "
                f"{type(result).__name__} for bucket {bucket.index}; expected a "
                f"torch.futures.Future whose value is {self.inner.hook_value_kind}"
            )
        value = result.wait()
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        return self.inner.hook_value(bucket, value)

    def write_back(
        self, reducer: ReducerLike, bucket: Bucket, value: torch.Tensor, unused: frozenset[int]
    ) -> None:
        self.inner.write_back(reducer, bucket, value, unused)

    def shadow(self, reducer: ReducerLike, bucket: Bucket) -> Any:
        return self.hook(reducer.hook_state, self._grad_bucket(reducer, bucket, None))

    def __repr__(self) -> str:
        return f"CommHook({getattr(self.hook, '__name__', self.hook)!r}, {self.inner!r})"


def pack_into(view: torch.Tensor, grad, scale: float) -> bool:
    """``view = grad * scale`` (`view` on the CPU, `scale` already rounded to fp32 by
    ``fp32_scale``): the arrival pack of one gradient; whether it was made (not for ``None``
    or a gradient of another type, layout, dtype, device or shape: the launch packs the
    bucket whole)."""
    if (
        type(grad) is not torch.Tensor
        or grad.is_sparse
        or grad.dtype is not view.dtype
        or not grad.is_cpu
        or grad.shape != view.shape
    ):
        return False
    torch.mul(grad, scale, out=view)
    return True


#: The stateless strategies, shared by every bucket that takes them.
PACKED = PackedAllReduce()
ARRIVAL_PACKED = ArrivalPackedAllReduce()
VIEW = ViewAllReduce()
