"""DDP bucket memory in shared memory, all-reduced in place out of the peers' buckets.

A :class:`ShmBucketRegion` is a second segment per DDP model: one area per rank, where autograd
accumulates that rank's gradients, read by every rank. Rank ``r`` reduces slice ``r`` of a bucket
straight out of every rank's area (each term times its rank's factor, in rank order) and pushes
the result into slice ``r`` of every area, so nothing is copied in or out. Two counters per rank
(``ready``, ``reduced``) order the passes. Layout, ordering and lifetime: ``docs/shm.md``.
"""

from __future__ import annotations

import os
import secrets
import struct
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..bucket_stats import RegionStats
from ..errors import CommAbortedError, FastcommError
from ..store import Store
from .core import PREMUL_KINDS, reduce_terms
from .flags import PeerFlags, fence
from .segment import (
    ABORTED,
    CLOSED,
    LINE,
    MAGIC,
    NAME_PATTERN,
    PAGE,
    SHM_DIR,
    Layout,
    Segment,
    attach_segment,
    pid_start_time,
    round_up,
    segment_name,
    sweep_stale,
    unlink_segment,
)

__all__ = ["ALIGN", "ShmBucketRegion", "RegionStats", "ShmBucket"]

ALIGN = 64  # every bucket and every slice boundary: no two ranks write one cache line
_READY, _REDUCED = 0, 1
_MBOX = 4096  # the Layout's mailbox size: a region has no send/recv, the smallest allowed
_BITS, _BITS_D = struct.Struct("<Q"), struct.Struct("<d")
_increment_version = torch._C._increment_version
#: dtypes a region holds (those whose PremulSum reduction is the communicator's own bits)
DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True, slots=True)
class _RegionLayout(Layout):
    """A communicator segment's control blocks, then one area of ``area_bytes`` per rank."""

    area_bytes: int = 0
    max_buckets: int = 1

    @property
    def ctrl_stride(self) -> int:
        """Bytes of one rank's control block: the segment's lines, then the factor words."""
        return round_up(max(4 + 2 * self.size, 8) * LINE + 8 * self.max_buckets, PAGE)

    def counter(self, rank: int, kind: int) -> int:
        """Offset of ``rank``'s counter ``kind`` (the word after it: its sleep announcement)."""
        return self.ctrl(rank) + 4 * LINE + kind * LINE

    def factor(self, rank: int, index: int) -> int:
        """Offset of ``rank``'s factor word of bucket ``index``."""
        return self.ctrl(rank) + max(4 + 2 * self.size, 8) * LINE + 8 * index

    def area(self, rank: int) -> int:
        """Offset of ``rank``'s area."""
        return self.data + rank * self.area_bytes

    @property
    def total(self) -> int:
        return self.data + self.size * self.area_bytes


