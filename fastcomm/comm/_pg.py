"""Collectives on a torch ``ProcessGroup``: the one implementation behind the Gloo communicator
(a ``ProcessGroupGloo`` fastcomm builds on its own store) and ``TorchPGCommunicator`` (a group a
script made with ``torch.distributed``).

Completion: each native handle is waited on by the communicator's ``Lane`` thread, in issue
order, which also applies what the backend lacks (``AVG`` as ``SUM`` then a division) before
the ``Work`` resolves. The lane works for every handle, including Gloo's ``reduce_scatter``,
whose handle has no future. Subclasses may override ``_issue`` (CUDA groups do, to keep torch's
stream-aware futures).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .base import Communicator
from .types import ReduceOp
from .work import Lane, Work, wrap_error

__all__ = ["ProcessGroupCommunicator", "divide_"]

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
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


class ProcessGroupCommunicator(Communicator):
    """A ``Communicator`` whose collectives run on ``self.process_group``.

    Subclasses set ``process_group`` and ``native_avg`` (whether the backend has ``AVG``) in
    their constructor.
    """

    process_group: dist.ProcessGroup
    native_avg: bool = False

    def __init__(self, store, rank, size, timeout=None) -> None:
        super().__init__(store, rank, size, timeout)
        self._completions = Lane(f"fastcomm-{self.backend}-r{rank}")  # thread starts on use

    def _issue(
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

    def _reduce_op(self, op: ReduceOp, tensor: torch.Tensor):
        """torch's op for ``op`` and the post-processing it needs (``AVG`` emulation)."""
        if op is ReduceOp.AVG and not self.native_avg:
            return dist.ReduceOp.SUM, (lambda: divide_(tensor, self.size))
        return _TORCH_OPS[op], None

    # ------------------------------------------------------------------ collectives
    def _impl_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        if tensor.numel() == 0:
            return self._done("all_reduce", tensor)
        opts = dist.AllreduceOptions()
        opts.reduceOp, post = self._reduce_op(op, tensor)
        pg = self.process_group
        return self._issue("all_reduce", tensor, lambda: pg.allreduce([tensor], opts), post)

    def _impl_broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        if tensor.numel() == 0:
            return self._done("broadcast", tensor)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        pg = self.process_group
        return self._issue("broadcast", tensor, lambda: pg.broadcast([tensor], opts))

    def _impl_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        if input.numel() == 0:
            return self._done("all_gather", output)
        out_flat, in_flat = output.view(-1), input.view(-1)
        pg = self.process_group
        return self._issue("all_gather", output, lambda: pg._allgather_base(out_flat, in_flat))

    def _impl_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp
    ) -> Work:
        if output.numel() == 0:
            return self._done("reduce_scatter", output)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp, post = self._reduce_op(op, output)
        out_flat, in_flat = output.view(-1), input.view(-1)
        pg = self.process_group
        return self._issue(
            "reduce_scatter", output, lambda: pg._reduce_scatter_base(out_flat, in_flat, opts), post
        )

    def _impl_all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        if input.numel() == 0:
            return self._done("all_to_all", output)
        out_flat, in_flat = output.view(-1), input.view(-1)
        pg = self.process_group
        return self._issue(
            "all_to_all",
            output,
            lambda: pg.alltoall_base(out_flat, in_flat, [], [], dist.AllToAllOptions()),
        )

    def _impl_send(self, tensor: torch.Tensor, dst: int) -> Work:
        if tensor.numel() == 0:
            return self._done("send", tensor)
        pg = self.process_group
        return self._issue("send", tensor, lambda: pg.send([tensor], dst, 0))

    def _impl_recv(self, tensor: torch.Tensor, src: int) -> Work:
        if tensor.numel() == 0:
            return self._done("recv", tensor)
        pg = self.process_group
        return self._issue("recv", tensor, lambda: pg.recv([tensor], src, 0))

    def _impl_barrier(self) -> Work:
        pg = self.process_group
        return self._issue("barrier", None, lambda: pg.barrier(dist.BarrierOptions()))

    def _impl_close(self) -> None:
        self._completions.close(timeout=5.0)
