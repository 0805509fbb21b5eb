"""A torch ``ProcessGroup`` presented as a fastcomm :class:`Communicator`.

``TorchPGCommunicator(pg)`` lets code written against fastcomm (the DDP reducer, the comm
hooks) run on a group a script already made with ``torch.distributed``: collectives go
straight to the group's backend (group-local ranks), sharing its connections, streams and
ordering. The collectives are ``ProcessGroupCommunicator``'s (``process_group.py``).

Invariants: a :class:`~.process_group.PGWork` resolves to the output tensor; ``AVG`` on a
backend without it is ``SUM`` then a division, done before the future resolves; on a CUDA
group ``wait()`` orders the caller's stream after the collective; ``split`` builds fastcomm
communicators on the group's store under a private prefix, never splitting the group itself.

More: docs/torch_backend.md.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from ..base import Communicator
from ..errors import FastcommError
from ..store import Store
from ..types import Capabilities
from .gloo import GlooCommunicator
from .process_group import ProcessGroupCommunicator

__all__ = ["TorchPGCommunicator", "group_store"]

_ADAPTERS: dict[str, itertools.count] = {}


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
        gloo = "gloo" in self.pg_backend
        if "nccl" in self.pg_backend and torch.cuda.is_available():
            self._device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._device = torch.device("cpu")
        # Gloo (and MPI) lack AVG; NCCL has it natively.
        self.native_avg = "nccl" in self.pg_backend
        # Gloo also stages CUDA tensors through host memory and reduces sparse COO tensors;
        # beyond two ranks, torch's backends sum an element in an order set by its position
        devices = {"cpu", "cuda"} if gloo else {self._device.type}
        self.capabilities = Capabilities(
            devices=frozenset(devices), sparse_all_reduce=gloo, layout_free=size <= 2
        )

    @property
    def device(self) -> torch.device:
        """The group's device: this rank's CUDA device for an NCCL group, else CPU."""
        return self._device

    def __repr__(self) -> str:
        return (
            f"TorchPGCommunicator(rank={self.rank}, size={self.size}, "
            f"backend={self.pg_backend}, device={self.device})"
        )

    @classmethod
    def for_new_members(
        cls, store: Store, rank: int, size: int, timeout: timedelta, *,
        old: Communicator | None = None, spans_hosts: bool = False,
    ) -> Communicator:
        """Gloo over new members (it moves CPU and CUDA tensors): a torch group cannot be
        rebuilt over them."""
        return GlooCommunicator.for_new_members(store, rank, size, timeout)

    # ------------------------------------------------------------------ split
    def _new_child(self, store: Store, rank: int, size: int, timeout: timedelta):
        if self._device.type == "cuda":
            raise FastcommError(
                f"{self._where()}: a sub-communicator of a CUDA group is built by "
                "fastcomm.comm.world (get this adapter from fastcomm.comm.group_communicator)"
            )
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