class ShmBucket:
    """One bucket's place in the region: ``flat`` (this rank's, where its gradients live),
    every rank's copy of each slice, and where this iteration's reduction stands.

    Attributes:
        index: the bucket's position in launch order.
        flat: this rank's bucket (a view of its area).
        nbytes: the bucket's bytes.
    """

    __slots__ = ("index", "flat", "nbytes", "slices", "terms", "numel_mine", "phase",
                 "serial", "kind", "region", "lo", "hi", "sources")

    def __init__(self, region: ShmBucketRegion, index: int, views: list[torch.Tensor]) -> None:
        self.region = region
        self.index = index
        me, n = region.rank, region.size
        self.flat = views[me]
        self.nbytes = self.flat.numel() * self.flat.element_size()
        esize = self.flat.element_size()
        count = self.flat.numel()
        align = ALIGN // esize
        bounds = [0] + [(p * count // n) // align * align for p in range(1, n)] + [count]
        sizes = [bounds[p + 1] - bounds[p] for p in range(n)]
        # slices[q][p]: slice p of rank q's bucket
        self.slices = [v.split(sizes) for v in views]
        # every rank's copy of this rank's slice: the terms of its reduction, and where the
        # result goes
        self.terms = [self.slices[q][me] for q in range(n)]
        self.numel_mine = sizes[me]
        self.lo, self.hi = bounds[me], bounds[me + 1]  # this rank's slice, in elements
        # this iteration's pieces of this rank's slice whose terms are still in private memory
        # (a fresh gradient): (start, flat tensor) in order, read in place by the reduction
        self.sources: list[tuple[int, torch.Tensor]] = []
        self.kind = PREMUL_KINDS.get(self.flat.dtype)
        self.phase = 3  # 0 launched, 1 ready published, 2 reduced and pushed, 3 finished
        self.serial = 0  # this bucket's place in the region's count of launches

    def wait(self) -> None:
        """Finishes this bucket's reduction (blocking)."""
        self.region.finish(self)

    def stage(self, offset: int, grad: torch.Tensor) -> None:
        """Puts ``grad`` (contiguous, the bucket's dtype) at element ``offset`` of this rank's
        bucket before launch: the parts the peers reduce are copied in (they read them from
        here); the part in this rank's own slice stays where it is and the reduction reads it
        there, so it is neither copied in nor back."""
        flat = grad.view(-1)
        end = offset + flat.numel()
        lo, hi = max(offset, self.lo), min(end, self.hi)
        if lo >= hi:
            self.flat[offset:end].copy_(flat)
            return
        if offset < lo:
            self.flat[offset:lo].copy_(flat[: lo - offset])
        if hi < end:
            self.flat[hi:end].copy_(flat[hi - offset :])
        self.sources.append((lo, flat[lo - offset : hi - offset]))

    def unstage(self) -> None:
        """Forgets pieces staged by a backward that never launched this bucket."""
        self.sources.clear()


class ShmBucketRegion:
    """The shared bucket memory of one DDP model over an ``shm`` communicator's ranks, a
    :class:`~fastcomm.comm.bucket_region.BucketRegion`.

    Build with :meth:`setup` on every rank (a collective); see the module docstring.

    Attributes:
        stats: bytes moved by this rank's reductions (:class:`RegionStats`).
        nbytes: bytes of the whole segment (every rank's area and the control blocks).
    """

    stages = True
    """Its buckets take fresh gradients' slices where autograd left them, copied at launch
    (:meth:`ShmBucket.stage`), as well as whole copies."""
    starts_zeroed = True
    """A new segment's pages read as zeros (``posix_fallocate`` of a new file): a bucket laid
    out where no bucket was needs no zeroing."""

    def __init__(self, name: str, layout: _RegionLayout, mm, rank: int, timeout_s: float,
                 spin_us: float, yield_us: float) -> None:
        self.name = name
        self.layout = layout
        self.rank = rank
        self.size = layout.size
        self.nbytes = layout.total
        self._mm = mm
        seg = Segment(name, layout, mm)  # the flags read a Segment's mapping and identities
        seg._put(layout.misc(rank, 2), os.getpid())
        seg._put(layout.misc(rank, 3), pid_start_time(os.getpid()) or 0)
        self._seg = seg
        self._timeout_s = timeout_s
        self._spin_us, self._yield_us = spin_us, yield_us
        self.flags: PeerFlags | None = None  # made once every rank recorded its identity
        self._u8 = torch.frombuffer(mm, dtype=torch.uint8)
        self.stats = RegionStats()
        # the communicator's CommStats: each launched bucket counts as one
        # "shared_all_reduce" of its bytes (set by ShmCommunicator.bucket_region)
        self.comm_stats = None
        self._launched = 0  # buckets launched (= this rank's ready counter once published)
        # launched buckets in order: not yet reduced here, and reduced here but not finished
        # (waiting for a peer's push); a bucket is reduced as soon as every peer is ready for
        # it, whether or not the buckets before it are finished
        self._unreduced: list[ShmBucket] = []
        self._unfinished: list[ShmBucket] = []
        self._broken: BaseException | None = None
        self._pid = os.getpid()

    # ------------------------------------------------------------------ setup
    @classmethod
    def setup(
        cls,
        store: Store,
        key: str,
        rank: int,
        size: int,
        area_bytes: int,
        max_buckets: int,
        timeout: timedelta,
        *,
        cap_bytes: int | None = None,
        spin_us: float = 0.0,
        yield_us: float = 1000.0,
    ) -> ShmBucketRegion | str:
        """Every rank maps rank 0's segment of ``size`` areas of ``area_bytes``; rank 0 unlinks
        its name once all have. Returns the region, or on every rank the reason it could not be
        made (over ``cap_bytes``, ``/dev/shm`` too small): the caller falls back.

        Args:
            store: the communicator's store namespace.
            key: a store key prefix unique to this region (the same on every rank).
            rank: this rank.
            size: the number of ranks.
            area_bytes: bytes of each rank's area (a multiple of 4096).
            max_buckets: the most buckets it will hold (one factor word each).
            timeout: limit of every wait (setup and the reductions).
            cap_bytes: the most bytes the segment may take (``None``: no cap).
            spin_us, yield_us: the waits' polling (:class:`~.flags.PeerFlags`).

        Raises:
            FastcommError: a rank could not map the segment rank 0 made.
            StoreTimeoutError: a rank did not answer within ``timeout``.
        """
        if area_bytes < 0 or area_bytes % PAGE:
            raise ValueError(f"area_bytes must be a multiple of {PAGE} >= 0, got {area_bytes}")
        if max_buckets < 1:
            raise ValueError(f"max_buckets must be >= 1, got {max_buckets}")
        layout = _RegionLayout(size, PAGE, _MBOX, area_bytes, max_buckets)
        keys = [f"{key}/mapped/{r}" for r in range(size)]
        path = None
        try:
            if rank == 0:
                name, mm, why = _create_region(layout, cap_bytes)
                if mm is None:
                    store.set(f"{key}/name", f"fallback: {why}")
                    return why
                path = os.path.join(SHM_DIR, name)
                store.set(f"{key}/name", name)
            else:
                raw = store.get(f"{key}/name", timeout).decode("utf-8", "replace")
                if raw.startswith("fallback: "):
                    return raw.removeprefix("fallback: ")
                if not NAME_PATTERN.fullmatch(raw):
                    raise FastcommError(
                        f"rank {rank}: the store's {key}/name {raw[:80]!r} is not a segment name"
                    )
                name = raw
                try:
                    mm = attach_segment(os.path.join(SHM_DIR, name), layout, rank)
                except FastcommError as exc:
                    store.set(keys[rank], f"error: {exc}")
                    raise
            region = cls(name, layout, mm, rank, timeout.total_seconds(), spin_us, yield_us)
            store.set(keys[rank], b"1")
            store.wait(keys, timeout, op="shm bucket region setup")
            path = os.path.join(SHM_DIR, name)
            for r in range(size):
                value = store.get(keys[r], timeout)
                if value != b"1":
                    raise FastcommError(
                        f"rank {rank}: shm bucket region setup failed on rank {r}: "
                        f"{value.decode('utf-8', 'replace').removeprefix('error: ')}"
                    )
            region.flags = PeerFlags(
                region._seg, rank, region._timeout_s, spin_us, yield_us
            )
            return region
        finally:
            if path is not None:
                unlink_segment(path)

    def views(self, offset: int, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        """Every rank's ``numel`` elements of ``dtype`` at byte ``offset`` of its area."""
        esize = torch.empty((), dtype=dtype).element_size()
        if offset % ALIGN or offset + numel * esize > self.layout.area_bytes:
            raise ValueError(
                f"a bucket of {numel} x {dtype} at offset {offset} does not fit an area of "
                f"{self.layout.area_bytes} bytes at {ALIGN}-byte alignment"
            )
        out = []
        for r in range(self.size):
            start = self.layout.area(r) + offset
            out.append(self._u8[start : start + numel * esize].view(dtype))
        return out

    def bucket(self, index: int, offset: int, dtype: torch.dtype, numel: int) -> ShmBucket:
        """The bucket ``index`` at byte ``offset`` of every area."""
        if dtype not in DTYPES:
            raise TypeError(f"a shared bucket holds {DTYPES}, got {dtype}")
        if not 0 <= index < self.layout.max_buckets:
            raise ValueError(
                f"bucket index {index} out of range: the region holds {self.layout.max_buckets}"
            )
        return ShmBucket(self, index, self.views(offset, dtype, numel))

    # ------------------------------------------------------------------ the all-reduce
    def launch(self, bucket: ShmBucket, factor: float) -> ShmBucket:
        """Publishes that ``bucket``'s gradients are in place (its term is ``flat * factor``)
        and advances what can advance without waiting. Every rank launches the same buckets in
        the same order."""
        self._check_usable("launch")
        if bucket.phase != 3:
            raise RuntimeError(
                f"rank {self.rank}: shared bucket {bucket.index} launched twice in one iteration"
            )
        flags, layout = self.flags, self.layout
        if self.comm_stats is not None:
            self.comm_stats.count("shared_all_reduce", bucket.nbytes)
        try:  # a failure here leaves this rank out of step: the peers must fail fast too
            bucket.serial = self._launched = self._launched + 1
            bucket.phase = 0
            flags.words[layout.factor(self.rank, bucket.index) // 8] = _BITS.unpack(
                _BITS_D.pack(float(factor))
            )[0]
            self._publish(_READY, bucket.serial)
        except BaseException as exc:
            self._abort("shm bucket all_reduce", exc)
        bucket.phase = 1
        self._unreduced.append(bucket)
        self.poll()
        return bucket

    def poll(self) -> None:
        """Reduces the launched buckets, in order, as far as the peers are ready, and finishes
        those every peer has pushed, without waiting."""
        try:
            self._advance()
        except BaseException as exc:
            self._abort("shm bucket all_reduce", exc)

    def finish(self, bucket: ShmBucket) -> None:
        """Waits until ``bucket`` (and every bucket launched before it) is finished here: its
        slice reduced and pushed by every rank, the whole result in this rank's area."""
        try:
            while True:
                self._advance()
                if bucket.phase == 3:
                    return
                # wait for what comes first in the order every rank follows: the peers'
                # `ready` of the next bucket to reduce (while this one is not reduced), then
                # their `reduced` of the oldest unfinished one (they need nothing more of us)
                if bucket.phase == 1:
                    head, kind = self._unreduced[0], _READY
                else:
                    head, kind = self._unfinished[0], _REDUCED
                self._peers_reached(kind, head.serial, head.index, block=True)
        except BaseException as exc:
            self._abort("shm bucket all_reduce", exc)

    def settle(self) -> None:
        """Waits until no peer reads or writes this rank's area any more, so that the next
        backward may write it (module docstring): until every bucket this rank launched is
        finished here, which says every peer has pushed its slice of it. Nothing to wait for
        after every bucket's ``wait()``."""
        self._check_usable("settle")
        last = self._unreduced or self._unfinished
        if last:
            self.finish(last[-1])

    def _advance(self) -> None:
        """Reduces every launched bucket the peers are ready for, then finishes every reduced
        one the peers have pushed (each in launch order), without waiting."""
        unreduced, unfinished = self._unreduced, self._unfinished
        while unreduced:
            bucket = unreduced[0]
            if not self._peers_reached(_READY, bucket.serial, bucket.index, block=False):
                break
            self._reduce(bucket)
            self._publish(_REDUCED, bucket.serial)
            bucket.phase = 2
            unfinished.append(unreduced.pop(0))
        while unfinished:
            bucket = unfinished[0]
            if not self._peers_reached(_REDUCED, bucket.serial, bucket.index, block=False):
                break
            bucket.phase = 3  # every peer pushed its slice into this rank's area
            unfinished.pop(0)

    def _peers_reached(self, kind: int, target: int, index: int, block: bool) -> bool:
        flags, layout = self.flags, self.layout
        words = flags.words
        start = time.monotonic()
        for p in flags.peers:
            idx = layout.counter(p, kind) // 8
            if words[idx] >= target:
                continue
            if not block:
                return False
            what = "ready" if kind == _READY else "reduced"
            flags.wait_word(
                idx, target, p, f"shm bucket all_reduce (bucket {index}: waiting for {what})",
                start, announce_idx=layout.counter(self.rank, kind) // 8 + 1,
            )
        if flags.fenced:
            fence()
        return True

    def _publish(self, kind: int, value: int) -> None:
        """Stores this rank's counter ``kind`` (after its data stores) and wakes the peers
        that announced they sleep on it."""
        flags, layout = self.flags, self.layout
        idx = layout.counter(self.rank, kind) // 8
        for p in flags.peers:
            flags.set_word(idx, value, layout.counter(p, kind) // 8 + 1)

    def _factors(self, index: int) -> list[float]:
        words, layout = self.flags.words, self.layout
        return [
            _BITS_D.unpack(_BITS.pack(words[layout.factor(q, index) // 8]))[0]
            for q in range(self.size)
        ]

    def _reduce(self, bucket: ShmBucket) -> None:
        """Slice ``rank`` of every rank's bucket = the sum over ranks, in rank order, of each
        rank's slice times its factor (each product rounded in the dtype)."""
        terms, n = bucket.terms, self.size
        numel = bucket.numel_mine
        factors = self._factors(bucket.index)
        esize = bucket.flat.element_size()
        st = self.stats
        st.buckets += 1
        st.gradient_bytes += bucket.nbytes
        st.read += n * numel * esize
        st.peer_read += (n - 1) * numel * esize
        st.written += n * numel * esize  # into this rank's area and each peer's
        if not numel:
            bucket.sources.clear()
            return
        if not bucket.sources:
            self._reduce_range(terms, terms, factors, bucket.kind)
            return
        # pieces whose term is a private gradient, and the gaps between them (in the bucket)
        lo, me = bucket.lo, self.rank
        position = 0
        bucket.sources.sort(key=lambda entry: entry[0])  # gradients arrive in any order
        for start, source in bucket.sources:
            if start - lo > position:
                rng = slice(position, start - lo)
                piece = [t[rng] for t in terms]
                self._reduce_range(piece, piece, factors, bucket.kind)
            position = start - lo + source.numel()
            rng = slice(start - lo, position)
            outs = [t[rng] for t in terms]
            piece = [source if q == me else t for q, t in enumerate(outs)]
            self._reduce_range(outs, piece, factors, bucket.kind)
        if position < numel:
            rng = slice(position, numel)
            piece = [t[rng] for t in terms]
            self._reduce_range(piece, piece, factors, bucket.kind)
        bucket.sources.clear()

    def _reduce_range(self, outs, terms, factors, kind) -> None:
        """Every ``outs[q]`` (rank ``q``'s copy of this rank's slice, or a range of it) = the
        sum of ``terms[q] * factors[q]`` in rank order. ``terms[q]`` is ``outs[q]`` itself, or
        (this rank's term) the private gradient autograd left."""
        numel = outs[0].numel()
        if not numel:
            return
        same = all(f == factors[0] for f in factors)
        # The compiled core reduces into outs[0] (it may alias terms[0]: rank 0's slice is
        # read before written) and copies each 64 KiB chunk of the result into the other outs
        # while it is in cache, after every term of the chunk was read (each of outs is its
        # term, or not a term at all)
        if same and kind is not None:
            reduce_terms(outs[0].data_ptr(), [t.data_ptr() for t in terms], numel, kind,
                         factors[0], [o.data_ptr() for o in outs[1:]])
            _increment_version(outs)  # the core wrote the bytes behind torch's back
            return
        acc = terms[0] * factors[0]
        for term, factor in zip(terms[1:], factors[1:], strict=True):
            acc.add_(term * factor)
        for out in outs:
            out.copy_(acc)

    # ------------------------------------------------------------------ failure, lifetime
    def _check_usable(self, op: str) -> None:
        if self._broken is not None:
            raise CommAbortedError(
                f"rank {self.rank}: {op} refused: this shm bucket region failed earlier "
                f"({self._broken})"
            )

    def _abort(self, op: str, exc: BaseException) -> None:
        """Marks this rank ABORTED in the region (the peers then fail fast) and re-raises."""
        if self._broken is None:
            self._broken = exc
            if self.flags is not None and os.getpid() == self._pid:
                self.flags.mark(ABORTED, f"{op} failed: {type(exc).__name__}: {exc}")
                for kind in (_READY, _REDUCED):
                    self.flags.wake(self.layout.counter(self.rank, kind) // 8)
        raise exc

    def close(self) -> None:
        """Marks this rank closed in the region (peers waiting on it raise at once)."""
        if self.flags is not None and self._broken is None and os.getpid() == self._pid:
            self.flags.mark(CLOSED, "closed")
            for kind in (_READY, _REDUCED):
                self.flags.wake(self.layout.counter(self.rank, kind) // 8)
            self._broken = CommAbortedError(f"rank {self.rank}: the bucket region was closed")


def _create_region(layout: _RegionLayout, cap_bytes: int | None):
    """Rank 0's segment: ``(name, mapping, "")``, or ``(None, None, why)`` when it is over the
    cap or ``/dev/shm`` cannot hold it (its pages are reserved here, not on first touch)."""
    import mmap

    total = layout.total
    if cap_bytes is not None and total > cap_bytes:
        return None, None, (
            f"the shared buckets need {total} bytes of /dev/shm, over the cap of {cap_bytes}"
        )
    sweep_stale()
    name = segment_name(f"b{secrets.token_hex(6)}")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return None, None, f"cannot create {path}: {exc}"
    try:
        os.ftruncate(fd, total)
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            unlink_segment(path)
            free = _shm_free()
            return None, None, (
                f"/dev/shm cannot hold the shared buckets' {total} bytes ({free} free): {exc}"
            )
        mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        unlink_segment(path)
        return None, None, f"cannot map {path} ({total} bytes): {exc}"
    finally:
        os.close(fd)
    struct.pack_into("<5Q", mm, 0, MAGIC, layout.size, layout.slot_bytes, layout.mbox_bytes,
                     total)
    return name, mm, ""


def _shm_free() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def area_bytes_for(nbytes: list[int]) -> int:
    """The area that holds buckets of ``nbytes`` each at ``ALIGN``, rounded up to a page."""
    return round_up(sum(round_up(b, ALIGN) for b in nbytes), PAGE)
