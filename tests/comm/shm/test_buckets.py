"""shm bucket regions (``fastcomm/comm/shm/buckets.py``): in-place all-reduce of buckets that
live in shared memory, read straight out of the peers' buckets, each rank's slice of the result
pushed into every rank's bucket.

Real ranks and real shared memory (2 and 3 ranks; equal factors reduce in the compiled core,
mixed ones through torch ops, which must give the same bits). Every rank builds every rank's
data from the same seeds, so the reference is computed locally: the sum in rank order of each
rank's data times its factor, each product rounded in the dtype (``atol=0``).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from fastcomm.comm import CommAbortedError, CommTimeoutError
from fastcomm.comm.bucket_region import BucketRegion, RegionBucket
from fastcomm.comm.shm.buckets import ALIGN, ShmBucketRegion, area_bytes_for
from fastcomm.comm.shm.core import BUILT
from fastcomm.comm.shm.segment import SHM_DIR
from tests.harness import fresh_comm, pool_fixture

TIMEOUT = 30.0
OP_TIMEOUT = 2.0
# (numel, dtype): sizes off the 64-byte grid, an empty bucket, and one of a few MiB
BUCKETS = [(1000, torch.float32), (0, torch.float32), (77, torch.float64), (1 << 20, torch.float32)]


def _data(rank: int, it: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * it + 10 * rank + numel % 7)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def _expected(n: int, it: int, numel: int, dtype: torch.dtype, factors) -> torch.Tensor:
    expected = _data(0, it, numel, dtype) * factors[0]
    for q in range(1, n):
        expected = expected + _data(q, it, numel, dtype) * factors[q]
    return expected


def _region(comm, specs):
    area = area_bytes_for([n * torch.empty((), dtype=d).element_size() for n, d in specs])
    region = comm.bucket_region(area, len(specs))
    assert isinstance(region, ShmBucketRegion), region
    buckets, offset = [], 0
    for i, (numel, dtype) in enumerate(specs):
        buckets.append(region.bucket(i, offset, dtype, numel))
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        offset += -(-nbytes // ALIGN) * ALIGN
    # the protocol DDP types against (fastcomm.comm.bucket_region)
    assert isinstance(region, BucketRegion)
    assert all(isinstance(b, RegionBucket) for b in buckets)
    return region, buckets


# ---------------------------------------------------------------------- checks (every rank)
def check_reduce_in_place(name: str, iterations: int, factors: list[float]):
    torch.set_num_threads(1)
    comm = fresh_comm("shm", name, timeout=TIMEOUT)
    region, buckets = _region(comm, BUCKETS)
    leftover = os.path.exists(os.path.join(SHM_DIR, region.name))
    n, me = comm.size, comm.rank
    for it in range(iterations):
        for bucket, (numel, dtype) in zip(buckets, BUCKETS, strict=True):
            bucket.flat.copy_(_data(me, it, numel, dtype))
        for bucket in buckets:  # launched in order; the reductions advance as peers arrive
            region.launch(bucket, factors[me])
        for bucket, (numel, dtype) in zip(buckets, BUCKETS, strict=True):
            bucket.wait()
            expected = _expected(n, it, numel, dtype, factors)
            assert torch.equal(bucket.flat, expected), (it, numel, dtype)
        region.settle()
    stats = region.stats.per_gradient_byte()
    comm.close()
    return leftover, stats, region.stats.buckets


def _bounds(bucket) -> list[int]:
    """Where each rank's slice of ``bucket`` starts and the last one ends, in elements."""
    bounds = [0]
    for piece in bucket.slices[0]:
        bounds.append(bounds[-1] + piece.numel())
    return bounds


