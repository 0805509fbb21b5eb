"""``hier`` communicator: shared memory inside each host, Gloo between one leader per host.

Topology, built from every rank's host identity (``FASTCOMM_HOST_ID`` or hostname + boot id,
exchanged through the store): hosts are numbered in order of their lowest rank; on each host the
ranks are ordered by global rank and the first is the host's leader.

- ``intra``: a :class:`ShmCommunicator` over the ranks of this host (``None`` for a lone rank).
- ``leaders``: a :class:`GlooCommunicator` over the leaders (``None`` elsewhere, or on one host).
- ``world``: a :class:`GlooCommunicator` over every rank, for what has no hierarchical schedule
  here (``all_gather``, ``reduce_scatter``, ``all_to_all``, ``send``/``recv``) and for CUDA
  tensors (:meth:`HierCommunicator.route` decides, and says so once in the log).

``all_reduce`` = reduce to the leader in the host, all-reduce across leaders, broadcast in the
host (``AVG`` sums and the leader divides once, so integers truncate as elsewhere).
``broadcast`` = in the source's host to its leader, across leaders, then in every other host.
``barrier`` = in host, across leaders, in host. Hierarchical calls run in issue order on the
communicator's executor (as ``shm``'s do); ``world`` calls are ordered by Gloo itself.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from .base import Communicator
from .pg.gloo import GlooCommunicator
from .shm import ShmCommunicator
from .shm.segment import host_id
from .store import Store
from .types import ReduceOp, divide_
from .work import Task

__all__ = ["HierCommunicator"]


class HierCommunicator(Communicator):
    """Hierarchical collectives for jobs that span hosts.

    Args:
        store: a store namespace private to this communicator; the host communicators, the
            leaders' and ``world`` take namespaces under it.
        rank: this process's rank among ``size`` ranks on any number of hosts.
        size: number of ranks.
        timeout: limit for setup and for every operation.

    Attributes:
        hosts: every rank's host index, in rank order.
        intra: this host's shm communicator (``None`` if this rank is alone on its host).
        leaders: the Gloo communicator of host leaders (``None`` on non-leaders or one host).
        world: the Gloo communicator over all ranks.
    """

    backend = "hier"

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float | timedelta | None = None,
    ) -> None:
        super().__init__(store, rank, size, timeout)
        names = store.all_gather_object("hier/hosts", rank, size, host_id(), self.timeout)
        order = list(dict.fromkeys(names))
        self.hosts = [order.index(name) for name in names]
        self.host = self.hosts[rank]
        self.num_hosts = len(order)
        self._members = [[r for r in range(size) if self.hosts[r] == h] for h in range(len(order))]
        local = self._members[self.host]
        self.local_rank = local.index(rank)
        self.is_leader = self.local_rank == 0
        self.intra: ShmCommunicator | None = None
        self.leaders: GlooCommunicator | None = None
        if len(local) > 1:
            self.intra = ShmCommunicator(
                store.prefixed(f"hier/host{self.host}", rank=self.local_rank),
                self.local_rank,
                len(local),
                self.timeout,
                fallback=False,
            )
        if self.is_leader and self.num_hosts > 1:
            self.leaders = GlooCommunicator(
                store.prefixed("hier/leaders", rank=self.host), self.host, self.num_hosts,
                self.timeout,
            )
        self.world = GlooCommunicator(store.prefixed("hier/world"), rank, size, self.timeout)

    @property
    def device(self) -> torch.device:
        """CPU: the tensors this communicator moves itself (CUDA ones take ``world``)."""
        return torch.device("cpu")

    def _device_ok(self, device: torch.device) -> bool:
        return device.type in ("cpu", "cuda")

    def route(self, device: torch.device | str, op: str | None = None) -> Communicator:
        """The communicator that moves tensors on ``device``: this one (shared memory inside
        hosts, Gloo across leaders) for CPU tensors, ``world`` (Gloo over every rank, staging
        through host memory) for CUDA tensors.

        Raises:
            ValueError: a device other than CPU or CUDA.
        """
        if not isinstance(device, torch.device):
            device = torch.device(device)
        if device.type == "cpu":
            return self
        if device.type == "cuda":
            how = (
                "its flat Gloo communicator, CPU tensors through shared memory and the host "
                "leaders"
            )
            return self._hand_off(device, self.world, how)
        raise ValueError(
            f"{self._where()}: no route for tensors on {device}; it moves CPU tensors "
            "hierarchically and CUDA tensors through Gloo"
        )

    def _new_child(self, store: Store, rank: int, size: int, timeout: timedelta):
        return HierCommunicator(store, rank, size, timeout)

    # ------------------------------------------------------------------ hierarchical ops
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        inner = ReduceOp.SUM if op is ReduceOp.AVG else op
        if self.intra is not None:
            self.intra.reduce(tensor, 0, inner)
        if self.is_leader:
            if self.leaders is not None:
                self.leaders.all_reduce(tensor, inner)
            if op is ReduceOp.AVG:
                divide_(tensor, self.size)
        if self.intra is not None:
            self.intra.broadcast(tensor, 0)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        src_host = self.hosts[src]
        if self.intra is not None and self.host == src_host:
            self.intra.broadcast(tensor, self._members[src_host].index(src))
        if self.leaders is not None:
            self.leaders.broadcast(tensor, src_host)
        if self.intra is not None and self.host != src_host:
            self.intra.broadcast(tensor, 0)

    def _barrier(self) -> None:
        if self.intra is not None:
            self.intra.barrier()
        if self.leaders is not None:
            self.leaders.barrier()
        if self.intra is not None:
            self.intra.barrier()

    def _impl_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Task:
        return self._task("all_reduce", tensor, lambda: self._all_reduce(tensor, op))

    def _impl_broadcast(self, tensor: torch.Tensor, src: int) -> Task:
        return self._task("broadcast", tensor, lambda: self._broadcast(tensor, src))

    def _impl_barrier(self) -> Task:
        return self._task("barrier", None, self._barrier)

    # ------------------------------------------------------------------ flat ops (Gloo)
    def _impl_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Task:
        return self.world._impl_all_gather(output, input)

    def _impl_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp
    ) -> Task:
        return self.world._impl_reduce_scatter(output, input, op)

    def _impl_all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Task:
        return self.world._impl_all_to_all(output, input)

    def _impl_send(self, tensor: torch.Tensor, dst: int) -> Task:
        return self.world._impl_send(tensor, dst)

    def _impl_recv(self, tensor: torch.Tensor, src: int) -> Task:
        return self.world._impl_recv(tensor, src)

    # ------------------------------------------------------------------ lifetime
    def _impl_close(self) -> None:
        super()._impl_close()
        for comm in (self.intra, self.leaders, self.world):
            if comm is not None:
                comm.close()
