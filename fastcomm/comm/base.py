"""The communicator front end: the public calls every backend shares.

:class:`Communicator` holds the public collectives; each checks its arguments (:mod:`.checks`)
before anything is sent, takes an id and a slot in the flight recorder (:mod:`.flight`; a call
that fails runs the communicator's failure hooks, :mod:`.hooks`), counts it, routes it to the
communicator that moves tensors on that device (this one or its ``fallback``), does what that
backend lacks (:mod:`.adapt`), and runs the backend's typed op (:mod:`.backend`: ``blocking``
where the caller waits, so a backend may move the data at once) through :meth:`_run`. Its
parents hold the backend contract (:class:`~.backend.CommBackend`) and the calls of unequal
sizes (:class:`~.unequal.UnequalCalls`).

Collective ordering: like NCCL and Gloo, every rank must issue the same collectives in the same
order; store helpers (``split``, object exchange) number their keys in that order. The contract
in full: docs/architecture.md, "The communicator contract".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from . import adapt
from .adapt import followed_by, overlap, reduces_itself, staged
from .checks import (
    DTYPES,
    REDUCED_DTYPES,
    bad_sizes,
    check_p2p,
    check_pair,
    check_peer,
    check_premul_dtype,
    check_reduce_scatter_op,
    check_sparse,
    check_split_args,
    check_tensor,
    plain_pair,
    reject_premul,
    untracked,
)
from .flight import SAMPLE, recorded, recorder_for
from .hooks import CommHooks
from .reduction import reduce_gathered
from .stats import CommStats
from .store import DEFAULT_TIMEOUT, Store, as_timedelta
from .types import BITWISE_OPS, PremulSum, ReduceOp
from .unequal import UnequalCalls
from .work import OrderedExecutor, Task, Work

__all__ = ["Communicator", "CommStats", "reject_premul"]

logger = logging.getLogger("fastcomm")

_DTYPES = DTYPES
_STRIDED = torch.strided
_UNTIMED = SAMPLE - 1  # a call whose sequence number has these bits set is not timed


class Communicator(UnequalCalls):
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

    Raises:
        ValueError: ``size`` is not a positive int, ``rank`` not in ``[0, size)``, or the
            fallback spans other ranks (checked before anything is built).
        TypeError: ``fallback`` is not a ``Communicator``.

    Attributes:
        capabilities: what this communicator moves and how (:class:`~.types.Capabilities`),
            set by each backend.
        fallback: the communicator given at construction, or ``None``.
        make_child: builds a sub-communicator of this kind for :meth:`split`, given
            ``(store, rank, size, timeout)``; set by ``fastcomm.comm.world`` to build the
            child's fallback too (``None``: the backend builds one of its own kind alone).
        hooks: what its owner attached to its calls (:class:`~.hooks.CommHooks`).
        flight: its flight recorder (:mod:`.flight`), ``None`` when turned off.
        stats: its calls and bytes per operation (:class:`~.stats.CommStats`).
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
        self._check_members(rank, size, fallback)
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
        self.hooks = CommHooks()
        self.flight = recorder_for(self)  # it reports failed calls to self.hooks
        self.stats.flight = self.flight
        self._executor = OrderedExecutor(f"fastcomm-{self.backend}-r{rank}", rank, self._run_task)

    @staticmethod
    def _check_members(rank: Any, size: Any, fallback: Any) -> None:
        """The ranks of a communicator to be built, and its fallback's (constructor's
        ``Raises``)."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"rank must be an int in [0, {size}), got {rank!r}")
        if fallback is not None and not isinstance(fallback, Communicator):
            raise TypeError(
                f"fallback must be a fastcomm Communicator or None, got {type(fallback).__name__}"
            )
        if fallback is not None and (fallback.rank, fallback.size) != (rank, size):
            raise ValueError(
                f"the fallback must span the same ranks: rank {fallback.rank} of "
                f"{fallback.size}, this communicator rank {rank} of {size}"
            )

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
    # tensors on that device (`_target`), run its typed op (`_impl_*`, blocking where the
    # caller waits) through `_run`. `@recorded` gives each its flight record.
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
                task = target._impl_all_reduce(tensor, op, not async_op)
                result = None if task is None else self._run(task, async_op)
            else:
                result = self._all_reduce_general(tensor, op, async_op)
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

    def _all_reduce_general(self, tensor, op, async_op: bool) -> Work | None:
        """:meth:`all_reduce` of anything but a plain dense tensor with a :class:`ReduceOp`:
        every check, sparse tensors, op names and torch's ops, ``PremulSum`` (a ``mul_``
        before a ``SUM`` where the backend does not fold it), tensors that require grad."""
        tensor = untracked(tensor)
        self._check_open("all_reduce")
        if isinstance(tensor, torch.Tensor) and tensor.layout is torch.sparse_coo:
            return self._all_reduce_sparse(tensor, op, async_op)
        check_tensor(tensor, "all_reduce", dtypes=REDUCED_DTYPES)
        op = ReduceOp.coerce(op)
        if op.__class__ is PremulSum:
            check_premul_dtype(tensor, op)
        self.stats.record("all_reduce", tensor)
        target = self._target(tensor, "all_reduce")
        if op.__class__ is not PremulSum:
            if (op in BITWISE_OPS or tensor.dtype not in _DTYPES) and not reduces_itself(
                target, tensor, op, "all_reduce"
            ):
                return self._run(self._gathered(target, tensor, op, None), async_op)
            task = target._impl_all_reduce(tensor, op, not async_op)
            return None if task is None else self._run(task, async_op)
        if tensor.dtype in target.capabilities.premul_dtypes:
            task = target._impl_all_reduce(tensor, op, not async_op)
            return None if task is None else self._run(task, async_op)
        task = target._impl_all_reduce(tensor, ReduceOp.SUM)
        if op.factor != 1.0:  # x * 1.0 == x: no pass needed
            task = adapt.premultiplied(task, tensor, op.factor)
        return self._run(task, async_op)

    def _all_reduce_sparse(self, tensor: torch.Tensor, op: object, async_op: bool):
        """``all_reduce`` of a sparse COO tensor: natively where the backend declares it
        (``sparse_all_reduce``), else densified, reduced and made sparse again (rows that are
        zero after the reduction are dropped); the result replaces ``tensor`` in place."""
        check_sparse(tensor, op)
        self.stats.record("all_reduce", tensor._values())
        target = self.route(tensor.device, "all_reduce")
        if target.capabilities.sparse_all_reduce:
            return self._run(target._impl_all_reduce(tensor, ReduceOp.SUM), async_op)
        dense = tensor.to_dense()
        sparse_dim = tensor.sparse_dim()
        task = target._impl_all_reduce(dense, ReduceOp.SUM)
        task = followed_by(task, lambda: tensor.copy_(dense.to_sparse(sparse_dim)))
        return self._run(Task("all_reduce", tensor, task.run, task.executor), async_op)

    def _gathered(self, target: Communicator, tensor: torch.Tensor, op: ReduceOp,
                  root: int | None) -> Task:
        """A reduction ``target`` does not do itself: an ``all_gather`` of every rank's bytes,
        then the terms reduced in rank order (:func:`~.reduction.reduce_gathered`) on every
        rank, or on ``root`` only. One round of the backend's own all-gather, ``size`` times
        the tensor's bytes of scratch."""
        flat = tensor.view(-1).view(torch.uint8)
        rows = flat.new_empty((self.size, flat.numel()))
        task = target._impl_all_gather(rows, flat)
        name = "all_reduce" if root is None else "reduce"
        if root is not None and root != self.rank:
            return Task(name, tensor, task.run, task.executor)
        return Task(name, tensor, followed_by(task, lambda: reduce_gathered(rows, tensor, op)).run,
                    task.executor)

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
            return self._run(self._gathered(target, tensor, op, root), async_op)
        task = target._impl_reduce(tensor, root, op, not async_op)
        return None if task is None else self._run(task, async_op)

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
        task = target._impl_broadcast(tensor, src, not async_op)
        return None if task is None else self._run(task, async_op)

    def _plain_pair(self, output: object, input: object, op: str) -> tuple:
        """``(output, input)`` of a call of two tensors, checked (:func:`~.checks.check_pair`)
        unless they are the usual operands of this open communicator."""
        if self._closed or not self._cpu_native or not plain_pair(output, input):
            output, input = untracked(output), untracked(input)
            self._check_open(op)
            check_pair(output, input, op)
        return output, input

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
        output, input = self._plain_pair(output, input, "all_gather")
        if output.numel() != self.size * input.numel():
            raise bad_sizes("all_gather", "output", output.numel(), "input", self.size,
                            input.numel())
        self.stats.record("all_gather", input)
        target = self._target(input, "all_gather")
        input = staged(target, output, input)
        task = target._impl_all_gather(output, input, not async_op)
        return None if task is None else self._run(task, async_op)

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
        output, input = self._plain_pair(output, input, "reduce_scatter")
        if op.__class__ is not ReduceOp:
            op = check_reduce_scatter_op(op)
        if input.numel() != self.size * output.numel():
            raise bad_sizes("reduce_scatter", "input", input.numel(), "output", self.size,
                            output.numel())
        self.stats.record("reduce_scatter", input)
        target = self._target(input, "reduce_scatter")
        if input.numel() and overlap(output, input):
            input = input.clone()  # a rank's reduction may read its slice after writing it
        task = target._impl_reduce_scatter(output, input, op, not async_op)
        return None if task is None else self._run(task, async_op)

    @recorded("all_to_all", 1)
    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Work | None:
        """Sends slice ``j`` of ``input`` to rank ``j``; slice ``i`` of ``output`` comes from
        rank ``i`` (equal splits of the flattened tensors).

        Raises:
            TypeError, ValueError: as for :meth:`all_gather`.
        """
        output, input = self._plain_pair(output, input, "all_to_all")
        if output.numel() != input.numel() or input.numel() % self.size:
            raise ValueError(
                f"all_to_all: input ({input.numel()} elements) and output ({output.numel()}) "
                f"must have the same number of elements, divisible by size {self.size}"
            )
        self.stats.record("all_to_all", input)
        target = self._target(input, "all_to_all")
        input = staged(target, output, input)
        task = target._impl_all_to_all(output, input, not async_op)
        return None if task is None else self._run(task, async_op)

    # ------------------------------------------------------------------ point to point
    @recorded("send", 0, 1, "dst")
    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False) -> Work | None:
        """Sends ``tensor`` to rank ``dst`` (which must call ``recv`` with ``src`` = us).

        Raises:
            TypeError, ValueError: as for :meth:`all_reduce`; ``dst`` out of range or this rank.
        """
        self._check_open("send")
        check_p2p(self.rank, self.size, tensor, dst, "send", "dst", "send to")
        self.stats.record("send", tensor)
        target = self._target(tensor, "send")
        task = target._impl_send(tensor, dst, not async_op)
        return None if task is None else self._run(task, async_op)

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
        self._check_open("recv")
        check_p2p(self.rank, self.size, tensor, src, "recv", "src", "receive from")
        self.stats.record("recv", None)
        target = self._target(tensor, "recv")
        task = target._impl_recv(tensor, src, not async_op)
        return None if task is None else self._run(task, async_op)

    @recorded("barrier", -1)
    def barrier(self, async_op: bool = False) -> Work | None:
        """Returns once every rank has entered the barrier."""
        self._check_open("barrier")
        self.stats.record("barrier", None)
        task = self._impl_barrier(not async_op)
        return None if task is None else self._run(task, async_op)

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

        A collective call: every rank must call it. Every rank publishes ``(color, key,
        rank)`` under a key numbered by :meth:`next_key`; ranks within a color are ordered by
        ``(key, rank)`` (``key`` defaults to the rank), and each child gets the store
        namespace ``<that key>/color<c>`` (:meth:`_split_child`), so two splits, or two colors
        of one split, never read each other's values. A rank passing ``color=None`` (or a
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
        self._check_open("split")
        check_split_args(color, key)
        if color is not None and color < 0:
            color = None
        key = self.rank if key is None else key
        new_timeout = as_timedelta(timeout, self.timeout)
        name = self.next_key("split")
        entries = self.store.all_gather_object(
            name, self.rank, self.size, (color, key, self.rank), self.timeout
        )
        if color is None:
            self._split_child(None, name, -1, 0, [], new_timeout)
            return None
        ranks = [r for _, r in sorted((k, r) for c, k, r in entries if c == color)]
        new_rank = ranks.index(self.rank)
        return self._split_child(color, name, new_rank, len(ranks), ranks, new_timeout)

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
