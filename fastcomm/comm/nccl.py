"""NCCL communicator through CuPy's ``cupy.cuda.nccl`` bindings.

Stream and pointer plumbing only; argument checks live in ``Communicator`` and are tested on CPU.

Stream invariants:
- Every collective runs on ``self.stream``, a communication stream of this communicator. Before
  enqueueing, that stream waits on the caller's current stream (so it reads finished data);
  tensors are ``record_stream``-ed on it so the caching allocator does not reuse them early.
- The ``Work``'s future is created with ``devices=[device]`` and resolved while the
  communication stream is current: a consumer's ``future.wait()`` makes *its* stream wait on the
  collective, and the host never blocks. ``Work.wait()`` does the same for the current stream.
- A watchdog thread polls each pending collective's CUDA event; one that exceeds the timeout
  aborts the NCCL communicator (``ncclCommAbort``) and fails every pending ``Work``.

Never run on a GPU in this project's CI (no GPU there): see the README.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch

from .base import Communicator
from .errors import CommAbortedError, CommTimeoutError, FastcommError
from .store import Store
from .types import ReduceOp
from .work import Work

__all__ = ["NcclCommunicator", "cupy_nccl", "decode_nccl_version", "nccl_version"]


def cupy_nccl():
    """CuPy's NCCL module, or ``None`` when CuPy or libnccl is missing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
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


def nccl_dtype(nccl, dtype: torch.dtype) -> int:
    table = {
        torch.float16: nccl.NCCL_FLOAT16,
        torch.bfloat16: nccl.NCCL_BFLOAT16,
        torch.float32: nccl.NCCL_FLOAT32,
        torch.float64: nccl.NCCL_FLOAT64,
        torch.int8: nccl.NCCL_INT8,
        torch.uint8: nccl.NCCL_UINT8,
        torch.int32: nccl.NCCL_INT32,
        torch.int64: nccl.NCCL_INT64,
    }
    if dtype not in table:
        allowed = ", ".join(str(d) for d in table)
        raise TypeError(f"NCCL cannot move dtype {dtype}; allowed: {allowed}")
    return table[dtype]


def nccl_op(nccl, op: ReduceOp) -> int:
    return {
        ReduceOp.SUM: nccl.NCCL_SUM,
        ReduceOp.AVG: nccl.NCCL_AVG,
        ReduceOp.MAX: nccl.NCCL_MAX,
        ReduceOp.MIN: nccl.NCCL_MIN,
        ReduceOp.PRODUCT: nccl.NCCL_PROD,
    }[op]


