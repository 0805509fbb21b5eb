"""CUDA transport of the ipc backend: allreduce by Triton kernels over peers' GPU memory.

Every rank ``cudaMalloc``s one workspace (``plan.WorkspaceLayout``), exports it as a CUDA IPC
handle through the store and maps every peer's; an int64 table of the addresses lives on the
device. `CudaIpcTransport` runs `plan.all_reduce_steps` through `_CudaOps` (memcpy,
``peer_signal``, ``peer_reduce_table``) on ``transport.stream``, which first waits on the
caller's stream; the returned `EventWork` makes the caller's stream wait on the collective.
A `StreamWatchdog` sets the barriers' stop word past the timeout (`CommTimeoutError` naming the
missing ranks); a disagreement or timeout aborts the transport. Protocol: ``docs/ipc.md``.
"""

from __future__ import annotations

import ctypes
import time
from datetime import timedelta

import torch

from ...kernels._peer_reduce import MAX_PEERS
from ...kernels._peer_signal import CONTROL_WORDS, check_peer_signal, launch_peer_signal
from ..errors import CommAbortedError, CommTimeoutError, FastcommError
from ..store import Store, as_timedelta
from ..stream import EventWork, StreamWatchdog
from ..types import ReduceOp
from .cuda_region import CudaBucketRegion
from .descriptor import SETUP_DESCRIPTOR, call_descriptor, disagreement_error, timeout_message
from .plan import (
    EpochClock,
    IpcCudaOptions,
    Reduce,
    agreed_options,
    all_reduce_steps,
    check_agreed_options,
    check_all_reduce,
    max_spins_for,
    reduce_step,
    run_steps,
    workspace_layout,
)

__all__ = ["CudaIpcTransport"]


def _cupy_cuda():
    try:
        from cupy import cuda
    except Exception as exc:  # ImportError, or CUDA errors while loading
        raise RuntimeError(
            "the CUDA IPC transport needs CuPy (pip install 'fastcomm[cuda12]')"
        ) from exc
    return cuda


