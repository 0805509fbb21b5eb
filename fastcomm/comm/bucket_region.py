"""What DDP asks of a shared bucket region, whichever backend hands it out.

A communicator whose ``capabilities.shared_buckets`` names a device type builds a region with
``bucket_region(area_bytes, max_buckets, cap_bytes, device=...)`` (a collective; it returns the
region or, on every rank, the reason it cannot). ``shm`` builds a
:class:`~fastcomm.comm.shm.buckets.ShmBucketRegion` on CPU, ``ipc`` a
:class:`~fastcomm.comm.ipc.cuda_region.CudaBucketRegion` on CUDA (its device-neutral part,
:class:`~fastcomm.comm.ipc.region.PeerBucketRegion`, runs on CPU in the tests). Both implement
these protocols; ``fastcomm.ddp.shared`` uses nothing else.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .bucket_stats import RegionStats

__all__ = ["BucketRegion", "Launched", "RegionBucket"]


@runtime_checkable
class RegionBucket(Protocol):
    """One bucket's place in a region: this rank's copy, where its gradients live."""

    index: int
    """Its position in launch order (every rank launches the buckets in this order)."""
    flat: torch.Tensor
    """This rank's copy, a view of region memory the peers read (the bucket's ``.grad`` views
    alias it)."""
    nbytes: int
    """Its bytes."""

    def stage(self, offset: int, grad: torch.Tensor) -> None:
        """Puts ``grad`` (contiguous, the bucket's dtype) at element ``offset`` before launch.
        A region whose ``stages`` is true may leave part of it where it is and read it there
        at launch; otherwise it is copied in whole."""
        ...

    def unstage(self) -> None:
        """Forgets pieces staged by a backward that never launched the bucket."""
        ...


@runtime_checkable
class Launched(Protocol):
    """A launched all-reduce of a bucket."""

    def wait(self) -> object:
        """Blocks until the bucket holds the result (or, on a CUDA stream, makes the caller's
        stream wait for it)."""
        ...


@runtime_checkable
class BucketRegion(Protocol):
    """Bucket memory every rank maps, all-reduced in place out of the peers' copies."""

    stages: bool
    """Whether :meth:`RegionBucket.stage` saves a copy (shm: the part in this rank's own slice
    is read where autograd left it); DDP stages fresh gradients only where it does."""
    starts_zeroed: bool
    """Whether its memory reads as zeros until written (shm's new pages; not CUDA's), so that
    a bucket laid out where none was needs no zeroing."""
    nbytes: int
    """Bytes of memory the region takes on this rank."""
    stats: RegionStats
    """Bytes this rank's in-place all-reduces moved."""
    comm_stats: object
    """The communicator's ``CommStats`` (each launch counts as one ``shared_all_reduce``), or
    ``None``; set by the communicator that built the region."""

    def bucket(self, index: int, offset: int, dtype: torch.dtype, numel: int) -> RegionBucket:
        """The bucket ``index`` at byte ``offset`` of every rank's area.

        Raises:
            TypeError: a dtype the region does not hold.
            ValueError: an index past the region's buckets, or a bucket off its alignment or
                past the area.
        """
        ...

    def launch(self, bucket: RegionBucket, factor: float) -> Launched:
        """Publishes that ``bucket``'s gradients are in place and starts its all-reduce: every
        rank's copy becomes the sum over ranks of the copies times ``factor``. Every rank
        launches the same buckets in the same order."""
        ...

    def settle(self) -> None:
        """Waits until no peer reads or writes this rank's copy of a launched bucket any more
        (the next backward may then write it)."""
        ...

    def close(self) -> None:
        """Refuses further launches; peers waiting on this rank raise."""
        ...
