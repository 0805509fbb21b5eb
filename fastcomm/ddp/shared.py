"""Zero-copy buckets: gradients in communicator memory the peers read, reduced in place.

Where the communicator declares ``capabilities.shared_buckets`` (``shm``), the reducer asks it
for one region of shared memory (``bucket_region``) and lays its dense fp32/fp64 CPU buckets
out there instead of in private buffers. The ``.grad`` of each parameter is then its view in
that memory (``gradient_as_bucket_view``): autograd accumulates into it, or, where ``.grad``
was ``None`` (``zero_grad(set_to_none=True)``), the reducer copies the fresh gradient in as it
arrives, still in cache -- for a gradient of ``STAGE_MIN_BYTES`` or more, only the parts the
peers reduce: the reduction reads the part in this rank's own slice where autograd left it and
writes the result into the bucket (``BucketRegion.stage``). `SharedViewAllReduce` all-reduces
such a bucket in place: each rank reduces its slice straight out of every rank's bucket, the
averaging factor folded in, then copies the other slices out of the peers' buckets
(``fastcomm.comm.shm.buckets``): no pack, no staging into the communicator's slots, no copy
back, no unpack.

Results: every element is ``sum over ranks, in rank order, of (grad * scale)``, each product
rounded in the dtype: the bits of the communicator's own ``PremulSum`` all-reduce, hence of the
packed path and of torch DDP (``tests/ddp/test_torch_parity.py``).

Default: on where the communicator offers it and the gradients average
``AUTO_MIN_MEAN_BYTES`` or more, with ``gradient_as_bucket_view`` left ``None``; always with
``gradient_as_bucket_view=True``. ``.grad`` then aliases the bucket as with torch's
``gradient_as_bucket_view=True`` (``DDP.grads_are_bucket_views``; ``DDP.gradient_as_bucket_view``
reports the argument, as torch's does). ``gradient_as_bucket_view=False`` keeps torch's default
aliasing (a ``.grad`` of its own, reduced by the communicator's ``all_reduce``), and
``shared_buckets=False`` (or ``FASTCOMM_DDP_SHARED_BUCKETS=0``) turns the region off.

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

import os
import warnings
from collections.abc import Sequence

import torch

from .bucket import Bucket
from .strategy import ViewAllReduce

__all__ = [
    "AUTO_MIN_MEAN_BYTES",
    "SHARED_VIEW",
    "STAGE_MIN_BYTES",
    "SharedBuckets",
    "SharedViewAllReduce",
    "eligible",
    "worth_sharing",
]

# A fresh gradient at least this large is staged (only the peers' parts copied in, its own
# slice read where autograd left it); a smaller one is copied whole: the staging's few slicing
# calls cost more than copying a few KiB (400 tiny gradients: ~1 ms a step).
STAGE_MIN_BYTES = 64 << 10
# By default (gradient_as_bucket_view=None) the buckets are shared only where the gradients
# average this many bytes: a bucket view costs a copy and a `.grad` store per gradient in
# Python (~2 us), which the packed path does in two foreach calls per bucket; with hundreds of
# tiny gradients that outweighs the collective's saving (200 x Linear(16, 16): 2.5 ms a step
# more CPU than the packed path on 2 ranks).
# (``FASTCOMM_DDP_SHARED_MIN_MEAN_BYTES`` overrides it: 0 shares every model's buckets).
AUTO_MIN_MEAN_BYTES = 16 << 10


def worth_sharing(params: Sequence[torch.Tensor], sparse: frozenset[int]) -> bool:
    """Whether the default puts `params`' buckets in shared memory (``AUTO_MIN_MEAN_BYTES``)."""
    text = os.environ.get("FASTCOMM_DDP_SHARED_MIN_MEAN_BYTES", "").strip()
    try:
        least = int(text) if text else AUTO_MIN_MEAN_BYTES
    except ValueError:
        raise ValueError(
            f"FASTCOMM_DDP_SHARED_MIN_MEAN_BYTES={text!r}: expected a number of bytes"
        ) from None
    sizes = [p.numel() * p.element_size() for i, p in enumerate(params) if i not in sparse]
    return bool(sizes) and sum(sizes) >= least * len(sizes)


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
