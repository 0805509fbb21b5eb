"""fastcomm as a ``torch.distributed`` backend: ``dist.init_process_group("fastcomm")``.

``import fastcomm`` registers the backend name ``"fastcomm"`` (CPU and CUDA, torch's extended
API). For every group of that backend torch calls :func:`create_process_group`, which returns a
:class:`FastcommProcessGroup`: a Python ``dist.ProcessGroup`` that torch keeps as the group
itself (the default group, ``new_group``, a ``DeviceMesh`` dimension). Each c10d method maps the
call onto the :class:`~.base.Communicator` contract; nothing here moves or reduces data.

Which object does what:

- ``group.communicator``: the CPU communicator ``fastcomm.init()`` would build on the group's
  store (``communicator_for``: shm on one host, hier across hosts, else Gloo). Built at group
  creation. ``fastcomm.ddp.DDP`` given the group uses it directly (no second wrap).
- CUDA tensors: the CUDA transport is built on the group's first CUDA operation, which every
  member must issue (a collective, not a send/recv): the fastcomm CUDA communicator
  (``communicator_for(device=cuda)``: NCCL through CuPy, or ``ipc``), or, for the device-map
  form ``"cpu:fastcomm,cuda:nccl"``, torch's own backend of that name, to which CUDA calls
  are forwarded unchanged.
- ``group.gloo``: a ``ProcessGroupGloo`` over the same ranks, built at group creation (a
  send/recv involves two ranks only, so it cannot be built lazily); the CPU communicator's own
  Gloo part when it has one. It takes what the contract has no fast path for: ``gather``,
  ``scatter``, ``send``/``recv``/``recv_anysource``, ``alltoall`` (lists), ``all_to_all_single``
  with explicit split sizes, ``allgather`` / ``reduce_scatter`` lists of unequal sizes,
  ``allgather_coalesced``, bitwise ops (``BAND``/``BOR``/``BXOR``), reductions of dtypes the
  contract lacks (``bool``, ...), several tensors per call, and non-contiguous tensors other
  than the one tensor of ``allreduce``/``broadcast``/``reduce`` (those run on a contiguous copy
  written back).
  It is also the group's registered C++ backend, so torch's introspection
  (``group._device_types``, ``group._get_backend``) sees a CPU backend. A collective handed to
  it is first compared across the ranks through the communicator (what each rank sends to and
  expects from each other, the dtype, root and reduce op): Gloo aborts the process when ranks
  disagree on sizes, fastcomm raises ``ValueError`` on every rank and the group stays usable.

Work: a call torch issues synchronously (``opts.asyncOp`` false: ``dist.all_reduce(t)``) runs
on the caller's thread, on the communicator's synchronous lane, and returns a
:class:`FinishedWork`; an asynchronous one (``async_op=True``, DDP's buckets, FSDP2) returns a
:class:`FastcommWork` over the communicator's (or Gloo's) own work. Both are ``dist._Work``
subclasses; their futures' value is the list of output tensors, as torch's own backends give
it; errors are raised by ``wait()`` and carried by the future, naming the rank and the
operation (and, for a call handed to Gloo, the group and the peer of a send or receive).

Complex tensors go through their real view; data that is only moved (``broadcast``, gathers,
``all_to_all``) goes through a byte view whatever its dtype.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from .base import Communicator
from .errors import FastcommError
from .store import Store
from .types import SUPPORTED_DTYPES, PremulSum, ReduceOp
from .work import wrap_error
from .world import communicator_for

__all__ = ["BACKEND_NAME", "FastcommProcessGroup", "FastcommWork", "create_process_group"]

BACKEND_NAME = "fastcomm"

_DTYPES = frozenset(SUPPORTED_DTYPES)
_STRIDED = torch.strided
_RED = dist.ReduceOp.RedOpType
# keyed by the enum's value: hashing and comparing pybind11 enum members costs ~1 us a lookup
_OPS = {
    _RED.SUM.value: ReduceOp.SUM,
    _RED.AVG.value: ReduceOp.AVG,
    _RED.MAX.value: ReduceOp.MAX,
    _RED.MIN.value: ReduceOp.MIN,
    _RED.PRODUCT.value: ReduceOp.PRODUCT,
}
_PREMUL = _RED.PREMUL_SUM.value


def _kind_of(reduce_op: Any) -> int:
    """The value of a ``dist.ReduceOp``'s kind (``RedOpType``)."""
    return getattr(reduce_op, "op", reduce_op).value


# torch 2.13 hashes a ReduceOp to its kind's value, 5x cheaper than reading `.op.value`; used
# only where this process confirms it for every kind
_op_kind = (
    hash if all(hash(dist.ReduceOp(kind)) == kind.value for kind in _RED.__members__.values()
                if kind is not _RED.PREMUL_SUM)
    else _kind_of
)
# c10d's ProcessGroup method -> the Backend method that implements it (forwarding to Gloo/NCCL)
_BACKEND_NAMES = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
}
# a coalesced method a backend may lack -> the per-tensor method it is done with
_PER_TENSOR = {
    "allgather_into_tensor_coalesced": "_allgather_base",
    "reduce_scatter_tensor_coalesced": "_reduce_scatter_base",
}


