"""Zero-copy buckets: gradients in communicator memory the peers read, reduced in place.

Where the communicator declares ``capabilities.shared_buckets`` for the model's device (shm:
CPU; ipc: CUDA), the dense buckets of ``SHARED_BUCKET_DTYPES`` live in one region every rank
maps (``bucket_region``), ``.grad`` is each parameter's view there, and
`SharedViewAllReduce` has each rank reduce its slice straight out of every rank's bucket
(averaging folded in): no pack, no staging, no copy back, no unpack.

Invariants: ``.grad`` aliases the shared bucket (``DDP.grads_are_bucket_views``); a bucket is
reduced only once every rank published that its gradients are in place; the end of a
synchronized backward (``settle``; on CUDA the bucket's last barrier, which the caller's
stream waits for) guarantees no peer reads or writes this rank's buckets any more. A rank
that dies or times out makes the others raise, naming it.

Results, defaults, memory and safety in detail: docs/ddp.md.
"""

from __future__ import annotations

import warnings

import torch

from fastcomm.comm.bucket_region import BucketRegion, Launched, RegionBucket
from fastcomm.comm.types import SHARED_BUCKET_DTYPES

from .bucket import Bucket
from .strategy import ViewAllReduce

__all__ = ["SHARED_VIEW", "SharedBuckets", "SharedViewAllReduce", "eligible"]

# Every bucket starts at a multiple of this in the region: shm's cache lines (64) and the
# ipc areas' aligned kernel accesses (256) alike.
BUCKET_ALIGN = 256
_PAGE = 4096  # shm's areas are whole pages


def eligible(param: torch.Tensor, device: torch.device) -> bool:
    """Whether `param`'s gradient may live in shared bucket memory on `device` (dense fp32/fp64
    on CPU, fp32/fp16/bf16 on CUDA: ``SHARED_BUCKET_DTYPES``)."""
    return param.device == device and param.dtype in SHARED_BUCKET_DTYPES.get(device.type, ())


def _padded(nbytes: int) -> int:
    return -(-nbytes // BUCKET_ALIGN) * BUCKET_ALIGN


class SharedBuckets:
    """A reducer's shared bucket memory: the region and where each bucket sits in it.

    Build with :meth:`create` (a collective: every rank's reducer calls it).

    Attributes:
        region: the communicator's region (a ``fastcomm.comm.bucket_region.BucketRegion``).
        staged: whether its buckets stage fresh gradients (the region's ``stages``: shm's
            do; ipc's would copy them in whole).
    """

    def __init__(self, region: BucketRegion, device: torch.device) -> None:
        self.region = region
        self.device = device
        self.staged = region.stages
        # bytes of the areas that may hold anything but zeros: a bucket laid out past them
        # needs no zeroing (a region that starts zeroed: shm's fresh pages), and its pages are
        # first touched by the gradients themselves
        self._written = 0 if region.starts_zeroed else float("inf")
        self.begin_layout()

    @classmethod
    def create(cls, comm, request, cap_mb: float | None) -> SharedBuckets | None:
        """The region `request` asks for (a ``plan.SharedRequest``: the device, the parameters
        whose buckets it holds), or ``None`` with a warning when the
        communicator cannot make it (over the cap, ``/dev/shm`` too small, the GPU out of
        memory). A collective: every rank's reducer calls it with the same request."""
        # buckets start at BUCKET_ALIGN boundaries: padding each parameter so bounds any
        # grouping
        area = _padded(sum(_padded(p.numel() * p.element_size()) for p in request.params))
        area = -(-area // _PAGE) * _PAGE
        cap = None if cap_mb is None else int(cap_mb * 1024 * 1024)
        region = comm.bucket_region(area, len(request.params), cap, device=request.device)
        if isinstance(region, str):
            warnings.warn(
                f"fastcomm DDP (rank {comm.rank}): no shared-memory buckets ({region}); "
                "reducing through the communicator's collectives instead (set "
                "shared_bucket_cap_mb / FASTCOMM_DDP_SHARED_CAP_MB, or grow /dev/shm or free "
                "GPU memory)",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        return cls(region, request.device)

    def begin_layout(self) -> None:
        """Starts laying out a new set of buckets from the region's beginning (a build or a
        rebuild: the old buckets' memory is reused)."""
        self._offset = self._slot = 0
        self._staged: list[RegionBucket] = []

    def take(self, bucket: Bucket) -> RegionBucket | None:
        """The region's bucket for a dense bucket being built, in build order (its memory
        zeroed), or ``None`` when it is not eligible (it keeps a buffer of its own)."""
        if not eligible(bucket.params[0], self.device):
            return None
        shared = self.region.bucket(self._slot, self._offset, bucket.dtype, bucket.numel)
        end = self._offset + _padded(shared.nbytes)
        if self._offset < self._written:
            shared.flat.zero_()
        self._written = max(self._written, end)
        if self.staged:
            self._staged.append(shared)
        self._slot += 1
        self._offset = end
        return shared

    def begin_backward(self) -> None:
        """Forgets gradient pieces staged by a backward that never launched their bucket (it
        raised, or stopped short of a reduction): a piece is read at its bucket's launch."""
        for shared in self._staged:
            shared.unstage()

    def settle(self) -> None:
        """Waits until no peer reads or writes a bucket this rank launched any more."""
        self.region.settle()

    @property
    def stats(self):
        """Bytes this rank's in-place reductions moved (``RegionStats``)."""
        return self.region.stats


class SharedViewAllReduce(ViewAllReduce):
    """A bucket in shared memory: all-reduced in place out of the peers' buckets, its
    ``.grad`` the bucket view (see the module docstring)."""

    __slots__ = ()

    def launch(self, reducer, bucket: Bucket, grads) -> Launched:
        return reducer.shared.region.launch(bucket.shared, reducer.scale)

    def wait(self, reducer, bucket: Bucket, result: Launched) -> torch.Tensor:
        result.wait()
        return bucket.flat

    def shadow(self, reducer, bucket: Bucket) -> Launched:
        bucket.flat.zero_()
        # ipc applies the factor to the sum, each rank to the chunk it reduces: the joined
        # rank passes the training ranks' factor (join.py keeps it)
        return reducer.shared.region.launch(bucket.shared, reducer.scale)


SHARED_VIEW = SharedViewAllReduce()
