"""``hier`` communicator: shared memory inside each host, Gloo between one leader per host.

Topology (:class:`~.topology.HostLayout`, from every rank's host identity exchanged through the
store): hosts are numbered in order of their lowest rank; on each host the ranks are ordered by
global rank and the first is the host's leader. ``fastcomm.comm.world`` builds the three parts
and hands them over (:func:`~fastcomm.comm.world.new_communicator`); this module imports no
other backend:

- ``intra``: a shared-memory communicator over the ranks of this host (``None`` for a lone rank).
- ``leaders``: a Gloo communicator over the leaders (``None`` elsewhere, or on one host).
- ``flat``: a Gloo communicator over every rank, the ``fallback``: what has no hierarchical
  schedule here (``all_gather``, ``reduce_scatter``, ``all_to_all``, ``send``/``recv``) and
  CUDA tensors go through it.

``all_reduce`` = reduce to the leader in the host, all-reduce across leaders, broadcast in the
host (``AVG`` sums and the leader divides once, so integers truncate as elsewhere).
``broadcast`` = in the source's host to its leader, across leaders, then in every other host.
``barrier`` = in host, across leaders, in host. Hierarchical calls run in issue order on the
communicator's executor (as ``shm``'s do); ``flat`` calls are ordered by Gloo itself.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from .base import Communicator
from .store import Store
from .topology import HostLayout
from .types import Capabilities, ReduceOp, divide_
from .work import Task

__all__ = ["HierCommunicator"]


class HierCommunicator(Communicator):
    """Hierarchical collectives for jobs that span hosts.

    Args:
        store: a store namespace private to this communicator.
        rank: this process's rank among ``size`` ranks on any number of hosts.
        size: number of ranks.
        timeout: limit for every operation.
        layout: the ranks' hosts.
        intra: this host's shared-memory communicator (``None`` if this rank is alone on it).
        leaders: the host leaders' communicator (``None`` on non-leaders or on one host).
        flat: a communicator over every rank (Gloo), for the flat operations and CUDA tensors.

    Attributes:
        hosts: every rank's host index, in rank order.
    """

    backend = "hier"

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float | timedelta | None = None,
        *,
        layout: HostLayout,
        intra: Communicator | None,
        leaders: Communicator | None,
        flat: Communicator,
    ) -> None:
        super().__init__(store, rank, size, timeout, fallback=flat)
        self.layout = layout
        self.hosts = list(layout.hosts)
        self.host = layout.host
        self.num_hosts = layout.num_hosts
        self.local_rank = layout.local_rank
        self.is_leader = layout.is_leader
        self.intra = intra
        self.leaders = leaders
        # CPU tensors, hierarchically; the leaders' sum order depends on an element's place
        # beyond two hosts, the shm sum inside a host does not
        self.capabilities = Capabilities(layout_free=size <= 2)

    @property
    def flat(self) -> Communicator:
        """The Gloo communicator over every rank (the ``fallback``)."""
        return self.fallback

    @property
    def device(self) -> torch.device:
        """CPU: the tensors this communicator moves itself (CUDA ones take ``flat``)."""
        return torch.device("cpu")

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
            self.intra.broadcast(tensor, self.layout.members(src_host).index(src))
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
        return self.flat._impl_all_gather(output, input)

    def _impl_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp
    ) -> Task:
        return self.flat._impl_reduce_scatter(output, input, op)

    def _impl_all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Task:
        return self.flat._impl_all_to_all(output, input)

    def _impl_send(self, tensor: torch.Tensor, dst: int) -> Task:
        return self.flat._impl_send(tensor, dst)

    def _impl_recv(self, tensor: torch.Tensor, src: int) -> Task:
        return self.flat._impl_recv(tensor, src)

    # ------------------------------------------------------------------ lifetime
    def _new_child(self, store: Store, rank: int, size: int, timeout: timedelta):
        raise TypeError(
            "a hier communicator's sub-communicators are built by fastcomm.comm.world "
            "(make_child); build this one with fastcomm.comm.new_communicator('hier', ...)"
        )

    def _impl_close(self) -> None:
        super()._impl_close()
        for comm in (self.intra, self.leaders):
            if comm is not None:
                comm.close()