def check_push(name: str):
    """Rank 0 launches last, so its launches reduce its slice of each bucket at once and push
    it into every rank's bucket while the peers still wait (they reduce nothing before rank 0
    says so): the peers' buckets then hold the result in slice 0 and their raw gradients
    elsewhere, and rank 0's buckets are reduced but not finished. Each
    rank's bucket 0 is staged: its own slice half in the bucket, half a fresh gradient (the
    bucket holds inf there, which the reduction must not read)."""
    torch.set_num_threads(1)
    comm = fresh_comm("shm", name, timeout=TIMEOUT)
    specs = [(1 << 18, torch.float32), (77, torch.float64)]  # 1 MiB: many of the core's chunks
    region, buckets = _region(comm, specs)
    n, me = comm.size, comm.rank
    factors = [0.5] * n

    def raw_area(q: int, b: int) -> torch.Tensor:
        """What rank ``q`` wrote into bucket ``b`` of its area before launching it."""
        data = _data(q, 0, *specs[b])
        if b == 0:
            lo, hi = _bounds(buckets[0])[q : q + 2]
            data[(lo + hi) // 2 : hi] = float("inf")
        return data

    for b, bucket in enumerate(buckets):
        bucket.flat.copy_(raw_area(me, b))
    lo, hi = buckets[0].lo, buckets[0].hi
    fresh = _data(me, 0, *specs[0])[(lo + hi) // 2 :].clone()
    buckets[0].stage((lo + hi) // 2, fresh)
    if me != 0:
        for bucket in buckets:
            region.launch(bucket, factors[me])
        comm.store.set(f"launched/{me}", "1")
        comm.store.wait(["pushed"], timeout=TIMEOUT)
    else:
        comm.store.wait([f"launched/{r}" for r in range(1, n)], timeout=TIMEOUT)
        for bucket in buckets:
            region.launch(bucket, factors[me])
        # reduced and pushed, not finished: no peer has reduced them yet
        assert [b.phase for b in buckets] == [2, 2]
        slice_bytes = 0
        for b, bucket in enumerate(buckets):
            expected = _expected(n, 0, *specs[b], factors)
            bounds = _bounds(bucket)
            for q in range(n):
                area = bucket.slices[q]
                assert torch.equal(area[0], expected[: bounds[1]]), (b, q)  # pushed by rank 0
                for p in range(1, n):  # not reduced yet: what rank q wrote
                    raw = raw_area(q, b)[bounds[p] : bounds[p + 1]]
                    assert torch.equal(area[p], raw), (b, q, p)
            slice_bytes += bounds[1] * bucket.flat.element_size()
        # counted by the push itself: slice 0 written n times, read out of n - 1 peers
        assert (region.stats.written, region.stats.peer_read) == (
            n * slice_bytes,
            (n - 1) * slice_bytes,
        )
        comm.store.set("pushed", "1")
    for b, bucket in enumerate(buckets):
        bucket.wait()
        expected = _expected(n, 0, *specs[b], factors)
        # every slice of every rank's bucket holds the result: nothing is left to copy
        for q in range(n):
            assert torch.equal(torch.cat(bucket.slices[q]), expected), (b, q)
    region.settle()
    assert torch.equal(fresh, _data(me, 0, *specs[0])[(lo + hi) // 2 :])  # read, not written
    stats = region.stats
    result = (stats.per_gradient_byte(), stats.written, stats.peer_read)
    comm.barrier()  # no rank closes (marks itself closed) while a peer still checks
    comm.close()
    return result


def check_cap_and_full_dev_shm(name: str):
    comm = fresh_comm("shm", name, timeout=TIMEOUT)
    over_cap = comm.bucket_region(1 << 20, 4, cap_bytes=1 << 20)  # control blocks push it over
    real = os.posix_fallocate
    if comm.rank == 0:  # only the creator reserves the pages: /dev/shm "full" there

        def full(fd, offset, length):
            raise OSError(28, "No space left on device")

        os.posix_fallocate = full
    try:
        no_room = comm.bucket_region(1 << 20, 4)
    finally:
        os.posix_fallocate = real
    fine = comm.bucket_region(1 << 20, 4)  # the next one is made again
    comm.close()
    return over_cap, no_room, isinstance(fine, ShmBucketRegion)


def check_peer_killed(name: str):
    torch.set_num_threads(1)
    comm = fresh_comm("shm", name, timeout=TIMEOUT)
    region, buckets = _region(comm, BUCKETS[:1])
    dead = comm.size - 1
    if comm.rank == dead:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        region.launch(buckets[0], 1.0).wait()
    except CommAbortedError as exc:
        return str(exc), time.monotonic() - start
    raise AssertionError("the reduction finished although a peer died")


def check_peer_absent_times_out(name: str):
    comm = fresh_comm("shm", name, timeout=TIMEOUT)
    region, buckets = _region(comm, BUCKETS[:1])
    region.flags.timeout_s = OP_TIMEOUT
    absent = comm.size - 1
    if comm.rank == absent:  # stays away until every other rank has timed out
        comm.store.wait([f"timed-out/{r}" for r in range(absent)], timeout=TIMEOUT)
        comm.close()
        return None
    start = time.monotonic()
    try:
        region.launch(buckets[0], 1.0).wait()
    except CommTimeoutError as exc:
        result = str(exc), time.monotonic() - start
    comm.store.set(f"timed-out/{comm.rank}", "1")
    # this region failed: it says so at once, and the peer learns it too
    try:
        region.launch(buckets[0], 1.0)
    except CommAbortedError as exc:
        again = str(exc)
    comm.close()
    return result, again


# ---------------------------------------------------------------------- tests (pytest side)
@pytest.mark.skipif(not BUILT, reason="the compiled core is not built")
@pytest.mark.parametrize("numel", [0, 1, 77, (64 << 10) // 4 * 3 + 5])  # chunks and a tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nterms", [2, 3])
def test_core_reduce_pushes_each_chunk_into_outs(numel, dtype, nterms):
    """``_core.reduce(..., outs)``, as a region's push calls it: the result lands in ``out``
    (terms[0] itself) and in every one of ``outs`` (the other terms themselves, and a buffer of
    its own), with the bits of the reduction alone, each term times the scale."""
    from fastcomm.comm.shm import _core

    kind = {torch.float32: _core.KIND_F32, torch.float64: _core.KIND_F64}[dtype]
    terms = [_data(q, 5, numel, dtype) for q in range(nterms)]
    expected = terms[0] * 0.5
    for term in terms[1:]:
        expected = expected + term * 0.5
    spare = torch.full((numel,), float("nan"), dtype=dtype)
    outs = [*terms[1:], spare]
    _core.reduce(terms[0].data_ptr(), [t.data_ptr() for t in terms], numel, kind, _core.OP_SUM,
                 0.5, [o.data_ptr() for o in outs])
    for got in (terms[0], *outs):
        assert torch.equal(got, expected)
    one = torch.ones(1, dtype=dtype)
    with pytest.raises(ValueError, match="outs must not hold out"):
        _core.reduce(one.data_ptr(), [one.data_ptr()], 1, kind, _core.OP_SUM, 1.0,
                     [one.data_ptr()])
    with pytest.raises(ValueError, match="an out is a null address"):
        _core.reduce(one.data_ptr(), [one.data_ptr()], 1, kind, _core.OP_SUM, 1.0, [0])
    with pytest.raises(TypeError, match="sequences of addresses"):
        _core.reduce(one.data_ptr(), [one.data_ptr()], 1, kind, _core.OP_SUM, 1.0, 5)


pool = pool_fixture([2, 3], timeout=90)


@pytest.mark.parametrize("factors", [[0.5, 0.5, 0.5], [0.25, 1.0, 1 / 3]], ids=["same", "mixed"])
def test_buckets_reduce_in_place_with_the_communicators_bits(pool, unique_name, factors):
    n = pool.world_size
    results = pool.run(check_reduce_in_place, unique_name, 3, factors[:n])
    for leftover, stats, buckets in results:
        assert not leftover  # unlinked once every rank mapped it
        assert buckets == 3 * len(BUCKETS)
        # B written and (n - 1) B / n read from the peers, per gradient byte B (64-byte
        # slice boundaries move a few bytes between ranks)
        assert stats["written"] == pytest.approx(1.0, abs=0.01)
        assert stats["peer_read"] == pytest.approx((n - 1) / n, abs=0.02)
        assert stats["moved"] == pytest.approx(1 + (n - 1) / n, abs=0.02)


def test_each_rank_pushes_its_slice_into_every_bucket(pool, unique_name):
    n = pool.world_size
    results = pool.run(check_push, unique_name)
    for stats, written, peer_read in results:
        # each slice of ~B/n written n times, (n - 1) of the n terms read out of the peers
        assert stats["written"] == pytest.approx(1.0, abs=0.01)
        assert stats["peer_read"] == pytest.approx((n - 1) / n, abs=0.02)
        assert stats["moved"] == pytest.approx(1 + (n - 1) / n, abs=0.02)
        assert peer_read * n == written * (n - 1)  # at rank order: exact, slice for slice
    if n == 2:
        assert all(r[0]["moved"] == pytest.approx(1.5, abs=0.01) for r in results)


def test_cap_or_full_dev_shm_falls_back_on_every_rank(pool, unique_name):
    for over_cap, no_room, fine in pool.run(check_cap_and_full_dev_shm, unique_name):
        assert isinstance(over_cap, str) and "over the cap" in over_cap, over_cap
        assert isinstance(no_room, str) and "/dev/shm cannot hold" in no_room, no_room
        assert fine


def test_peer_killed_mid_reduction_fails_the_others_fast(pool, unique_name):
    failure = pool.expect_failure(check_peer_killed, unique_name)
    dead = pool.world_size - 1
    assert list(failure.errors) == [dead] and "died" in failure.errors[dead]
    for rank in range(dead):
        message, elapsed = failure.results[rank]
        assert f"rank {dead}" in message and "exited" in message and "bucket" in message
        assert elapsed < TIMEOUT / 3, (elapsed, message)


def test_absent_peer_is_named_in_the_timeout(pool, unique_name):
    absent = pool.world_size - 1
    for result in pool.run(check_peer_absent_times_out, unique_name)[:-1]:
        (message, elapsed), again = result
        assert "timed out" in message and "bucket 0" in message, message
        assert str(absent) in message
        assert OP_TIMEOUT - 0.1 <= elapsed < TIMEOUT / 2, (elapsed, message)
        assert "failed earlier" in again, again