def _reduce_op(reduce_op: Any) -> ReduceOp | PremulSum | None:
    """The contract's op for torch's (``None``: the contract has none, e.g. ``BAND``)."""
    kind = _kind_of(reduce_op)
    found = _OPS.get(kind)
    if found is None and kind == _PREMUL:
        factor = reduce_op.factor
        return PremulSum(factor.item() if isinstance(factor, torch.Tensor) else float(factor))
    return found


def _reducible(t: torch.Tensor) -> torch.Tensor | None:
    """``t``, or its real view when complex, if the contract reduces it (else ``None``)."""
    if t.dtype in _DTYPES and t.layout is _STRIDED and t.is_contiguous():
        return t
    if t.is_complex() and t.layout is _STRIDED and t.is_contiguous():
        return torch.view_as_real(t)
    return None


def _movable(t: torch.Tensor) -> torch.Tensor | None:
    """``t``, or its bytes, if the contract can move it (dense and contiguous; else ``None``)."""
    if t.layout is not _STRIDED or not t.is_contiguous():
        return None
    if t.dtype in _DTYPES:
        return t
    return t.reshape(-1).view(torch.uint8)


def _staged(tensor: torch.Tensor) -> torch.Tensor | None:
    """A contiguous copy of a dense non-contiguous ``tensor`` (an in-place call runs on it and
    copies the result back), else ``None``."""
    if tensor.layout is _STRIDED and not tensor.is_contiguous():
        return tensor.contiguous()
    return None


