"""NCCL communicator through CuPy's ``cupy.cuda.nccl`` bindings.

Stream and pointer plumbing only; argument checks live in ``Communicator`` and are tested on CPU.
What does not change per call (device, stream handle, dtype and op codes, the communicator
handle, a reusable event) is looked up once, in ``__init__``.

Invariants: every collective runs on ``self.stream``, which first waits on the caller's current
stream; each call returns an :class:`~fastcomm.comm.stream.EventWork` that the
:class:`~fastcomm.comm.stream.StreamWatchdog` keeps (with its tensors) until its event
completes, so no ``record_stream``; a collective past the timeout aborts the NCCL communicator
(``ncclCommAbort``) and fails every pending ``Work``, and so does :meth:`NcclCommunicator.abort`
(a lost rank, from in-place recovery's liveness watch: a NCCL kernel waiting on a dead peer
spins forever); an aborted communicator refuses later calls and closes without waiting.

Never run on a GPU in this project's CI (no GPU there): see docs/environments.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial

import torch

from .base import Communicator
from .errors import CommAbortedError, CommTimeoutError, FastcommError
from .graph_lane import GraphLane
from .store import Store
from .stream import EventWork, StreamWatchdog
from .types import Capabilities, ReduceOp
from .work import Task

__all__ = ["NcclCommunicator", "cupy_nccl", "decode_nccl_version", "nccl_version"]


def cupy_nccl():
    """CuPy's NCCL module, or ``None`` when CuPy or libnccl is missing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl  # optional dependency: CPU-only installs never load it
    except Exception:  # ImportError, or CUDA runtime errors on import
        return None
    return nccl if hasattr(nccl, "NcclCommunicator") else None


