"""DDP bucket memory the peers map, all-reduced in place by the kernel collectives.

The ``ipc`` backend's shared buckets, for CUDA tensors (``shm`` has its own for CPU ones,
``fastcomm.comm.shm.buckets``). Every rank allocates one *area* for a DDP model's buckets on
its GPU, with a flag area after them, exports it through CUDA IPC and maps every peer's, as the
transport maps its workspace (``cuda.py``); an int64 table of the areas' addresses, as mapped
in this process, lives on the device. The reducer lays its buckets out in the area and points
each ``.grad`` at its view there (``gradient_as_bucket_view``): autograd writes the gradients
straight into memory the peers read. An all-reduce of a bucket (`bucket_steps`) is then:

1. a barrier (``peer_signal``): every rank's gradients of the bucket are in place (its
   release covers what ran before it on the stream: backward's writes);
2. one ``peer_reduce`` launch: rank ``r`` reduces chunk ``r`` of the bucket
   (``two_shot_chunk``) out of every rank's area, in rank order with fp32 accumulation, times
   the averaging factor in the same pass, and writes the result into chunk ``r`` of *every*
   rank's area. Only rank ``r`` reads or writes chunk ``r`` of any area, and each element is
   read before it is written, so the bucket is its own output;
3. a barrier: every rank's chunks are in every area.

Nothing is staged: per bucket of ``B`` bytes, rank ``r`` reads ``B`` (``(n - 1) B / n`` of it
in the peers' areas) and writes ``B`` (``(n - 1) B / n`` into theirs): 1.5 bytes moved
(written + read from the peers) per gradient byte at 2 ranks, 2 at most for any ``n``, against
3.5 at 2 ranks for the transport's ``all_reduce`` of a private bucket (copy in, two-shot,
copy out; and DDP's pack and unpack around it without bucket views).

Ordering: once a rank has passed barrier 3 of a bucket, every peer has finished its kernel of
step 2 (each announces barrier 3 after it), so no peer reads or writes this rank's copy of the
bucket until the next launch's barrier 1, which waits for this rank: the next backward may
write it (``settle`` has nothing to wait for). The caller's stream waits for the collective
through the returned work (``EventWork.wait``), so the optimizer, ``zero_grad`` and the next
backward run after it. The descriptor of every barrier (``call_descriptor``:
``bucket_all_reduce``, element count, dtype) makes a rank whose buckets differ from its
peers' raise on every rank, as the transport's calls do.

`PeerBucketRegion` is the device-neutral part: it runs a launch's steps through the kernels at
once, in the calling thread. Over CPU address tables (Triton's interpreter, POSIX shared
memory: the tests) that is the whole all-reduce; `CudaBucketRegion` enqueues the same steps
on its transport's stream, shares its control block (stop word, report), spin bound and
watchdog, and is closed with it.

Memory: one area per rank on its own GPU, holding its buckets: the model's gradient bytes once
per rank, in place of the private buckets (nothing more than without sharing). A cap
(``cap_bytes``) or a GPU out of memory makes every rank fall back to its own buffers. A region
is the transport's until the communicator closes (its peers' mappings of it must be closed
collectively first): a process that builds many DDP models on one communicator holds an area
for each until then.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from ...kernels._launch import fp32_scale
from ...kernels._peer_reduce import MAX_PEERS, launch_peer_reduce_table
from ...kernels._peer_signal import check_peer_signal, flag_area_words, launch_peer_signal
from ..bucket_stats import RegionStats
from ..errors import CommAbortedError, CommTimeoutError, FastcommError
from ..types import SHARED_BUCKET_DTYPES, ReduceOp
from ..work import Work
from .cuda import (
    ALIGN,
    MAX_NUMEL,
    SETUP_DESCRIPTOR,
    Barrier,
    EpochClock,
    Reduce,
    call_descriptor,
    disagreement_error,
    timeout_message,
    two_shot_chunk,
)

__all__ = [
    "ALIGN",
    "DTYPES",
    "CudaBucketRegion",
    "PeerBucket",
    "PeerBucketRegion",
    "RegionLayout",
    "bucket_steps",
    "region_layout",
]

#: dtypes a region holds (the kernel accumulates fp16/bf16 in fp32).
DTYPES = SHARED_BUCKET_DTYPES["cuda"]
_OP = "bucket_all_reduce"


class RegionLayout(NamedTuple):
    """Byte offsets of every rank's area (identical on every rank)."""

    area_bytes: int  # the buckets
    flags_offset: int  # the flag area (``peer_signal``), after the buckets
    total_bytes: int
    max_buckets: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def region_layout(area_bytes: int, size: int, max_buckets: int) -> RegionLayout:
    """The layout of an area of ``area_bytes`` of buckets for ``size`` ranks.

    Raises:
        ValueError: a negative size, no bucket, or a world outside ``1..16``.
    """
    if area_bytes < 0:
        raise ValueError(f"area_bytes must be >= 0, got {area_bytes}")
    if max_buckets < 1:
        raise ValueError(f"max_buckets must be >= 1, got {max_buckets}")
    if not 1 <= size <= MAX_PEERS:
        raise ValueError(f"a bucket region spans 1..{MAX_PEERS} ranks, got {size}")
    flags = _align(area_bytes)
    return RegionLayout(area_bytes, flags, flags + _align(8 * flag_area_words(size)),
                        max_buckets)


