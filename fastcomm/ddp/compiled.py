"""Compiled autograd: the bucket reductions traced into the compiled backward.

Under compiled autograd (``torch._dynamo.config.compiled_autograd``, the backward called from a
compiled function) Dynamo traces the parameters' post-accumulate-grad hooks into the backward
graph, so the reducer's eager path (counters, a final callback on the autograd engine) cannot
run there. A traced hook hands its parameter to :class:`TracedBuckets` instead, which counts
the bucket's gradients at trace time; the hook that completes bucket ``next`` puts a
``fastcomm::bucket_all_reduce`` call into the graph for it and every later bucket already
complete (index order, as eager), and copies the reduced gradients back into ``.grad``. At run
time the op reduces through the bucket's packed all-reduce or the registered comm hook, on the
reducer's communicator of the moment (looked up by an integer key), so recovery's swap and the
hooks (fp16, bf16, PowerSGD...) work unchanged.

Invariants: each op takes the token the previous bucket's op returned, so no compiler reorders
the collectives (every rank issues them in bucket order); the trace leaves the counters as it
found them (Dynamo replays the trace's writes after each run: the next backward finds them
armed, and its guards hold, so no recompilation); the op of the last bucket ends the
synchronized iteration (``Reducer.abandon_step``: step count, bucket rebuild).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from .strategy import PACKED, CommHook

__all__ = ["TracedBuckets", "bucket_all_reduce", "check_compiled_autograd", "compiled_autograd_on"]

# reducer key -> weakref to the reducer; a key is never reused
_REDUCERS: dict[int, weakref.ref] = {}
_KEYS = itertools.count()


@torch.library.custom_op("fastcomm::bucket_all_reduce", mutates_args=())
def bucket_all_reduce(
    grads: list[torch.Tensor], after: torch.Tensor, key: int, bucket: int
) -> list[torch.Tensor]:
    """Bucket `bucket` of the reducer `key` reduced: its gradients `grads` averaged over the
    ranks (or whatever its comm hook makes of them), as new tensors, then a new token.

    Args:
        grads: the bucket's gradients in bucket order.
        after: the token of the previous bucket's call (orders the collectives).
        key: the reducer's key (:class:`TracedBuckets`).
        bucket: the bucket's index.
    """
    reducer = _REDUCERS[key]()
    if reducer is None:
        raise RuntimeError(f"fastcomm::bucket_all_reduce: the DDP of key {key} is gone")
    b = reducer.buckets[bucket]
    strategy = PACKED if reducer.comm_hook is None else CommHook(reducer.comm_hook, PACKED)
    value = strategy.wait(reducer, b, strategy.launch(reducer, b, list(grads)))
    reduced = [
        value[o : o + g.numel()].view(g.shape).to(g.dtype, copy=True)
        for o, g in zip(b.offsets, grads, strict=True)
    ]
    if bucket == len(reducer.buckets) - 1:
        reducer.abandon_step()  # its eager state unused
    return [*reduced, torch.empty((), dtype=after.dtype, device=after.device)]


@bucket_all_reduce.register_fake
def _(grads, after, key, bucket):
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
        self.bucket_of = [0] * n
        for b, members in enumerate(self.members):
            for i in members:
                self.bucket_of[i] = b
        self.sizes = [len(m) for m in self.members]
        self.pending = list(self.sizes)
        self.arrived: list[Any] = [None] * n
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
        token = self.token
        while self.next < len(self.members) and self.pending[self.next] == 0:
            members = self.members[self.next]
            params = [self.arrived[k] for k in members]
            out = torch.ops.fastcomm.bucket_all_reduce(
                [p.grad for p in params], token, self.key, self.next
            )
            for p, g in zip(params, out, strict=False):
                p.grad.copy_(g)
            token = out[-1]
            self.next += 1
        if self.next == len(self.members):  # armed again for the next backward
            self.pending[:] = self.sizes
            self.arrived[:] = [None] * len(self.arrived)
            self.next = 0


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