def decode_nccl_version(code: int) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of ``ncclGetVersion``'s integer.

    NCCL encodes ``major*10000 + minor*100 + patch`` since 2.9 and ``major*1000 + minor*100 +
    patch`` before (``NCCL_VERSION_CODE``).
    """
    if code >= 20900:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def nccl_version() -> tuple[int, int, int] | None:
    """The version of the libnccl that CuPy loaded (the one fastcomm's NCCL backend calls),
    read from the library itself with ``ncclGetVersion``; ``None`` when it cannot be loaded.

    torch may bundle a different NCCL than CuPy loads, so torch's number is not used.
    """
    nccl = cupy_nccl()
    if nccl is None:
        return None
    try:
        return decode_nccl_version(int(nccl.get_version()))
    except Exception:  # a libnccl without ncclGetVersion, or a CUDA error while loading it
        return None


#: The NCCL constant (an attribute of CuPy's ``nccl`` module) of each dtype NCCL moves.
NCCL_DTYPE_NAMES = {
    torch.float16: "NCCL_FLOAT16",
    torch.bfloat16: "NCCL_BFLOAT16",
    torch.float32: "NCCL_FLOAT32",
    torch.float64: "NCCL_FLOAT64",
    torch.int8: "NCCL_INT8",
    torch.uint8: "NCCL_UINT8",
    torch.int32: "NCCL_INT32",
    torch.int64: "NCCL_INT64",
}

#: The NCCL constant of each reduction.
NCCL_OP_NAMES = {
    ReduceOp.SUM: "NCCL_SUM",
    ReduceOp.AVG: "NCCL_AVG",
    ReduceOp.MAX: "NCCL_MAX",
    ReduceOp.MIN: "NCCL_MIN",
    ReduceOp.PRODUCT: "NCCL_PROD",
}


def nccl_tables(nccl) -> tuple[dict[torch.dtype, int], dict[ReduceOp, int]]:
    """The dtype and op codes of `nccl` (CuPy's module), built once per communicator."""
    dtypes = {d: getattr(nccl, name) for d, name in NCCL_DTYPE_NAMES.items()}
    ops = {op: getattr(nccl, name) for op, name in NCCL_OP_NAMES.items()}
    return dtypes, ops


def dtype_code(table: dict[torch.dtype, int], dtype: torch.dtype) -> int:
    """`dtype`'s code in `table`.

    Raises:
        TypeError: NCCL does not move `dtype` (the message lists what it moves).
    """
    code = table.get(dtype)
    if code is None:
        allowed = ", ".join(str(d) for d in table)
        raise TypeError(f"NCCL cannot move dtype {dtype}; allowed: {allowed}")
    return code


def nccl_dtype(nccl, dtype: torch.dtype) -> int:
    """`dtype`'s NCCL code (raises TypeError for a dtype NCCL does not move)."""
    return dtype_code(nccl_tables(nccl)[0], dtype)


def nccl_op(nccl, op: ReduceOp) -> int:
    """`op`'s NCCL code."""
    return nccl_tables(nccl)[1][op]


class NcclCommunicator(Communicator):
    """Collectives on CUDA tensors with NCCL (one device per rank).

    Args:
        store: a store namespace private to this communicator; rank 0 publishes the NCCL
            unique id there.
        rank: this process's rank.
        size: number of ranks.
        timeout: limit for every collective (enforced by the watchdog).
        device: CUDA device index or ``torch.device`` (default: the current device).

    Raises:
        RuntimeError: CuPy's NCCL bindings or CUDA are missing.
    """

    backend = "nccl"

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float | timedelta | None = None,
        *,
        device: torch.device | int | None = None,
        _nccl_comm=None,
    ) -> None:
        super().__init__(store, rank, size, timeout)
        nccl = cupy_nccl()
        if nccl is None or not torch.cuda.is_available():
            raise RuntimeError(
                "the nccl backend needs CUDA and CuPy with libnccl "
                "(pip install 'fastcomm[cuda12]'); use backend='gloo' on CPU"
            )
        import cupy  # optional (the cuda extra): loaded only where an NCCL communicator is built

        self._nccl = nccl
        if device is None:
            device = torch.cuda.current_device()
        self._device = torch.device("cuda", device if isinstance(device, int) else device.index)
        present = torch.cuda.device_count()
        if self._device.index is not None and not 0 <= self._device.index < present:
            # checked before the unique id is exchanged: CUDA would only say "invalid device
            # ordinal" from inside NCCL's setup
            raise RuntimeError(
                f"rank {rank}: the nccl backend was given CUDA device {self._device.index}, but "
                f"this process sees {present} CUDA device(s) (0..{present - 1})"
            )
        if _nccl_comm is None:
            uid = store.broadcast_object(
                "nccl_unique_id",
                nccl.get_unique_id() if rank == 0 else None,
                is_source=rank == 0,
                timeout=self.timeout,
            )
            with cupy.cuda.Device(self._device.index):
                _nccl_comm = nccl.NcclCommunicator(size, uid, rank)
        self._comm = _nccl_comm
        self._index = self._device.index
        self._dtypes, self._ops = nccl_tables(nccl)
        self.stream = torch.cuda.Stream(self._device)
        self._stream_handle = self.stream.cuda_stream
        self._future_stream = torch.cuda.Stream(self._device)
        self._caller_ready = torch.cuda.Event()  # re-recorded on the caller's stream per call
        self._watchdog = StreamWatchdog(
            f"fastcomm-nccl-watchdog-r{rank}", self.timeout.total_seconds(), 0.05, self._stuck
        )
        self._aborted: BaseException | None = None
        self.loss_grace = 0.0
        """Non-zero once in-place recovery watches the peers: ``wait()`` then blocks the host
        until the collective is done, so a lost peer's abort is seen before the step goes on."""
        # CUDA tensors of its own device (`moves`); two-term sums are layout free (NCCL's
        # rings and trees order more terms by their position)
        self.capabilities = Capabilities(
            devices=frozenset({"cuda"}), layout_free=size <= 2, graph_all_reduce=True,
            shrinks_across_hosts=True,
        )
        self._graph_lane: GraphLane | None = None

    @property
    def device(self) -> torch.device:
        """This rank's CUDA device."""
        return self._device

    def moves(self, device: torch.device, op: str | None = None) -> bool:
        return device == self._device

    @classmethod
    def for_new_members(
        cls, store: Store, rank: int, size: int, timeout: timedelta, *,
        old: Communicator | None = None, spans_hosts: bool = False,
    ) -> Communicator:
        """NCCL over new members: a fresh unique id, on ``old``'s GPU (a rank that joins them:
        the current device)."""
        from .world import new_communicator  # world imports every backend

        return new_communicator(
            cls.backend, store=store, rank=rank, size=size, timeout=timeout,
            device=None if old is None else old.device,
        )

    # ------------------------------------------------------------------ plumbing
    def _enqueue(
        self,
        op: str,
        output: torch.Tensor | None,
        keep: tuple[torch.Tensor, ...],
        launch: Callable[[int], None],
    ) -> EventWork:
        watchdog = self._watchdog
        with watchdog.lock:  # one (wait on the caller, launch, record) sequence at a time
            if watchdog.error is not None:  # under the lock: abort() holds it to set it
                raise self._refused(op)
            ready = self._caller_ready
            ready.record(torch.cuda.current_stream(self._index))
            self.stream.wait_event(ready)  # waits on the record made just now
            try:
                launch(self._stream_handle)
            except self._nccl.NcclError as exc:
                raise FastcommError(f"rank {self.rank}: {op} failed: {exc}") from exc
            event = torch.cuda.Event()
            event.record(self.stream)
            work = EventWork(op, self.rank, output, self._device, event, keep,
                             self._future_stream)
            work.host_waits = self.loss_grace > 0
            watchdog.track(work)
        return work

    def graph_lane(self) -> GraphLane:
        """This communicator's all-reduce inside CUDA graphs (``capabilities.graph_all_reduce``,
        see :mod:`fastcomm.comm.graph_lane`): made once."""
        if self._graph_lane is None:
            self._graph_lane = GraphLane(
                self,
                stream=self.stream,
                watchdog=self._watchdog,
                future_stream=self._future_stream,
                enqueue=self._enqueue_raw_all_reduce,
                refused=self._refused,
            )
        return self._graph_lane

    def _enqueue_raw_all_reduce(self, tensor: torch.Tensor, op: ReduceOp, stream: int) -> None:
        """NCCL's all-reduce of `tensor` on the raw `stream`, nothing else (a capture's)."""
        dt, red = dtype_code(self._dtypes, tensor.dtype), self._ops[op]
        ptr = tensor.data_ptr()
        try:
            self._comm.allReduce(ptr, ptr, tensor.numel(), dt, red, stream)
        except self._nccl.NcclError as exc:
            raise FastcommError(f"rank {self.rank}: captured all_reduce failed: {exc}") from exc

    def _refused(self, op: str) -> CommAbortedError:
        cause = self._aborted or self._watchdog.error
        return CommAbortedError(f"rank {self.rank}: {op} refused: NCCL communicator aborted: "
                                f"{cause}")

    def abort(self, error: BaseException) -> None:
        """From any thread (a lost rank): every pending ``Work`` fails with
        ``CommAbortedError`` naming ``error``, later calls raise it, and ``ncclCommAbort``
        stops this rank's NCCL kernels (they return; their outputs are garbage).
        :meth:`close` follows without waiting on the peers."""
        if self._closed or self._watchdog.error is not None:
            return
        self._aborted = error
        failure = CommAbortedError(f"rank {self.rank}: NCCL communicator aborted: {error}")
        self._watchdog.abort(failure, self._comm.abort)

    def _stuck(self, work: EventWork) -> BaseException:
        """The watchdog's verdict on a collective past the timeout: abort NCCL."""
        limit = self._watchdog.timeout_s
        error = CommTimeoutError(
            f"rank {self.rank}: {work.op} did not finish within {limit:.1f} s (elapsed "
            f"{work._elapsed():.1f} s); NCCL communicator aborted"
        )
        try:
            self._comm.abort()
        except Exception:  # already broken: the abort is best effort
            pass
        return error

    # ------------------------------------------------------------------ collectives
    def _stream_task(
        self,
        op: str,
        output: torch.Tensor,
        keep: tuple[torch.Tensor, ...],
        launch: Callable[[int], None],
    ) -> Task:
        """A task that enqueues ``launch`` on the communication stream and returns its
        :class:`EventWork` (the stream orders the collectives; the event completes them)."""
        return Task(op, output, partial(self._enqueue, op, output, keep, launch))

    def _impl_all_reduce(self, tensor: torch.Tensor, op: ReduceOp,
                         blocking: bool = False) -> Task:
        n, ptr, comm = tensor.numel(), tensor.data_ptr(), self._comm
        dt, red = dtype_code(self._dtypes, tensor.dtype), self._ops[op]
        return self._stream_task(
            "all_reduce", tensor, (tensor,), lambda s: comm.allReduce(ptr, ptr, n, dt, red, s)
        )

    def _impl_broadcast(self, tensor: torch.Tensor, src: int, blocking: bool = False) -> Task:
        n, ptr, comm = tensor.numel(), tensor.data_ptr(), self._comm
        dt = dtype_code(self._dtypes, tensor.dtype)
        return self._stream_task(
            "broadcast", tensor, (tensor,), lambda s: comm.broadcast(ptr, ptr, n, dt, src, s)
        )

    def _impl_all_gather(self, output: torch.Tensor, input: torch.Tensor,
                         blocking: bool = False) -> Task:
        n, dt = input.numel(), dtype_code(self._dtypes, input.dtype)
        return self._stream_task(
            "all_gather", output, (output, input),
            lambda s: self._comm.allGather(input.data_ptr(), output.data_ptr(), n, dt, s),
        )

    def _impl_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                             blocking: bool = False) -> Task:
        n, dt = output.numel(), dtype_code(self._dtypes, input.dtype)
        red = self._ops[op]
        return self._stream_task(
            "reduce_scatter", output, (output, input),
            lambda s: self._comm.reduceScatter(input.data_ptr(), output.data_ptr(), n, dt, red, s),
        )

    def _impl_all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                         blocking: bool = False) -> Task:
        chunk, dt = input.numel() // self.size, dtype_code(self._dtypes, input.dtype)
        step = chunk * input.element_size()

        def launch(s):
            self._nccl.groupStart()
            try:
                for peer in range(self.size):
                    self._comm.send(input.data_ptr() + peer * step, chunk, dt, peer, s)
                    self._comm.recv(output.data_ptr() + peer * step, chunk, dt, peer, s)
            finally:
                self._nccl.groupEnd()

        return self._stream_task("all_to_all", output, (output, input), launch)

    def _impl_send(self, tensor: torch.Tensor, dst: int, blocking: bool = False) -> Task:
        n, dt = tensor.numel(), dtype_code(self._dtypes, tensor.dtype)
        return self._stream_task(
            "send", tensor, (tensor,), lambda s: self._comm.send(tensor.data_ptr(), n, dt, dst, s)
        )

    def _impl_recv(self, tensor: torch.Tensor, src: int, blocking: bool = False) -> Task:
        n, dt = tensor.numel(), dtype_code(self._dtypes, tensor.dtype)
        return self._stream_task(
            "recv", tensor, (tensor,), lambda s: self._comm.recv(tensor.data_ptr(), n, dt, src, s)
        )

    def _impl_barrier(self, blocking: bool = False) -> Task:
        def run() -> EventWork:
            one = torch.ones(1, device=self._device)
            work = self._impl_all_reduce(one, ReduceOp.SUM).run()
            work.synchronize()  # a barrier is a host-side promise
            return work

        return Task("barrier", None, run)

    @contextmanager
    def group(self) -> Iterator[None]:
        """Issues the enclosed collectives as one NCCL group (ncclGroupStart/End)."""
        self._nccl.groupStart()
        try:
            yield
        finally:
            self._nccl.groupEnd()

    # ------------------------------------------------------------------ split / close
    def _split_child(self, color, name, new_rank, new_size, parent_ranks, timeout):
        native = getattr(self._comm, "commSplit", None)
        if native is None:
            return super()._split_child(color, name, new_rank, new_size, parent_ranks, timeout)
        import cupy  # optional, as in __init__

        with cupy.cuda.Device(self._device.index):
            child = native(-1 if color is None else color, new_rank if color is not None else 0)
        if color is None:
            return None
        store = self.store.prefixed(f"{name}/color{color}", rank=new_rank)
        return NcclCommunicator(
            store, new_rank, new_size, timeout, device=self._device, _nccl_comm=child
        )

    def _new_child(self, store: Store, rank: int, size: int, timeout: timedelta):
        return NcclCommunicator(store, rank, size, timeout, device=self._device)

    def _impl_close(self) -> None:
        self._watchdog.close()
        if self._watchdog.error is not None:
            # aborted (a lost peer, or a timeout): ncclCommAbort freed the communicator and
            # released its kernels; waiting on the stream or destroying it would only risk
            # a wait on a peer that is gone
            return
        self.stream.synchronize()
        try:
            self._comm.destroy()
        except Exception:  # aborted communicators cannot be destroyed twice
            pass
