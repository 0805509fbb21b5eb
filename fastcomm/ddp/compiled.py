"""Compiled autograd: the bucket reductions traced into the compiled backward.

Under compiled autograd (``torch._dynamo.config.compiled_autograd``, the backward called from a
compiled function) Dynamo traces the parameters' post-accumulate-grad hooks into the backward
graph, so the reducer's eager path (counters, a final callback on the autograd engine) cannot
run there. A traced hook hands its parameter to :class:`TracedBuckets` instead, which counts
the bucket's gradients at trace time; the hook that completes bucket ``next`` puts a
``fastcomm::bucket_launch`` call into the graph for it and every later bucket already complete
(index order, as eager): it packs the gradients and starts the reduction without waiting. A
``fastcomm::bucket_wait`` per bucket waits for the reduction and copies the reduced gradients
back into ``.grad``. With overlap (``FASTCOMM_DDP_COMPILED_OVERLAP``; by default for CUDA
buckets) the hook that launches the last bucket adds every wait, so the graph reduces bucket
``k`` while it differentiates the layers below it, as eager DDP does; without it (by default
for CPU buckets, whose reduction thread would take the backward's cores) each wait follows its
launch. At run time the ops reduce through the bucket's packed all-reduce or the registered
comm hook, on the reducer's communicator of the moment (looked up by an integer key), so
recovery's swap and the hooks (fp16, bf16, PowerSGD...) work unchanged. A launch whose wait
never came (a backward that raised between them) is replaced by the bucket's next launch.

Invariants: each launch takes the token the previous launch returned, and each wait its
bucket's launch token and the previous wait's, so no compiler reorders the collectives (every
rank issues them in bucket order) or waits before the last launch; the trace leaves
:class:`TracedBuckets` as it found it (Dynamo replays the trace's writes after each run: the
next backward finds it armed, and its guards hold, so no recompilation); the wait of the last
bucket ends the synchronized iteration (``Reducer.abandon_step``: step count, bucket rebuild).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from fastcomm import settings

from .strategy import PACKED, CommHook

__all__ = [
    "TracedBuckets", "bucket_launch", "bucket_wait", "check_compiled_autograd",
    "compiled_autograd_on",
]

# reducer key -> weakref to the reducer; a key is never reused
_REDUCERS: dict[int, weakref.ref] = {}
_KEYS = itertools.count()


# (reducer key, bucket index) -> (the strategy, what its launch returned), from a bucket's
# launch op to its wait op
_LAUNCHED: dict[tuple[int, int], tuple[Any, Any]] = {}


def _reducer(key: int, op: str) -> Any:
    reducer = _REDUCERS[key]()
    if reducer is None:
        raise RuntimeError(f"fastcomm::{op}: the DDP of key {key} is gone")
    return reducer


@torch.library.custom_op("fastcomm::bucket_launch", mutates_args=())
def bucket_launch(grads: list[torch.Tensor], after: torch.Tensor, key: int,
                  bucket: int) -> torch.Tensor:
    """Bucket `bucket` of the reducer `key` launched: its gradients `grads` (bucket order)
    packed and their reduction started (the bucket's packed all-reduce or the registered comm
    hook), without waiting for it; a new token.

    Args:
        grads: the bucket's gradients in bucket order (copied into the bucket at once).
        after: the token of the previous bucket's launch (orders the collectives).
        key: the reducer's key (:class:`TracedBuckets`).
        bucket: the bucket's index.
    """
    reducer = _reducer(key, "bucket_launch")
    b = reducer.buckets[bucket]
    strategy = PACKED if reducer.comm_hook is None else CommHook(reducer.comm_hook, PACKED)
    _LAUNCHED[(key, bucket)] = (strategy, strategy.launch(reducer, b, list(grads)))
    return torch.empty((), dtype=after.dtype, device=after.device)


@bucket_launch.register_fake
def _(grads, after, key, bucket):
    return torch.empty_like(after)


@torch.library.custom_op("fastcomm::bucket_wait", mutates_args=())
def bucket_wait(grads: list[torch.Tensor], launched: torch.Tensor, after: torch.Tensor,
                key: int, bucket: int) -> list[torch.Tensor]:
    """The reduction :func:`bucket_launch` started for bucket `bucket` of the reducer `key`,
    waited for: the reduced gradients as new tensors (shaped and typed as `grads`), then a
    new token. The last bucket's wait ends the synchronized iteration.

    Args:
        grads: the bucket's gradients in bucket order (their shapes and dtypes).
        launched: the token of this bucket's launch.
        after: the token of the previous bucket's wait (the last launch's for the first).
        key: the reducer's key.
        bucket: the bucket's index.
    """
    reducer = _reducer(key, "bucket_wait")
    b = reducer.buckets[bucket]
    try:
        strategy, launched = _LAUNCHED.pop((key, bucket))
    except KeyError:
        raise RuntimeError(
            f"rank {reducer.comm.rank}: fastcomm::bucket_wait: bucket {bucket} was not launched"
        ) from None
    value = strategy.wait(reducer, b, launched)
    reduced = [
        value[o : o + g.numel()].view(g.shape).to(g.dtype, copy=True)
        for o, g in zip(b.offsets, grads, strict=True)
    ]
    if bucket == len(reducer.buckets) - 1:
        reducer.abandon_step()  # its eager state unused
    return [*reduced, torch.empty((), dtype=after.dtype, device=after.device)]


@bucket_wait.register_fake
def _(grads, launched, after, key, bucket):
    return [*(torch.empty_like(g) for g in grads), torch.empty_like(after)]


class TracedBuckets:
    """The reducer's buckets as compiled autograd traces them: which hook launches what.

    Args:
        reducer: the reducer (held by key, weakly).
    """

    def __init__(self, reducer: Any) -> None:
        self.key = next(_KEYS)
        _REDUCERS[self.key] = weakref.ref(reducer)
        self.token = torch.zeros((), device=reducer.comm.device)
        self.layout([], 0)  # the reducer's _build lays out its buckets

    def layout(self, buckets: list, n: int) -> None:
        """Takes the reducer's (new) buckets; a backward traced before it is traced again."""
        self.members = [list(b.param_indices) for b in buckets]
        self.overlap = _overlaps(self.token.device)
        self.bucket_of = [0] * n
        for b, members in enumerate(self.members):
            for i in members:
                self.bucket_of[i] = b
        self.sizes = [len(m) for m in self.members]
        self.pending = list(self.sizes)
        self.arrived: list[Any] = [None] * n
        self.launched: list[Any] = [None] * len(buckets)
        self.last = self.token
        self.next = 0

    def ready(self, i: int, param: torch.Tensor, reducer: Any) -> None:
        """Parameter `i` of `reducer` has its gradient (traced, in its post-accumulate-grad
        hook); the first synchronized backward records the arrival order (the rebuild's)."""
        if reducer._recording:
            reducer._arrivals.append(i)
        self.arrived[i] = param
        b = self.bucket_of[i]
        self.pending[b] -= 1
        if b != self.next or self.pending[b]:
            return
        while self.next < len(self.members) and self.pending[self.next] == 0:
            grads = [self.arrived[k].grad for k in self.members[self.next]]
            self.last = torch.ops.fastcomm.bucket_launch(grads, self.last, self.key, self.next)
            self.launched[self.next] = self.last
            if not self.overlap:  # waited for at once
                self.last = self._wait(self.next, self.last)
            self.next += 1
        if self.next < len(self.members):
            return
        if self.overlap:  # every bucket launched: the waits
            token = self.last
            for b in range(len(self.members)):
                token = self._wait(b, token)
        # armed again for the next backward, every attribute as the trace found it
        self.pending[:] = self.sizes
        self.arrived[:] = [None] * len(self.arrived)
        self.launched[:] = [None] * len(self.launched)
        self.last = self.token
        self.next = 0

    def _wait(self, b: int, after: torch.Tensor) -> torch.Tensor:
        """Traces bucket `b`'s wait (after token `after`) and the copy of its reduced gradients
        into ``.grad``; the wait's token."""
        params = [self.arrived[k] for k in self.members[b]]
        out = torch.ops.fastcomm.bucket_wait([p.grad for p in params], self.launched[b], after,
                                             self.key, b)
        for p, g in zip(params, out, strict=False):
            p.grad.copy_(g)
        return out[-1]


