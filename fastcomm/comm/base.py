"""The communicator contract shared by every backend.

``Communicator`` owns everything a collective does before and after the data moves, in one
place for every backend:

1. **Checks** (type, dtype, contiguity, sizes, ranks, ops, closed state) *before* anything is
   sent, so a bad call raises the same clear error on every backend and never leaves a peer
   waiting on half a collective.
2. **Routing:** each backend declares what it moves itself (:class:`~.types.Capabilities`); a
   tensor on another device goes to the communicator's ``fallback`` when that one moves it
   (``shm`` and ``hier`` hand CUDA tensors to Gloo), else the call raises (:meth:`route`).
3. **What a backend lacks,** done once here: a ``PremulSum`` it does not fold is a ``mul_``
   before a ``SUM``; a sparse tensor it cannot reduce is densified, reduced and made sparse
   again; an output overlapping its input where the backend does not allow it is staged;
   ``reduce`` is an ``all_reduce`` of a copy kept on the root unless the backend has its own.
4. **Running** the :class:`~.work.Task` the backend's ``_impl_*`` hook built (:meth:`_run`).

Backends implement the ``_impl_*`` hooks only. Each receives validated tensors (empty ones
too: every rank still takes part, so a rank whose tensor is empty where a peer's is not is
caught by the backend's agreement check instead of leaving the peer waiting) on a device it
declared, and returns the task that moves the data. A backend may also finish a synchronous
call on the caller's thread without building a task (``_sync``): the small-message lane of
``shm``.

Collective ordering: like NCCL and Gloo, every rank must issue the same collectives in the same
order. Store-based helpers (``split``, object exchange) number their keys with a per-communicator
sequence that advances identically on every rank for that reason.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from .errors import CommClosedError
from .reduction import reduce_gathered, torch_reduce
from .stats import CommStats
from .store import DEFAULT_TIMEOUT, Store, as_timedelta
from .types import (
    BITWISE_OPS,
    EXTRA_DTYPES,
    SUPPORTED_DTYPES,
    Capabilities,
    PremulSum,
    ReduceOp,
    check_reduction,
)
from .vcoll import check_v, default_task
from .work import OrderedExecutor, Task, Work, completed_work, wrap_error

__all__ = ["Communicator", "CommStats", "reject_premul"]

logger = logging.getLogger("fastcomm")

_DTYPES = frozenset(SUPPORTED_DTYPES)
_REDUCED_ORDER = SUPPORTED_DTYPES + EXTRA_DTYPES
_REDUCED_DTYPES = frozenset(_REDUCED_ORDER)  # all_reduce / reduce take these
_STRIDED = torch.strided


def _untracked(tensor: Any) -> Any:
    """``tensor``, or where autograd tracks it (``requires_grad``) a detached alias of the same
    storage: a collective writes its result in place without recording the write in the graph,
    as Gloo and NCCL do (with grad mode on, torch refuses ``out=`` ops on such a tensor, and an
    in-place op would add the communicator's arithmetic to the graph; ``.numpy()`` refuses it
    always). Every tensor enters the contract through here, so no backend sees a tracked one.
    Anything else (a bad argument) passes through to the checks that name it."""
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        return tensor.detach()
    return tensor


def reject_premul(op: ReduceOp | PremulSum, name: str) -> None:
    """Raises for a :class:`PremulSum` given to an operation other than ``all_reduce``.

    Raises:
        TypeError: ``op`` is a ``PremulSum``.
    """
    if op.__class__ is PremulSum:
        raise TypeError(
            f"{name}: {op!r} is supported by all_reduce only; multiply the input by "
            f"{op.factor!r} first and pass ReduceOp.SUM"
        )


def _then(task: Task, after: Callable[[], None]) -> Task:
    """``task``, followed by ``after()`` once its data is in place (on the task's executor, or
    on the caller's thread for a task issued at once, which then waits for its data)."""
    inner = task.run

    def run() -> None:
        work = inner()
        if work is not None:
            work.wait()
        after()

    return Task(task.op, task.output, run, task.executor)


def _premultiplied(task: Task, tensor: torch.Tensor, factor: float) -> Task:
    """``task`` (a ``SUM`` of ``tensor``) preceded by ``tensor.mul_(factor)``, run where and
    when the task runs: after the collectives queued before it on a backend that queues its
    tasks, at the call on one that issues at once (as the caller's own ``mul_`` would)."""
    reduce = task.run

    def run() -> Work | None:
        tensor.mul_(factor)
        return reduce()

    return Task(task.op, task.output, run, task.executor)


_EMPTY: dict[tuple, torch.Tensor] = {}


def _nothing(like: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``like``'s dtype and device (the piece a rank neither sends nor
    receives), made once per dtype and device."""
    key = (like.dtype, like.device)
    empty = _EMPTY.get(key)
    if empty is None:
        empty = _EMPTY[key] = like.new_empty(0)
    return empty


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (contiguous) share bytes."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class Communicator(abc.ABC):
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

    backend: str = "base"
    _capabilities: Capabilities = Capabilities()
    _cpu_native = True  # "cpu" in capabilities.devices, read on every call

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float | timedelta | None = None,
        *,
        fallback: Communicator | None = None,
    ) -> None:
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
        self._executor = OrderedExecutor(f"fastcomm-{self.backend}-r{rank}", rank, self._run_task)

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

    # ------------------------------------------------------------------ validation
    def _where(self) -> str:
        return f"rank {self.rank} of {self.backend} communicator (size {self.size})"

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise CommClosedError(f"{self._where()}: {op} called after close()")

    def _check_tensor(
        self, t: object, op: str, name: str = "tensor", dtypes: frozenset = _DTYPES
    ) -> torch.Tensor:
        if type(t) is torch.Tensor and t.dtype in _DTYPES and t.is_contiguous():
            return t  # the usual case, checked without building any message
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes and t.dtype in _REDUCED_DTYPES:
            raise TypeError(
                f"{op}: {name} has dtype {t.dtype}, which all_reduce and reduce take; "
                f"{op} moves these: {', '.join(str(d).removeprefix('torch.') for d in dtypes)}"
            )
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in
                                (SUPPORTED_DTYPES if dtypes is _DTYPES else _REDUCED_ORDER))
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; allowed: {allowed}")
        if t.layout is not _STRIDED:
            raise TypeError(
                f"{op}: {name} has layout {t.layout}; only all_reduce takes sparse tensors "
                "(torch.sparse_coo)"
            )
        if not t.is_contiguous():
            raise ValueError(
                f"{op}: {name} must be contiguous (shape {tuple(t.shape)}, "
                f"strides {t.stride()}); call .contiguous() first"
            )
        return t

    def _check_pair(self, output: torch.Tensor, input: torch.Tensor, op: str) -> None:
        self._check_tensor(output, op, "output")
        self._check_tensor(input, op, "input")
        if output.dtype != input.dtype:
            raise TypeError(f"{op}: output dtype {output.dtype} != input dtype {input.dtype}")
        if output.device != input.device:
            raise ValueError(f"{op}: output on {output.device} but input on {input.device}")

    def _plain_pair(self, output: object, input: object) -> bool:
        """Whether ``output`` and ``input`` are the usual operands (open communicator, plain
        contiguous CPU tensors of one supported dtype that autograd does not track, moved by this
        communicator): then every check of :meth:`_check_pair` holds, tested in a fraction of
        its time."""
        return (
            type(output) is torch.Tensor
            and type(input) is torch.Tensor
            and not self._closed
            and output.is_cpu
            and input.is_cpu
            and self._cpu_native
            and output.dtype is input.dtype
            and input.dtype in _DTYPES
            and not output.requires_grad
            and not input.requires_grad
            and output.is_contiguous()
            and input.is_contiguous()
        )

    def _check_peer(self, peer: object, op: str, name: str) -> int:
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < self.size:
            raise ValueError(f"{op}: {name}={peer!r} out of range; allowed: 0..{self.size - 1}")
        return peer

    def _check_p2p(self, tensor: object, peer: object, op: str, name: str, verb: str) -> None:
        """The checks of ``send``/``recv``: open, a valid tensor, a peer that is another rank."""
        self._check_open(op)
        self._check_tensor(tensor, op)
        self._check_peer(peer, op, name)
        if peer == self.rank:
            raise ValueError(f"{op}: {name}={peer} is this rank; a rank cannot {verb} itself")

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

    # ------------------------------------------------------------------ collectives
    # Every collective: check the arguments (before anything is sent, so a bad call never
    # leaves a peer waiting), count it, pick the communicator that moves tensors on that device
    # (`_target`), let it build its task (`_impl_*`), run the task (`_run`).
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
        if (  # the usual call (DDP's, a training step's), checked inline: every check below
            # is the same as the general path's, which names what failed
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
            if not async_op and target._sync("all_reduce", tensor, op):
                return None
            return self._run(target._impl_all_reduce(tensor, op), async_op)
        return self._all_reduce_general(tensor, op, async_op)

    def _all_reduce_general(self, tensor, op, async_op: bool) -> Work | None:
        """:meth:`all_reduce` of anything but a plain dense tensor with a :class:`ReduceOp`:
        every check, sparse tensors, op names and torch's ops, ``PremulSum``, tensors that
        require grad."""
        tensor = _untracked(tensor)
        self._check_open("all_reduce")
        if isinstance(tensor, torch.Tensor) and tensor.layout is torch.sparse_coo:
            return self._all_reduce_sparse(tensor, op, async_op)
        self._check_tensor(tensor, "all_reduce", dtypes=_REDUCED_DTYPES)
        op = ReduceOp.coerce(op)
        if op.__class__ is PremulSum and not tensor.is_floating_point():
            raise TypeError(
                f"all_reduce: {op!r} needs a floating-point tensor, got dtype "
                f"{tensor.dtype}; multiply first and reduce with ReduceOp.SUM"
            )
        self.stats.record("all_reduce", tensor)
        target = self._target(tensor, "all_reduce")
        if op.__class__ is not PremulSum:
            if (op in BITWISE_OPS or tensor.dtype not in _DTYPES) and not self._extended(
                target, tensor, op, "all_reduce"
            ):
                return self._run(self._gathered(target, tensor, op, None), async_op)
            if not async_op and target._sync("all_reduce", tensor, op):
                return None
            return self._run(target._impl_all_reduce(tensor, op), async_op)
        if tensor.dtype in target.capabilities.premul_dtypes:
            return self._run(target._impl_all_reduce(tensor, op), async_op)
        task = target._impl_all_reduce(tensor, ReduceOp.SUM)
        if op.factor != 1.0:  # x * 1.0 == x: no pass needed
            task = _premultiplied(task, tensor, op.factor)
        return self._run(task, async_op)

    @staticmethod
    def _extended(target: Communicator, tensor: torch.Tensor, op: ReduceOp, name: str) -> bool:
        """For a bitwise op or a dtype of :data:`~.types.EXTRA_DTYPES`: raises unless the
        contract reduces the pair (before anything is sent), then whether ``target`` reduces it
        itself (``Capabilities.extended_reductions``)."""
        check_reduction(tensor.dtype, op, name)
        return target.capabilities.extended_reductions

    def _gathered(self, target: Communicator, tensor: torch.Tensor, op: ReduceOp,
                  root: int | None) -> Task:
        """A reduction ``target`` does not do itself: an ``all_gather`` of every rank's bytes,
        then the terms reduced in rank order (:func:`~.reduction.reduce_gathered`) on every rank,
        or on ``root`` only. One round of the backend's own all-gather, ``size`` times the
        tensor's bytes of scratch."""
        flat = tensor.view(-1).view(torch.uint8)
        rows = flat.new_empty((self.size, flat.numel()))
        task = target._impl_all_gather(rows, flat)
        name = "all_reduce" if root is None else "reduce"
        if root is not None and root != self.rank:
            return Task(name, tensor, task.run, task.executor)
        return Task(name, tensor, _then(task, lambda: reduce_gathered(rows, tensor, op)).run,
                    task.executor)

    def _sync(self, op: str, *args: Any) -> bool:
        """A backend's lane for a synchronous call of ``op`` (``args`` as its ``_impl_*``
        hook takes them): finishes the call on the caller's thread and returns ``True``, or
        returns ``False`` having done nothing (then its task runs). Default: no such lane."""
        return False

    def _sync_p2p(self, op: str, tensor: torch.Tensor, peer: int) -> bool:
        """A backend's lane for a synchronous ``send`` or ``recv`` (``op``) of ``tensor`` with
        rank ``peer``, as :meth:`_sync` is for collectives: finishes it on the caller's thread
        and returns ``True``, or returns ``False`` having done nothing. Default: no such lane."""
        return False

    def _all_reduce_sparse(self, tensor: torch.Tensor, op: object, async_op: bool):
        """``all_reduce`` of a sparse COO tensor: natively where the backend declares it
        (``sparse_all_reduce``), else densified, reduced and made sparse again (rows that are
        zero after the reduction are dropped); the result replaces ``tensor`` in place."""
        if tensor.dtype not in _DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise TypeError(f"all_reduce: tensor has dtype {tensor.dtype}; allowed: {allowed}")
        if ReduceOp.coerce(op) is not ReduceOp.SUM:
            raise ValueError(f"all_reduce: sparse tensors are reduced with SUM only, got {op!r}")
        self.stats.record("all_reduce", tensor._values())
        target = self.route(tensor.device, "all_reduce")
        if target.capabilities.sparse_all_reduce:
            return self._run(target._impl_all_reduce(tensor, ReduceOp.SUM), async_op)
        dense = tensor.to_dense()
        sparse_dim = tensor.sparse_dim()
        task = target._impl_all_reduce(dense, ReduceOp.SUM)
        task = _then(task, lambda: tensor.copy_(dense.to_sparse(sparse_dim)))
        return self._run(Task("all_reduce", tensor, task.run, task.executor), async_op)

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
        tensor = _untracked(tensor)
        self._check_open("reduce")
        self._check_tensor(tensor, "reduce", dtypes=_REDUCED_DTYPES)
        self._check_peer(root, "reduce", "root")
        op = ReduceOp.coerce(op)
        reject_premul(op, "reduce")
        self.stats.record("reduce", tensor)
        target = self._target(tensor, "reduce")
        if (op in BITWISE_OPS or tensor.dtype not in _DTYPES) and not self._extended(
            target, tensor, op, "reduce"
        ):
            return self._run(self._gathered(target, tensor, op, root), async_op)
        if not async_op and target._sync("reduce", tensor, root, op):
            return None
        return self._run(target._impl_reduce(tensor, root, op), async_op)

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
            tensor = _untracked(tensor)
            self._check_open("broadcast")
            self._check_tensor(tensor, "broadcast")
            self._check_peer(src, "broadcast", "src")
        self.stats.record("broadcast", tensor)
        target = self._target(tensor, "broadcast")
        if not async_op and target._sync("broadcast", tensor, src):
            return None
        return self._run(target._impl_broadcast(tensor, src), async_op)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Work | None:
        """Writes every rank's ``input`` into ``output`` in rank order.

        ``output`` has ``size * input.numel()`` elements (any shape, e.g. ``(size, *shape)``);
        ``input`` may be this rank's slice of ``output``.

        Raises:
            TypeError, ValueError: as for :meth:`all_reduce`; mismatched dtypes, devices or sizes.
        """
        if not self._plain_pair(output, input):
            output, input = _untracked(output), _untracked(input)
            self._check_open("all_gather")
            self._check_pair(output, input, "all_gather")
        if output.numel() != self.size * input.numel():
            raise ValueError(
                f"all_gather: output has {output.numel()} elements; expected size * "
                f"input.numel() = {self.size} * {input.numel()} = {self.size * input.numel()}"
            )
        self.stats.record("all_gather", input)
        target = self._target(input, "all_gather")
        input = self._staged(target, output, input)
        if not async_op and target._sync("all_gather", output, input):
            return None
        return self._run(target._impl_all_gather(output, input), async_op)

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
        if not self._plain_pair(output, input):
            output, input = _untracked(output), _untracked(input)
            self._check_open("reduce_scatter")
            self._check_pair(output, input, "reduce_scatter")
        if op.__class__ is not ReduceOp:
            op = ReduceOp.coerce(op)
            reject_premul(op, "reduce_scatter")
            if op.__class__ is not ReduceOp:
                raise TypeError(
                    f"reduce_scatter: {op.name} is reduced by all_reduce and reduce only"
                )
        if input.numel() != self.size * output.numel():
            raise ValueError(
                f"reduce_scatter: input has {input.numel()} elements; expected size * "
                f"output.numel() = {self.size} * {output.numel()} = {self.size * output.numel()}"
            )
        self.stats.record("reduce_scatter", input)
        target = self._target(input, "reduce_scatter")
        if input.numel() and _overlap(output, input):
            input = input.clone()  # a rank's reduction may read its slice after writing it
        if not async_op and target._sync("reduce_scatter", output, input, op):
            return None
        return self._run(target._impl_reduce_scatter(output, input, op), async_op)

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Work | None:
        """Sends slice ``j`` of ``input`` to rank ``j``; slice ``i`` of ``output`` comes from
        rank ``i`` (equal splits of the flattened tensors).

        Raises:
            TypeError, ValueError: as for :meth:`all_gather`.
        """
        if not self._plain_pair(output, input):
            output, input = _untracked(output), _untracked(input)
            self._check_open("all_to_all")
            self._check_pair(output, input, "all_to_all")
        if output.numel() != input.numel() or input.numel() % self.size:
            raise ValueError(
                f"all_to_all: input ({input.numel()} elements) and output ({output.numel()}) "
                f"must have the same number of elements, divisible by size {self.size}"
            )
        self.stats.record("all_to_all", input)
        target = self._target(input, "all_to_all")
        input = self._staged(target, output, input)
        if not async_op and target._sync("all_to_all", output, input):
            return None
        return self._run(target._impl_all_to_all(output, input), async_op)

    def _staged(self, target: Communicator, output: torch.Tensor, input: torch.Tensor):
        """``input``, or a copy of it where it overlaps ``output`` and ``target`` does not
        take overlapping operands (``Capabilities.in_place``)."""
        if target.capabilities.in_place or not input.numel() or not _overlap(output, input):
            return input
        return input.clone()

    # ------------------------------------------------------------------ unequal sizes
    # One v-call each (see ``vcoll``): every rank sends a piece of any size to every rank; the
    # ranks' sizes are compared inside the call, a disagreement a ValueError on every rank.
    def all_to_all_v(self, outputs: list, inputs: list, async_op: bool = False) -> Work | None:
        """Sends ``inputs[r]`` to rank ``r``; ``outputs[q]`` receives what rank ``q`` sends
        this rank. Pieces of any size (empty too), one dtype.

        Raises:
            TypeError, ValueError: bad pieces (:func:`~.vcoll.check_v`).
            SizesDisagreement: (a ``ValueError``) on every rank, when a piece's size differs
                from what its receiver expects.
        """
        return self._v_call("all_to_all", -1, outputs, inputs, async_op)

    def all_to_all_split(self, output: torch.Tensor, input: torch.Tensor,
                         output_splits: list[int], input_splits: list[int],
                         async_op: bool = False) -> Work | None:
        """:meth:`all_to_all_v` of consecutive row blocks of one tensor each side, as torch's
        ``all_to_all_single`` with split sizes: rows ``input_splits[r]`` of ``input`` (along
        dim 0, in rank order) go to rank ``r``; ``output_splits[q]`` rows of ``output`` come from
        rank ``q``. No tensor is made per piece where the backend takes the offsets
        (``_sync_v_split``).

        Raises:
            TypeError, ValueError: as for :meth:`all_to_all_v`; splits that are not ``size``
                non-negative ints summing to the tensor's rows.
        """
        outputs, inputs = check_v(self, "all_to_all", [output] * self.size, [input] * self.size)
        byte_splits = []
        for name, t, splits in (("output", output, output_splits), ("input", input, input_splits)):
            rows = t.shape[0] if t.dim() else -1
            if (rows < 0 or len(splits) != self.size or sum(splits) != rows
                    or min(splits) < 0):
                raise ValueError(
                    f"all_to_all: {name}_splits {list(splits)} must be {self.size} sizes >= 0 "
                    f"summing to the {name}'s {rows} rows (shape {tuple(t.shape)})")
            row_bytes = t.nbytes // rows if rows else 0
            byte_splits.append([n * row_bytes for n in splits])
        self.stats.count("all_to_all", input.nbytes)
        target = self._target(input, "all_to_all")
        if not async_op and target._sync_v_split(output, input, *byte_splits):
            return None
        outputs = list(output.split_with_sizes(list(output_splits)))
        inputs = list(input.split_with_sizes(list(input_splits)))
        return self._run(target._impl_v_call("all_to_all", -1, outputs, inputs), async_op)

    def gather(self, outputs: list | None, input: torch.Tensor, root: int = 0,
               async_op: bool = False) -> Work | None:
        """Writes every rank's ``input`` into ``outputs[q]`` of rank ``root`` (``outputs``:
        one tensor per rank on the root, ignored elsewhere; sizes may differ by rank)."""
        self._check_peer(root, "gather", "root")
        empty = _nothing(input)
        pieces = [empty] * self.size
        pieces[root] = input
        if self.rank != root:
            outputs = [empty] * self.size
        elif outputs is None:
            raise ValueError(f"gather: rank {root} is the root and needs one output per rank")
        return self._v_call("gather", root, outputs, pieces, async_op)

    def scatter(self, output: torch.Tensor, inputs: list | None, root: int = 0,
                async_op: bool = False) -> Work | None:
        """Writes ``inputs[r]`` of rank ``root`` into ``output`` of rank ``r`` (``inputs``:
        one tensor per rank on the root, ignored elsewhere)."""
        self._check_peer(root, "scatter", "root")
        empty = _nothing(output)
        outputs = [empty] * self.size
        outputs[root] = output
        if self.rank != root:
            inputs = [empty] * self.size
        elif inputs is None:
            raise ValueError(f"scatter: rank {root} is the root and needs one input per rank")
        return self._v_call("scatter", root, outputs, inputs, async_op)

    def all_gather_v(self, outputs: list, input: torch.Tensor,
                     async_op: bool = False) -> Work | None:
        """Writes every rank's ``input`` into ``outputs[q]`` of every rank (sizes may differ
        by rank, as NCCL's ``all_gather`` of a list allows)."""
        return self._v_call("all_gather", -1, outputs, [input] * self.size, async_op)

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
        self._check_tensor(output, "reduce_scatter", "output")
        terms = [torch.empty_like(output) for _ in range(self.size)]
        task = self._v_task("reduce_scatter", -1, terms, inputs)
        return self._run(_then(task, lambda: torch_reduce(output, terms, op)), async_op)

    def _v_call(self, kind: str, root: int, outputs, inputs, async_op: bool) -> Work | None:
        target, outputs, inputs = self._v_target(kind, outputs, inputs)
        if not async_op and target._sync_v(kind, root, outputs, inputs):
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
        nbytes = first.nbytes if all(t is first for t in inputs) else sum(
            t.nbytes for t in inputs)
        self.stats.count(kind, nbytes)
        target = self._target(first, kind)
        return target, outputs, inputs

    def _sync_v_split(self, output: torch.Tensor, input: torch.Tensor, out_bytes: list[int],
                      in_bytes: list[int]) -> bool:
        """:meth:`_sync_v` for :meth:`all_to_all_split` (each piece's bytes, in rank order).
        Default: no such lane."""
        return False

    def _sync_v(self, kind: str, root: int, outputs: list, inputs: list) -> bool:
        """A backend's lane for a synchronous v-call, as :meth:`_sync` is for the other
        collectives: finishes it on the caller's thread and returns ``True``, or returns
        ``False`` having done nothing. Default: no such lane."""
        return False

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False) -> Work | None:
        """Sends ``tensor`` to rank ``dst`` (which must call ``recv`` with ``src`` = us).

        Raises:
            TypeError, ValueError: as for :meth:`all_reduce`; ``dst`` out of range or this rank.
        """
        self._check_p2p(tensor, dst, "send", "dst", "send to")
        self.stats.record("send", tensor)
        target = self._target(tensor, "send")
        if not async_op and target._sync_p2p("send", tensor, dst):
            return None
        return self._run(target._impl_send(tensor, dst), async_op)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Work | None:
        """Receives into ``tensor`` from rank ``src``.

        Args:
            tensor: where the data lands; the sender's tensor has as many bytes.
            src: the sending rank (not this one).
            async_op: return a :class:`Work` at once instead of waiting.

        Raises:
            TypeError, ValueError: as for :meth:`all_reduce`; ``src`` out of range or this rank.
        """
        tensor = _untracked(tensor)
        self._check_p2p(tensor, src, "recv", "src", "receive from")
        self.stats.record("recv", None)
        target = self._target(tensor, "recv")
        if not async_op and target._sync_p2p("recv", tensor, src):
            return None
        return self._run(target._impl_recv(tensor, src), async_op)

    def barrier(self, async_op: bool = False) -> Work | None:
        """Returns once every rank has entered the barrier."""
        self._check_open("barrier")
        self.stats.record("barrier", None)
        if not async_op and self._sync("barrier"):
            return None
        return self._run(self._impl_barrier(), async_op)

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

    # ------------------------------------------------------------------ store helpers
    def next_key(self, what: str) -> str:
        """A store key prefix unique to this use, the same on every rank: ``"<what>/<n>"``.

        A collective call in effect: ``n`` counts this communicator's calls, so every rank must
        call it in the same order (as it issues collectives). Store helpers (``split``, object
        exchange) and callers that keep their own keys in :attr:`store` use it, so two uses never
        read each other's values.

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

        Raises:
            TypeError: ``color`` or ``key`` is not an int (or ``None``).
        """
        self._check_open("split")
        if color is not None and (not isinstance(color, int) or isinstance(color, bool)):
            raise TypeError(f"split: color must be an int or None, got {color!r}")
        if key is not None and (not isinstance(key, int) or isinstance(key, bool)):
            raise TypeError(f"split: key must be an int or None, got {key!r}")
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
        members = sorted((k, r) for c, k, r in entries if c == color)
        ranks = [r for _, r in members]
        new_rank = ranks.index(self.rank)
        return self._split_child(color, name, new_rank, len(ranks), ranks, new_timeout)

    def _split_child(
        self,
        color: int | None,
        name: str,
        new_rank: int,
        new_size: int,
        parent_ranks: list[int],
        timeout: timedelta,
    ) -> Communicator | None:
        """Builds the child communicator (backends override to use a native split)."""
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

    # ------------------------------------------------------------------ backend hooks
    # Called with validated tensors (possibly empty) on a device this backend moves (`route`);
    # each returns the :class:`Task` that moves the data, and `_run` runs it.
    @abc.abstractmethod
    def _impl_all_reduce(self, tensor: torch.Tensor, op: ReduceOp | PremulSum) -> Task:
        """``op`` is a ``PremulSum`` only for dtypes in ``capabilities.premul_dtypes``; a
        sparse ``tensor`` only where ``capabilities.sparse_all_reduce``."""

    def _impl_reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> Task:
        """Default: an ``all_reduce`` of a copy, written back on ``root`` only."""
        scratch = tensor.clone()
        task = self._impl_all_reduce(scratch, op)
        keep = (lambda: tensor.copy_(scratch)) if self.rank == root else (lambda: None)
        return Task("reduce", tensor, _then(task, keep).run, task.executor)

    @abc.abstractmethod
    def _impl_broadcast(self, tensor: torch.Tensor, src: int) -> Task: ...

    @abc.abstractmethod
    def _impl_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Task: ...

    @abc.abstractmethod
    def _impl_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp
    ) -> Task: ...

    @abc.abstractmethod
    def _impl_all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Task: ...

    def _impl_v_call(self, kind: str, root: int, outputs: list, inputs: list) -> Task:
        """A v-call (``vcoll``): ``inputs[r]`` to rank ``r``, ``outputs[q]`` from rank ``q``.
        Default: its rows gathered and compared, then a padded ``all_to_all``
        (:func:`~.vcoll.default_task`)."""
        return default_task(self, kind, root, outputs, inputs)

    @abc.abstractmethod
    def _impl_send(self, tensor: torch.Tensor, dst: int) -> Task: ...

    @abc.abstractmethod
    def _impl_recv(self, tensor: torch.Tensor, src: int) -> Task: ...

    @abc.abstractmethod
    def _impl_barrier(self) -> Task: ...

    def _impl_close(self) -> None:
        """Releases the backend's resources (called once, by :meth:`close`)."""
        self._executor.close(timeout=5.0)