def bucket_steps(offset: int, numel: int, itemsize: int, rank: int, size: int,
                 clock: EpochClock) -> list:
    """The steps of one bucket all-reduce on ``rank`` (module docstring); advances ``clock``.

    Args:
        offset: the bucket's byte offset in every area.
        numel: its elements; ``itemsize``: their bytes.
        rank, size: this rank and the world.
        clock: the region's barrier epochs.
    """
    steps: list = [Barrier(clock.next_epoch())]
    lo, hi = two_shot_chunk(numel, itemsize, size, rank)
    if hi > lo:  # the last ranks' chunks of a small bucket may be empty
        at = offset + lo * itemsize
        steps.append(Reduce(at, at, hi - lo, True))
    steps.append(Barrier(clock.next_epoch()))
    return steps


class PeerBucket:
    """One bucket's place in a region.

    Attributes:
        index: its position in launch order.
        offset: its byte offset in every area.
        flat: this rank's copy (a view of its area), where its gradients live.
        nbytes: its bytes.
    """

    __slots__ = ("region", "index", "offset", "flat", "nbytes")

    def __init__(self, region: PeerBucketRegion, index: int, offset: int,
                 flat: torch.Tensor) -> None:
        self.region = region
        self.index = index
        self.offset = offset
        self.flat = flat
        self.nbytes = flat.numel() * flat.element_size()