class NcclWork(Work):
    """A collective enqueued on the communication stream; see the module docstring."""

    def __init__(self, op, rank, output, device, event):
        super().__init__(op, rank, output, devices=[device])
        self.event = event

    def is_completed(self) -> bool:
        return self._error is not None or self.event.query()

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        if self._error is not None:
            raise self._error
        torch.cuda.current_stream().wait_event(self.event)
        return True

    def synchronize(self) -> None:
        """Blocks the host until the collective has finished on the device."""
        self.event.synchronize()
        if self._error is not None:
            raise self._error


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
        import cupy

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
        self.stream = torch.cuda.Stream(self._device)
        self._pending: deque[NcclWork] = deque()
        self._lock = threading.Lock()
        self._aborted: BaseException | None = None
        self._watchdog = threading.Thread(
            target=self._watch, name=f"fastcomm-nccl-watchdog-r{rank}", daemon=True
        )
        self._watchdog.start()

    @property
    def device(self) -> torch.device:
        return self._device

    def _device_ok(self, device: torch.device) -> bool:
        return device == self._device

    # ------------------------------------------------------------------ plumbing
    def _enqueue(
        self,
        op: str,
        output: torch.Tensor | None,
        tensors: list[torch.Tensor],
        launch: Callable[[int], None],
    ) -> NcclWork:
        if self._aborted is not None:
            raise CommAbortedError(f"rank {self.rank}: {op} on an aborted NCCL communicator: "
                                   f"{self._aborted}")
        caller = torch.cuda.current_stream(self._device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            try:
                launch(self.stream.cuda_stream)
            except self._nccl.NcclError as exc:
                raise FastcommError(f"rank {self.rank}: {op} failed: {exc}") from exc
            for t in tensors:
                t.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
            work = NcclWork(op, self.rank, output, self._device, event)
            work._complete()  # resolved with the comm stream current: stream-ordered future
        with self._lock:
            self._pending.append(work)
        return work

    def _watch(self) -> None:
        limit = self.timeout.total_seconds()
        while not self._closed:
            time.sleep(0.05)
            with self._lock:
                while self._pending and self._pending[0].event.query():
                    self._pending.popleft()
                stuck = self._pending[0] if self._pending else None
            if stuck is None or stuck._elapsed() <= limit:
                continue
            error = CommTimeoutError(
                f"rank {self.rank}: {stuck.op} did not finish within "
                f"{limit:.1f} s (elapsed {stuck._elapsed():.1f} s); NCCL communicator aborted"
            )
            self._abort(error)
            return

    def _abort(self, error: BaseException) -> None:
        self._aborted = error
        try:
            self._comm.abort()
        except Exception:  # already broken: the abort is best effort
            pass
        with self._lock:
            for work in self._pending:
                work._error = error
            self._pending.clear()

    # ------------------------------------------------------------------ collectives
    def _impl_all_reduce(self, tensor, op):
        n, dt = tensor.numel(), nccl_dtype(self._nccl, tensor.dtype)
        ptr = tensor.data_ptr()
        return self._enqueue(
            "all_reduce", tensor, [tensor],
            lambda s: self._comm.allReduce(ptr, ptr, n, dt, nccl_op(self._nccl, op), s),
        )

    def _impl_broadcast(self, tensor, src):
        n, dt, ptr = tensor.numel(), nccl_dtype(self._nccl, tensor.dtype), tensor.data_ptr()
        return self._enqueue(
            "broadcast", tensor, [tensor],
            lambda s: self._comm.broadcast(ptr, ptr, n, dt, src, s),
        )

    def _impl_all_gather(self, output, input):
        n, dt = input.numel(), nccl_dtype(self._nccl, input.dtype)
        return self._enqueue(
            "all_gather", output, [output, input],
            lambda s: self._comm.allGather(input.data_ptr(), output.data_ptr(), n, dt, s),
        )

    def _impl_reduce_scatter(self, output, input, op):
        n, dt = output.numel(), nccl_dtype(self._nccl, input.dtype)
        red = nccl_op(self._nccl, op)
        return self._enqueue(
            "reduce_scatter", output, [output, input],
            lambda s: self._comm.reduceScatter(input.data_ptr(), output.data_ptr(), n, dt, red, s),
        )

    def _impl_all_to_all(self, output, input):
        chunk, dt = input.numel() // self.size, nccl_dtype(self._nccl, input.dtype)
        step = chunk * input.element_size()

        def launch(s):
            self._nccl.groupStart()
            try:
                for peer in range(self.size):
                    self._comm.send(input.data_ptr() + peer * step, chunk, dt, peer, s)
                    self._comm.recv(output.data_ptr() + peer * step, chunk, dt, peer, s)
            finally:
                self._nccl.groupEnd()

        return self._enqueue("all_to_all", output, [output, input], launch)

    def _impl_send(self, tensor, dst):
        n, dt = tensor.numel(), nccl_dtype(self._nccl, tensor.dtype)
        return self._enqueue(
            "send", tensor, [tensor], lambda s: self._comm.send(tensor.data_ptr(), n, dt, dst, s)
        )

    def _impl_recv(self, tensor, src):
        n, dt = tensor.numel(), nccl_dtype(self._nccl, tensor.dtype)
        return self._enqueue(
            "recv", tensor, [tensor], lambda s: self._comm.recv(tensor.data_ptr(), n, dt, src, s)
        )

    def _impl_barrier(self):
        one = torch.ones(1, device=self._device)
        work = self._impl_all_reduce(one, ReduceOp.SUM)
        work.synchronize()  # a barrier is a host-side promise
        return work

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
        import cupy

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
        self.stream.synchronize()
        try:
            self._comm.destroy()
        except Exception:  # aborted communicators cannot be destroyed twice
            pass
