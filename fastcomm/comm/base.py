"""The communicator contract shared by every backend.

:class:`Communicator` holds the public collectives and the ``_impl_*`` hooks each backend
implements. A public call checks its arguments (:mod:`.checks`) before anything is sent, counts
it, routes it to the communicator that moves tensors on that device (this one or its
``fallback``), adapts what that backend lacks (:mod:`.adapt`), and runs the task the backend's
hook built (:meth:`Communicator._run`). A backend may instead finish a synchronous call on the
caller's thread (``_run_inline*``: the small-message lane of ``shm``).

Collective ordering: like NCCL and Gloo, every rank must issue the same collectives in the same
order; store helpers (:mod:`.split`, object exchange) number their keys in that order. The
contract in full: docs/architecture.md, "The communicator contract".
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from . import split as _split
from .adapt import (
    all_reduce_general,
    followed_by,
    gathered,
    overlap,
    reduce_by_all_reduce,
    reduces_itself,
    rooted_pieces,
    staged,
)
from .checks import (
    DTYPES,
    REDUCED_DTYPES,
    bad_sizes,
    check_members,
    check_p2p,
    check_pair,
    check_peer,
    check_reduce_scatter_op,
    check_splits,
    check_tensor,
    plain_pair,
    reject_premul,
    untracked,
)
from .errors import CommClosedError
from .flight import SAMPLE, recorded, recorder_for
from .flight_watch import on_failure as _dumps_on_failure  # noqa: F401 (registers it)
from .reduction import torch_reduce
from .stats import CommStats
from .store import DEFAULT_TIMEOUT, Store, as_timedelta
from .types import BITWISE_OPS, Capabilities, PremulSum, ReduceOp
from .vcoll import check_v, default_task, input_bytes, plain_pieces, split_bytes
from .work import OrderedExecutor, Task, Work, completed_work, wrap_error

__all__ = ["Communicator", "CommStats", "reject_premul"]

logger = logging.getLogger("fastcomm")

_DTYPES = DTYPES
_STRIDED = torch.strided
_UNTIMED = SAMPLE - 1  # a call whose sequence number has these bits set is not timed


class CommBackend(abc.ABC):
    """What a backend implements (the ``_impl_*`` hooks and the optional ``_run_inline*``
    lanes), and how the contract picks and runs it: routing (:meth:`route`) and execution
    (:meth:`_run`). :class:`Communicator` adds the public calls and sets the state used here
    (``rank``, ``size``, ``store``, ``fallback``, ``capabilities``, ``_executor``).
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
    def _moves(self, device: torch.device, op: str | None) -> bool:
        """Whether this communicator moves tensors on ``device`` for ``op`` itself."""
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
        if self._moves(device, op):
            return self
        fallback = self.fallback
        if fallback is not None and fallback._moves(device, op):
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
    def _run(self, task: Task, async_op: bool) -> Work | None:
        """Runs ``task``: the one way every backend's operations execute.

        A task with an executor runs there, in issue order (on the caller's thread when
        nothing is pending and the caller waits); one without runs now, on the caller's
        thread. Either way ``task.run`` does the host's part and returns the ``Work`` of what
        is left, or ``None`` when the data is in place.
        """
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

    # ------------------------------------------------------------------ backend hooks
    # What a backend implements. Each `_impl_*` hook gets checked tensors (possibly empty:
    # every rank still takes part) on a device the backend moves (`route`), and returns the
    # `Task` that moves the data; `_run` runs it. The `_run_inline*` lanes are optional.
    @abc.abstractmethod
    def _impl_all_reduce(self, tensor: torch.Tensor, op: ReduceOp | PremulSum) -> Task:
        """Reduces ``tensor`` in place across ranks.

        Args:
            tensor: dense, or sparse COO only where ``capabilities.sparse_all_reduce``.
            op: a ``PremulSum`` only for dtypes in ``capabilities.premul_dtypes``; a bitwise op
                or an extra dtype only where ``capabilities.extended_reductions``.

        Returns:
            The task that reduces.
        """

    def _impl_reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> Task:
        """Reduces ``tensor`` of every rank into ``tensor`` of ``root``.

        Default: an ``all_reduce`` of a copy, written back on ``root`` only.

        Args:
            tensor: the operand (and the result, on ``root``).
            root: the rank that keeps the result.
            op: the reduction (never a ``PremulSum``).

        Returns:
            The task that reduces.
        """
        return reduce_by_all_reduce(self, tensor, root, op)

    @abc.abstractmethod
    def _impl_broadcast(self, tensor: torch.Tensor, src: int) -> Task:
        """Copies ``tensor`` of rank ``src`` into ``tensor`` of every rank.

        Returns:
            The task that copies.
        """

    @abc.abstractmethod
    def _impl_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Task:
        """Writes every rank's ``input`` into ``output``, in rank order.

        Args:
            output: ``size * input.numel()`` elements of ``input``'s dtype.
            input: may overlap ``output`` only where ``capabilities.in_place``.

        Returns:
            The task that gathers.
        """

    @abc.abstractmethod
    def _impl_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp
    ) -> Task:
        """Reduces ``input`` across ranks, slice ``rank`` of the result into ``output``.

        Args:
            output: ``input.numel() / size`` elements; never overlapping ``input``.
            input: the terms, ``size`` slices.
            op: a plain :class:`ReduceOp`.

        Returns:
            The task that reduces.
        """

    @abc.abstractmethod
    def _impl_all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Task:
        """Slice ``j`` of ``input`` to rank ``j``, slice ``i`` of ``output`` from rank ``i``.

        Args:
            output: as many elements as ``input``, a multiple of ``size``.
            input: may overlap ``output`` only where ``capabilities.in_place``.

        Returns:
            The task that exchanges.
        """

    def _impl_v_call(self, kind: str, root: int, outputs: list, inputs: list) -> Task:
        """A v-call (``vcoll``): ``inputs[r]`` to rank ``r``, ``outputs[q]`` from rank ``q``.

        Default: its rows gathered and compared, then a padded ``all_to_all``
        (:func:`~.vcoll.default_task`).

        Args:
            kind: one of :data:`~.vcoll.KINDS`.
            root: the root of ``gather``/``scatter``, else ``-1``.
            outputs: one piece per rank (checked by :func:`~.vcoll.check_v`).
            inputs: one piece per rank.

        Returns:
            The task that compares the ranks' sizes and moves the pieces.
        """
        return default_task(self, kind, root, outputs, inputs)

    @abc.abstractmethod
    def _impl_send(self, tensor: torch.Tensor, dst: int) -> Task:
        """Sends ``tensor`` to rank ``dst`` (another rank), in issue order per peer.

        Returns:
            The task that sends.
        """

    @abc.abstractmethod
    def _impl_recv(self, tensor: torch.Tensor, src: int) -> Task:
        """Receives into ``tensor`` from rank ``src`` (another rank), in issue order per peer.

        Returns:
            The task that receives.
        """

    @abc.abstractmethod
    def _impl_barrier(self) -> Task:
        """Returns the task that completes once every rank has entered the barrier."""

    def _impl_close(self) -> None:
        """Releases the backend's resources (called once, by :meth:`close`)."""
        self._executor.close(timeout=5.0)

    def _run_inline(self, op: str, *args: Any) -> bool:
        """Finishes a synchronous call of ``op`` on the caller's thread, with no task built.

        Default: no such lane.

        Args:
            op: the operation (``"all_reduce"``, ``"barrier"``...).
            *args: as its ``_impl_*`` hook takes them.

        Returns:
            ``True`` once the call is done, ``False`` having done nothing (its task runs).
        """
        return False

    def _run_inline_p2p(self, op: str, tensor: torch.Tensor, peer: int) -> bool:
        """:meth:`_run_inline` for a ``send`` or ``recv`` (``op``) of ``tensor`` with rank
        ``peer``. Default: no such lane."""
        return False

    def _run_inline_v(self, kind: str, root: int, outputs: list, inputs: list) -> bool:
        """:meth:`_run_inline` for a v-call (arguments as :meth:`_impl_v_call`). Default: no
        such lane."""
        return False

    def _run_inline_v_split(self, output: torch.Tensor, input: torch.Tensor,
                            out_bytes: list[int], in_bytes: list[int]) -> bool:
        """:meth:`_run_inline_v` for :meth:`all_to_all_split` (each piece's bytes, in rank
        order). Default: no such lane."""
        return False

    def _run_inline_rooted(self, kind: str, root: int, mine: torch.Tensor,
                           theirs: list | None) -> bool:
        """:meth:`_run_inline_v` of a ``gather`` (``kind``; ``mine``: the input, ``theirs``: the
        root's outputs) or ``scatter`` (``mine``: the output, ``theirs``: the root's inputs) of
        contiguous CPU tensors of one dtype, checked (``adapt.rooted_now``). Default: the
        pieces made (:func:`~.adapt.rooted_pieces`) and handed to :meth:`_run_inline_v`."""
        pieces, others, _ = rooted_pieces(self, kind, mine, theirs, root)
        outputs, inputs = (others, pieces) if kind == "gather" else (pieces, others)
        return self._run_inline_v(kind, root, outputs, inputs)

    def _split_child(
        self,
        color: int | None,
        name: str,
        new_rank: int,
        new_size: int,
        parent_ranks: list[int],
        timeout: timedelta,
    ) -> Communicator | None:
        """Builds the child of :meth:`split` (backends override to use a native split).

        Default: :func:`~.split.default_child` over the store namespace ``<name>/color<c>``.

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
        return _split.default_child(self, color, name, new_rank, new_size, timeout)

    def _new_child(self, store: Store, rank: int, size: int, timeout: timedelta) -> Communicator:
        """A communicator of this backend alone (no fallback) over ``store``'s ranks; backends
        whose parts are built by ``fastcomm.comm.world`` need :attr:`make_child` instead."""
        return type(self)(store, rank, size, timeout)

    # ------------------------------------------------------------------ membership changes
    def reconfigured(
        self, store: Store, rank: int, size: int, *, spans_hosts: bool = False
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


class Communicator(CommBackend):
    """A group of ``size`` ranks that run collectives together.

    Args:
        store: a store namespace private to this communicator (the same on every member).
        rank: this process's rank in ``[0, size)``.
        size: number of ranks.
        timeout: how long any collective may take before it raises (seconds or timedelta;
            default :data:`~fastcomm.comm.store.DEFAULT_TIMEOUT`).
        fallback: a communicator over the same ranks that moves what this one does not
            (tensors on other devices); built by the caller (``fastcomm.comm.world``), closed
            with this one.

    Attributes:
        capabilities: what this communicator moves and how (:class:`~.types.Capabilities`),
            set by each backend.
        fallback: the communicator given at construction, or ``None``.
        make_child: builds a sub-communicator of this kind for :meth:`split`, given
            ``(store, rank, size, timeout)``; set by ``fastcomm.comm.world`` to build the
            child's fallback too (``None``: the backend builds one of its own kind alone).
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float | timedelta | None = None,
        *,
        fallback: Communicator | None = None,
    ) -> None:
        check_members(rank, size, fallback, Communicator)
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout = as_timedelta(timeout, DEFAULT_TIMEOUT)
        self.fallback = fallback
        self.make_child: Callable[[Store, int, int, timedelta], Communicator] | None = None
        self._closed = False
        self._seq = 0
        self._told_route = False
        self.stats = CommStats()
        self.flight = recorder_for(self)
        """This communicator's flight recorder (:mod:`.flight`), ``None`` when turned off."""
        self.stats.flight = self.flight
        self._executor = OrderedExecutor(f"fastcomm-{self.backend}-r{rank}", rank, self._run_task)

    # ------------------------------------------------------------------ properties
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return (
            f"{type(self).__name__}(rank={self.rank}, size={self.size}, "
            f"device={self.device}{state})"
        )

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ collectives
    # Every collective: check the arguments, count it, pick the communicator that moves
    # tensors on that device (`_target`), let it finish the call inline (`_run_inline`) or
    # build its task (`_impl_*`), run the task (`_run`).
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | PremulSum | str = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work | None:
        """Reduces ``tensor`` across ranks, in place.

        Args:
            tensor: the contiguous tensor to reduce, the same shape and dtype on every rank;
                or a sparse COO tensor (``SUM`` only), replaced in place by the sum.
            op: the reduction (a :class:`ReduceOp`, its name, torch's ``dist.ReduceOp``, or a
                :class:`PremulSum` for floating-point tensors).
            async_op: return a :class:`Work` at once instead of waiting.

        Returns:
            The ``Work`` when ``async_op`` is true, else ``None`` once the result is in place.

        Raises:
            TypeError: not a tensor, an unsupported dtype, or a ``PremulSum`` of an integer
                tensor.
            ValueError: wrong device, non-contiguous, unknown op.
        """
        # the hottest call: recorded inline (not by @recorded), its checks inline too
        recorder = self.flight
        seq = recorder.issue("all_reduce", tensor, op) if recorder is not None else 0
        try:
            if (  # the usual call (DDP's, a training step's): every check below is the same
                # as the general path's, which names what failed
                type(tensor) is torch.Tensor
                and op.__class__ is ReduceOp
                and not self._closed
                and not tensor.requires_grad
                and tensor.layout is _STRIDED
                and tensor.dtype in _DTYPES
                and tensor.is_contiguous()
            ):
                self.stats.record("all_reduce", tensor)
                # _target inlined: the hottest call skips a method call
                target = self if tensor.is_cpu and self._cpu_native else self.route(
                    tensor.device, "all_reduce"
                )
                if not async_op and target._run_inline("all_reduce", tensor, op):
                    result = None
                else:
                    result = self._run(target._impl_all_reduce(tensor, op), async_op)
            else:
                result = all_reduce_general(self, tensor, op, async_op)
        except BaseException as exc:
            if recorder is not None:
                recorder.fail(seq, exc)
            raise
        if recorder is not None:
            if result is None and seq & _UNTIMED and recorder._range is None:
                recorder.done = seq  # completed, in one store (FlightRecorder.done)
            elif result is None:
                recorder.end(seq)
            else:
                recorder.finish(seq, result)
        return result

    @recorded("reduce", 0, 1, "root")
    def reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: ReduceOp | str = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work | None:
        """Reduces ``tensor`` of every rank into ``tensor`` of rank ``root`` (the others'
        tensors are left unchanged).

        Raises:
            TypeError, ValueError: as for :meth:`all_reduce`; ``root`` out of range.
        """
        tensor = untracked(tensor)
        self._check_open("reduce")
        check_tensor(tensor, "reduce", dtypes=REDUCED_DTYPES)
        check_peer(root, self.size, "reduce", "root")
        op = ReduceOp.coerce(op)
        reject_premul(op, "reduce")
        self.stats.record("reduce", tensor)
        target = self._target(tensor, "reduce")
        if (op in BITWISE_OPS or tensor.dtype not in _DTYPES) and not reduces_itself(
            target, tensor, op, "reduce"
        ):
            return self._run(gathered(self, target, tensor, op, root), async_op)
        if not async_op and target._run_inline("reduce", tensor, root, op):
            return None
        return self._run(target._impl_reduce(tensor, root, op), async_op)

    @recorded("broadcast", 0, 1, "src")
    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, async_op: bool = False
    ) -> Work | None:
        """Copies ``tensor`` of rank ``src`` into ``tensor`` of every rank.

        Raises:
            TypeError, ValueError: as for :meth:`all_reduce`; ``src`` out of range.
        """
        if not (  # the usual call, checked inline as in all_reduce
            type(tensor) is torch.Tensor
            and src.__class__ is int
            and 0 <= src < self.size
            and not self._closed
            and not tensor.requires_grad
            and tensor.is_cpu
            and self._cpu_native
            and tensor.dtype in _DTYPES
            and tensor.is_contiguous()
        ):
            tensor = untracked(tensor)
            self._check_open("broadcast")
            check_tensor(tensor, "broadcast")
            check_peer(src, self.size, "broadcast", "src")
        self.stats.record("broadcast", tensor)
        target = self._target(tensor, "broadcast")
        if not async_op and target._run_inline("broadcast", tensor, src):
            return None
        return self._run(target._impl_broadcast(tensor, src), async_op)

    @recorded("all_gather", 1)
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Work | None:
        """Writes every rank's ``input`` into ``output`` in rank order.

        ``output`` has ``size * input.numel()`` elements (any shape, e.g. ``(size, *shape)``);
        ``input`` may be this rank's slice of ``output``.

        Raises:
            TypeError, ValueError: as for :meth:`all_reduce`; mismatched dtypes, devices or sizes.
        """
        if not plain_pair(self, output, input):
            output, input = untracked(output), untracked(input)
            self._check_open("all_gather")
            check_pair(output, input, "all_gather")
        if output.numel() != self.size * input.numel():
            raise bad_sizes("all_gather", "output", output.numel(), "input", self.size,
                            input.numel())
        self.stats.record("all_gather", input)
        target = self._target(input, "all_gather")
        input = staged(target, output, input)
        if not async_op and target._run_inline("all_gather", output, input):
            return None
        return self._run(target._impl_all_gather(output, input), async_op)

    @recorded("reduce_scatter", 1, 2, "op")
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work | None:
        """Reduces ``input`` across ranks and leaves slice ``rank`` of the result in ``output``.

        ``input`` has ``size * output.numel()`` elements.

        Raises:
            TypeError, ValueError: as for :meth:`all_gather`; unknown op.
        """
        if not plain_pair(self, output, input):
            output, input = untracked(output), untracked(input)
            self._check_open("reduce_scatter")
            check_pair(output, input, "reduce_scatter")
        if op.__class__ is not ReduceOp:
            op = check_reduce_scatter_op(op)
        if input.numel() != self.size * output.numel():
            raise bad_sizes("reduce_scatter", "input", input.numel(), "output", self.size,
                            output.numel())
        self.stats.record("reduce_scatter", input)
        target = self._target(input, "reduce_scatter")
        if input.numel() and overlap(output, input):
            input = input.clone()  # a rank's reduction may read its slice after writing it
        if not async_op and target._run_inline("reduce_scatter", output, input, op):
            return None
        return self._run(target._impl_reduce_scatter(output, input, op), async_op)

    @recorded("all_to_all", 1)
    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Work | None:
        """Sends slice ``j`` of ``input`` to rank ``j``; slice ``i`` of ``output`` comes from
        rank ``i`` (equal splits of the flattened tensors).

        Raises:
            TypeError, ValueError: as for :meth:`all_gather`.
        """
        if not plain_pair(self, output, input):
            output, input = untracked(output), untracked(input)
            self._check_open("all_to_all")
            check_pair(output, input, "all_to_all")
        if output.numel() != input.numel() or input.numel() % self.size:
            raise ValueError(
                f"all_to_all: input ({input.numel()} elements) and output ({output.numel()}) "
                f"must have the same number of elements, divisible by size {self.size}"
            )
        self.stats.record("all_to_all", input)
        target = self._target(input, "all_to_all")
        input = staged(target, output, input)
        if not async_op and target._run_inline("all_to_all", output, input):
            return None
        return self._run(target._impl_all_to_all(output, input), async_op)

    # ------------------------------------------------------------------ unequal sizes
    # One v-call each (see ``vcoll``): every rank sends a piece of any size to every rank; the
    # ranks' sizes are compared inside the call, a disagreement a ValueError on every rank.
    @recorded("all_to_all_v", 1)
    def all_to_all_v(self, outputs: list, inputs: list, async_op: bool = False) -> Work | None:
        """Sends ``inputs[r]`` to rank ``r``; ``outputs[q]`` receives what rank ``q`` sends
        this rank. Pieces of any size (empty too), one dtype.

        Raises:
            TypeError, ValueError: bad pieces (:func:`~.vcoll.check_v`).
            SizesDisagreement: (a ``ValueError``) on every rank, when a piece's size differs
                from what its receiver expects.
        """
        return self._v_call("all_to_all", -1, outputs, inputs, async_op)

    @recorded("all_to_all_v", 1)
    def all_to_all_split(self, output: torch.Tensor, input: torch.Tensor,
                         output_splits: list[int], input_splits: list[int],
                         async_op: bool = False) -> Work | None:
        """:meth:`all_to_all_v` of consecutive row blocks of one tensor each side, as torch's
        ``all_to_all_single`` with split sizes: rows ``input_splits[r]`` of ``input`` (along
        dim 0, in rank order) go to rank ``r``; ``output_splits[q]`` rows of ``output`` come from
        rank ``q``. No tensor is made per piece where the backend takes the offsets
        (``_run_inline_v_split``).

        Raises:
            TypeError, ValueError: as for :meth:`all_to_all_v`; splits that are not ``size``
                non-negative ints summing to the tensor's rows.
        """
        size = self.size
        if (self._closed or input.__class__ is not torch.Tensor
                or not plain_pieces((output, input), input)):  # check_v names what is wrong
            check_v(self, "all_to_all", (output,) * size, (input,) * size)
        byte_splits = split_bytes(size, output, input, output_splits, input_splits)
        if byte_splits is None:  # raises, naming what is wrong
            byte_splits = check_splits(size, output, input, output_splits, input_splits)
        self.stats.count("all_to_all", input.nbytes)
        target = self if input.is_cpu and self._cpu_native else self.route(input.device,
                                                                            "all_to_all")
        if not async_op and target._run_inline_v_split(output, input, *byte_splits):
            return None
        outputs = list(output.split_with_sizes(list(output_splits)))
        inputs = list(input.split_with_sizes(list(input_splits)))
        return self._run(target._impl_v_call("all_to_all", -1, outputs, inputs), async_op)

    @recorded("gather", 1, 2, "root")
    def gather(self, outputs: list | None, input: torch.Tensor, root: int = 0,
               async_op: bool = False) -> Work | None:
        """Writes every rank's ``input`` into ``outputs[q]`` of rank ``root`` (``outputs``:
        one tensor per rank on the root, ignored elsewhere; sizes may differ by rank)."""
        inputs, outputs, checked = rooted_pieces(self, "gather", input, outputs, root)
        return self._v_call("gather", root, outputs, inputs, async_op, checked)

    @recorded("scatter", 0, 2, "root")
    def scatter(self, output: torch.Tensor, inputs: list | None, root: int = 0,
                async_op: bool = False) -> Work | None:
        """Writes ``inputs[r]`` of rank ``root`` into ``output`` of rank ``r`` (``inputs``:
        one tensor per rank on the root, ignored elsewhere)."""
        outputs, inputs, checked = rooted_pieces(self, "scatter", output, inputs, root)
        return self._v_call("scatter", root, outputs, inputs, async_op, checked)

    @recorded("all_gather_v", 1)
    def all_gather_v(self, outputs: list, input: torch.Tensor,
                     async_op: bool = False) -> Work | None:
        """Writes every rank's ``input`` into ``outputs[q]`` of every rank (sizes may differ
        by rank, as NCCL's ``all_gather`` of a list allows)."""
        return self._v_call("all_gather", -1, outputs, [input] * self.size, async_op)

    @recorded("reduce_scatter_v", 0, 2, "op")
    def reduce_scatter_v(self, output: torch.Tensor, inputs: list,
                         op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False,
                         ) -> Work | None:
        """Reduces ``inputs[r]`` of every rank into ``output`` of rank ``r``, in rank order
        (sizes may differ by rank: ``inputs[r]`` has ``output``'s size on rank ``r``).

        Raises:
            TypeError: a ``PremulSum``; as for :meth:`all_to_all_v`.
        """
        op = ReduceOp.coerce(op)
        reject_premul(op, "reduce_scatter")
        check_tensor(output, "reduce_scatter", "output")
        terms = [torch.empty_like(output) for _ in range(self.size)]
        task = self._v_task("reduce_scatter", -1, terms, inputs)
        return self._run(followed_by(task, lambda: torch_reduce(output, terms, op)), async_op)

    def _v_call(self, kind: str, root: int, outputs, inputs, async_op: bool,
                checked: int = -1) -> Work | None:
        """A v-call, checked, counted and run; ``checked``: the bytes of the inputs where the
        caller checked the pieces already (lists of contiguous CPU tensors of one dtype), else
        -1."""
        if checked < 0 or async_op or self._closed or not self._cpu_native:
            target, outputs, inputs = self._v_target(kind, outputs, inputs)
        else:  # the usual synchronous call: the caller's checks are check_v's
            self.stats.count(kind, checked)
            target = self
        if not async_op and target._run_inline_v(kind, root, outputs, inputs):
            return None
        return self._run(target._impl_v_call(kind, root, outputs, inputs), async_op)

    def _v_task(self, kind: str, root: int, outputs, inputs) -> Task:
        """A checked and counted v-call's task on the communicator that moves it."""
        target, outputs, inputs = self._v_target(kind, outputs, inputs)
        return target._impl_v_call(kind, root, outputs, inputs)

    def _v_target(self, kind: str, outputs, inputs) -> tuple[Communicator, list, list]:
        """Checks a v-call and counts it: ``(the communicator that moves it, outputs,
        inputs)`` (that one stages inputs overlapping outputs where its schedule needs it)."""
        outputs, inputs = check_v(self, kind, outputs, inputs)
        first = inputs[0]
        self.stats.count(kind, input_bytes(inputs))
        if first.is_cpu and self._cpu_native:  # _target inlined
            return self, outputs, inputs
        return self.route(first.device, kind), outputs, inputs

    # ------------------------------------------------------------------ point to point
    @recorded("send", 0, 1, "dst")
    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False) -> Work | None:
        """Sends ``tensor`` to rank ``dst`` (which must call ``recv`` with ``src`` = us).

        Raises:
            TypeError, ValueError: as for :meth:`all_reduce`; ``dst`` out of range or this rank.
        """
        check_p2p(self, tensor, dst, "send", "dst", "send to")
        self.stats.record("send", tensor)
        target = self._target(tensor, "send")
        if not async_op and target._run_inline_p2p("send", tensor, dst):
            return None
        return self._run(target._impl_send(tensor, dst), async_op)

    @recorded("recv", 0, 1, "src")
    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Work | None:
        """Receives into ``tensor`` from rank ``src``.

        Args:
            tensor: where the data lands; the sender's tensor has as many bytes.
            src: the sending rank (not this one).
            async_op: return a :class:`Work` at once instead of waiting.

        Raises:
            TypeError, ValueError: as for :meth:`all_reduce`; ``src`` out of range or this rank.
        """
        tensor = untracked(tensor)
        check_p2p(self, tensor, src, "recv", "src", "receive from")
        self.stats.record("recv", None)
        target = self._target(tensor, "recv")
        if not async_op and target._run_inline_p2p("recv", tensor, src):
            return None
        return self._run(target._impl_recv(tensor, src), async_op)

    @recorded("barrier", -1)
    def barrier(self, async_op: bool = False) -> Work | None:
        """Returns once every rank has entered the barrier."""
        self._check_open("barrier")
        self.stats.record("barrier", None)
        if not async_op and self._run_inline("barrier"):
            return None
        return self._run(self._impl_barrier(), async_op)

    # ------------------------------------------------------------------ store helpers
    def next_key(self, what: str) -> str:
        """A store key prefix unique to this use, the same on every rank: ``"<what>/<n>"``.

        A collective call in effect (``n`` counts this communicator's calls): every rank must
        call it in the same order. Callers that keep their own keys in :attr:`store` use it,
        so two uses never read each other's values.

        Args:
            what: names the use (``"split"``), for readable keys.

        Returns:
            The prefix, e.g. ``"split/3"``.
        """
        self._seq += 1
        return f"{what}/{self._seq}"

    def all_gather_object(self, obj: Any, timeout: float | timedelta | None = None) -> list:
        """Gathers a small object from every rank through the store (the values the store's
        ``all_gather_object`` encodes)."""
        self._check_open("all_gather_object")
        return self.store.all_gather_object(
            self.next_key("objects"), self.rank, self.size, obj, timeout or self.timeout
        )

    def split(
        self,
        color: int | None,
        key: int | None = None,
        timeout: float | timedelta | None = None,
    ) -> Communicator | None:
        """Splits into sub-communicators of the ranks that pass the same ``color``.

        A collective call: every rank must call it. Ranks within a color are ordered by
        ``(key, rank)`` (``key`` defaults to the rank). A rank passing ``color=None`` (or a
        negative color) takes part but gets ``None`` back.

        Args:
            color: the group this rank joins, or ``None`` (or negative) for none.
            key: orders the ranks within a color (default: the rank).
            timeout: the child's timeout (default: this communicator's).

        Returns:
            The child communicator, or ``None`` for no color.

        Raises:
            TypeError: ``color`` or ``key`` is not an int (or ``None``).
        """
        return _split.split(self, color, key, timeout)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Releases the communicator (and its fallback); later calls raise
        ``CommClosedError``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._impl_close()
        if self.fallback is not None:
            self.fallback.close()

    @contextmanager
    def group(self) -> Iterator[None]:
        """Groups the collectives issued inside (NCCL's groupStart/End); a no-op elsewhere."""
        yield


def abort_parts(comm: Communicator, error: BaseException, parts) -> None:
    """``abort`` of a communicator made of `parts` (``hier``, ``ipc``): from any thread, marks
    `comm` aborted by `error` (a lost rank) and aborts each part that can be (``None`` parts
    skipped), so their pending and later calls fail; once only, and not after ``close``."""
    if comm._aborted is not None or comm._closed:
        return
    comm._aborted = error
    for part in parts:
        if part is not None and hasattr(part, "abort"):
            part.abort(error)
