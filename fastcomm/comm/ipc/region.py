"""ipc's shared DDP buckets, device-neutral: peer-mapped areas all-reduced in place.

Every rank holds one area of buckets that every peer maps; a bucket's all-reduce
(`bucket_steps`) is a ``peer_signal`` barrier, one ``peer_reduce`` launch in which rank ``r``
reduces chunk ``r`` out of every area and writes it into every area, and a second barrier.
`PeerBucketRegion` runs those steps at once in the calling thread: over CPU address tables
(Triton's interpreter, POSIX shared memory: the tests) that is the whole all-reduce; the CUDA
one (``cuda_region.CudaBucketRegion``) enqueues them on its transport's stream. Ordering,
bytes moved and memory: ``docs/ipc.md``.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from ...kernels._launch import fp32_scale
from ...kernels._peer_reduce import MAX_PEERS, launch_peer_reduce_table
from ...kernels._peer_signal import check_peer_signal, flag_area_words, launch_peer_signal
from ..bucket_stats import RegionStats
from ..errors import CommAbortedError, CommTimeoutError
from ..types import SHARED_BUCKET_DTYPES, ReduceOp
from ..work import Work
from .descriptor import (
    MAX_NUMEL,
    SETUP_DESCRIPTOR,
    call_descriptor,
    disagreement_error,
    timeout_message,
)
from .plan import ALIGN, Barrier, EpochClock, Reduce, two_shot_chunk

__all__ = [
    "DTYPES",
    "PeerBucket",
    "PeerBucketRegion",
    "RegionLayout",
    "bucket_steps",
    "region_layout",
]

#: dtypes a region holds (the kernel accumulates fp16/bf16 in fp32).
DTYPES = SHARED_BUCKET_DTYPES["cuda"]
BUCKET_OP = "bucket_all_reduce"


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
    """The steps of one bucket all-reduce on ``rank`` (``docs/ipc.md``); advances ``clock``.

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

    def stage(self, offset: int, grad: torch.Tensor) -> None:
        """Copies ``grad`` in whole at element ``offset`` (the region's ``stages`` is false:
        every part of it is read from this rank's area by some rank)."""
        flat = grad.view(-1)
        self.flat[offset : offset + flat.numel()].copy_(flat)

    def unstage(self) -> None:
        """Nothing is ever staged."""


class PeerBucketRegion:
    """The shared buckets of one DDP model over ranks that map each other's areas, a
    :class:`~fastcomm.comm.bucket_region.BucketRegion` (see
    ``docs/ipc.md``): the device-neutral part, which runs each launch at once.

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
    starts_zeroed = False
    """Its area is allocated, not cleared: every bucket is zeroed as it is laid out."""

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
        self._check_usable(BUCKET_OP)
        if bucket.region is not self:
            raise ValueError(f"rank {self.rank}: bucket {bucket.index} is another region's")
        flat = bucket.flat
        itemsize = flat.element_size()
        steps = bucket_steps(bucket.offset, flat.numel(), itemsize, self.rank, self.size,
                             self._clock)
        self._count(bucket, steps, itemsize)
        descriptor = call_descriptor(BUCKET_OP, flat.numel(), flat.dtype, ReduceOp.SUM)
        return self._run(bucket, steps, descriptor, fp32_scale(factor))

    def settle(self) -> None:
        """Nothing to wait for: a bucket's last barrier already says no peer touches this
        rank's copy any more (``docs/ipc.md``). Raises if the region failed."""
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
        return Work(BUCKET_OP, self.rank, bucket.flat, completed=True)

    def _verdict(self, elapsed: float) -> BaseException | None:
        words = self.control.tolist()
        if words[1] < 0:
            return disagreement_error(self.rank, words)
        if words[0] or words[1]:
            return CommTimeoutError(timeout_message(self.rank, BUCKET_OP, elapsed, self.timeout_s,
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

