"""The communicator interface shared by every backend.

``Communicator`` validates arguments (type, device, dtype, contiguity, sizes, ranks, closed
state) *before* anything is sent, so a bad call raises the same clear error on every backend and
never leaves a peer waiting on half a collective. Backends implement the ``_impl_*`` methods,
which receive validated, non-empty tensors on a device they move and return the
:class:`~fastcomm.comm.work.Task` that moves the data; ``Communicator`` runs every task the same
way (``_run``), in issue order.

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
from .store import DEFAULT_TIMEOUT, Store, as_timedelta
from .types import SUPPORTED_DTYPES, PremulSum, ReduceOp
from .work import OrderedExecutor, Task, Work, completed_work, wrap_error

__all__ = ["Communicator", "CommStats", "reject_premul"]

logger = logging.getLogger("fastcomm")


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


def _premultiplied(task: Task, tensor: torch.Tensor, factor: float) -> Task:
    """``task`` (a ``SUM`` of ``tensor``) preceded by ``tensor.mul_(factor)``, run where and
    when the task runs."""
    reduce = task.run

    def run() -> Work | None:
        tensor.mul_(factor)
        return reduce()

    return Task(task.op, task.output, run, task.executor)


class CommStats:
    """Calls and payload bytes per operation issued by this rank.

    ``bytes[op]`` counts the bytes this rank contributes (the input of ``all_gather``, the
    tensor of ``all_reduce``...), the figure compression hooks shrink. Reset with ``reset()``.
    """

    __slots__ = ("calls", "bytes")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def record(self, op: str, tensor: torch.Tensor | None) -> None:
        """Counts one call of ``op`` and the bytes of ``tensor`` (``None``: no payload)."""
        self.calls[op] = self.calls.get(op, 0) + 1
        if tensor is not None:
            self.bytes[op] = self.bytes.get(op, 0) + tensor.numel() * tensor.element_size()

    def count(self, op: str, nbytes: int) -> None:
        """Counts one call of ``op`` that moved ``nbytes`` (a caller that knows the size)."""
        self.calls[op] = self.calls.get(op, 0) + 1
        self.bytes[op] = self.bytes.get(op, 0) + nbytes

    @property
    def total_bytes(self) -> int:
        """Bytes of every operation together."""
        return sum(self.bytes.values())

    def reset(self) -> None:
        """Forgets every count."""
        self.calls.clear()
        self.bytes.clear()

    def __repr__(self) -> str:
        return f"CommStats(calls={self.calls}, bytes={self.bytes})"


class Communicator(abc.ABC):
    """A group of ``size`` ranks that run collectives together.

    Args:
        store: a store namespace private to this communicator (the same on every member).
        rank: this process's rank in ``[0, size)``.
        size: number of ranks.
        timeout: how long any collective may take before it raises (seconds or timedelta;
            default :data:`~fastcomm.comm.store.DEFAULT_TIMEOUT`).
    """

    backend: str = "base"

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float | timedelta | None = None,
    ) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"rank must be an int in [0, {size}), got {rank!r}")
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout = as_timedelta(timeout, DEFAULT_TIMEOUT)
        self._closed = False
        self._seq = 0
        self._told_route = False
        self.stats = CommStats()
        self._executor = OrderedExecutor(f"fastcomm-{self.backend}-r{rank}", rank, self._run_task)

    # ------------------------------------------------------------------ properties
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

    def _device_ok(self, device: torch.device) -> bool:
        return device.type == self.device.type

    def _check_tensor(self, t: object, op: str, name: str = "tensor") -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; allowed: {allowed}")
        if not self._device_ok(t.device):
            raise ValueError(
                f"{op}: {name} is on {t.device}, but the {self.backend} communicator of "
                f"rank {self.rank} works on {self.device.type} tensors"
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

    # ------------------------------------------------------------------ collectives
    # Every collective is the same preamble: check the arguments (before anything is sent, so a
    # bad call never leaves a peer waiting), count it, then `_submit`: answer an empty tensor at
    # once (every rank has the same sizes, so every rank skips together), pick the communicator
    # that moves tensors on that device (`route`), and run the task its backend builds (`_run`).
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | PremulSum | str = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work | None:
        """Reduces ``tensor`` across ranks, in place.

        Args:
            tensor: the contiguous tensor to reduce, the same shape and dtype on every rank.
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
        self._check_open("all_reduce")
        self._check_tensor(tensor, "all_reduce")
        if op.__class__ is not ReduceOp:
            op = ReduceOp.coerce(op)
            if op.__class__ is PremulSum:
                return self._all_reduce_premul(tensor, op, async_op)
        self.stats.record("all_reduce", tensor)
        return self._submit("all_reduce", tensor, async_op, "_impl_all_reduce", tensor, op)

    def _all_reduce_premul(
        self, tensor: torch.Tensor, op: PremulSum, async_op: bool
    ) -> Work | None:
        """:meth:`all_reduce` with a :class:`PremulSum`, for every backend: the communicator
        that moves ``tensor`` either applies the factor inside its collective
        (:meth:`_fuses_premul`) or gets a ``SUM`` task that multiplies ``tensor`` in place
        first, when the task runs: on a backend that queues its tasks (shm, hier) after the
        collectives issued before it have run; on one that issues at once (a torch process
        group, NCCL's stream) at the call, as the caller's own ``mul_`` would.
        """
        if not tensor.is_floating_point():
            raise TypeError(
                f"all_reduce: {op!r} needs a floating-point tensor, got dtype {tensor.dtype}; "
                "multiply first and reduce with ReduceOp.SUM"
            )
        self.stats.record("all_reduce", tensor)
        if not tensor.numel():
            return self._nothing_to_move("all_reduce", tensor, async_op)
        target = self.route(tensor.device, "all_reduce")
        if target._fuses_premul(tensor):
            return self._run(target._impl_all_reduce(tensor, op), async_op)
        task = target._impl_all_reduce(tensor, ReduceOp.SUM)
        if op.factor != 1.0:  # x * 1.0 == x: no pass needed
            task = _premultiplied(task, tensor, op.factor)
        return self._run(task, async_op)

    def _fuses_premul(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`_impl_all_reduce` applies a :class:`PremulSum` to ``tensor`` itself
        (a non-empty floating-point tensor this communicator moves), with the bits of
        ``mul_`` then ``SUM``. Default: no; the caller then multiplies before a ``SUM``."""
        return False

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, async_op: bool = False
    ) -> Work | None:
        """Copies ``tensor`` of rank ``src`` into ``tensor`` of every rank.

        Raises:
            TypeError, ValueError: as for :meth:`all_reduce`; ``src`` out of range.
        """
        self._check_open("broadcast")
        self._check_tensor(tensor, "broadcast")
        self._check_peer(src, "broadcast", "src")
        self.stats.record("broadcast", tensor)
        return self._submit("broadcast", tensor, async_op, "_impl_broadcast", tensor, src)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Work | None:
        """Writes every rank's ``input`` into ``output`` in rank order.

        ``output`` has ``size * input.numel()`` elements (any shape, e.g. ``(size, *shape)``).

        Raises:
            TypeError, ValueError: as for :meth:`all_reduce`; mismatched dtypes, devices or sizes.
        """
        self._check_open("all_gather")
        self._check_pair(output, input, "all_gather")
        if output.numel() != self.size * input.numel():
            raise ValueError(
                f"all_gather: output has {output.numel()} elements; expected size * "
                f"input.numel() = {self.size} * {input.numel()} = {self.size * input.numel()}"
            )
        self.stats.record("all_gather", input)
        return self._submit("all_gather", input, async_op, "_impl_all_gather", output, input)

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
        self._check_open("reduce_scatter")
        self._check_pair(output, input, "reduce_scatter")
        op = ReduceOp.coerce(op)
        reject_premul(op, "reduce_scatter")
        if input.numel() != self.size * output.numel():
            raise ValueError(
                f"reduce_scatter: input has {input.numel()} elements; expected size * "
                f"output.numel() = {self.size} * {output.numel()} = {self.size * output.numel()}"
            )
        self.stats.record("reduce_scatter", input)
        return self._submit(
            "reduce_scatter", input, async_op, "_impl_reduce_scatter", output, input, op
        )

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Work | None:
        """Sends slice ``j`` of ``input`` to rank ``j``; slice ``i`` of ``output`` comes from
        rank ``i`` (equal splits of the flattened tensors).

        Raises:
            TypeError, ValueError: as for :meth:`all_gather`.
        """
        self._check_open("all_to_all")
        self._check_pair(output, input, "all_to_all")
        if output.numel() != input.numel() or input.numel() % self.size:
            raise ValueError(
                f"all_to_all: input ({input.numel()} elements) and output ({output.numel()}) "
                f"must have the same number of elements, divisible by size {self.size}"
            )
        self.stats.record("all_to_all", input)
        return self._submit("all_to_all", input, async_op, "_impl_all_to_all", output, input)

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False) -> Work | None:
        """Sends ``tensor`` to rank ``dst`` (which must call ``recv`` with ``src`` = us).

        Raises:
            TypeError, ValueError: as for :meth:`all_reduce`; ``dst`` out of range or this rank.
        """
        self._check_p2p(tensor, dst, "send", "dst", "send to")
        self.stats.record("send", tensor)
        return self._submit("send", tensor, async_op, "_impl_send", tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Work | None:
        """Receives into ``tensor`` from rank ``src``.

        Args:
            tensor: where the data lands; the sender's tensor has as many bytes.
            src: the sending rank (not this one).
            async_op: return a :class:`Work` at once instead of waiting.

        Raises:
            TypeError, ValueError: as for :meth:`all_reduce`; ``src`` out of range or this rank.
        """
        self._check_p2p(tensor, src, "recv", "src", "receive from")
        self.stats.record("recv", None)
        return self._submit("recv", tensor, async_op, "_impl_recv", tensor, src)

    def barrier(self, async_op: bool = False) -> Work | None:
        """Returns once every rank has entered the barrier."""
        self._check_open("barrier")
        self.stats.record("barrier", None)
        return self._run(self._impl_barrier(), async_op)

    # ------------------------------------------------------------------ execution
    def _submit(
        self, op: str, data: torch.Tensor, async_op: bool, impl: str, *args: Any
    ) -> Work | None:
        """The end of every collective's preamble: an empty ``data`` (the tensor whose size
        says what moves) is done at once; otherwise backend hook ``impl`` of the communicator
        that moves ``data``'s device builds the task, called with ``args`` (the output first),
        and :meth:`_run` runs it."""
        if not data.numel():
            return self._nothing_to_move(op, args[0], async_op)
        return self._run(getattr(self.route(data.device, op), impl)(*args), async_op)

    def route(self, device: torch.device | str, op: str | None = None) -> Communicator:
        """The communicator that moves tensors on ``device``: this one, unless a backend hands
        some devices to a fallback (``shm`` and ``hier`` send CUDA tensors to Gloo).

        Args:
            device: where the tensors live.
            op: the operation (``"all_reduce"``), for a backend that routes some operations
                of a device differently from the others; ``None``: any operation.
        """
        return self

    def _hand_off(self, device: torch.device, target: Communicator, how: str) -> Communicator:
        """``target``, for tensors on ``device`` that this backend hands to it; says ``how`` the
        tensors travel in the log (logger ``fastcomm``) the first time only."""
        if not self._told_route:
            self._told_route = True
            logger.info("%s: %s tensors go through %s", self._where(), device.type, how)
        return target

    def _run(self, task: Task, async_op: bool) -> Work | None:
        """Runs ``task`` in issue order: the one way every backend's operations execute.

        A task with an executor runs there (on the caller's thread when nothing is pending and
        the caller waits); one without is issued now, and its backend completes the ``Work``.
        """
        executor = task.executor
        work = task.run() if executor is None else executor.run(task, async_op)
        if async_op or work is None:
            return work
        work.wait()
        return None

    def _run_task(self, task: Task, start: float) -> None:
        """Runs one task for an :class:`OrderedExecutor` (``start``: when it was issued); its
        error comes out naming the rank, the operation and the elapsed time."""
        try:
            task.run()
        except Exception as exc:
            error = wrap_error(task.op, self.rank, start, exc)
            if error is exc:
                raise
            raise error from exc

    def _task(self, op: str, output: torch.Tensor | None, run: Callable[[], None]) -> Task:
        """A task for this communicator's executor (backends whose ``run`` blocks)."""
        return Task(op, output, run, self._executor)

    def _nothing_to_move(
        self, op: str, output: torch.Tensor | None, async_op: bool
    ) -> Work | None:
        """The outcome of an operation on empty tensors: done, with nothing sent."""
        return completed_work(op, self.rank, output) if async_op else None

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
        """Gathers a small picklable object from every rank through the store."""
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
        return self._new_child(store, new_rank, new_size, timeout)

    @abc.abstractmethod
    def _new_child(
        self, store: Store, rank: int, size: int, timeout: timedelta
    ) -> Communicator: ...

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Releases the communicator; later calls raise ``CommClosedError``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._impl_close()

    @contextmanager
    def group(self) -> Iterator[None]:
        """Groups the collectives issued inside (NCCL's groupStart/End); a no-op elsewhere."""
        yield

    # ------------------------------------------------------------------ backend hooks
    # Called only with validated, non-empty tensors on a device this backend moves (`route`);
    # each returns the :class:`Task` that moves the data, and `_run` runs it.
    @abc.abstractmethod
    def _impl_all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Task: ...

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

    @abc.abstractmethod
    def _impl_send(self, tensor: torch.Tensor, dst: int) -> Task: ...

    @abc.abstractmethod
    def _impl_recv(self, tensor: torch.Tensor, src: int) -> Task: ...

    @abc.abstractmethod
    def _impl_barrier(self) -> Task: ...

    def _impl_close(self) -> None:
        """Releases the backend's resources (called once, by :meth:`close`)."""
        self._executor.close(timeout=5.0)
