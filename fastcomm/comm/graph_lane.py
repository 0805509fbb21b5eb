"""A communicator's all-reduce inside CUDA graphs: captured once, replayed every step.

A DDP bucket whose pack, all-reduce and unpack never change but for the gradients' addresses
is captured once into a CUDA graph and replayed each step (``fastcomm.ddp.graphs``): one host
call instead of hundreds of microseconds of Python. The communicator that offers this
(``capabilities.graph_all_reduce``: NCCL) hands DDP a `GraphLane`:

- `capture_all_reduce` enqueues the collective on the current stream while a graph is being
  captured there (no ``Work``, no event: nothing runs until the graph is replayed);
- `replay` issues a replay on the communicator's own stream, after the caller's stream, in
  the same order as the communicator's other calls, and returns an `EventWork` that the
  stream watchdog times out like any other: the flight record, the statistics and the
  timeout of a replayed collective are those of a call made eagerly.

Invariants: replays and eager calls share one stream, so every rank issues its collectives to
NCCL in one order whichever way each was made; `replay` makes no event, queries none and
allocates no pinned memory (the caller passes two events it made once); a refused
communicator (aborted, timed out) refuses replays too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .stream import EventWork, StreamWatchdog
from .types import ReduceOp

__all__ = ["GraphLane"]


class GraphLane:
    """All-reduces of one communicator in CUDA graphs (module docstring).

    Args:
        comm: the communicator (its ``rank``, ``flight`` recorder and ``stats`` are read at
            each call, as its own calls read them).
        stream: the communicator's stream, where every replay runs.
        watchdog: the communicator's stream watchdog (its lock orders replays with the
            communicator's other enqueues; its error refuses them).
        future_stream: the stream a replay's future completes on (the communicator's).
        enqueue: ``enqueue(tensor, op, stream_handle)`` puts the collective on that stream
            (called inside a capture only).
        refused: the error a refused call raises, given the op's name.
    """

    def __init__(
        self,
        comm: Any,
        *,
        stream: torch.cuda.Stream,
        watchdog: StreamWatchdog,
        future_stream: torch.cuda.Stream,
        enqueue: Callable[[torch.Tensor, ReduceOp, int], None],
        refused: Callable[[str], BaseException],
    ) -> None:
        self.comm = comm
        self.stream = stream
        self.device = stream.device
        self._watchdog = watchdog
        self._future_stream = future_stream
        self._enqueue = enqueue
        self._refused = refused

    def capture_all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        """Enqueues `tensor`'s all-reduce on the current stream, which is capturing a graph.

        Raises:
            ValueError: `tensor` is not a contiguous tensor on the communicator's device, or
                the current stream is not capturing.
            TypeError: a dtype the communicator cannot reduce, or an op other than SUM/AVG.
        """
        if not isinstance(tensor, torch.Tensor) or tensor.device != self.device:
            where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"rank {self.comm.rank}: a captured all_reduce takes a tensor on "
                             f"{self.device}, got {where}")
        if not tensor.is_contiguous():
            raise ValueError(f"rank {self.comm.rank}: a captured all_reduce takes a contiguous "
                             f"tensor")
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise TypeError(f"rank {self.comm.rank}: a captured all_reduce takes SUM or AVG, "
                            f"got {op}")
        if not torch.cuda.is_current_stream_capturing():
            raise ValueError(f"rank {self.comm.rank}: capture_all_reduce outside a CUDA graph "
                             f"capture (use the communicator's all_reduce)")
        self._enqueue(tensor, op, torch.cuda.current_stream(self.device).cuda_stream)

    def replay(
        self,
        graph: torch.cuda.CUDAGraph,
        tensor: torch.Tensor,
        caller: torch.cuda.Stream,
        ready: torch.cuda.Event,
        done: torch.cuda.Event,
        op: ReduceOp = ReduceOp.SUM,
    ) -> EventWork:
        """Replays `graph` (whose one collective is `tensor`'s all-reduce) on the
        communicator's stream once `caller`'s work so far is done; its `EventWork`.

        Args:
            graph: the captured graph.
            tensor: the tensor its collective reduces (recorded, counted, kept).
            caller: the stream whose work the replay must follow (the caller's current one).
            ready: an event of the caller's, recorded on `caller` here.
            done: an event of the caller's, recorded after the replay (the work's event).
            op: the captured reduction, for the flight record.

        Raises:
            CommAbortedError: the communicator was aborted or timed out.
        """
        comm = self.comm
        recorder = comm.flight
        seq = recorder.issue("all_reduce", tensor, op) if recorder is not None else 0
        stream = self.stream
        watchdog = self._watchdog
        try:
            with watchdog.lock:  # one (wait, launch, record) sequence at a time, as _enqueue
                if watchdog.error is not None:
                    raise self._refused("all_reduce")
                ready.record(caller)
                stream.wait_event(ready)
                torch.cuda.set_stream(stream)
                try:
                    graph.replay()
                finally:
                    torch.cuda.set_stream(caller)
                done.record(stream)
                work = EventWork("all_reduce", comm.rank, tensor, self.device, done, (tensor,),
                                 self._future_stream)
                watchdog.add(work)
        except BaseException as exc:
            if recorder is not None:
                recorder.fail(seq, exc)
            raise
        comm.stats.record("all_reduce", tensor)
        if recorder is not None:
            recorder.finish(seq, work)
        return work