class PeerBucketRegion:
    """The shared buckets of one DDP model over ranks that map each other's areas (see the
    module docstring): the device-neutral part, which runs each launch at once.

    Args:
        rank: this rank.
        size: the number of ranks.
        layout: every area's layout.
        area: this rank's area, ``layout.total_bytes`` bytes (uint8), its flag area zeroed
            before any peer could read it.
        bases: int64, the address of every rank's area as mapped in this process, rank order,
            on the device the kernels run on.
        control: int64 control block of the barrier (``CONTROL_WORDS`` words it can address).
        max_spins: the barrier's spin bound.
        timeout_s: the bound in seconds, for the messages.

    Raises:
        RuntimeError: the kernels cannot follow ``bases`` here (CPU tables without
            ``FASTCOMM_KERNELS=triton``).

    Attributes:
        stats: bytes this rank's all-reduces moved (:class:`~fastcomm.comm.bucket_stats.
            RegionStats`).
        nbytes: bytes of this rank's area.
        comm_stats: the communicator's ``CommStats`` (each launch counts as one
            ``shared_all_reduce`` of its bytes), or ``None``.
    """

    stages = False
    """Its buckets stage nothing: a fresh gradient reaches them as a whole copy."""

    def __init__(self, rank: int, size: int, layout: RegionLayout, area: torch.Tensor,
                 bases: torch.Tensor, control: torch.Tensor, max_spins: int,
                 timeout_s: float) -> None:
        if area.dtype != torch.uint8 or area.numel() < layout.total_bytes:
            raise ValueError(
                f"area must be {layout.total_bytes} uint8 bytes, got {area.numel()} x {area.dtype}"
            )
        if bases.numel() != size:
            raise ValueError(f"bases has {bases.numel()} entries for {size} ranks")
        # once: every launch then runs unchecked
        check_peer_signal(bases, layout.flags_offset, rank, 1, control, max_spins,
                          SETUP_DESCRIPTOR)
        self.rank, self.size, self.layout = rank, size, layout
        self.area, self.bases, self.control = area, bases, control
        self._control_addr = control.data_ptr()
        self._max_spins = max_spins
        self.timeout_s = timeout_s
        self.nbytes = layout.total_bytes
        self.stats = RegionStats()
        self.comm_stats = None
        self._clock = EpochClock()
        self._broken: BaseException | None = None
        self._closed = False

    def bucket(self, index: int, offset: int, dtype: torch.dtype, numel: int) -> PeerBucket:
        """The bucket ``index`` at byte ``offset`` of every area.

        Raises:
            TypeError: a dtype the region does not hold.
            ValueError: an index past ``max_buckets``, or a bucket off the alignment or past
                the area.
            CommAbortedError: the region is closed or failed.
        """
        self._check_usable("bucket")
        if dtype not in DTYPES:
            raise TypeError(f"a shared bucket on ipc holds {DTYPES}, got {dtype}")
        if not 0 <= index < self.layout.max_buckets:
            raise ValueError(
                f"bucket index {index} out of range: the region holds {self.layout.max_buckets}"
            )
        nbytes = numel * dtype.itemsize
        if offset % ALIGN or offset < 0 or offset + nbytes > self.layout.area_bytes:
            raise ValueError(
                f"a bucket of {numel} x {dtype} at offset {offset} does not fit an area of "
                f"{self.layout.area_bytes} bytes at {ALIGN}-byte alignment"
            )
        if numel >= MAX_NUMEL:
            raise ValueError(f"a bucket of {numel} elements: fewer than 2**40 allowed")
        flat = self.area[offset : offset + nbytes].view(dtype)
        return PeerBucket(self, index, offset, flat)

    # ------------------------------------------------------------------ the all-reduce
    def launch(self, bucket: PeerBucket, factor: float) -> Work:
        """All-reduces ``bucket`` in place: every rank's copy becomes the sum over ranks, in
        rank order, times ``factor`` (rounded to fp32; every rank passes the same). Every
        rank launches the same buckets in the same order.

        Returns:
            Its work: ``wait()`` orders the caller after it.

        Raises:
            CommAbortedError: an earlier all-reduce of the region failed, or it is closed.
            CommTimeoutError, FastcommError: (run at once) a peer did not arrive in time, or
                launched another bucket.
        """
        self._check_usable(_OP)
        if bucket.region is not self:
            raise ValueError(f"rank {self.rank}: bucket {bucket.index} is another region's")
        flat = bucket.flat
        itemsize = flat.element_size()
        steps = bucket_steps(bucket.offset, flat.numel(), itemsize, self.rank, self.size,
                             self._clock)
        self._count(bucket, steps, itemsize)
        descriptor = call_descriptor(_OP, flat.numel(), flat.dtype, ReduceOp.SUM)
        return self._run(bucket, steps, descriptor, fp32_scale(factor))

    def settle(self) -> None:
        """Nothing to wait for: a bucket's last barrier already says no peer touches this
        rank's copy any more (module docstring). Raises if the region failed."""
        self._check_usable("settle")

    def _count(self, bucket: PeerBucket, steps: list, itemsize: int) -> None:
        chunk = sum(s.numel for s in steps if type(s) is Reduce) * itemsize
        st = self.stats
        st.buckets += 1
        st.gradient_bytes += bucket.nbytes
        st.read += self.size * chunk
        st.peer_read += (self.size - 1) * chunk
        st.written += self.size * chunk
        if self.comm_stats is not None:
            self.comm_stats.count("shared_all_reduce", bucket.nbytes)

    def _execute(self, steps: list, dtype: torch.dtype, scale: float, descriptor: int) -> None:
        """Launches ``steps``' kernels (on the current stream where they run on a GPU)."""
        bases, flags, control, rank = (self.bases, self.layout.flags_offset,
                                       self._control_addr, self.rank)
        for step in steps:
            if type(step) is Barrier:
                launch_peer_signal(bases, flags, control, rank, step.epoch, self._max_spins,
                                   descriptor)
            else:
                launch_peer_reduce_table(bases, bases, step.src_byte, step.dst_byte, step.numel,
                                         dtype, "sum", scale)

    def _run(self, bucket: PeerBucket, steps: list, descriptor: int, scale: float) -> Work:
        """Runs the steps now and reads the barrier's verdict."""
        start = time.monotonic()
        self._execute(steps, bucket.flat.dtype, scale, descriptor)
        error = self._verdict(time.monotonic() - start)
        if error is not None:
            self._broken = error
            raise error
        return Work(_OP, self.rank, bucket.flat, completed=True)

    def _verdict(self, elapsed: float) -> BaseException | None:
        words = self.control.tolist()
        if words[1] < 0:
            return disagreement_error(self.rank, words)
        if words[0] or words[1]:
            return CommTimeoutError(timeout_message(self.rank, _OP, elapsed, self.timeout_s,
                                                    words[1], words[2]))
        return None

    # ------------------------------------------------------------------ failure, lifetime
    def _check_usable(self, op: str) -> None:
        if self._closed:
            raise CommAbortedError(f"rank {self.rank}: {op} on a closed bucket region")
        if self._broken is not None:
            raise CommAbortedError(
                f"rank {self.rank}: {op} refused: this bucket region failed earlier "
                f"({self._broken})"
            )

    def close(self) -> None:
        """Refuses further launches (the memory is its owner's)."""
        self._closed = True


