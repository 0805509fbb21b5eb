"""A torch ``ProcessGroup`` presented as a fastcomm :class:`Communicator`.

``TorchPGCommunicator(pg)`` lets code written against fastcomm (the DDP reducer, the comm
hooks) run on a group a training script already made with ``torch.distributed``: collectives
go straight to the group's backend (``pg.allreduce`` and friends, with group-local ranks), so
they share its connections, streams and ordering with any other use of the same group.

The collectives are ``ProcessGroupCommunicator``'s (``process_group.py``), shared with the Gloo
communicator: a :class:`Work` resolves to the output tensor (fastcomm's contract; torch's own
futures resolve to a list), and ``AVG`` on a backend without it (Gloo) is a ``SUM`` followed
by a division, done before the future resolves. On a CUDA (NCCL) group the future is torch's
CUDA-aware future instead, so ``wait()`` orders the caller's stream after the collective.

Sub-communicators (``split``) are fastcomm communicators (Gloo on CPU, NCCL on CUDA) built on
the group's store under a private prefix; the group itself is never split.
"""

from __future__ import annotations

import itertools
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import FastcommError
from ..nccl import NcclCommunicator
from ..store import Store
from ..work import Work, wrap_error
from .gloo import GlooCommunicator
from .process_group import ProcessGroupCommunicator

__all__ = ["TorchPGCommunicator", "group_store"]

_ADAPTERS: dict[str, itertools.count] = {}


class _TorchWork(Work):
    """A fastcomm ``Work`` over a torch ``Work`` (completion is torch's, not a thread's)."""

    def __init__(self, op, rank, output, torch_work, post=None):
        super().__init__(op, rank, output)
        self._torch_work = torch_work
        output_ = output

        def resolve(fut: torch.futures.Future):
            fut.value()  # re-raises the collective's error
            if post is not None:
                post()
            return output_

        self._chained = torch_work.get_future().then(resolve)

    def is_completed(self) -> bool:
        return self._chained.done()

    def is_success(self) -> bool:
        return self._chained.done() and self.exception() is None

    def exception(self) -> BaseException | None:
        if not self._chained.done():
            return None
        try:
            self._chained.value()
        except BaseException as exc:  # reported, not raised: the caller asked for it
            return exc
        return None

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        try:
            if timeout is None:
                self._torch_work.wait()
            else:
                seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
                self._torch_work.wait(timedelta(seconds=seconds))
            self._chained.wait()
        except FastcommError:
            raise
        except RuntimeError as exc:
            raise wrap_error(self.op, self.rank, self.start, exc) from exc
        return True

    def get_future(self) -> torch.futures.Future:
        return self._chained


def _backend_name(pg: dist.ProcessGroup) -> str:
    try:
        return str(dist.get_backend(pg)).lower()
    except (RuntimeError, ValueError):
        return "unknown"


class TorchPGCommunicator(ProcessGroupCommunicator):
    """Collectives on a torch ``ProcessGroup`` (the default group when ``None``).

    Args:
        process_group: the group; ``None`` means ``torch.distributed``'s default group.
        timeout: limit used by ``Work.wait`` when no timeout is passed and by store helpers.

    Raises:
        RuntimeError: ``process_group`` is ``None`` and ``torch.distributed`` is not
            initialized, or this process is not a member of the group.
    """

    backend = "torch"

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        timeout: float | timedelta | None = None,
    ) -> None:
        if process_group is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "TorchPGCommunicator(None) needs torch.distributed.init_process_group() "
                    "to have been called (or pass a ProcessGroup)"
                )
            process_group = dist.distributed_c10d._get_default_group()
        rank, size = process_group.rank(), process_group.size()
        if rank < 0:
            raise RuntimeError("this process is not a member of the given process group")
        self.process_group = process_group
        self.pg_backend = _backend_name(process_group)
        store = group_store(process_group, rank, timeout)
        super().__init__(store, rank, size, timeout)
        if "nccl" in self.pg_backend and torch.cuda.is_available():
            self._device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._device = torch.device("cpu")
        # Gloo (and MPI) lack AVG; NCCL has it natively.
        self.native_avg = "nccl" in self.pg_backend

    @property
    def device(self) -> torch.device:
        """The group's device: this rank's CUDA device for an NCCL group, else CPU."""
        return self._device

    def _device_ok(self, device: torch.device) -> bool:
        if "gloo" in self.pg_backend:
            return device.type in ("cpu", "cuda")
        return device.type == self._device.type

    def __repr__(self) -> str:
        return (
            f"TorchPGCommunicator(rank={self.rank}, size={self.size}, "
            f"backend={self.pg_backend}, device={self.device})"
        )

    def _issue(self, op, output, issue, post=None) -> Work:
        if self._device.type != "cuda":
            return super()._issue(op, output, issue, post)
        # CUDA groups keep torch's stream-aware future: waiting orders the caller's stream
        # after the collective instead of blocking a host thread.
        start = time.monotonic()
        try:
            torch_work = issue()
        except RuntimeError as exc:
            raise wrap_error(op, self.rank, start, exc) from exc
        return _TorchWork(op, self.rank, output, torch_work, post)

    # ------------------------------------------------------------------ objects / split
    def all_gather_object(self, obj, timeout=None) -> list:
        """Gathers a small picklable object from every member (through the group itself)."""
        self._check_open("all_gather_object")
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, obj, group=self.process_group)
        return gathered

    def _new_child(self, store: Store, rank: int, size: int, timeout: timedelta):
        if self._device.type == "cuda":
            return NcclCommunicator(store, rank, size, timeout, device=self._device)
        return GlooCommunicator(store, rank, size, timeout)


def group_store(
    pg: dist.ProcessGroup, rank: int, timeout: float | timedelta | None
) -> Store:
    """A fastcomm view of a torch group's own store, under a prefix private to this call.

    Args:
        pg: the torch group whose store (or the default group's) is used.
        rank: this process's rank in ``pg``, named in the store's errors.
        timeout: the store's default timeout (``None``: fastcomm's default).
    """
    try:
        base = pg.get_group_store()
    except (RuntimeError, AttributeError):
        base = dist.distributed_c10d._get_default_store()
    # Every adapter of a group gets its own namespace (adapters are made in the same order on
    # every member, like any collective), so store-based helpers of two never share keys.
    count = _ADAPTERS.setdefault(pg.group_name, itertools.count())
    prefix = f"fastcomm/torch_pg/{pg.group_name}/{next(count)}"
    return Store(
        timeout=timeout,
        rank=rank,
        _base=dist.PrefixStore(prefix, base),
        _root=base,
        prefix=prefix,
    )
