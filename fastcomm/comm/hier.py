"""``hier`` communicator: shared memory inside each host, Gloo between one leader per host.

``fastcomm.comm.world`` builds the three parts and hands them over (this module imports no
other backend): ``intra`` (shm over this host's ranks, ``None`` for a lone rank), ``leaders``
(Gloo over the hosts' leaders, ``None`` elsewhere) and ``flat`` (Gloo over every rank: the
``fallback`` for what has no hierarchical schedule, and CUDA tensors). ``all_reduce`` and
``broadcast`` go through the leader in each host; ``barrier`` is the agreement exchange alone.

Invariants: hosts are numbered by their lowest rank and each host's first rank is its leader;
every collective is first compared across all ranks (its :class:`~.calls.Call` row), so a
disagreement raises ``FastcommError`` on every rank before any tensor changes; every
collective, ``flat`` ones included, runs in issue order on the communicator's executor; a
lost rank's :meth:`HierCommunicator.abort` (any thread) stops the waits on Gloo and shm.

The topology, the agreement exchange and small all-reduces riding in it: docs/architecture.md.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from .base import Communicator
from .calls import HEAD, Call, encode, first_difference, mismatch_message, tensor_call
from .errors import (
    CollectiveMismatchError,
    CommAbortedError,
    CommClosedError,
    CommTimeoutError,
    FastcommError,
)
from .reduction import reduce_into
from .store import Store
from .topology import HostLayout
from .types import Capabilities, ReduceOp, divide_
from .work import Task

__all__ = ["HierCommunicator"]

# a rank's row in the agreement: its rank, then its call (calls.encode: no per-rank lists)
_WIDTH = 1 + HEAD
_PAIR_BYTES = 2 * _WIDTH * 8  # a host's verdict in the leaders' exchange: two rows
# the largest all-reduce whose hosts' sums ride in the agreement's exchange across leaders (a
# Gloo gather of this much costs about what the Gloo all-reduce of it does)
_RIDE_BYTES = 4096
#: Seconds a wait on Gloo sleeps before it looks whether the communicator was aborted.
ABORT_SLICE_S = 0.02
# what Gloo's errors say when a peer's connection went (its process or its host is gone)
_CONNECTION_LOST = ("connection closed", "connection reset", "broken pipe", "no route to host",
                    "connection refused", "socket closed")


def _mismatch(table: torch.Tensor) -> str | None:
    """The first two calls that differ in the leaders' table (bytes of rows), in words."""
    rows = table.view(torch.int64).view(-1, _WIDTH).tolist()
    return first_difference([row[1:] for row in rows], [row[0] for row in rows])


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
        self.capabilities = Capabilities(
            layout_free=size <= 2, sees_lost_peers=True, shrinks_across_hosts=True
        )
        for part in (leaders, flat):
            if part is not None and hasattr(part, "abort_slice_s"):
                part.abort_slice_s = ABORT_SLICE_S
        self.loss_grace = 0.0
        """Seconds a failed call waits for :meth:`abort` to name a lost rank before its own
        error stands (in-place recovery sets it: a peer's closed socket is seen before the
        launcher names the loss)."""
        self._aborted: BaseException | None = None

    @property
    def flat(self) -> Communicator:
        """The Gloo communicator over every rank (the ``fallback``)."""
        return self.fallback

    @property
    def device(self) -> torch.device:
        """CPU: the tensors this communicator moves itself (CUDA ones take ``flat``)."""
        return torch.device("cpu")

    # ------------------------------------------------------------------ agreement
    def _agree(self, call: Call, ride: tuple | None = None) -> bool:
        """Compares ``call`` across every rank; raises on every rank
        alike, naming both calls, where any two differ.

        Three steps, each of one size on every rank whatever the collective (so they never
        disagree themselves): the host's rows gathered over shm; the leaders gather, over Gloo,
        each host's first row and the first one that differs from it (with room for
        ``_RIDE_BYTES`` of data); the leader broadcasts the table (and that data) in its host.

        Args:
            call: this rank's call.
            ride: ``(flat tensor, op)`` of an all-reduce of at most ``_RIDE_BYTES``: where the
                host agrees it is reduced to the leader first, and the hosts' sums ride in the
                leaders' exchange, folded in host order and divided there for ``AVG`` (what the
                Gloo all-reduce they replace computes): a small all-reduce still crosses the
                hosts once, its steps those of the call without agreement plus one shm gather.

        Returns:
            Whether ``ride``'s tensor now holds the all-reduced values.

        Raises:
            FastcommError: the ranks' calls differ (or a step failed: timeout, peer gone).
        """
        intra = self.intra
        row = [self.rank, *encode(call)]
        if intra is not None:
            mine = torch.tensor(row, dtype=torch.int64)
            rows = mine.new_empty((intra.size, _WIDTH))
            intra.all_gather(rows, mine)
            host_rows = rows.tolist()
        else:
            host_rows = [row]
        first = host_rows[0]
        other = next((r for r in host_rows if r[1:] != first[1:]), first)
        # the same on every rank of this host: they all hold the same rows
        riding = ride is not None and other is first
        if riding:
            flat, op = ride
            nbytes = flat.numel() * flat.element_size()
            inner = ReduceOp.SUM if op is ReduceOp.AVG else op
            if intra is not None:
                intra.reduce(flat, 0, inner)
        head = self.num_hosts * _PAIR_BYTES
        out = torch.empty(head + _RIDE_BYTES, dtype=torch.uint8)
        if self.is_leader:
            send = torch.empty(_PAIR_BYTES + _RIDE_BYTES, dtype=torch.uint8)
            send[:_PAIR_BYTES].view(torch.int64).copy_(
                torch.tensor(first + other, dtype=torch.int64)
            )
            if riding:
                send[_PAIR_BYTES:_PAIR_BYTES + nbytes].copy_(flat.view(torch.uint8))
            if self.leaders is not None:
                gathered = send.new_empty((self.num_hosts, send.numel()))
                self.leaders.all_gather(gathered, send)
            else:
                gathered = send.view(1, -1)
            out[:head].view(self.num_hosts, _PAIR_BYTES).copy_(gathered[:, :_PAIR_BYTES])
            if riding and _mismatch(out[:head]) is None:
                result = out[head:head + nbytes].view(flat.dtype)
                terms = [g[_PAIR_BYTES:_PAIR_BYTES + nbytes].view(flat.dtype) for g in gathered]
                reduce_into(result, terms, inner)
                if op is ReduceOp.AVG:
                    divide_(result, self.size)
        if intra is not None:
            intra.broadcast(out, 0)
        problem = _mismatch(out[:head])
        if problem is not None:
            raise CollectiveMismatchError(mismatch_message(self.rank, call.op, problem))
        if riding:
            flat.copy_(out[head:head + nbytes].view(flat.dtype))
        return riding

    def _agreed(self, op: str, output: torch.Tensor | None, call: Call, run) -> Task:
        """A task for the executor: the agreement on ``call``, then ``run()``."""

        def agree_then_run():
            self._agree(call)
            return run()

        return Task(op, output, agree_then_run, self._executor)

    # ------------------------------------------------------------------ hierarchical ops
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, call: Call) -> None:
        if tensor.numel() * tensor.element_size() <= _RIDE_BYTES:
            # the leader's host sum goes into a copy: a call that fails leaves its tensor be
            flat = tensor.view(-1)
            if self.is_leader and self.intra is not None:
                flat = flat.clone()
            if self._agree(call, (flat, op)):
                if flat.data_ptr() != tensor.data_ptr():
                    tensor.view(-1).copy_(flat)
                return
        else:
            self._agree(call)
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

    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp, call) -> None:
        # the all-reduce of a copy off the root: only the root's tensor changes
        self._all_reduce(tensor if self.rank == root else tensor.clone(), op, call)

    def _impl_all_reduce(self, tensor: torch.Tensor, op: ReduceOp,
                         blocking: bool = False) -> Task:
        call = tensor_call("all_reduce", tensor, op)
        return self._task("all_reduce", tensor, lambda: self._all_reduce(tensor, op, call))

    def _impl_reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp,
                     blocking: bool = False) -> Task:
        call = tensor_call("reduce", tensor, op, root)
        return self._task("reduce", tensor, lambda: self._reduce(tensor, root, op, call))

    def _impl_broadcast(self, tensor: torch.Tensor, src: int, blocking: bool = False) -> Task:
        call = tensor_call("broadcast", tensor, root=src)
        return self._agreed("broadcast", tensor, call,
                            lambda: self._broadcast(tensor, src))

    def _impl_barrier(self, blocking: bool = False) -> Task:
        # the agreement waits for every rank: it is the barrier
        return self._agreed("barrier", None, tensor_call("barrier"), lambda: None)

    # ------------------------------------------------------------------ flat ops (Gloo)
    # agreed first: Gloo given calls that differ hangs, aborts the process or returns garbage
    def _impl_all_gather(self, output: torch.Tensor, input: torch.Tensor,
                         blocking: bool = False) -> Task:
        task = self.flat._impl_all_gather(output, input)
        return self._agreed("all_gather", output, tensor_call("all_gather", input), task.run)

    def _impl_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                             blocking: bool = False) -> Task:
        task = self.flat._impl_reduce_scatter(output, input, op)
        call = tensor_call("reduce_scatter", output, op)
        return self._agreed("reduce_scatter", output, call, task.run)

    def _impl_all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                         blocking: bool = False) -> Task:
        task = self.flat._impl_all_to_all(output, input)
        return self._agreed("all_to_all", output, tensor_call("all_to_all", input), task.run)

    def _impl_send(self, tensor: torch.Tensor, dst: int, blocking: bool = False) -> Task:
        return self.flat._impl_send(tensor, dst)

    def _impl_recv(self, tensor: torch.Tensor, src: int, blocking: bool = False) -> Task:
        return self.flat._impl_recv(tensor, src)

    # ------------------------------------------------------------------ lost ranks
    def abort(self, error: BaseException) -> None:
        """From any thread: every pending and later call raises ``CommAbortedError`` naming
        ``error`` (a lost rank); the shm part is marked aborted (this host's peers fail at
        once), the Gloo parts' waits stop within ``ABORT_SLICE_S``. :meth:`close` follows."""
        self._abort_parts(error, (self.leaders, self.flat, self.intra))

    def _run_task(self, task: Task, start: float) -> None:
        if self._aborted is not None:
            raise CommAbortedError(f"rank {self.rank}: {task.op} refused: {self._aborted}")
        try:
            super()._run_task(task, start)
        except FastcommError as exc:
            why = self._loss_behind(exc)
            if why is None:
                raise
            elapsed = time.monotonic() - start
            raise CommAbortedError(
                f"rank {self.rank}: {task.op} failed after {elapsed:.1f} s: {why}"
            ) from exc

    def _loss_behind(self, exc: FastcommError) -> BaseException | None:
        """The lost rank behind ``exc``: named by :meth:`abort` already, or within
        ``loss_grace`` where ``exc`` says a Gloo peer's connection went (a timeout is a hang;
        a shm peer's loss is already a loss error, on this host's liveness)."""
        text = str(exc).lower()
        went = not isinstance(exc, (CommTimeoutError, CommAbortedError, CommClosedError)) and \
            any(word in text for word in _CONNECTION_LOST)
        deadline = time.monotonic() + (self.loss_grace if went else 0.0)
        while self._aborted is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._aborted

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
