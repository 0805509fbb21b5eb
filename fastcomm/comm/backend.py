"""The backend contract: what every communicator backend implements, typed, one method per op.

A backend is a set of named ops (:class:`CommBackend`), each a method with its own typed
arguments that gets checked tensors (possibly empty: every rank still takes part) on a device
the backend moves (:meth:`CommBackend.route`) and returns the :class:`~.work.Task` that moves
the data. Each also takes ``blocking``: ``True`` where the caller waits for the result and asks
nothing of its ``Work`` (a synchronous call); a backend may then, where nothing of its own is
queued before the call, move the data at once, on the caller's thread, and return ``None``
(shm's small-message lane: below a few KiB, building a task would cost as much as moving the
bytes).
With ``blocking`` false it always returns a task, which callers may compose (``hier`` runs its
Gloo part's tasks after its agreement; :mod:`.adapt` wraps them).

The front end (:class:`~.base.Communicator`) wraps every public call the same way: its checks,
an id and slot in the flight recorder, the backend's op, the call's end (:mod:`.flight`,
:mod:`.hooks`); no op travels as a string to be looked up.

The ops: ``_impl_all_reduce``, ``_impl_reduce``, ``_impl_broadcast``, ``_impl_all_gather``,
``_impl_reduce_scatter``, ``_impl_all_to_all``, ``_impl_v_call`` (a call of unequal sizes),
``_impl_gather``, ``_impl_scatter`` and ``_impl_all_to_all_split`` (the v-calls a backend may
take without a list of pieces), ``_impl_send``, ``_impl_recv``, ``_impl_barrier``, and
``_impl_close``. ``_impl_reduce``, the four v-call ops and ``_impl_close`` have defaults built
on the others.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

import torch

from .adapt import followed_by, rooted_pieces
from .calls import HEAD, encode, first_difference, v_call
from .errors import CommClosedError
from .store import Store
from .types import Capabilities, PremulSum, ReduceOp
from .vcoll import raise_disagreement
from .work import OrderedExecutor, Task, Work, completed_work, wrap_error

if TYPE_CHECKING:
    from .base import Communicator

__all__ = ["CommBackend", "VKind"]

logger = logging.getLogger("fastcomm")

VKind = Literal["gather", "scatter", "all_to_all", "all_gather", "reduce_scatter",
                "all_gather_coalesced"]
"""The op a v-call's ranks compare (one of :data:`~.vcoll.KINDS`; ``calls.OPS`` codes it)."""


