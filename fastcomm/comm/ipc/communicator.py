"""``ipc`` communicator: kernel collectives between the ranks of one node.

It composes what ``fastcomm.comm.world`` builds for it (this package imports no other backend).
CPU tensors: a shared-memory communicator (``cpu``) whose every reduction is the Triton kernel
:func:`fastcomm.kernels.peer_reduce` (:func:`cpu_reduction`, :func:`kernel_reduce`) over the
peers' slots as this process mapped them; its torch reference (:func:`reference_reduce`) unless
``FASTCOMM_KERNELS=triton``, read when the communicator is built. Numerics are the kernel's:
fp32 accumulation, one rounding, ``AVG`` scaled in the same pass; ``PRODUCT``, integer dtypes
and more than 16 ranks take the shm schedules' torch reduction.

CUDA tensors: ``all_reduce`` (sum/avg/max/min of fp32/fp16/bf16) and DDP bucket regions go to
``cuda.CudaIpcTransport``, built and imported on the first such call (no CuPy without CUDA).
Where some rank cannot build it, every rank logs one line and takes the Gloo fallback (the ranks
agree through the store); every other CUDA op goes to Gloo, as on ``shm``. See ``docs/ipc.md``.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch

from ...kernels._launch import fp32_scale, kernel_backend
from ...kernels._peer_reduce import MAX_PEERS, PEER_DTYPES, peer_reduce, reduce_unchecked
from ..base import Communicator
from ..reduction import Reduction, torch_reduce
from ..store import Store
from ..types import Capabilities, ReduceOp
from ..work import Task, Work

__all__ = ["IpcCommunicator", "cpu_reduction", "kernel_reduce", "reference_reduce"]

logger = logging.getLogger("fastcomm")

#: dtypes the CUDA transport reduces (others, and PRODUCT, take Gloo on every rank alike)
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# by the member's name: an Enum member hashes through a Python-level __hash__
_KERNEL_OPS = {"SUM": "sum", "AVG": "avg", "MAX": "max", "MIN": "min"}


def _kernel_op(out: torch.Tensor, terms: list[torch.Tensor], op: ReduceOp) -> str | None:
    """``peer_reduce``'s name for ``op`` when the kernel covers the case, else ``None``
    (``PRODUCT``, non-float dtypes, more than ``MAX_PEERS`` terms): decided from the op, the
    dtype and the world size only, so every rank decides alike."""
    name = _KERNEL_OPS.get(op._name_)
    if name is None or out.dtype not in PEER_DTYPES or len(terms) > MAX_PEERS:
        return None
    return name


def kernel_reduce(out: torch.Tensor, terms: list[torch.Tensor], op: ReduceOp) -> None:
    """The schedules' reduction as one :func:`~fastcomm.kernels.peer_reduce` launch.

    ``srcs`` are ``terms`` in rank order (views of the slots in this process's mapping, and
    this rank's own tensor where a schedule reads it in place), ``dsts`` is ``[out]``. Cases
    the kernel does not cover take :func:`~fastcomm.comm.reduction.torch_reduce`.
    """
    name = _kernel_op(out, terms, op)
    if name is None:
        torch_reduce(out, terms, op)
    else:
        peer_reduce(terms, (out,), op=name)


def reference_reduce(out: torch.Tensor, terms: list[torch.Tensor], op: ReduceOp) -> None:
    """:func:`kernel_reduce` computed as ``peer_reduce_reference`` computes it, bit for bit,
    without its per-call argument checks (which would double the cost of a 4 KiB all-reduce):
    the schedules hand it valid operands (``out`` may alias ``terms[0]`` or ``terms[1]``)."""
    name = _kernel_op(out, terms, op)
    if name is None:
        torch_reduce(out, terms, op)
        return
    scale = fp32_scale(1.0 / len(terms)) if name == "avg" else 1.0
    reduce_unchecked(terms, [out], name, scale)


def cpu_reduction() -> Reduction:
    """The reduction of an ipc communicator on CPU tensors: :func:`kernel_reduce` where
    ``fastcomm.kernels`` runs Triton for CPU tensors (``FASTCOMM_KERNELS=triton``: the
    interpreter), else :func:`reference_reduce`. Read once, when a communicator is built (the
    per-call check would cost as much as a 4 KiB reduction).

    Raises:
        RuntimeError, ValueError: ``FASTCOMM_KERNELS`` asks for what cannot run here.
    """
    return kernel_reduce if kernel_backend(torch.device("cpu")) == "triton" else reference_reduce


class IpcCommunicator(Communicator):
    """Kernel collectives for ranks on one node (see the module docstring).

    Args:
        store: a store namespace private to this communicator.
        rank: this process's rank.
        size: number of ranks (all on this node).
        timeout: limit for setup and for every operation.
        cpu: the shared-memory communicator over the same ranks, built with
            :func:`cpu_reduction` as its reduction: it moves every CPU tensor.
        fallback: the communicator (Gloo) of every CUDA op but ``all_reduce``, and of
            ``all_reduce`` too where the CUDA transport cannot be built or reduce the tensor
            (``None``: those raise).

    Raises:
        RuntimeError: ``FASTCOMM_KERNELS=triton`` but Triton cannot run on CPU tensors here
            (checked by :func:`cpu_reduction`, which the builder calls first).
    """

    backend = "ipc"

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float | timedelta | None = None,
        *,
        cpu: Communicator,
        fallback: Communicator | None = None,
    ) -> None:
        super().__init__(store, rank, size, timeout, fallback=fallback)
        if (cpu.rank, cpu.size) != (rank, size):
            raise ValueError(f"cpu must span the same ranks, got rank {cpu.rank} of {cpu.size}")
        self.cpu = cpu
        # CPU tensors through `cpu`; CUDA all_reduce here (the transport, or the fallback for
        # what it lacks); both reduce in rank order, so the results are layout free
        self.capabilities = Capabilities(
            all_reduce_devices=frozenset({"cuda"}), layout_free=True,
            in_place=cpu.capabilities.in_place,
            shared_buckets=frozenset({"cuda"}) | cpu.capabilities.shared_buckets,
        )
        self._aborted: BaseException | None = None
        self._loss_grace = 0.0
        self._cuda = None  # the CUDA transport, once built
        self._cuda_device: torch.device | None = None
        self._cuda_tried = False
        self._pid = os.getpid()

    @property
    def device(self) -> torch.device:
        """CPU: the tensors this communicator moves through shared memory."""
        return torch.device("cpu")

    @property
    def loss_grace(self) -> float:
        """Non-zero once in-place recovery watches the peers: the CUDA transport's ``wait()``
        then blocks the host, so a lost peer's abort is seen before the step goes on."""
        return self._loss_grace

    @loss_grace.setter
    def loss_grace(self, seconds: float) -> None:
        self._loss_grace = seconds
        if self._cuda is not None:
            self._cuda.host_waits = seconds > 0

    @classmethod
    def for_new_members(
        cls, store: Store, rank: int, size: int, timeout: timedelta, *,
        old: Communicator | None = None, spans_hosts: bool = False,
    ) -> Communicator:
        """ipc over new members, with its Gloo fallback (its CUDA ops but ``all_reduce`` take
        it) on every member alike."""
        from ..world import new_communicator  # world imports every backend

        return new_communicator(
            cls.backend, store=store, rank=rank, size=size, timeout=timeout, fallback=True
        )

    @property
    def cuda_transport(self):
        """The CUDA IPC transport of ``all_reduce`` (``None`` before the first CUDA
        ``all_reduce`` or where it could not be built)."""
        return self._cuda

    # ------------------------------------------------------------------ CPU: the shm part
    # Every op but a CUDA all_reduce is the shm part's, blocking calls on its lane included;
    # the v-calls are the contract's defaults over these.
    def _impl_reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp,
                     blocking: bool = False) -> Task | None:
        return self.cpu._impl_reduce(tensor, root, op, blocking)

    def _impl_broadcast(self, tensor: torch.Tensor, src: int,
                        blocking: bool = False) -> Task | None:
        return self.cpu._impl_broadcast(tensor, src, blocking)

    def _impl_all_gather(self, output: torch.Tensor, input: torch.Tensor,
                         blocking: bool = False) -> Task | None:
        return self.cpu._impl_all_gather(output, input, blocking)

    def _impl_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                             blocking: bool = False) -> Task | None:
        return self.cpu._impl_reduce_scatter(output, input, op, blocking)

    def _impl_all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                         blocking: bool = False) -> Task | None:
        return self.cpu._impl_all_to_all(output, input, blocking)

    def _impl_send(self, tensor: torch.Tensor, dst: int, blocking: bool = False) -> Task | None:
        return self.cpu._impl_send(tensor, dst, blocking)

    def _impl_recv(self, tensor: torch.Tensor, src: int, blocking: bool = False) -> Task | None:
        return self.cpu._impl_recv(tensor, src, blocking)

    def _impl_barrier(self, blocking: bool = False) -> Task | None:
        return self.cpu._impl_barrier(blocking)

    # ------------------------------------------------------------------ CUDA all_reduce
    def _cuda_route(self, device: torch.device):
        """The CUDA transport for ``device``, built on first use (``None``: use Gloo)."""
        if not self._cuda_tried:
            self._cuda_tried = True
            self._cuda = self._build_cuda(device)
            self._cuda_device = device
            self.loss_grace = self._loss_grace  # passed on to the transport
        if self._cuda is not None and device != self._cuda_device:
            raise ValueError(
                f"{self._where()}: its CUDA transport lives on {self._cuda_device}, got a tensor "
                f"on {device}; keep every CUDA tensor of this communicator on one device"
            )
        return self._cuda

    def _build_cuda(self, device: torch.device):
        """Builds the transport where every rank can; otherwise logs why and returns ``None``.

        Two store rounds, once per communicator: first whether the module imports on every
        rank (so no rank enters the transport's setup exchange while a peer never will), then
        whether every rank built it (so all ranks take the same route).
        """
        timeout = self.timeout
        why = None
        try:
            from .cuda import CudaIpcTransport  # CuPy loads only here
        except Exception as exc:  # noqa: BLE001 - any import failure means "use Gloo"
            why = f"import failed: {type(exc).__name__}: {exc}"
        whys = self.store.all_gather_object("ipc/cuda-import", self.rank, self.size, why, timeout)
        transport = None
        if not any(whys):
            try:
                transport = CudaIpcTransport(
                    self.store.prefixed("ipc-cuda"), self.rank, self.size, timeout, device
                )
            except Exception as exc:  # noqa: BLE001 - reported below, then Gloo
                why = f"setup failed: {type(exc).__name__}: {exc}"
            whys = self.store.all_gather_object(
                "ipc/cuda-built", self.rank, self.size, why, timeout
            )
        failed = {r: w for r, w in enumerate(whys) if w}
        if not failed:
            return transport
        if transport is not None:
            try:
                transport.close()
            except Exception:  # noqa: BLE001 - the warning below says why it is not used
                pass
        logger.warning(
            "%s: the CUDA IPC transport is unavailable (%s); CUDA all_reduce goes through "
            "the Gloo fallback", self._where(),
            "; ".join(f"rank {r}: {w}" for r, w in sorted(failed.items())),
        )
        return None

    def _impl_all_reduce(self, tensor: torch.Tensor, op: ReduceOp,
                         blocking: bool = False) -> Task | None:
        if tensor.device.type != "cuda":
            return self.cpu._impl_all_reduce(tensor, op, blocking)
        transport = None
        if tensor.dtype in _CUDA_DTYPES and op._name_ in _KERNEL_OPS:
            transport = self._cuda_route(tensor.device)
        if transport is None:
            if self.fallback is None:
                raise ValueError(
                    f"{self._where()}: no route for a CUDA all_reduce of {tensor.dtype} "
                    f"({op.name}): the CUDA transport does not take it and there is no fallback"
                )
            return self.fallback._impl_all_reduce(tensor, op, blocking)

        def enqueue() -> Work:
            work = transport.all_reduce(tensor, op)  # enqueued in the caller's stream order
            if work is not None:
                return work
            # done in stream order: a future's consumer syncs with the current stream
            return Work("all_reduce", self.rank, tensor, devices=[tensor.device], completed=True)

        return Task("all_reduce", tensor, enqueue)  # issued at once: the stream orders it

    # ------------------------------------------------------------------ shared DDP buckets
    def bucket_region(
        self, area_bytes: int, max_buckets: int, cap_bytes: int | None = None,
        device: torch.device | str = "cpu",
    ):
        """DDP bucket memory the peers map, all-reduced in place (``capabilities.
        shared_buckets``; a collective: every rank calls it alike).

        CUDA: a :class:`~.cuda_region.CudaBucketRegion` of the CUDA transport (built here on first
        use), reduced by the ``peer_reduce`` kernel out of the peers' areas. CPU: the shared-
        memory communicator's region.

        Args:
            area_bytes: bytes of buckets per rank.
            max_buckets: the most buckets it will hold.
            cap_bytes: the most bytes of memory it may take per rank (``None``: no cap).
            device: the device of the buckets (one CUDA device per communicator).

        Returns:
            The region, or on every rank the reason it was not made (no CUDA transport, over
            the cap, out of memory): the caller keeps its own buffers.
        """
        device = torch.device(device)
        if device.type == "cpu":
            return self.cpu.bucket_region(area_bytes, max_buckets, cap_bytes)
        if device.type != "cuda":
            raise ValueError(f"{self._where()}: bucket memory on cpu or cuda, got {device}")
        self._check_open("bucket_region")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        transport = self._cuda_route(device)
        if transport is None:
            return "the CUDA IPC transport is unavailable here (see the warning above)"
        region = transport.bucket_region(area_bytes, max_buckets, cap_bytes)
        if not isinstance(region, str):
            region.comm_stats = self.stats  # the buckets' bytes count among this one's
        return region

    # ------------------------------------------------------------------ lifetime
    def abort(self, error: BaseException) -> None:
        """From any thread (a lost rank): every part is aborted (the shm part marks this rank
        aborted, the CUDA transport stops its barriers, the Gloo fallback's waits stop), so
        pending and later calls raise ``CommAbortedError``; :meth:`close` follows."""
        self._abort_parts(error, (self._cuda, self.cpu, self.fallback))

    def _new_child(self, store: Store, rank: int, size: int, timeout: timedelta):
        raise TypeError(
            "an ipc communicator's sub-communicators are built by fastcomm.comm.world "
            "(make_child); build this one with fastcomm.comm.new_communicator('ipc', ...)"
        )

    def _impl_close(self) -> None:
        if self._cuda is not None and os.getpid() == self._pid:  # not a fork()ed child's
            self._cuda.close()
            self._cuda = None
        super()._impl_close()
        self.cpu.close()