def _seconds(timeout: Any) -> float | None:
    """A wait's limit in seconds; ``None`` or zero (C++'s ``kNoTimeout``) means none."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return seconds if seconds > 0 else None


class FinishedWork(dist._Work):
    """The handle of a call that finished before it returned (torch issued it synchronously):
    ``wait()`` returns at once, the future is already completed with the outputs. Made by
    :func:`_finished` (no ``__init__`` of its own: it is made on every synchronous call)."""

    __slots__ = ("_outputs",)

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> list:
        return self._outputs

    def synchronize(self) -> None:
        pass

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(self._outputs)
        return future

    def __repr__(self) -> str:
        return "FinishedWork()"


def _finished(outputs: list) -> FinishedWork:
    work = FinishedWork()
    work._outputs = outputs
    return work


class FastcommWork(dist._Work):
    """The handle of a call still in flight: over the communicator's ``Work`` (or Gloo's), with
    the step that completes the call afterwards (copying a packed result out), run once by
    whichever of ``wait()``, ``is_completed()`` and the future comes first.

    Args:
        op: the operation's name, for errors.
        rank: this rank in the group, for errors.
        outputs: the tensors the future resolves to (torch's convention: a list).
        inner: the pending works the call is made of.
        post: what runs once they are done, or ``None``.
    """

    __slots__ = (
        "_op", "_rank", "_outputs", "_inner", "_post", "_start", "_finished", "_error",
        "_future", "_lock",
    )

    def __init__(
        self,
        op: str,
        rank: int,
        outputs: list,
        inner: Sequence[Any],
        post: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._op = op
        self._rank = rank
        self._outputs = outputs
        self._inner = inner
        self._post = post
        self._start = time.monotonic()
        self._finished = False
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None
        self._lock = threading.Lock()

    def _settle(self, error: BaseException | None) -> None:
        """Records the outcome once: runs ``post`` after the inner works succeeded."""
        with self._lock:
            if self._finished:
                return
            try:
                if error is not None:
                    raise error
                if self._post is not None:
                    self._post()
            except BaseException as exc:  # kept for every later wait() and the future
                self._error = wrap_error(self._op, self._rank, self._start, exc)
            self._finished = True

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Blocks until the call is done and raises its error.

        Args:
            timeout: a limit for this wait (``None`` or zero: the group's own timeout ends a
                call that cannot finish). When it passes, ``CommTimeoutError`` is raised and
                the operation is left running.

        Returns:
            ``True``, as torch's ``Work.wait``.
        """
        if not self._finished:
            limit = _seconds(timeout)
            try:
                for work in self._inner:
                    if limit is None:
                        work.wait()
                    elif isinstance(work, dist._Work):
                        work.wait(timedelta(seconds=limit))
                    else:
                        work.wait(limit)
            except BaseException as exc:
                if limit is not None and not all(w.is_completed() for w in self._inner):
                    raise wrap_error(self._op, self._rank, self._start, exc) from exc
                self._settle(exc)
            else:
                self._settle(None)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._finished and all(w.is_completed() for w in self._inner):
            try:
                self.wait()
            except BaseException:  # noqa: BLE001 - reported by exception() and wait()
                pass
        return self._finished

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error if self.is_completed() else None

    def result(self) -> list:
        """Waits, then returns the output tensors."""
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        """The sender of a ``recv_anysource`` (torch reads it as ``work._source_rank()``)."""
        return self._inner[0]._source_rank()

    source_rank = _source_rank

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` whose value is the list of output tensors."""
        if self._future is None:
            futures = [_future_of(w) for w in self._inner]
            if len(futures) == 1:
                joined = futures[0]
            else:  # several works, or none (a call whose data was in place at once)
                joined = torch.futures.collect_all(futures)
            self._future = joined.then(self._resolve)
        return self._future

    def _resolve(self, joined: torch.futures.Future) -> list:
        try:
            value = joined.value()
            for part in value if len(self._inner) > 1 else ():
                part.value()
        except BaseException as exc:  # the call failed: so does every chained future
            self._settle(exc)
        else:
            self._settle(None)
        if self._error is not None:
            raise self._error
        return self._outputs

    def __repr__(self) -> str:
        state = "done" if self._finished else "pending"
        return f"FastcommWork({self._op}, rank={self._rank}, {state})"


def _future_of(work: Any) -> torch.futures.Future:
    """``work``'s future; for a torch handle without one (Gloo's send, recv, gather...), one
    completed by a thread of its own once the handle is done (never on a communicator's
    executor: a receive waiting there would stall the collectives queued behind it)."""
    try:
        return work.get_future()
    except RuntimeError:
        pass
    future = torch.futures.Future()

    def wait() -> None:
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            future.set_exception(exc)
        else:
            future.set_result(None)

    threading.Thread(target=wait, name="fastcomm-c10d-future", daemon=True).start()
    return future


def _gloo_of(comm: Communicator) -> dist.ProcessGroupGloo | None:
    """The ``ProcessGroupGloo`` over all of ``comm``'s ranks that it already holds, if any
    (asked of what the communicator or its fallback holds, not of its class)."""
    for part in (comm, comm.fallback):
        group = getattr(part, "process_group", None)
        if isinstance(group, dist.ProcessGroupGloo) and part.size == comm.size:
            return group
    return None


def _cuda_backend_name(group: dist.ProcessGroup) -> str:
    """The backend the group's config names for CUDA (``"fastcomm"`` unless a device map says
    otherwise, e.g. ``"cpu:fastcomm,cuda:nccl"``)."""
    try:
        config = dist.get_backend_config(group)
    except (RuntimeError, ValueError, KeyError):
        return BACKEND_NAME
    for pair in str(config).split(","):
        device, _, name = pair.partition(":")
        if device.strip() == "cuda" and name:
            return name.strip().lower()
    return BACKEND_NAME


def _options(opts: Any, cls: type) -> Any:
    """torch's options object for a call made without one (``pg.allreduce([t])``), or with a
    bare op (``pg.allreduce([t], dist.ReduceOp.MAX)``)."""
    if isinstance(opts, cls):
        return opts
    made = cls()
    if opts is not None:
        made.reduceOp = opts
    return made


def _as_list(tensors: Any) -> list:
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors


def _scaled(tensor: torch.Tensor, op: ReduceOp | PremulSum) -> tuple[torch.Tensor, ReduceOp]:
    """A reduction other than ``all_reduce`` given a ``PremulSum``: a scaled copy and ``SUM``
    (the input is left as it was, as NCCL leaves it)."""
    if op.__class__ is PremulSum:
        return tensor * op.factor, ReduceOp.SUM
    return tensor, op


def _copy_rows(flat: torch.Tensor, outputs: list, dtype: torch.dtype) -> None:
    """Copies row ``i`` of the gathered ``flat`` into ``outputs[i]`` (its dtype and shape)."""
    for row, out in zip(flat, outputs, strict=True):
        out.copy_(row.view(dtype).view(out.shape))


# ---------------------------------------------------------------------- Gloo-path agreement
# Gloo aborts the process (gloo::EnforceNotMet from its own thread) when the ranks of a call
# disagree on sizes, so a collective handed to it is first described on every rank and the
# descriptions are compared through the communicator: a disagreement is a ValueError on every
# rank, as on the fast path. Point-to-point calls involve two ranks only and are not checked.
_DTYPE_LIST = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)},
                           key=str))
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPE_LIST)}
_CHECKED_OPS = (
    "allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather",
    "all_gather_single", "all_gather_single_coalesced", "allgather_coalesced",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "all_to_all_single", "alltoall", "gather", "scatter",
)
_OP_CODES = {op: code for code, op in enumerate(_CHECKED_OPS)}
_SYMMETRIC = frozenset(("allreduce", "allreduce_coalesced", "reduce", "broadcast"))
_HEAD = 5  # op, root, reduce op, dtype, layout; then elements sent to / expected from each rank


def _numel(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def _per_rank(sizes: list[int], size: int) -> list[int]:
    """``sizes`` if it has an entry per rank, else ``-1`` for each (a list of the wrong
    length, which Gloo refuses itself when every rank passes one)."""
    return sizes if len(sizes) == size else [-1] * size


def _even(numel: int, size: int) -> int:
    return numel // size if numel % size == 0 else -1


def _flows(op: str, size: int, args: tuple) -> tuple[list, list[int], list[int]]:
    """What a collective handed to Gloo moves: ``(this rank's tensors, sent_to,
    expected_from)``, the elements this rank sends to each rank and expects from each. The
    ranks' calls agree when rank ``r``'s ``sent_to[j]`` is rank ``j``'s ``expected_from[r]``.

    Args:
        op: the group method's name (one of ``_CHECKED_OPS``).
        size: the group's size.
        args: the arguments handed to Gloo, options last.
    """
    *tensors, opts = args
    if op in _SYMMETRIC:  # (tensors, opts): the same tensors on every rank
        mine = tensors[0]
        return mine, [_numel(mine)] * size, [_numel(mine)] * size
    if op == "gather":  # ([[t per rank]] on the root, else []), [t]
        outputs, mine = tensors
        sent = [0] * size
        sent[opts.rootRank % size] = _numel(mine)
        expected = [t.numel() for t in outputs[0]] if outputs else [0] * size
        return mine, sent, _per_rank(expected, size)
    if op == "scatter":  # [t], ([[t per rank]] on the root, else [])
        mine, inputs = tensors
        expected = [0] * size
        expected[opts.rootRank % size] = _numel(mine)
        sent = [t.numel() for t in inputs[0]] if inputs else [0] * size
        return mine, _per_rank(sent, size), expected
    if op == "allgather":  # [[t per rank]], [t]
        outputs, mine = tensors
        expected = [t.numel() for t in outputs[0]] if outputs else []
        return mine, [_numel(mine)] * size, _per_rank(expected, size)
    if op == "allgather_coalesced":  # [[t per input] per rank], [t per input]
        outputs, mine = tensors
        return mine, [_numel(mine)] * size, _per_rank([_numel(row) for row in outputs], size)
    if op == "reduce_scatter":  # [t], [[t per rank]]
        mine, inputs = tensors
        sent = [t.numel() for t in inputs[0]] if inputs else []
        return mine, _per_rank(sent, size), [_numel(mine)] * size
    if op == "alltoall":  # [t per rank], [t per rank]
        outputs, inputs = tensors
        sent = _per_rank([t.numel() for t in inputs], size)
        return inputs, sent, _per_rank([t.numel() for t in outputs], size)
    if op == "all_to_all_single":  # output, input, output splits, input splits

        def split(t: torch.Tensor, splits: Sequence[int]) -> list[int]:
            if not splits:
                return [_even(t.numel(), size)] * size
            row = t[0].numel() if t.dim() and len(t) else 0
            return _per_rank([n * row for n in splits], size)

        output, input, out_splits, in_splits = tensors
        return [input], split(input, in_splits), split(output, out_splits)
    # all_gather_single / reduce_scatter_single and their coalesced forms: output(s), input(s)
    outputs, inputs = (_as_list(t) for t in tensors)
    if "gather" in op:
        return inputs, [_numel(inputs)] * size, [_even(_numel(outputs), size)] * size
    return inputs, [_even(_numel(inputs), size)] * size, [_numel(outputs)] * size


def _descriptor(op: str, size: int, args: tuple) -> torch.Tensor:
    """This rank's description of a collective handed to Gloo (``int64``: ``_HEAD`` fields,
    then the elements it sends to each rank and expects from each)."""
    tensors, sent, expected = _flows(op, size, args)
    opts = args[-1]
    reduce_op = getattr(opts, "reduceOp", None)
    dtype = _DTYPE_CODES.get(tensors[0].dtype, -1) if tensors else -1
    # symmetric ops: every tensor's size agrees, not only the total (hash of ints: the same
    # in every process)
    layout = hash(tuple(t.numel() for t in tensors)) if op in _SYMMETRIC else 0
    head = [_OP_CODES[op], getattr(opts, "rootRank", -1),
            -1 if reduce_op is None else _kind_of(reduce_op), dtype, layout]
    return torch.tensor(head + sent + expected, dtype=torch.int64)


def _disagreement(rows: list[list[int]]) -> str | None:
    """The first way the ranks' descriptors disagree, in words, or ``None``."""
    size = len(rows)
    for r, row in enumerate(rows):
        if row[:_HEAD] != rows[0][:_HEAD]:
            return f"rank 0 called {_describe(rows[0])} but rank {r} called {_describe(row)}"
    for r, row in enumerate(rows):
        for j in range(size):
            if row[_HEAD + j] != rows[j][_HEAD + size + r]:
                return (f"rank {r} sends {row[_HEAD + j]} elements to rank {j}, which expects "
                        f"{rows[j][_HEAD + size + r]} from it (rank {r}: {_describe(row)}; "
                        f"rank {j}: {_describe(rows[j])})")
    return None


def _describe(row: list[int]) -> str:
    """One rank's descriptor, in words."""
    op, root, reduce_kind, dtype, _ = row[:_HEAD]
    kind = str(_DTYPE_LIST[dtype]).removeprefix("torch.") if 0 <= dtype < len(_DTYPE_LIST) \
        else "no tensor"
    size = (len(row) - _HEAD) // 2
    extra = f", root {root}" if root >= 0 else ""
    if reduce_kind >= 0:
        extra += f", op {_RED(reduce_kind).name}"
    return (f"{_CHECKED_OPS[op]}({kind}{extra}, sending {row[_HEAD:_HEAD + size]}, expecting "
            f"{row[_HEAD + size:]})")


class FastcommProcessGroup(dist.ProcessGroup):
    """A torch process group whose collectives run on fastcomm communicators.

    Built by :func:`create_process_group` (torch calls it for ``init_process_group``,
    ``new_group`` and ``DeviceMesh``); see the module docstring for what runs where.

    Args:
        store: the group's c10d store (torch's prefix for it).
        rank: this process's rank in the group.
        size: the group's size.
        timeout: limit for setup and for every operation.
        group_name: the name torch gave the group.

    Attributes:
        communicator: the CPU communicator (shm, hier or Gloo).
        gloo: the ``ProcessGroupGloo`` that takes the ops the contract has no fast path for.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        group_name: str = "",
    ) -> None:
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._name = group_name
        self._c10d_store = store
        self._store = Store(
            timeout=timeout,
            rank=rank,
            _base=dist.PrefixStore("fastcomm", store),
            _root=store,
            prefix=f"{group_name}/fastcomm",
        )
        self.communicator = communicator_for(
            self._store.prefixed("cpu"), rank, size, timeout, device=torch.device("cpu")
        )
        gloo = _gloo_of(self.communicator)
        self._own_gloo = gloo is None
        if gloo is None:
            gloo = dist.ProcessGroupGloo(self._store.prefixed("gloo").torch_store, rank, size,
                                         timeout)
        self.gloo = gloo
        # torch's introspection (group._device_types, group._get_backend) finds a CPU backend
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        self._cuda: tuple[Communicator | None, Any] | None = None
        self._coalescing: list | None = None
        self._cuda_lock = threading.Lock()
        # collectives handed to Gloo whose sizes the ranks compared first, by op
        self.agreed: Counter[str] = Counter()

    # ------------------------------------------------------------------ identity
    @property
    def group_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:  # noqa: N802 - torch's name (its C++ virtual)
        return BACKEND_NAME

    def get_group_store(self) -> dist.Store:
        return self._c10d_store

    def __repr__(self) -> str:
        return (
            f"FastcommProcessGroup(rank={self._rank}, size={self._size}, "
            f"name={self._name!r}, communicator={self.communicator!r})"
        )

    def device_communicator(self, device: torch.device | str) -> Communicator | None:
        """The communicator this group runs ``device``'s tensors on: ``communicator`` for CPU;
        for CUDA the fastcomm CUDA communicator, built on first use (a collective: every member
        calls it, or issues its first CUDA operation, at the same point); ``None`` where a
        device map hands the device to a torch backend (``"cpu:fastcomm,cuda:nccl"``)."""
        kind = torch.device(device).type
        if kind == "cpu":
            return self.communicator
        if kind == "cuda":
            return self._cuda_route()[0]
        return None

    # ------------------------------------------------------------------ routing
    def _comm_for(self, tensor: torch.Tensor) -> Communicator | None:
        """The communicator for ``tensor``'s device (``None``: forward to a torch backend)."""
        if tensor.is_cpu:
            return self.communicator
        if tensor.is_cuda:
            return self._cuda_route()[0]
        return None

    def _backend_for(self, tensor: torch.Tensor | None) -> Any:
        if tensor is not None and tensor.is_cuda and self._cuda_backend_is_torch():
            return self._cuda_route()[1]
        return self.gloo

    def _cuda_backend_is_torch(self) -> bool:
        return _cuda_backend_name(self) != BACKEND_NAME

    def _cuda_route(self) -> tuple[Communicator | None, Any]:
        """``(communicator, torch backend)`` for CUDA tensors, built on first use (a collective:
        every member's first CUDA operation builds it)."""
        route = self._cuda
        if route is None:
            with self._cuda_lock:
                route = self._cuda
                if route is None:
                    route = self._cuda = self._build_cuda()
        return route

    def _build_cuda(self) -> tuple[Communicator | None, Any]:
        name = _cuda_backend_name(self)
        if name == BACKEND_NAME:
            device = torch.device("cuda", torch.cuda.current_device())
            comm = communicator_for(
                self._store.prefixed("cuda"), self._rank, self._size, self._timeout,
                device=device,
            )
            return comm, self.gloo
        if name == "gloo":
            return None, self.gloo
        if name == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            options.group_name = f"{self._name}:cuda"
            backend = dist.ProcessGroupNCCL(
                dist.PrefixStore("cuda-nccl/", self._c10d_store), self._rank, self._size,
                options,
            )
            return None, backend
        raise ValueError(
            f"rank {self._rank}: group {self._name!r} names backend {name!r} for CUDA tensors; "
            f"the fastcomm group forwards CUDA calls to fastcomm, nccl or gloo"
        )

    # ------------------------------------------------------------------ issuing
    def _issue(self, op: str, outputs: list, async_op: bool, fn, *args, post=None):
        """Runs the communicator call ``fn(*args, async_op)``: to completion on this thread
        when torch issues the call synchronously (the communicator's synchronous lane), else
        as its asynchronous work; ``post`` completes the call once the data is in place."""
        if async_op:
            work = fn(*args, True)
            if work is None and post is None:
                handle = _finished(outputs)
            else:
                handle = FastcommWork(op, self._rank, outputs, (work,) if work else (), post)
        else:
            fn(*args, False)
            if post is not None:
                post()
            handle = _finished(outputs)
        if self._coalescing is not None:
            self._coalescing.append(handle)
        return handle

    def _issue_all(self, op: str, outputs: list, async_op: bool, calls: list):
        """Several communicator calls (a coalesced op) as one work."""
        works = [fn(*args, True) for fn, *args in calls]
        handle = FastcommWork(op, self._rank, outputs, [w for w in works if w is not None])
        if not async_op:
            handle.wait()
        if self._coalescing is not None:
            self._coalescing.append(handle)
        return handle

    def _forward(self, op: str, outputs: list, tensor: torch.Tensor | None, *args,
                 peer: int | None = None) -> FastcommWork:
        """Hands the call to the torch backend beside the communicator (Gloo; for CUDA tensors
        a device map's own backend), unchanged; a collective handed to Gloo after the ranks
        agreed on its sizes (:meth:`_agree`). Its errors name this rank, the operation, the
        group and the peer of a send or receive (Gloo's own text does not say who is late)."""
        backend = self._backend_for(tensor)
        name = _BACKEND_NAMES.get(op, op)
        where = f"{backend.name()} in group {self._name!r} of {self._size} ranks"
        call = op
        op = f"{op} (through {where}{'' if peer is None else f', peer rank {peer}'})"
        if call in _OP_CODES and backend is self.gloo:
            self._agree(op, call, args)
        method = getattr(backend, name, None)
        try:
            if method is None and name in _PER_TENSOR:  # Gloo has no coalesced form of these
                method = getattr(backend, _PER_TENSOR[name])
                outs, ins, *opts = args
                works = [method(o, i, *opts) for o, i in zip(outs, ins, strict=True)]
            else:
                works = [method(*args)]
        except RuntimeError as exc:
            raise wrap_error(op, self._rank, time.monotonic(), exc) from exc
        handle = FastcommWork(op, self._rank, outputs, works)
        if self._coalescing is not None:
            self._coalescing.append(handle)
        return handle

    def _agree(self, what: str, op: str, args: tuple) -> None:
        """Compares the call's descriptor across the ranks (through the communicator, within
        the group's timeout); raises ``ValueError`` on every rank when they disagree."""
        mine = _descriptor(op, self._size, args)
        rows = mine.new_empty((self._size, mine.numel()))
        self.agreed[op] += 1
        try:
            self.communicator.all_gather(rows, mine)
        except FastcommError as exc:
            raise type(exc)(f"rank {self._rank}: {what}: comparing the ranks' sizes: {exc}") \
                from exc
        problem = _disagreement(rows.tolist())
        if problem is not None:
            raise ValueError(
                f"rank {self._rank}: {what}: the ranks' calls disagree: {problem}; every rank "
                "must issue the same collectives with sizes and dtypes that match"
            )

    def _start_coalescing(self, device: torch.device) -> None:
        self._coalescing = []

    def _end_coalescing(self, device: torch.device) -> FastcommWork:
        handles, self._coalescing = self._coalescing or [], None
        return FastcommWork("coalesced", self._rank, [], handles) if handles else _finished([])

    # ------------------------------------------------------------------ reductions
    def allreduce(self, tensors, opts=None) -> dist._Work:
        # the hot call (DDP buckets, dist.all_reduce): type checks by identity, no Enum hashing
        if tensors.__class__ is not list:
            tensors = _as_list(tensors)
        if opts.__class__ is not dist.AllreduceOptions:
            opts = _options(opts, dist.AllreduceOptions)
        if len(tensors) == 1:
            tensor = tensors[0]
            reduce_op = opts.reduceOp
            op = _OPS.get(_op_kind(reduce_op)) or _reduce_op(reduce_op)
            comm = self.communicator if tensor.is_cpu else self._comm_for(tensor)
            if comm is not None and op is not None:
                if tensor.layout is _STRIDED and tensor.dtype in _DTYPES and tensor.is_contiguous():
                    view = tensor
                elif tensor.layout is torch.sparse_coo:
                    view = tensor if op is ReduceOp.SUM else None
                else:
                    view = _reducible(tensor)
                    staged = _staged(tensor) if view is None else None
                    if staged is not None and _reducible(staged) is not None:
                        return self._issue("allreduce", tensors, opts.asyncOp, comm.all_reduce,
                                           _reducible(staged), op, post=partial(tensor.copy_,
                                                                                staged))
                if view is not None:
                    if opts.asyncOp or self._coalescing is not None:
                        return self._issue("allreduce", tensors, True, comm.all_reduce, view, op)
                    comm.all_reduce(view, op, False)
                    return _finished(tensors)
        return self._forward("allreduce", tensors, tensors[0], tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None) -> FastcommWork:
        opts = _options(opts, dist.AllreduceCoalescedOptions)
        op = _reduce_op(opts.reduceOp)
        calls = []
        for tensor in tensors:
            comm = self._comm_for(tensor)
            view = _reducible(tensor)
            if comm is None or op is None or view is None:
                return self._forward("allreduce_coalesced", tensors, tensor, tensors, opts)
            calls.append((comm.all_reduce, view, op))
        return self._issue_all("allreduce_coalesced", tensors, opts.asyncOp, calls)

    def reduce(self, tensors, opts=None) -> dist._Work:
        tensors = _as_list(tensors)
        opts = _options(opts, dist.ReduceOptions)
        if len(tensors) == 1:
            tensor = tensors[0]
            comm = self._comm_for(tensor)
            op = _reduce_op(opts.reduceOp)
            scratch = _staged(tensor)
            if op.__class__ is PremulSum:  # reduced from a scaled copy
                scratch, op = _scaled(tensor, op)
            view = _reducible(tensor if scratch is None else scratch)
            if comm is not None and op is not None and view is not None:
                # the root's result is copied back (the others' tensors are left as they were)
                post = None
                if scratch is not None and self._rank == opts.rootRank:
                    post = partial(tensor.copy_, scratch)
                return self._issue("reduce", tensors, opts.asyncOp, comm.reduce, view,
                                   opts.rootRank, op, post=post)
        return self._forward("reduce", tensors, tensors[0], tensors, opts)

    def _reduce_scatter_call(self, output, input, op):
        """``(fn, output view, input view, op)`` for one reduce-scatter, or ``None``."""
        comm = self._comm_for(input)
        if comm is None or op is None or output.dtype != input.dtype:
            return None
        input, op = _scaled(input, op)
        out_view, in_view = _reducible(output), _reducible(input)
        if out_view is None or in_view is None:
            return None
        return comm.reduce_scatter, out_view, in_view, op

    def reduce_scatter_single(self, output, input, opts=None) -> FastcommWork:
        opts = _options(opts, dist.ReduceScatterOptions)
        call = self._reduce_scatter_call(output, input, _reduce_op(opts.reduceOp))
        if call is None:
            return self._forward("reduce_scatter_single", [output], input, output, input, opts)
        return self._issue("reduce_scatter_single", [output], opts.asyncOp, *call)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> FastcommWork:
        opts = _options(opts, dist.ReduceScatterOptions)
        op = _reduce_op(opts.reduceOp)
        calls = [self._reduce_scatter_call(o, i, op) for o, i in zip(outputs, inputs, strict=True)]
        if any(call is None for call in calls):
            return self._forward("reduce_scatter_single_coalesced", outputs, inputs[0], outputs,
                                 inputs, opts)
        return self._issue_all("reduce_scatter_single_coalesced", outputs, opts.asyncOp, calls)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, output_tensors, input_tensors, opts=None) -> FastcommWork:
        opts = _options(opts, dist.ReduceScatterOptions)
        if len(output_tensors) == 1 and len(input_tensors) == 1:
            output, inputs = output_tensors[0], input_tensors[0]
            equal = len(inputs) == self._size and all(
                i.dtype == output.dtype and i.numel() == output.numel()
                and i.device == output.device for i in inputs
            )
            if equal:  # one reduce-scatter of the inputs packed end to end
                packed = torch.cat([i.reshape(-1) for i in inputs]) if inputs else output
                call = self._reduce_scatter_call(output, packed, _reduce_op(opts.reduceOp))
                if call is not None:
                    return self._issue("reduce_scatter", output_tensors, opts.asyncOp, *call)
        return self._forward("reduce_scatter", output_tensors, output_tensors[0],
                             output_tensors, input_tensors, opts)

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensors, opts=None) -> FastcommWork:
        tensors = _as_list(tensors)
        opts = _options(opts, dist.BroadcastOptions)
        if len(tensors) == 1 and opts.rootTensor == 0:
            tensor = tensors[0]
            comm = self._comm_for(tensor)
            staged = _staged(tensor)
            view = _movable(tensor if staged is None else staged)
            if comm is not None and view is not None:
                post = None if staged is None else partial(tensor.copy_, staged)
                return self._issue("broadcast", tensors, opts.asyncOp, comm.broadcast, view,
                                   opts.rootRank, post=post)
        return self._forward("broadcast", tensors, tensors[0], tensors, opts)

    def _gather_call(self, output, input):
        """``(fn, output view, input view)`` for one flat all-gather, or ``None``."""
        comm = self._comm_for(input)
        if comm is None or output.dtype != input.dtype:
            return None
        out_view, in_view = _movable(output), _movable(input)
        if out_view is None or in_view is None:
            return None
        return comm.all_gather, out_view, in_view

    def all_gather_single(self, output, input, opts=None) -> FastcommWork:
        opts = _options(opts, AllgatherOptions)
        call = self._gather_call(output, input)
        if call is None:
            return self._forward("all_gather_single", [output], input, output, input, opts)
        return self._issue("all_gather_single", [output], opts.asyncOp, *call)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> FastcommWork:
        opts = _options(opts, AllgatherOptions)
        calls = [self._gather_call(o, i) for o, i in zip(outputs, inputs, strict=True)]
        if any(call is None for call in calls):
            return self._forward("all_gather_single_coalesced", outputs, inputs[0], outputs,
                                 inputs, opts)
        return self._issue_all("all_gather_single_coalesced", outputs, opts.asyncOp, calls)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_tensors, input_tensors, opts=None) -> FastcommWork:
        opts = _options(opts, AllgatherOptions)
        if len(output_tensors) == 1 and len(input_tensors) == 1:
            input, outputs = input_tensors[0], output_tensors[0]
            comm = self._comm_for(input)
            in_view = _movable(input)
            equal = len(outputs) == self._size and all(
                o.dtype == input.dtype and o.numel() == input.numel()
                and o.device == input.device for o in outputs
            )
            if comm is not None and in_view is not None and equal:
                # one flat all-gather, rows copied out (the outputs are separate tensors)
                flat = in_view.new_empty((self._size, in_view.numel()))
                post = lambda: _copy_rows(flat, outputs, input.dtype)  # noqa: E731
                return self._issue("allgather", output_tensors, opts.asyncOp, comm.all_gather,
                                   flat, in_view, post=post)
        return self._forward("allgather", output_tensors, input_tensors[0], output_tensors,
                             input_tensors, opts)

    def all_to_all_single(
        self, output, input, output_split_sizes, input_split_sizes, opts=None
    ) -> FastcommWork:
        opts = _options(opts, dist.AllToAllOptions)
        if not output_split_sizes and not input_split_sizes:
            comm = self._comm_for(input)
            out_view, in_view = _movable(output), _movable(input)
            if (comm is not None and out_view is not None and in_view is not None
                    and output.dtype == input.dtype):
                return self._issue("all_to_all_single", [output], opts.asyncOp,
                                   comm.all_to_all, out_view, in_view)
        return self._forward("all_to_all_single", [output], input, output, input,
                             output_split_sizes, input_split_sizes, opts)

    alltoall_base = all_to_all_single

    def barrier(self, opts=None) -> FastcommWork:
        opts = _options(opts, dist.BarrierOptions)
        return self._issue("barrier", [], opts.asyncOp, self.communicator.barrier)

    # ------------------------------------------------------------------ Gloo's ops
    # No fast path in the contract: handed to Gloo (or a device map's CUDA backend) unchanged.
    def alltoall(self, output_tensors, input_tensors, opts=None) -> FastcommWork:
        opts = _options(opts, dist.AllToAllOptions)
        return self._forward("alltoall", output_tensors, input_tensors[0], output_tensors,
                             input_tensors, opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> FastcommWork:
        opts = _options(opts, AllgatherOptions)
        return self._forward("allgather_coalesced", output_lists, input_list[0], output_lists,
                             input_list, opts)

    def gather(self, output_tensors, input_tensors, opts=None) -> FastcommWork:
        opts = _options(opts, dist.GatherOptions)
        return self._forward("gather", output_tensors, input_tensors[0], output_tensors,
                             input_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts=None) -> FastcommWork:
        opts = _options(opts, dist.ScatterOptions)
        return self._forward("scatter", output_tensors, output_tensors[0], output_tensors,
                             input_tensors, opts)

    def send(self, tensors, dstRank, tag=0) -> FastcommWork:  # noqa: N803 - torch's names
        return self._forward("send", tensors, tensors[0], tensors, dstRank, tag, peer=dstRank)

    def recv(self, tensors, srcRank, tag=0) -> FastcommWork:  # noqa: N803
        return self._forward("recv", tensors, tensors[0], tensors, srcRank, tag, peer=srcRank)

    def recv_anysource(self, tensors, tag=0) -> FastcommWork:
        return self._forward("recv_anysource", tensors, tensors[0], tensors, tag)

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        """Closes the communicators and the Gloo group (``destroy_process_group``)."""
        comm, backend = self._cuda or (None, None)
        for part in (self.communicator, comm):
            if part is not None:
                part.close()
        owned = [backend] if backend is not None and backend is not self.gloo else []
        if self._own_gloo:
            owned.append(self.gloo)
        for group in owned:
            try:
                group.shutdown()
            except RuntimeError:
                pass  # already torn down by a failed peer

    abort = shutdown


def create_process_group(opts: Any, backend_options: Any = None) -> FastcommProcessGroup:
    """torch's creator for the ``fastcomm`` backend (``register_backend(extended_api=True)``).

    Args:
        opts: torch's ``_DistributedBackendOptions``: ``store``, ``group_rank``,
            ``group_size``, ``timeout``, ``group_id`` (the group's name).
        backend_options: ``pg_options`` of ``init_process_group``/``new_group`` (unused).
    """
    return FastcommProcessGroup(
        opts.store, opts.group_rank, opts.group_size, opts.timeout, group_name=opts.group_id
    )
