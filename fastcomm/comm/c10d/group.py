"""The process group of backend ``fastcomm`` (see the package docstring)."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from ..base import Communicator
from ..launch_env import LaunchEnv, LaunchEnvError, detect
from ..store import Store, as_timedelta
from ..types import SUPPORTED_DTYPES, BitwiseOp, PremulSum, ReduceOp
from ..work import SettledByWait
from ..world import communicator_for
from . import monitored
from .agree import RED, as_list, kind_of
from .compiled import never_traced
from .issue import IssueOps
from .multi import combined, copier, copy_to_all, same_tensors
from .p2p import MessageWork, P2POps, _Received
from .vcoll import VCollOps
from .works import FastcommWork, FinishedWork

BACKEND_NAME = "fastcomm"

_DTYPES = frozenset(SUPPORTED_DTYPES)
_STRIDED = torch.strided
# keyed by the enum's value: hashing and comparing pybind11 enum members is slow for a lookup
# (docs/torch_backend.md)
_OPS = {
    RED.SUM.value: ReduceOp.SUM,
    RED.AVG.value: ReduceOp.AVG,
    RED.MAX.value: ReduceOp.MAX,
    RED.MIN.value: ReduceOp.MIN,
    RED.PRODUCT.value: ReduceOp.PRODUCT,
}
_PREMUL = RED.PREMUL_SUM.value
# allreduce and reduce also take the bitwise ops and the contract's extra dtypes (bool, int16,
# unsigned); the other reductions (reduce-scatter) take _OPS on _DTYPES
_ALL_OPS = {
    **_OPS,
    RED.BAND.value: BitwiseOp.BAND,
    RED.BOR.value: BitwiseOp.BOR,
    RED.BXOR.value: BitwiseOp.BXOR,
}



# torch 2.13 hashes a ReduceOp to its kind's value, cheaper than reading `.op.value`
# (docs/torch_backend.md); used only where this process confirms it for every kind
_op_kind = (
    hash if all(hash(dist.ReduceOp(kind)) == kind.value for kind in RED.__members__.values()
                if kind is not RED.PREMUL_SUM)
    else kind_of
)


def _reduce_op(reduce_op: Any) -> ReduceOp | PremulSum | None:
    """The contract's op for torch's (``None``: the contract has none, e.g. ``BAND``)."""
    kind = kind_of(reduce_op)
    found = _OPS.get(kind)
    if found is None and kind == _PREMUL:
        factor = reduce_op.factor
        return PremulSum(factor.item() if isinstance(factor, torch.Tensor) else float(factor))
    return found


def _all_reduce_op(reduce_op: Any) -> ReduceOp | BitwiseOp | PremulSum | None:
    """:func:`_reduce_op` for ``allreduce``/``reduce``, which also take the bitwise ops."""
    found = _ALL_OPS.get(kind_of(reduce_op))
    return found if found is not None else _reduce_op(reduce_op)


def _all_reducible(t: torch.Tensor) -> torch.Tensor | None:
    """:func:`_reducible` for ``allreduce``/``reduce``, which also take the contract's extra
    dtypes: every dense real tensor goes to the communicator, which checks whether it reduces
    the dtype with the op (on every rank alike, before anything is sent)."""
    if t.layout is _STRIDED and t.is_contiguous() and not t.is_complex():
        return t  # a dtype the contract does not reduce (float8...): its TypeError, on every rank
    return _reducible(t)


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
        return tensor.detach().contiguous()
    return None


def _world_launch(rank: int, size: int) -> LaunchEnv | None:
    """The launcher's layout when this group is the job's world (torch's default group, built
    before ``dist.is_initialized()``), for :func:`communicator_for` to check across ranks."""
    if dist.is_initialized():
        return None
    try:
        launch = detect()
    except LaunchEnvError:  # the group was numbered by its caller, not by these variables
        return None
    return launch if (launch.rank, launch.world_size) == (rank, size) else None


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



def _scaled(tensor: torch.Tensor, op: ReduceOp | PremulSum) -> tuple[torch.Tensor, ReduceOp]:
    """A reduction other than ``all_reduce`` given a ``PremulSum``: a scaled copy and ``SUM``
    (the input is left as it was, as NCCL leaves it)."""
    if op.__class__ is PremulSum:
        return tensor.detach() * op.factor, ReduceOp.SUM
    return tensor, op


def _copy_rows(flat: torch.Tensor, outputs: list, dtype: torch.dtype) -> None:
    """Copies row ``i`` of the gathered ``flat`` into ``outputs[i]`` (its dtype and shape)."""
    for row, out in zip(flat, outputs, strict=True):
        out.detach().copy_(row.view(dtype).view(out.shape))


class FastcommProcessGroup(VCollOps, P2POps, IssueOps, dist.ProcessGroup):
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
        self._monitored_seq = 0  # monitored barriers called on this group
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
            self._store.prefixed("cpu"), rank, size, timeout, device=torch.device("cpu"),
            launch=_world_launch(rank, size),
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
        self._mailboxes = None  # the communicator's tagged send/recv engine (P2POps), or False
        self._lane = None  # the engine's compiled usual send and recv (P2POps), once built
        self._last_received = None  # the handle of a finished receive, reused (P2POps)
        self._cuda_lock = threading.Lock()
        # collectives handed to Gloo whose sizes the ranks compared first, by op
        self.agreed: Counter[str] = Counter()

    # ------------------------------------------------------------------ identity
    @property
    def group_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:  # noqa: N802 - torch's name (its C++ virtual)
        return BACKEND_NAME

    # torch's Python wrappers ask the group for these on every call (dist.gather, scatter, send):
    # the C++ getters release the GIL each time, about a microsecond; these are the same ints
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    def size(self) -> int:
        """The group's size."""
        return self._size

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

    # ------------------------------------------------------------------ reductions
    def allreduce(self, tensors, opts=None) -> dist._Work:
        # the hot call (DDP buckets, dist.all_reduce): type checks by identity, no Enum hashing
        if tensors.__class__ is not list:
            tensors = as_list(tensors)
        if opts.__class__ is not dist.AllreduceOptions:
            opts = _options(opts, dist.AllreduceOptions)
        if len(tensors) == 1:
            tensor = tensors[0]
            reduce_op = opts.reduceOp
            op = _OPS.get(_op_kind(reduce_op)) or _all_reduce_op(reduce_op)
            comm = self.communicator if tensor.is_cpu else self._comm_for(tensor)
            if comm is not None and op is not None:
                if tensor.layout is _STRIDED and tensor.dtype in _DTYPES and tensor.is_contiguous():
                    view = tensor
                elif tensor.layout is torch.sparse_coo:
                    view = tensor if op is ReduceOp.SUM else None
                else:
                    view = _all_reducible(tensor)
                    staged = _staged(tensor) if view is None else None
                    if staged is not None and _all_reducible(staged) is not None:
                        return self._issue("allreduce", tensors, opts.asyncOp, comm.all_reduce,
                                           _all_reducible(staged), op,
                                           post=copier(tensor, staged))
                if view is not None:
                    if opts.asyncOp or self._coalescing is not None:
                        return self._issue("allreduce", tensors, True, comm.all_reduce, view, op)
                    comm.all_reduce(view, op, False)
                    return self._done(tensors)
        elif tensors:
            handle = self._many("allreduce", tensors, opts, -1)
            if handle is not None:
                return handle
        return self._forward("allreduce", tensors, tensors[0], tensors, opts)

    def _many(self, what: str, tensors: list, opts, root: int) -> dist._Work | None:
        """``allreduce`` (``root`` -1) or ``reduce`` of several tensors in one call, as one
        work: every tensor of every rank reduced (Gloo's multi-tensor ``allreduce``), this
        rank's in list order first, then across the ranks on the communicator; the result is
        written into every tensor (``reduce``: the root's ``tensors[opts.rootTensor]``).
        ``None`` where the communicator cannot take it (a torch backend's device)."""
        same_tensors(self._rank, what, tensors)
        comm = self._comm_for(tensors[0])
        op = _all_reduce_op(opts.reduceOp)
        if comm is None or op is None or tensors[0].layout is not _STRIDED:
            return None
        scratch = combined(tensors, op)
        view = _all_reducible(scratch)
        if view is None:
            return None
        if root < 0:
            return self._issue(what, tensors, opts.asyncOp, comm.all_reduce, view, op,
                               post=partial(copy_to_all, scratch, tensors))
        if not 0 <= opts.rootTensor < len(tensors):
            raise ValueError(f"rank {self._rank}: reduce: rootTensor {opts.rootTensor} out of "
                             f"range for {len(tensors)} tensors")
        if op.__class__ is PremulSum:
            scratch, op = _scaled(scratch, op)
            view = _all_reducible(scratch)
        post = copier(tensors[opts.rootTensor], scratch) if self._rank == root else None
        return self._issue(what, tensors, opts.asyncOp, comm.reduce, view, root, op, post=post)

    def allreduce_coalesced(self, tensors, opts=None) -> FastcommWork:
        opts = _options(opts, dist.AllreduceCoalescedOptions)
        op = _all_reduce_op(opts.reduceOp)
        calls = []
        for tensor in tensors:
            comm = self._comm_for(tensor)
            view = _all_reducible(tensor)
            if comm is None or op is None or view is None:
                return self._forward("allreduce_coalesced", tensors, tensor, tensors, opts)
            calls.append((comm.all_reduce, view, op))
        return self._issue_all("allreduce_coalesced", tensors, opts.asyncOp, calls)

    def reduce(self, tensors, opts=None) -> dist._Work:
        tensors = as_list(tensors)
        opts = _options(opts, dist.ReduceOptions)
        if len(tensors) == 1:
            tensor = tensors[0]
            comm = self._comm_for(tensor)
            op = _all_reduce_op(opts.reduceOp)
            if tensor.is_complex() and op not in (ReduceOp.SUM, ReduceOp.AVG, None) \
                    and op.__class__ is not PremulSum:  # Gloo's refusal, without Gloo
                raise ValueError(f"reduce does not support {op.name} on complex tensors")
            scratch = _staged(tensor)
            if op.__class__ is PremulSum:  # reduced from a scaled copy
                scratch, op = _scaled(tensor, op)
            view = _all_reducible(tensor if scratch is None else scratch)
            if comm is not None and op is not None and view is not None:
                # the root's result is copied back (the others' tensors are left as they were)
                post = None
                if scratch is not None and self._rank == opts.rootRank:
                    post = copier(tensor, scratch)
                return self._issue("reduce", tensors, opts.asyncOp, comm.reduce, view,
                                   opts.rootRank, op, post=post)
        elif tensors:
            handle = self._many("reduce", tensors, opts, opts.rootRank)
            if handle is not None:
                return handle
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
        return self._coalesced("reduce_scatter_single_coalesced", outputs, inputs, opts, calls)

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
        return self._reduce_scatter_v(output_tensors, input_tensors,
                                      _reduce_op(opts.reduceOp), opts)

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensors, opts=None) -> FastcommWork:
        tensors = as_list(tensors)
        opts = _options(opts, dist.BroadcastOptions)
        if len(tensors) == 1 and opts.rootTensor == 0:
            tensor = tensors[0]
            comm = self._comm_for(tensor)
            staged = _staged(tensor)
            view = _movable(tensor if staged is None else staged)
            if comm is not None and view is not None:
                post = None if staged is None else copier(tensor, staged)
                return self._issue("broadcast", tensors, opts.asyncOp, comm.broadcast, view,
                                   opts.rootRank, post=post)
        elif tensors:
            handle = self._broadcast_many(tensors, opts)
            if handle is not None:
                return handle
        return self._forward("broadcast", tensors, tensors[0], tensors, opts)

    def _broadcast_many(self, tensors: list, opts) -> dist._Work | None:
        """``broadcast`` with several tensors (or a ``rootTensor`` other than 0), as one work:
        the root's ``tensors[opts.rootTensor]`` into every tensor of every rank (Gloo's
        semantics). ``None`` where the communicator cannot take it."""
        same_tensors(self._rank, "broadcast", tensors)
        if not 0 <= opts.rootTensor < len(tensors):
            raise ValueError(f"rank {self._rank}: broadcast: rootTensor {opts.rootTensor} out of "
                             f"range for {len(tensors)} tensors")
        source = tensors[opts.rootTensor if self._rank == opts.rootRank else 0]
        comm = self._comm_for(source)
        if comm is None or source.layout is not _STRIDED:
            return None
        scratch = source.detach().contiguous().clone()
        view = _movable(scratch)
        return self._issue("broadcast", tensors, opts.asyncOp, comm.broadcast, view,
                           opts.rootRank, post=partial(copy_to_all, scratch, tensors))

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
        return self._coalesced("all_gather_single_coalesced", outputs, inputs, opts, calls)

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
        return self._allgather_v(output_tensors, input_tensors, opts)

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
        return self._all_to_all_split(output, input, output_split_sizes, input_split_sizes, opts)

    alltoall_base = all_to_all_single

    def barrier(self, opts=None) -> FastcommWork:
        opts = _options(opts, dist.BarrierOptions)
        return self._issue("barrier", [], opts.asyncOp, self.communicator.barrier)

    def monitored_barrier(self, timeout: timedelta | float | None = None,
                          wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not reach it within ``timeout`` (torch's
        ``dist.monitored_barrier``, which refuses this backend by name; see
        :func:`~.monitored.monitored_barrier`).

        Raises:
            CommTimeoutError: naming the ranks that did not arrive (or rank 0, on the ranks
                that waited for its verdict).
        """
        try:
            timeout = as_timedelta(timeout, self._timeout)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"monitored_barrier: {exc}") from None
        # numbered per group, the same on every rank that calls
        self._monitored_seq += 1
        monitored.run(self._c10d_store, self._rank, self._size, self._monitored_seq, timeout,
                      wait_all_ranks, f"group {self._name!r} of {self._size} ranks")

    # ------------------------------------------------------------------ Gloo's ops
    # No fast path in the contract: handed to Gloo (or a device map's CUDA backend) unchanged.
    # (gather, scatter, alltoall, allgather_coalesced and the unequal sizes: VCollOps.)

    # ------------------------------------------------------------------ point to point
    # On shm: the communicator's tagged engine; else handed to Gloo (P2POps, p2p.py).

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


def monitored_barrier(
    group: Any = None, timeout: timedelta | float | None = None, wait_all_ranks: bool = False
) -> None:
    """A barrier that names the ranks that did not reach it within ``timeout`` (torch's
    ``dist.monitored_barrier``, for groups of the ``fastcomm`` backend; any other group is
    handed to torch's own).

    Args:
        group: the process group (``None``: the default group).
        timeout: how long rank 0 waits for the others (``timedelta`` or seconds; ``None``: the
            group's timeout).
        wait_all_ranks: collect every missing rank instead of stopping at the first.

    Raises:
        CommTimeoutError: some rank did not arrive (named, with the elapsed time), or rank 0
            never gave its verdict (on the ranks waiting for it).
        ValueError: ``timeout`` is not positive.
    """
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    if not isinstance(pg, FastcommProcessGroup):
        return dist.monitored_barrier(group, timeout, wait_all_ranks)
    return pg.monitored_barrier(timeout, wait_all_ranks)


# torch calls these from regions Dynamo compiles: run eagerly, as a C++ backend does
never_traced(FastcommProcessGroup, VCollOps, P2POps, IssueOps, FastcommWork, SettledByWait,
             FinishedWork, MessageWork, _Received)


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