class _DeviceMemory:
    """This rank's area: ``cudaMalloc``'d memory that torch tensors view (through
    ``__cuda_array_interface__``; each view holds this object). It is freed when the last view
    is gone (a ``.grad`` may outlive the region), and only once every peer has unmapped it."""

    def __init__(self, free, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "strides": None,
            "version": 2,
        }
        self._free = free
        self.ptr = ptr
        self.may_free = False

    def __del__(self) -> None:
        if self.may_free and self.ptr:
            ptr, self.ptr = self.ptr, 0
            try:
                self._free(ptr)
            except Exception:  # noqa: BLE001 - at exit the CUDA context may be gone, and
                # the memory with it; there is nobody to report to from a finalizer
                return


class CudaBucketRegion(PeerBucketRegion):
    """A :class:`PeerBucketRegion` of GPU memory mapped through CUDA IPC, run on its
    transport's stream (see the module docstring). Build with :meth:`setup` (a collective,
    through ``CudaIpcTransport.bucket_region``)."""

    def __init__(self, transport, key: str, layout: RegionLayout, memory: _DeviceMemory,
                 bases: torch.Tensor, opened: list[int]) -> None:
        area = torch.as_tensor(memory, device=transport.device)
        super().__init__(transport.rank, transport.size, layout, area, bases,
                         transport._control, transport._max_spins,
                         transport.timeout.total_seconds())
        self.transport = transport
        self.device = transport.device
        self._key = key
        self._memory = memory
        self._opened = opened

    @classmethod
    def setup(cls, transport, area_bytes: int, max_buckets: int, cap_bytes: int | None,
              key: str) -> CudaBucketRegion | str:
        """Every rank allocates its area, exports it and maps its peers'. Returns the region,
        or on every rank the reasons some rank could not allocate (the caller falls back).

        Raises:
            FastcommError: a rank could not map a peer's area (on every rank).
            StoreTimeoutError: a rank did not answer within the transport's timeout.
        """
        layout = region_layout(area_bytes, transport.size, max_buckets)
        rank, size, store, timeout = (transport.rank, transport.size, transport.store,
                                      transport.timeout)
        rt, total = transport._rt, layout.total_bytes
        why, ptr, handle = None, 0, None
        if cap_bytes is not None and total > cap_bytes:
            why = (f"the shared buckets need {total} bytes of GPU memory, over the cap of "
                   f"{cap_bytes}")
        else:
            with torch.cuda.device(transport.device), transport._cupy_device:
                try:
                    ptr = rt.malloc(total)
                    rt.memset(ptr, 0, total)
                    rt.deviceSynchronize()  # zeroed flags before any peer can see them
                    handle = rt.ipcGetMemHandle(ptr)
                except Exception as exc:  # noqa: BLE001 - out of memory: every rank falls back
                    if ptr:
                        rt.free(ptr)
                        ptr = 0
                    why = f"cannot allocate {total} bytes on {transport.device}: {exc}"
        gathered = store.all_gather_object(f"{key}/areas", rank, size, (why, handle), timeout)
        failed = [f"rank {r}: {w}" for r, (w, _) in enumerate(gathered) if w]
        if failed:
            if ptr:
                rt.free(ptr)
            return "; ".join(failed)
        opened: list[int] = []
        error = None
        with torch.cuda.device(transport.device), transport._cupy_device:
            try:
                for peer, (_, theirs) in enumerate(gathered):
                    if peer != rank:
                        opened.append(transport.map_peer(peer, theirs))
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = f"{type(exc).__name__}: {exc}"
        errors = store.all_gather_object(f"{key}/mapped", rank, size, error, timeout)
        if any(errors):
            with torch.cuda.device(transport.device), transport._cupy_device:
                for p in opened:
                    rt.ipcCloseMemHandle(p)
                # a peer may have mapped this area: freeing it under that mapping is undefined,
                # so it is kept (it goes with the process)
            raise FastcommError(
                f"rank {rank}: the ipc bucket region could not be mapped: "
                + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            )
        addresses = []
        it = iter(opened)
        for peer in range(size):
            addresses.append(ptr if peer == rank else next(it))
        bases = torch.tensor(addresses, dtype=torch.int64, device=transport.device)
        device_index = transport.device.index

        def free(p: int, rt=rt, cupy_device=transport._cupy_device) -> None:
            with torch.cuda.device(device_index), cupy_device:
                rt.free(p)

        memory = _DeviceMemory(free, ptr, total)
        return cls(transport, key, layout, memory, bases, opened)

    def _check_usable(self, op: str) -> None:
        super()._check_usable(op)
        self.transport._raise_if_unusable(op)

    def _run(self, bucket: PeerBucket, steps: list, descriptor: int, scale: float) -> Work:
        """Enqueues the steps on the transport's stream, after the caller's stream."""
        flat = bucket.flat
        return self.transport.enqueue(
            _OP, flat, lambda: self._execute(steps, flat.dtype, scale, descriptor)
        )

    def close(self) -> None:
        """Waits for the transport's stream, meets the peers, unmaps their areas; this rank's
        own is freed once every peer has unmapped it and its last view is gone. After a
        failure the ranks do not meet: the areas stay mapped until the processes end."""
        if self._closed:
            return
        self._closed = True
        t = self.transport
        t.stream.synchronize()
        healthy = t.failure() is None
        timeout = t.timeout
        if healthy:  # no kernel of any rank reads an area after this
            t.store.barrier(f"{self._key}/idle", self.size, timeout)
        with torch.cuda.device(t.device), t._cupy_device:
            for ptr in self._opened:
                t._rt.ipcCloseMemHandle(ptr)
        self._opened = []
        if healthy:
            t.store.barrier(f"{self._key}/unmapped", self.size, timeout)
            self._memory.may_free = True
        self.area = None  # the buckets' views keep the memory until they go
        self._memory = None

