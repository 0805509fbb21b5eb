"""CUDA buckets replayed from CUDA graphs: a bucket's pack, all-reduce and unpack in one call.

On a GPU the reducer's eager path costs hundreds of microseconds of Python per bucket (checks,
a flight record, a task, NCCL through CuPy, an event and a ``Work``, then the unpack's). What
a bucket does never changes from step to step but for the addresses autograd gives its
gradients. `GraphedAllReduce` captures each bucket once, after its first eager launch:

    relocate (the block table's address row, from the addresses on the device)
    pack     (the gradients into the bucket's flat buffer, times 1/world)
    all-reduce (SUM, on the communicator's ``GraphLane``)
    unpack   (into the gradients, writing the bucket's health row: norm and NaN/Inf count)

and from then on replays it with `GraphLane.replay`: a few host calls, whatever the bucket's
size. The replay runs on the communicator's stream as soon as the bucket's gradients are
ready, so communication overlaps the rest of backward as the eager path's does; the
gradients are written there, and the finalize makes the caller's stream wait for them.

When a bucket is not replayed (and takes `PackedAllReduce`'s eager path, bit for bit the same
result): before its capture; when a gradient is missing, not contiguous, or not 16-byte
aligned; under ``create_graph`` or in-place recovery (which keeps copies of the gradients);
when the averaging factor differs from the captured one (``join``); after a capture failed
(a warning says why, once). The relocatable plan (``fastcomm.kernels.RelocatablePlan``)
follows gradients that moved, so a new allocation costs an 8-byte copy per gradient, not a
capture.

Invariants: nothing on a replay's path makes an event, queries one, pins memory or allocates
(``tests/ddp/test_graphs.py`` reads this module's source for those calls); the caller's
stream is looked up once per step (again only when the hook runs on another stream); every
rank's collectives reach NCCL in bucket order on one stream, replayed or not.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from fastcomm.comm.graph_lane import GraphLane
from fastcomm.comm.stream import EventWork
from fastcomm.comm.types import ReduceOp
from fastcomm.kernels import RelocatablePlan
from fastcomm.kernels._launch import fp32_scale

from .bucket import Bucket
from .strategy import Grads, PackedAllReduce, ReducerLike

__all__ = ["CAPTURED", "GraphedAllReduce", "WARM_LAUNCHES"]

#: Eager launches of a bucket before it is captured (its first: the warm caches, the bucket
#: order of a rebuild; after a rebuild the buckets, and so their strategies, are new).
WARM_LAUNCHES = 1

#: What `GraphedAllReduce.wait` returns for a replayed bucket: its gradients are written.
CAPTURED = object()

_TENSOR = torch.Tensor
_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


class BucketGraph:
    """One bucket's captured graph and everything it reads or writes, kept alive with it."""

    __slots__ = ("plan", "graph", "flat", "scale", "stats", "row", "done")

    def __init__(self, bucket: Bucket, scale: float, stats: torch.Tensor | None) -> None:
        self.plan = RelocatablePlan([p.numel() for p in bucket.params], bucket.dtype,
                                    bucket.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.flat = bucket.flat
        self.scale = scale
        self.stats = stats  # the health's [n_buckets, 2] rows (None: no health)
        self.row = None if stats is None else stats[bucket.index]
        self.done = torch.cuda.Event()  # recorded after each replay (the work's event)

    def _steps(self, lane: GraphLane | None, scale: float) -> None:
        self.plan.relocate()
        self.plan.pack(self.flat, scale)
        if lane is not None:
            lane.capture_all_reduce(self.flat, ReduceOp.SUM)
        self.plan.unpack_measured(self.flat, self.row)

    def capture(self, lane: GraphLane, caller: torch.cuda.Stream,
                capture_stream: torch.cuda.Stream) -> None:
        """Compiles the kernels by running them once on the lane's stream (after `caller`),
        then captures the bucket on `capture_stream`; the gradients keep their values."""
        stream = lane.stream
        stream.wait_stream(caller)
        torch.cuda.set_stream(stream)
        try:
            # Triton compiles on a kernel's first launch, which a capture must not see. The
            # plain pack makes the flat buffer a copy of the gradients, so the unpack that
            # follows writes back the values they hold; then the scaled pack.
            self.plan.relocate()
            self.plan.pack(self.flat, 1.0)
            self.plan.unpack_measured(self.flat, self.row)
            if self.scale != 1.0:
                self.plan.pack(self.flat, self.scale)
        finally:
            torch.cuda.set_stream(caller)
        capture_stream.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.set_stream(capture_stream)
        try:
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._steps(lane, self.scale)
            finally:
                graph.capture_end()
        finally:
            torch.cuda.set_stream(caller)
        self.graph = graph


class GraphedAllReduce(PackedAllReduce):
    """`PackedAllReduce` replayed from a CUDA graph per bucket (see the module docstring).

    Args:
        lane: the communicator's ``graph_lane()``.
    """

    __slots__ = ("lane", "_graphs", "_launches", "_failed", "_caller", "_capture_stream",
                 "_ready")

    def __init__(self, lane: GraphLane) -> None:
        self.lane = lane
        self._graphs: dict[int, BucketGraph] = {}
        self._launches: dict[int, int] = {}  # eager launches per bucket, until its capture
        self._failed: set[int] = set()
        self._caller: torch.cuda.Stream | None = None
        self._capture_stream: torch.cuda.Stream | None = None
        self._ready: torch.cuda.Event | None = None

    # ------------------------------------------------------------------ the hot path
    def _caller_stream(self) -> torch.cuda.Stream:
        """The current stream, looked up only when its handle differs from the last one's."""
        caller = self._caller
        index = self.lane.device.index
        if caller is None or torch._C._cuda_getCurrentRawStream(index) != caller.cuda_stream:
            caller = self._caller = torch.cuda.current_stream(index)
        return caller

    def launch(self, reducer: ReducerLike, bucket: Bucket, grads: Grads):
        index = bucket.index
        graph = self._graphs.get(index)
        ptrs = _addresses(reducer, grads)
        if ptrs is None:
            return super().launch(reducer, bucket, grads)
        scale = fp32_scale(reducer.scale)
        if graph is None:
            if index in self._failed:
                return super().launch(reducer, bucket, grads)
            launches = self._launches.get(index, 0)
            if launches < WARM_LAUNCHES:
                self._launches[index] = launches + 1
                return super().launch(reducer, bucket, grads)
            graph = self._capture(reducer, bucket, grads, ptrs, scale)
            if graph is None:
                return super().launch(reducer, bucket, grads)
        elif graph.stats is not _stats_of(reducer):  # a new GradHealth (recovery): again
            del self._graphs[index]
            graph = self._capture(reducer, bucket, grads, ptrs, scale)
            if graph is None:
                return super().launch(reducer, bucket, grads)
        elif graph.scale != scale or not graph.plan.set_addresses(ptrs, self.lane.stream):
            return super().launch(reducer, bucket, grads)
        return self.lane.replay(graph.graph, graph.flat, self._caller_stream(), self._ready,
                                graph.done)

    def wait(self, reducer: ReducerLike, bucket: Bucket, result):
        if result.__class__ is not EventWork or result.event is not self._done_of(bucket):
            return super().wait(reducer, bucket, result)
        result._check()
        self._caller_stream().wait_event(result.event)
        return CAPTURED

    def write_back(self, reducer: ReducerLike, bucket: Bucket, value, unused: frozenset[int]):
        if value is not CAPTURED:
            super().write_back(reducer, bucket, value, unused)
            return
        if reducer.health is not None:  # the replay wrote the gradients and their row
            reducer.health.captured(bucket, bucket.grad_targets(unused, reducer.create_graph))

    def _done_of(self, bucket: Bucket):
        graph = self._graphs.get(bucket.index)
        return None if graph is None else graph.done

    # ------------------------------------------------------------------ capture
    def _capture(self, reducer: ReducerLike, bucket: Bucket, grads: Sequence[torch.Tensor],
                 ptrs: list[int], scale: float) -> BucketGraph | None:
        """Captures `bucket` (its gradients `grads` at `ptrs`); None where it cannot be."""
        stats = None if reducer.health is None else reducer.health.ensure_stats()
        caller = self._caller_stream()
        try:
            graph = BucketGraph(bucket, scale, stats)
            if not graph.plan.set_addresses(ptrs, self.lane.stream):
                return None  # misaligned this step: eager, and capture another time
            if self._capture_stream is None:
                self._capture_stream = torch.cuda.Stream(self.lane.device)
                self._ready = torch.cuda.Event()
            graph.capture(self.lane, caller, self._capture_stream)
        except Exception as exc:  # a CUDA, NCCL or Triton error: this bucket stays eager
            self._failed.add(bucket.index)
            caller.wait_stream(self.lane.stream)  # the eager pack follows the warm-up
            warnings.warn(
                f"fastcomm DDP (rank {reducer.comm.rank}): bucket {bucket.index} could not be "
                f"captured in a CUDA graph ({type(exc).__name__}: {exc}); it is reduced "
                "eagerly from now on (DDP(..., cuda_graphs=False) turns capture off)",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        self._graphs[bucket.index] = graph
        return graph

    def __repr__(self) -> str:
        return f"GraphedAllReduce({len(self._graphs)} captured)"


def _stats_of(reducer: ReducerLike) -> torch.Tensor | None:
    health = reducer.health
    return None if health is None else health.stats


def _addresses(reducer: ReducerLike, grads: Grads) -> list[int] | None:
    """The gradients' addresses where a replay can take them, else None (module docstring):
    every gradient a plain contiguous tensor, no ``create_graph``, no recovery keeper."""
    if reducer.create_graph or reducer.keeper is not None:
        return None
    try:
        if set(map(type, grads)) != {_TENSOR} or not all(map(_IS_CONTIGUOUS, grads)):
            return None
        return list(map(_DATA_PTR, grads))
    except TypeError:
        return None
