"""Zero-copy buckets: gradients in communicator memory the peers read, reduced in place.

Where the communicator declares ``capabilities.shared_buckets`` (``shm``), the reducer asks it
for one region of shared memory (``bucket_region``) and lays its dense fp32/fp64 CPU buckets
out there instead of in private buffers. The ``.grad`` of each parameter is then its view in
that memory (``gradient_as_bucket_view``): autograd accumulates into it, or, where ``.grad`` was
``None`` (``zero_grad(set_to_none=True)``), the reducer copies the fresh gradient in as it
arrives, while it is still in cache. `SharedViewAllReduce` all-reduces such a bucket in place:
each rank reduces its slice straight out of every rank's bucket, the averaging factor folded in,
then copies the other slices out of the peers' buckets (``fastcomm.comm.shm.buckets``): no pack,
no staging into the communicator's slots, no copy back, no unpack.

Results: every element is ``sum over ranks, in rank order, of (grad * scale)``, each product
rounded in the dtype: the bits of the communicator's own ``PremulSum`` all-reduce, hence of the
packed path and of torch DDP (``tests/ddp/test_torch_parity.py``).

Default: on wherever the communicator offers it and ``gradient_as_bucket_view`` is left
``None``; then ``.grad`` aliases the bucket as with torch's ``gradient_as_bucket_view=True``
(``DDP.gradient_as_bucket_view`` says so). ``gradient_as_bucket_view=False`` keeps torch's
default aliasing (a ``.grad`` of its own, reduced by the communicator's ``all_reduce``), and
``shared_buckets=False`` turns the region off.

Memory: the region holds every rank's buckets, ``size`` times the model's gradient bytes (the
buckets' private buffers are not allocated: per rank the same bytes, now in ``/dev/shm``).
``shared_bucket_cap_mb`` (or ``FASTCOMM_DDP_SHARED_CAP_MB``) caps it; over the cap, or when
``/dev/shm`` cannot hold it, every rank warns once and keeps today's buffers.

Safety: a bucket is reduced only once every rank published that its gradients are in place;
the end of a synchronized backward (and a joined rank's shadow step) waits until every peer has
copied out of this rank's buckets (``BucketRegion.settle``), so that nothing (an optimizer's
in-place clip, the next backward, ``zero_grad``) writes a bucket a peer still reads. A comm hook
gets the bucket as with ``gradient_as_bucket_view`` (its ``buffer()`` is the shared bucket) and
reduces it with the communicator's collectives, as before. A rank that dies or times out makes
the others raise, naming it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from .bucket import Bucket
from .strategy import ViewAllReduce

__all__ = ["SHARED_VIEW", "SharedBuckets", "SharedViewAllReduce", "eligible"]


def eligible(param: torch.Tensor) -> bool:
    """Whether `param`'s gradient may live in shared bucket memory (dense fp32/fp64 CPU)."""
    from fastcomm.comm.shm.buckets import DTYPES

    return param.device.type == "cpu" and param.dtype in DTYPES


class SharedBuckets:
    """A reducer's shared bucket memory: the region and where each bucket sits in it.

    Build with :meth:`create` (a collective: every rank's reducer calls it).

    Attributes:
        region: the communicator's ``BucketRegion``.
    """

    def __init__(self, region) -> None:
        self.region = region

    @classmethod
    def create(
        cls,
        comm,
        params: Sequence[torch.Tensor],
        sparse: frozenset[int],
        cap_mb: float | None,
    ) -> SharedBuckets | None:
        """The region for `params` (the dense eligible ones), or ``None`` with a warning when
        the communicator cannot make it (over the cap, ``/dev/shm`` too small)."""
        from fastcomm.comm.shm.buckets import ALIGN, area_bytes_for

        chosen = [p for i, p in enumerate(params) if i not in sparse and eligible(p)]
        if not chosen:
            return None
        # buckets start at ALIGN boundaries: sizing each parameter so bounds any grouping
        area = area_bytes_for([-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in chosen])
        cap = None if cap_mb is None else int(cap_mb * 1024 * 1024)
        region = comm.bucket_region(area, len(chosen), cap)
        if isinstance(region, str):
            warnings.warn(
                f"fastcomm DDP (rank {comm.rank}): no shared-memory buckets ({region}); "
                "reducing through the communicator's collectives instead (set "
                "shared_bucket_cap_mb / FASTCOMM_DDP_SHARED_CAP_MB, or grow /dev/shm)",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        return cls(region)

    def place(self, buckets: Sequence[Bucket]) -> None:
        """Moves every eligible dense bucket's ``flat`` into the region (zeros), in order."""
        from fastcomm.comm.shm.buckets import ALIGN

        offset = 0
        slot = 0
        for bucket in buckets:
            if bucket.sparse:
                continue
            bucket.shared = None
            if not eligible(bucket.params[0]):
                continue
            shared = self.region.bucket(slot, offset, bucket.dtype, bucket.numel)
            shared.flat.zero_()
            bucket.use_flat(shared.flat)
            bucket.shared = shared
            slot += 1
            offset += -(-bucket.numel * bucket.flat.element_size() // ALIGN) * ALIGN

    def settle(self) -> None:
        """Waits until the peers have copied out of every bucket this rank launched."""
        self.region.settle()

    @property
    def stats(self):
        """Bytes this rank's in-place reductions moved (``RegionStats``)."""
        return self.region.stats


class SharedViewAllReduce(ViewAllReduce):
    """A bucket in shared memory: all-reduced in place out of the peers' buckets, its
    ``.grad`` the bucket view (see the module docstring)."""

    __slots__ = ()

    def launch(self, reducer, bucket: Bucket, grads):
        return bucket.shared.region.launch(bucket.shared, reducer.scale)

    def wait(self, reducer, bucket: Bucket, result) -> torch.Tensor:
        result.wait()
        return bucket.flat

    def shadow(self, reducer, bucket: Bucket):
        bucket.flat.zero_()
        return bucket.shared.region.launch(bucket.shared, 1.0)


SHARED_VIEW = SharedViewAllReduce()