class CudaIpcTransport:
    """Allreduce of CUDA tensors of ranks on one node through mapped peer workspaces.

    Args:
        store: a store namespace private to this transport (IPC handles and the close barrier).
        rank: this process's rank.
        size: number of ranks (at most 16).
        timeout: limit of every collective (seconds or ``timedelta``).
        device: this rank's CUDA device (index or ``torch.device``).
        options: sizes and bounds; default `IpcCudaOptions.from_env()`.

    Raises:
        RuntimeError: no CUDA or CuPy, or a peer's GPU this process cannot access.
    """

    def __init__(self, store: Store, rank: int, size: int, timeout, device, *, options=None):
        if not 1 <= size <= MAX_PEERS:
            raise ValueError(f"the CUDA IPC transport spans 1..{MAX_PEERS} ranks, got {size}")
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA IPC transport needs a CUDA device")
        cuda = _cupy_cuda()
        runtime = self._rt = cuda.runtime
        self.store, self.rank, self.size = store, rank, size
        self.timeout = as_timedelta(timeout, timedelta(minutes=5))
        index = device if isinstance(device, int) else torch.device(device).index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self.options = options or IpcCudaOptions.from_env()
        self.layout = workspace_layout(self.options, size)
        self._closed = False
        self.host_waits = False
        """Whether the works' ``wait()`` blocks the host (``EventWork.host_waits``)."""
        self._failure: BaseException | None = None
        self._timed_out: tuple[str, float] | None = None
        self._opened: list[int] = []
        self._base = 0
        self._bus_ids: list[str] = []  # every rank's GPU, for the regions' mappings
        self._regions: list = []  # bucket regions (cuda_region.py), closed before the workspace
        self._region_count = 0
        # CuPy keeps its own current device (it may load another libcudart than torch's)
        self._cupy_device = cuda.Device(self.device.index)
        with torch.cuda.device(self.device), self._cupy_device:
            self._base = runtime.malloc(self.layout.total_bytes)
            try:
                runtime.memset(self._base, 0, self.layout.total_bytes)
                runtime.deviceSynchronize()  # zeroed flags before any peer can see them
                handle = runtime.ipcGetMemHandle(self._base)
                bus_id = runtime.deviceGetPCIBusId(self.device.index)
                peers = store.all_gather_object(
                    "ipc_cuda/workspaces", rank, size,
                    (handle, bus_id, agreed_options(self.options)), self.timeout,
                )
                # before any peer memory is opened: a differing layout would read past it
                check_agreed_options(rank, [p[2] for p in peers])
                self._bus_ids = [bus for _, bus, _ in peers]
                bases = [self._open(r, h, bus) for r, (h, bus, _) in enumerate(peers)]
            except BaseException:
                self._release()
                raise
        self._bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        # Pinned host memory is mapped at the same address on the device (UVA): the host reads
        # the barrier's report and writes its stop request without touching a stream.
        self._control = torch.zeros(CONTROL_WORDS, dtype=torch.int64, pin_memory=True)
        attrs = runtime.pointerGetAttributes(self._control.data_ptr())
        if attrs.devicePointer != self._control.data_ptr():
            self._release()
            raise RuntimeError("pinned host memory is not mapped at its host address (no UVA)")
        # the same words through ctypes: a read costs tens of ns (Work.wait reads them)
        self._words = (ctypes.c_int64 * CONTROL_WORDS).from_address(self._control.data_ptr())
        self._max_spins = max_spins_for(self.timeout.total_seconds(),
                                        self.options.spins_per_second)
        self._clock = EpochClock()
        self.stream = torch.cuda.Stream(self.device)
        self._future_stream = torch.cuda.Stream(self.device)
        self._caller_ready = torch.cuda.Event()
        self._ops = _CudaOps(self)
        self._watchdog = StreamWatchdog(
            f"fastcomm-ipc-cuda-watchdog-r{rank}", self.timeout.total_seconds(), 0.01,
            self._stuck, check=self._barrier_report,
        )
        self._first_barrier()

    def _first_barrier(self) -> None:
        """One barrier through the mapped flags before the first collective.

        It proves every mapping works end to end and compiles the signal kernel here, not in
        the first collective while the peers already spin.
        """
        start = time.monotonic()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self._ops.descriptor = SETUP_DESCRIPTOR
            self._ops.barrier(self._clock.next_epoch())
        done = torch.cuda.Event()
        done.record(self.stream)
        limit = self.timeout.total_seconds()
        while not done.query():
            if time.monotonic() - start > limit:
                self._timed_out = ("setup barrier", time.monotonic() - start)
                self._words[0] = 1
                break
            time.sleep(0.001)
        done.synchronize()
        error = self.failure()
        if error is not None:
            self.close()
            raise error

    def _open(self, peer: int, handle: bytes, bus_id: str) -> int:
        if peer == self.rank:
            return self._base
        ptr = self.map_peer(peer, handle, bus_id)
        self._opened.append(ptr)
        return ptr

    def map_peer(self, peer: int, handle: bytes, bus_id: str | None = None) -> int:
        """Opens rank ``peer``'s IPC ``handle`` (its GPU ``bus_id``, default the one it
        reported at setup) and returns the address; the caller closes it
        (``ipcCloseMemHandle``) once no kernel of any rank reads it.

        Raises:
            RuntimeError: the peer's GPU is not visible here or has no peer access.
        """
        bus_id = self._bus_ids[peer] if bus_id is None else bus_id
        here = self.device.index
        try:
            there = self._rt.deviceGetByPCIBusId(bus_id)
        except Exception as exc:  # CUDARuntimeError: not among this process's visible devices
            raise RuntimeError(
                f"rank {self.rank}: rank {peer}'s GPU {bus_id} is not visible to this process "
                f"(CUDA_VISIBLE_DEVICES?): the CUDA IPC transport maps every peer's memory"
            ) from exc
        if there != here and not torch.cuda.can_device_access_peer(here, there):
            raise RuntimeError(
                f"rank {self.rank}: rank {peer}'s GPU {bus_id} (device {there} here) cannot be "
                f"accessed from device {here} (no peer access): the CUDA IPC transport needs it"
            )
        return self._rt.ipcOpenMemHandle(handle)  # lazily enables peer access

    # ------------------------------------------------------------------ collective
    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM):
        """Enqueues an in-place allreduce of `tensor`; returns its `Work`.

        Raises:
            TypeError: a dtype other than fp32/fp16/bf16.
            ValueError: another device, a non-contiguous tensor, or an op other than
                sum/avg/max/min.
            CommAbortedError: an earlier collective failed (the transport is aborted).
        """
        op = check_all_reduce(tensor, op, self.device)
        self._raise_if_unusable("all_reduce")

        def issue() -> None:
            # planned here, under the enqueue lock: the epochs and buffers must follow the
            # enqueue order
            steps = all_reduce_steps(
                tensor.numel(), tensor.element_size(), self.rank, self.size, self.layout,
                self.options.two_shot_bytes, self._clock,
            )
            ops = self._ops
            ops.dtype, ops.op = tensor.dtype, op.value
            ops.descriptor = call_descriptor("all_reduce", tensor.numel(), tensor.dtype, op)
            run_steps(steps, ops, tensor.data_ptr(), self._base)

        return self.enqueue("all_reduce", tensor, issue)

    def enqueue(self, op: str, output: torch.Tensor, issue) -> EventWork:
        """Runs ``issue()`` (it launches a collective's kernels) on the transport's stream,
        after the caller's stream, under the lock that orders every rank's epochs; returns the
        collective's `EventWork`, tracked by the watchdog. A failure while launching aborts
        the transport: part of the steps are enqueued, so this rank's epochs no longer match
        its peers'."""
        with self._watchdog.lock, torch.cuda.device(self.device):
            ready = self._caller_ready
            ready.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(ready)
            try:
                with torch.cuda.stream(self.stream):
                    issue()
            except BaseException as exc:
                self._failure = FastcommError(
                    f"rank {self.rank}: {op} failed while enqueueing its steps "
                    f"(the CUDA IPC transport is aborted): {exc!r}"
                )
                self._words[0] = 1
                raise self._failure from exc
            event = torch.cuda.Event()
            event.record(self.stream)
            work = EventWork(op, self.rank, output, self.device, event, (output,),
                             self._future_stream, failure=self.failure)
            work.host_waits = self.host_waits
            self._watchdog.track(work)
        return work

    def bucket_region(self, area_bytes: int, max_buckets: int, cap_bytes: int | None = None):
        """DDP bucket memory on this rank's GPU that every rank maps, all-reduced in place
        (:class:`~.cuda_region.CudaBucketRegion`); a collective: every rank calls it alike.

        Returns:
            The region, or on every rank the reason it was not made (over ``cap_bytes``, the
            GPU out of memory): the caller keeps its own buffers.
        """
        self._raise_if_unusable("bucket_region")
        self._region_count += 1
        region = CudaBucketRegion.setup(
            self, area_bytes, max_buckets, cap_bytes, f"ipc_cuda/region/{self._region_count}"
        )
        if not isinstance(region, str):
            self._regions.append(region)
        return region

    # ------------------------------------------------------------------ failure
    def _raise_if_unusable(self, op: str) -> None:
        if self._closed:
            raise CommAbortedError(f"rank {self.rank}: {op} on a closed CUDA IPC transport")
        error = self.failure()
        if error is not None:
            raise CommAbortedError(f"rank {self.rank}: {op} on an aborted CUDA IPC transport: "
                                   f"{error}") from error

    def failure(self) -> BaseException | None:
        """The error that aborted the transport, if any (reads the barrier's report)."""
        words = self._words
        if self._failure is None and words[1] < 0:
            self._failure = disagreement_error(self.rank, words)
            return self._failure
        if self._failure is None and (words[1] or words[0]):
            op, elapsed = self._timed_out or ("all_reduce", None)
            pending = self._watchdog.pending
            if elapsed is None:
                elapsed = pending[0]._elapsed() if pending else 0.0
            message = timeout_message(self.rank, op, elapsed, self.timeout.total_seconds(),
                                      words[1], words[2])
            self._failure = CommTimeoutError(message)
        return self._failure

    def abort(self, error: BaseException) -> None:
        """From any thread (a lost rank): pending works fail with ``CommAbortedError`` naming
        ``error``, later calls raise it, and every spinning or later barrier gives up (the stop
        word); :meth:`close` then meets no peer, it only announces itself."""
        if self._closed or self._failure is not None:
            return
        failure = CommAbortedError(f"rank {self.rank}: CUDA IPC transport aborted: {error}")
        self._failure = failure  # first: the stop word alone would read as a timeout
        self._watchdog.abort(failure, lambda: self._words.__setitem__(0, 1))

    def _barrier_report(self) -> BaseException | None:
        """The watchdog's poll: a barrier that ran out of spins reported missing ranks, or one
        found a peer in another call."""
        return self.failure() if self._words[1] else None

    def _stuck(self, work: EventWork) -> BaseException:
        """The watchdog's verdict on a collective past the timeout: every spinning or later
        barrier gives up, and the spinning one reports which ranks were missing."""
        self._timed_out = (work.op, work._elapsed())
        self._words[0] = 1
        deadline = time.monotonic() + 5.0
        while not work.event.query() and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.failure()

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Waits for the pending collectives, meets the peers, unmaps and frees the workspace.

        Peers must not read this rank's workspace after it is freed: healthy ranks wait at a
        store barrier that every rank reaches on close; an aborted rank only announces itself.
        """
        if self._closed:
            return
        try:
            self.stream.synchronize()
        finally:
            self._closed = True
        regions, self._regions = self._regions, []
        try:
            for region in regions:  # they use the stream, the control block and the store
                region.close()
        finally:  # a region whose peers are gone still leaves the workspace to be released
            self._close_workspace()

    def _close_workspace(self) -> None:
        self._watchdog.close()
        name = "ipc_cuda/closed"
        if self.failure() is None:
            try:
                self.store.barrier(name, self.size, self.timeout)
            finally:
                self._release()
            return
        if self.store.add(f"{name}/arrived", 1) == self.size:
            self.store.set(f"{name}/done", b"1")
        self._release()

    def _release(self) -> None:
        rt = self._rt
        with torch.cuda.device(self.device), self._cupy_device:
            for ptr in self._opened:
                rt.ipcCloseMemHandle(ptr)
            self._opened = []
            if self._base:
                rt.free(self._base)
                self._base = 0


class _CudaOps:
    """`StepOps` on the transport's stream (the current stream while steps run)."""

    __slots__ = ("t", "dtype", "op", "descriptor", "_memcpy", "_stream", "_own", "_signal_args")

    def __init__(self, transport: CudaIpcTransport) -> None:
        t = self.t = transport
        self.dtype = torch.float32
        self.op = "sum"
        self.descriptor = SETUP_DESCRIPTOR  # of the call whose steps run (set per call)
        self._memcpy = t._rt.memcpyAsync
        self._stream = t.stream.cuda_stream
        self._own = t._bases[t.rank : t.rank + 1]
        # the barrier's arguments, checked here once: every barrier then launches unchecked
        check_peer_signal(t._bases, t.layout.flags_offset, t.rank, 1, t._control, t._max_spins,
                          SETUP_DESCRIPTOR)
        self._signal_args = (t._bases, t.layout.flags_offset, t._control.data_ptr(), t.rank)

    def copy(self, dst_addr: int, src_addr: int, nbytes: int) -> None:
        self._memcpy(dst_addr, src_addr, nbytes, 3, self._stream)  # 3: device to device

    def barrier(self, epoch: int) -> None:
        launch_peer_signal(*self._signal_args, epoch, self.t._max_spins, self.descriptor)

    def reduce(self, step: Reduce) -> None:
        reduce_step(step, self.t._bases, self._own, self.dtype, self.op)
