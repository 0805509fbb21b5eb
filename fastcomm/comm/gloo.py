"""Gloo communicator: torch's ``ProcessGroupGloo`` built directly on a fastcomm store.

No global ``torch.distributed`` state is touched: the process group is private to this object,
so a program may hold several (``split``) beside an ``init_process_group`` of its own.

Gloo's native handles are completed on a per-communicator thread (a ``Lane``), in
issue order, which also applies what Gloo lacks (``AVG`` is a ``SUM`` followed by a division)
before the ``Work``'s future resolves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from .base import Communicator
from .errors import FastcommError
from .store import Store
from .types import ReduceOp
from .work import Lane, Work, wrap_error

__all__ = ["GlooCommunicator"]

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.SUM,  # divided afterwards: Gloo has no AVG
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


def divide_(tensor: torch.Tensor, size: int) -> None:
    """In-place ``tensor / size``; integers truncate toward zero (NCCL's ncclAvg)."""
    if tensor.is_floating_point():
        tensor.div_(size)
    else:
        tensor.div_(size, rounding_mode="trunc")


class GlooCommunicator(Communicator):
    """Collectives over TCP with Gloo, on CPU tensors (and CUDA tensors, staged by Gloo).

    Args:
        store: a store namespace private to this communicator.
        rank: this process's rank.
        size: number of ranks.
        timeout: limit for connecting and for every collective.

    Raises:
        FastcommError: the full mesh could not be connected within ``timeout``.
    """

    backend = "gloo"

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float | timedelta | None = None,
    ) -> None:
        super().__init__(store, rank, size, timeout)
        start = time.monotonic()
        try:
            self._pg = dist.ProcessGroupGloo(
                store.prefixed("gloo").torch_store, rank, size, self.timeout
            )
        except RuntimeError as exc:
            raise FastcommError(
                f"rank {rank}: Gloo could not connect {size} ranks through the store at "
                f"{store.address} after {time.monotonic() - start:.1f} s: {exc}"
            ) from exc
        self._completions = Lane(f"fastcomm-gloo-r{rank}")
        self._tag = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _device_ok(self, device: torch.device) -> bool:
        return device.type in ("cpu", "cuda")

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The underlying ``ProcessGroupGloo`` (for code that wants torch's API)."""
        return self._pg

    def _new_child(self, store: Store, rank: int, size: int, timeout: timedelta):
        return GlooCommunicator(store, rank, size, timeout)

    # ------------------------------------------------------------------ plumbing
    def _submit(
        self,
        op: str,
        output: torch.Tensor | None,
        issue: Callable[[], object],
        post: Callable[[], None] | None = None,
    ) -> Work:
        work = Work(op, self.rank, output)
        try:
            handle = issue()
        except RuntimeError as exc:
            raise wrap_error(op, self.rank, work.start, exc) from exc
        timeout = self.timeout

        def finish() -> None:
            try:
                handle.wait(timeout)
                if post is not None:
                    post()
            except BaseException as exc:
                raise wrap_error(op, self.rank, work.start, exc) from exc

        self._completions.submit(work, finish)
        return work

    # ------------------------------------------------------------------ collectives
    def _impl_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        if tensor.numel() == 0:
            return self._done("all_reduce", tensor)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _TORCH_OPS[op]
        post = (lambda: divide_(tensor, self.size)) if op is ReduceOp.AVG else None
        return self._submit("all_reduce", tensor, lambda: self._pg.allreduce([tensor], opts), post)

    def _impl_broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        if tensor.numel() == 0:
            return self._done("broadcast", tensor)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self._submit("broadcast", tensor, lambda: self._pg.broadcast([tensor], opts))

    def _impl_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        if input.numel() == 0:
            return self._done("all_gather", output)
        out_flat, in_flat = output.view(-1), input.view(-1)
        return self._submit(
            "all_gather", output, lambda: self._pg._allgather_base(out_flat, in_flat)
        )

    def _impl_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp
    ) -> Work:
        if output.numel() == 0:
            return self._done("reduce_scatter", output)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _TORCH_OPS[op]
        out_flat, in_flat = output.view(-1), input.view(-1)
        post = (lambda: divide_(output, self.size)) if op is ReduceOp.AVG else None
        return self._submit(
            "reduce_scatter",
            output,
            lambda: self._pg._reduce_scatter_base(out_flat, in_flat, opts),
            post,
        )

    def _impl_all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        if input.numel() == 0:
            return self._done("all_to_all", output)
        out_flat, in_flat = output.view(-1), input.view(-1)
        return self._submit(
            "all_to_all",
            output,
            lambda: self._pg.alltoall_base(out_flat, in_flat, [], [], dist.AllToAllOptions()),
        )

    def _impl_send(self, tensor: torch.Tensor, dst: int) -> Work:
        if tensor.numel() == 0:
            return self._done("send", tensor)
        return self._submit("send", tensor, lambda: self._pg.send([tensor], dst, 0))

    def _impl_recv(self, tensor: torch.Tensor, src: int) -> Work:
        if tensor.numel() == 0:
            return self._done("recv", tensor)
        return self._submit("recv", tensor, lambda: self._pg.recv([tensor], src, 0))

    def _impl_barrier(self) -> Work:
        return self._submit("barrier", None, lambda: self._pg.barrier(dist.BarrierOptions()))

    def _impl_close(self) -> None:
        self._completions.close(timeout=5.0)
        try:
            self._pg.shutdown()
        except RuntimeError:
            pass  # already torn down by a failed peer; nothing left to release