def _overlaps(device: torch.device) -> bool:
    """Whether the waits go after the last launch (``FASTCOMM_DDP_COMPILED_OVERLAP``)."""
    choice = settings.DDP_COMPILED_OVERLAP.get()
    return device.type == "cuda" if choice == "auto" else choice == "on"


def check_compiled_autograd(ddp: Any) -> None:
    """Raises, naming the feature, when `ddp` uses one that compiled autograd's traced
    reductions do not support (called at a synchronized forward with compiled autograd on).

    Raises:
        RuntimeError: what is unsupported, and the way out.
    """
    reducer = ddp.reducer
    unsupported = [
        name
        for name, on in (
            ("find_unused_parameters=True", ddp.find_unused_parameters),
            ("sparse gradients", bool(reducer.sparse)),
            ("check_finite=True", reducer.health is not None and reducer.health.check_finite),
            ("join()", ddp.active_join is not None),
            ("in-place recovery (FASTCOMM_RECOVER=in-process)", reducer.recovery is not None),
        )
        if on
    ]
    if unsupported:
        raise RuntimeError(
            f"rank {reducer.comm.rank}: fastcomm DDP under compiled autograd "
            f"(torch._dynamo.config.compiled_autograd) does not support "
            f"{', '.join(unsupported)}; turn compiled autograd off for this model (the "
            "compiled forward and backward still overlap the reductions), or drop the option"
        )


def compiled_autograd_on() -> bool:
    """Whether a backward now would run under compiled autograd (without importing Dynamo)."""
    import sys

    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and module.compiled_autograd_enabled