class CommBackend(abc.ABC):
    """What a backend implements (the typed ``_impl_*`` ops), and how the contract picks and
    runs it: routing (:meth:`route`) and execution (:meth:`_run`). :class:`~.base.Communicator`
    adds the public calls and sets the state used here (``rank``, ``size``, ``store``,
    ``fallback``, ``capabilities``, ``_executor``).
    """

    rank: int
    size: int
    store: Store
    timeout: timedelta
    fallback: Communicator | None
    make_child: Callable[[Store, int, int, timedelta], Communicator] | None
    _executor: OrderedExecutor
    _told_route: bool
    _closed: bool

    backend: str = "base"
    _capabilities: Capabilities = Capabilities()
    _cpu_native = True  # "cpu" in capabilities.devices, read on every call

    # ------------------------------------------------------------------ properties
    @property
    def capabilities(self) -> Capabilities:
        """What this communicator moves and how (set by each backend)."""
        return self._capabilities

    @capabilities.setter
    def capabilities(self, value: Capabilities) -> None:
        self._capabilities = value
        self._cpu_native = "cpu" in value.devices

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """The device whose tensors this communicator is built for."""

    # ------------------------------------------------------------------ state checks
    def _where(self) -> str:
        return f"rank {self.rank} of {self.backend} communicator (size {self.size})"

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise CommClosedError(f"{self._where()}: {op} called after close()")

    # ------------------------------------------------------------------ routing
    def moves(self, device: torch.device, op: str | None = None) -> bool:
        """Whether this communicator moves tensors on ``device`` for ``op`` itself, without
        its fallback (``op`` as for :meth:`route`); from its capabilities (NCCL refines it:
        its own device only)."""
        caps = self.capabilities
        kind = device.type
        return kind in caps.devices or (op == "all_reduce" and kind in caps.all_reduce_devices)

    def route(self, device: torch.device | str, op: str | None = None) -> Communicator:
        """The communicator that moves tensors on ``device``: this one where its capabilities
        say so, else its fallback where that one does (said once in the log, logger
        ``fastcomm``).

        Args:
            device: where the tensors live.
            op: the operation (``"all_reduce"``): some backends move a device for some
                operations only; ``None``: any operation.

        Raises:
            ValueError: no communicator here moves tensors on ``device``.
        """
        if not isinstance(device, torch.device):
            device = torch.device(device)
        if self.moves(device, op):
            return self
        fallback = self.fallback
        if fallback is not None and fallback.moves(device, op):
            if not self._told_route:
                self._told_route = True
                logger.info(
                    "%s: %s tensors go through its %s fallback", self._where(), device.type,
                    fallback.backend,
                )
            return fallback
        own = ", ".join(sorted(self.capabilities.devices))
        extra = (
            f", its {fallback.backend} fallback {', '.join(sorted(fallback.capabilities.devices))}"
            if fallback is not None else " (no fallback)"
        )
        raise ValueError(
            f"{self._where()}: no route for tensors on {device}: it moves {own} tensors{extra}"
        )

    def _target(self, tensor: torch.Tensor, op: str) -> Communicator:
        # CPU tensors on a CPU backend, the usual case, skip building a device object
        if tensor.is_cpu and self._cpu_native:
            return self
        return self.route(tensor.device, op)

    # ------------------------------------------------------------------ execution
    def _run(self, task: Task | None, async_op: bool) -> Work | None:
        """Runs ``task``: the one way every backend's operations execute (``None``: the
        backend's op moved the data already, ``blocking``).

        A task with an executor runs there, in issue order (on the caller's thread when
        nothing is pending and the caller waits); one without runs now, on the caller's
        thread. Either way ``task.run`` does the host's part and returns the ``Work`` of what
        is left, or ``None`` when the data is in place.
        """
        if task is None:
            return None
        executor = task.executor
        if executor is not None:
            work = executor.run(task, async_op)
        else:
            work = task.run()
            if work is None:
                return completed_work(task.op, self.rank, task.output) if async_op else None
        if async_op or work is None:
            return work
        work.wait()
        return None

    def _run_task(self, task: Task, start: float) -> None:
        """Runs one task for an :class:`OrderedExecutor` (``start``: when it was issued) until
        its data is in place; its error comes out naming the rank, the operation and the
        elapsed time."""
        try:
            work = task.run()
            if work is not None:
                work.wait()
        except Exception as exc:
            error = wrap_error(task.op, self.rank, start, exc)
            if error is exc:
                raise
            raise error from exc

    def _task(self, op: str, output: torch.Tensor | None, run: Callable[[], None]) -> Task:
        """A task for this communicator's executor (backends whose ``run`` blocks)."""
        return Task(op, output, run, self._executor)

    # ------------------------------------------------------------------ the ops
    # Each gets checked tensors on a device the backend moves and returns the Task that moves
    # the data, or None having moved it already where `blocking` (module docstring).
    @abc.abstractmethod
    def _impl_all_reduce(self, tensor: torch.Tensor, op: ReduceOp | PremulSum,
                         blocking: bool = False) -> Task | None:
        """Reduces ``tensor`` in place across ranks.

        Args:
            tensor: dense, or sparse COO only where ``capabilities.sparse_all_reduce``.
            op: a ``PremulSum`` only for dtypes in ``capabilities.premul_dtypes``; a bitwise op
                or an extra dtype only where ``capabilities.extended_reductions``.
            blocking: the caller waits (module docstring).

        Returns:
            The task that reduces, or ``None`` once reduced (``blocking`` only).
        """

    def _impl_reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp,
                     blocking: bool = False) -> Task | None:
        """Reduces ``tensor`` of every rank into ``tensor`` of ``root``.

        Default: an ``all_reduce`` of a copy, written back on ``root`` only.

        Args:
            tensor: the operand (and the result, on ``root``).
            root: the rank that keeps the result.
            op: the reduction (never a ``PremulSum``).
            blocking: the caller waits.

        Returns:
            The task that reduces, or ``None`` once reduced (``blocking`` only).
        """
        scratch = tensor.clone()
        task = self._impl_all_reduce(scratch, op)
        keep = (lambda: tensor.copy_(scratch)) if self.rank == root else (lambda: None)
        return Task("reduce", tensor, followed_by(task, keep).run, task.executor)

    @abc.abstractmethod
    def _impl_broadcast(self, tensor: torch.Tensor, src: int,
                        blocking: bool = False) -> Task | None:
        """Copies ``tensor`` of rank ``src`` into ``tensor`` of every rank.

        Returns:
            The task that copies, or ``None`` once copied (``blocking`` only).
        """

    @abc.abstractmethod
    def _impl_all_gather(self, output: torch.Tensor, input: torch.Tensor,
                         blocking: bool = False) -> Task | None:
        """Writes every rank's ``input`` into ``output``, in rank order.

        Args:
            output: ``size * input.numel()`` elements of ``input``'s dtype.
            input: may overlap ``output`` only where ``capabilities.in_place``.
            blocking: the caller waits.

        Returns:
            The task that gathers, or ``None`` once gathered (``blocking`` only).
        """

    @abc.abstractmethod
    def _impl_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                             blocking: bool = False) -> Task | None:
        """Reduces ``input`` across ranks, slice ``rank`` of the result into ``output``.

        Args:
            output: ``input.numel() / size`` elements; never overlapping ``input``.
            input: the terms, ``size`` slices.
            op: a plain :class:`ReduceOp`.
            blocking: the caller waits.

        Returns:
            The task that reduces, or ``None`` once reduced (``blocking`` only).
        """

    @abc.abstractmethod
    def _impl_all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                         blocking: bool = False) -> Task | None:
        """Slice ``j`` of ``input`` to rank ``j``, slice ``i`` of ``output`` from rank ``i``.

        Args:
            output: as many elements as ``input``, a multiple of ``size``.
            input: may overlap ``output`` only where ``capabilities.in_place``.
            blocking: the caller waits.

        Returns:
            The task that exchanges, or ``None`` once exchanged (``blocking`` only).
        """

    def _impl_v_call(self, kind: VKind, root: int, outputs: list[torch.Tensor],
                     inputs: list[torch.Tensor], blocking: bool = False) -> Task | None:
        """A v-call (:mod:`.vcoll`): ``inputs[r]`` to rank ``r``, ``outputs[q]`` from rank
        ``q``; a disagreement on the sizes raises ``SizesDisagreement`` on every rank.

        Default: its rows gathered by :meth:`_impl_all_gather` and compared, then one
        :meth:`_impl_all_to_all` of the pieces padded to the largest (bytes), ordered as the
        backend orders its own calls.

        Args:
            kind: the op the ranks compare (and the descriptor row names).
            root: the root of ``gather``/``scatter``, else ``-1``.
            outputs: one piece per rank (checked by ``Communicator``: contiguous, one dtype,
                one device).
            inputs: one piece per rank.
            blocking: the caller waits.

        Returns:
            The task that compares the sizes and moves the pieces, or ``None`` once moved
            (``blocking`` only).
        """
        size, rank = self.size, self.rank
        esize = inputs[0].element_size()
        device = inputs[0].device
        mine = torch.tensor(encode(v_call(kind, root, outputs, inputs)), dtype=torch.int64)
        mine = mine.to(device)
        rows = mine.new_empty((size, mine.numel()))
        gather = self._impl_all_gather(rows, mine)

        def run() -> None:
            _finish(gather)
            table = rows.tolist()
            problem = first_difference(table)
            if problem is not None:
                raise_disagreement(rank, kind, problem)
            widest = max(max(row[HEAD:]) for row in table) * esize  # the dtypes agree
            if widest == 0:
                return
            sent = torch.zeros((size, widest), dtype=torch.uint8, device=device)
            for r, t in enumerate(inputs):
                if t.nbytes:
                    sent[r, : t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
            got = torch.empty_like(sent)
            _finish(self._impl_all_to_all(got, sent))
            for q, t in enumerate(outputs):
                if t.nbytes:
                    t.reshape(-1).view(torch.uint8).copy_(got[q, : t.nbytes])

        return Task(kind, outputs[rank] if outputs else None, run, gather.executor)

    def _impl_gather(self, input: torch.Tensor, outputs: list[torch.Tensor] | None, root: int,
                     blocking: bool = False) -> Task | None:
        """Every rank's ``input`` into ``outputs[q]`` of ``root`` (``outputs``: ``size``
        tensors on the root, ignored elsewhere), all contiguous CPU tensors of one dtype,
        checked; sizes may differ by rank.

        Default: the pieces of the v-call made (every one empty but the root's) and handed
        to :meth:`_impl_v_call`.
        """
        pieces, theirs, _ = rooted_pieces(self.rank, self.size, "gather", input, outputs, root)
        return self._impl_v_call("gather", root, theirs, pieces, blocking)

    def _impl_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int,
                      blocking: bool = False) -> Task | None:
        """``inputs[r]`` of ``root`` into ``output`` of rank ``r`` (``inputs``: ``size``
        tensors on the root, ignored elsewhere), checked as for :meth:`_impl_gather`.

        Default: the v-call's pieces made and handed to :meth:`_impl_v_call`.
        """
        pieces, theirs, _ = rooted_pieces(self.rank, self.size, "scatter", output, inputs, root)
        return self._impl_v_call("scatter", root, pieces, theirs, blocking)

    def _impl_all_to_all_split(self, output: torch.Tensor, input: torch.Tensor,
                               output_splits: list[int], input_splits: list[int],
                               byte_splits: tuple[list[int], list[int]],
                               blocking: bool = False) -> Task | None:
        """The all-to-all of row blocks of one tensor each side (``all_to_all_split``):
        ``input_splits[r]`` rows of ``input`` to rank ``r``, ``output_splits[q]`` rows of
        ``output`` from rank ``q``, both contiguous, checked; ``byte_splits``: the pieces'
        bytes, ``(output's, input's)``.

        Default: the blocks as views, handed to :meth:`_impl_v_call`.
        """
        outputs = list(output.split_with_sizes(list(output_splits)))
        inputs = list(input.split_with_sizes(list(input_splits)))
        return self._impl_v_call("all_to_all", -1, outputs, inputs, blocking)

    @abc.abstractmethod
    def _impl_send(self, tensor: torch.Tensor, dst: int, blocking: bool = False) -> Task | None:
        """Sends ``tensor`` to rank ``dst`` (another rank), in issue order per peer.

        Returns:
            The task that sends, or ``None`` once sent (``blocking`` only).
        """

    @abc.abstractmethod
    def _impl_recv(self, tensor: torch.Tensor, src: int, blocking: bool = False) -> Task | None:
        """Receives into ``tensor`` from rank ``src`` (another rank), in issue order per peer.

        Returns:
            The task that receives, or ``None`` once received (``blocking`` only).
        """

    @abc.abstractmethod
    def _impl_barrier(self, blocking: bool = False) -> Task | None:
        """The task that completes once every rank has entered the barrier, or ``None`` once
        they have (``blocking`` only)."""

    def _impl_close(self) -> None:
        """Releases the backend's resources (called once, by ``close``)."""
        self._executor.close(timeout=5.0)

    # ------------------------------------------------------------------ children
    def _split_child(
        self,
        color: int | None,
        name: str,
        new_rank: int,
        new_size: int,
        parent_ranks: list[int],
        timeout: timedelta,
    ) -> Communicator | None:
        """Builds the child of ``split`` (backends override to use a native split).

        Default: over the store namespace ``<name>/color<c>``, built by :attr:`make_child`
        where set, else by :meth:`_new_child`.

        Args:
            color: the child's color, ``None`` on a rank that joins none.
            name: the split's store key.
            new_rank: this rank in the child.
            new_size: the child's ranks.
            parent_ranks: the child's ranks, as ranks of this communicator.
            timeout: the child's timeout.

        Returns:
            The child, or ``None`` for no color.
        """
        if color is None:
            return None
        store = self.store.prefixed(f"{name}/color{color}", rank=new_rank)
        if self.make_child is not None:
            return self.make_child(store, new_rank, new_size, timeout)
        return self._new_child(store, new_rank, new_size, timeout)

    def _new_child(self, store: Store, rank: int, size: int, timeout: timedelta) -> Communicator:
        """A communicator of this backend alone (no fallback) over ``store``'s ranks; backends
        whose parts are built by ``fastcomm.comm.world`` need :attr:`make_child` instead."""
        return type(self)(store, rank, size, timeout)

    # ------------------------------------------------------------------ membership changes
    def reconfigured(
        self, store: Store, rank: int, size: int, *, spans_hosts: bool = False,
        survivors: list[int] | None = None,
    ) -> Communicator:
        """This communicator's successor over new members (in-place recovery's survivors, or
        the members after ranks joined): a collective of the new members, each calling it on
        its own communicator of this kind (a rank that joins them, holding none, calls
        ``fastcomm.comm.world.for_new_members`` with this one's ``backend``). Built by
        :meth:`for_new_members` with this one as ``old``.

        Args:
            store: a namespace private to the successor, the same on every new member.
            rank: this process's rank among the new members.
            size: the number of new members.
            spans_hosts: whether the new members run on more than one host.
            survivors: where every new member holds this communicator (a shrink), their ranks
                in it, in new-rank order: a kind may then build the successor from what they
                share instead of a store round (shm does). ``None``: a rank joins them.
        """
        return type(self).for_new_members(
            store, rank, size, self.timeout, old=self, spans_hosts=spans_hosts
        )

    @classmethod
    def for_new_members(
        cls, store: Store, rank: int, size: int, timeout: timedelta, *,
        old: Communicator | None = None, spans_hosts: bool = False,
    ) -> Communicator:
        """A communicator of this kind over new members, the same on every one of them
        whether it holds one of this kind (``old``) or joins them (``old`` is ``None``): what
        it keeps of ``old`` is per rank only (NCCL's device), or the same on every rank.
        Default: ``fastcomm.comm.world.new_communicator`` of this ``backend``, no fallback;
        backends override it (NCCL, shm, ipc, a torch group's adapter)."""
        from .world import new_communicator  # world imports every backend

        return new_communicator(
            cls.backend, store=store, rank=rank, size=size, timeout=timeout, fallback=False
        )

    # ------------------------------------------------------------------ composed backends
    _aborted: BaseException | None = None

    def _abort_parts(self, error: BaseException, parts) -> None:
        """``abort`` of a communicator made of ``parts`` (``hier``, ``ipc``): from any thread,
        marks it aborted by ``error`` (a lost rank) and aborts each part that can be
        (``None`` parts skipped), so their pending and later calls fail; once only, and not
        after ``close``."""
        if self._aborted is not None or self._closed:
            return
        self._aborted = error
        for part in parts:
            if part is not None and hasattr(part, "abort"):
                part.abort(error)


def _finish(task: Task) -> None:
    """Runs ``task`` here until its data is in place (a step of a composed task)."""
    work = task.run()
    if work is not None:
        work.wait()
