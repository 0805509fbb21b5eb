"""ipc's shared DDP buckets (``fastcomm/comm/ipc/region.py``, ``cuda_region.py``): the plan,
the region across processes, DDP on it, and the CUDA region on a GPU.

- The plan (`region_layout`, `bucket_steps`) is plain host logic, checked exactly.
- The *CPU twin*: every rank maps its peers' areas (POSIX shared memory, the layout a CUDA
  region has) and builds a `PeerBucketRegion` over CPU address tables: the region's own code
  runs the same kernels as on a GPU (``peer_signal``, ``peer_reduce_table``, in Triton's
  interpreter), at once instead of on a stream. Checked: results against the torch reference
  over 2 and 3 ranks and three dtypes, every rank's area holding the whole result after the
  launch (nothing copied in or out), the bytes counted, ranks launching different buckets
  (every rank raises, naming both), a rank that never launches (a timeout naming it), and
  fastcomm DDP training on the twin region exactly as torch DDP does (join included).
- GPU (``@pytest.mark.gpu``, skipped without CUDA): fastcomm DDP on the ``ipc`` communicator,
  2 ranks sharing GPU 0, with its buckets in a `CudaBucketRegion`, against torch's result.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from fastcomm.comm.bucket_region import BucketRegion, RegionBucket
from fastcomm.comm.errors import CommAbortedError, CommTimeoutError, FastcommError
from fastcomm.comm.ipc.descriptor import call_descriptor, describe_call
from fastcomm.comm.ipc.plan import ALIGN, Barrier, EpochClock, Reduce
from fastcomm.comm.ipc.region import (
    PeerBucketRegion,
    bucket_steps,
    region_layout,
)
from fastcomm.comm.types import ReduceOp
from fastcomm.kernels._peer_signal import CONTROL_WORDS, flag_area_words
from tests.harness import INTERPRETED_KERNELS, map_peer_files, pool_fixture, rank_comm

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------- plan and layout
@pytest.mark.parametrize("size", [1, 2, 3, 16])
def test_layout_puts_the_flags_after_the_buckets(size):
    layout = region_layout(10_000, size, 7)
    assert layout.flags_offset >= 10_000 and layout.flags_offset % ALIGN == 0
    assert layout.total_bytes >= layout.flags_offset + 8 * flag_area_words(size)
    assert layout.max_buckets == 7
    with pytest.raises(ValueError, match="1..16 ranks, got 17"):
        region_layout(4096, 17, 1)
    with pytest.raises(ValueError, match="max_buckets must be >= 1"):
        region_layout(4096, 2, 0)


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("numel", [1, 3, 64, 1001])
def test_every_rank_reduces_its_chunk_between_two_barriers(numel, size, itemsize):
    offset = 3 * ALIGN
    covered = []
    for rank in range(size):
        clock = EpochClock()
        clock.next_epoch()  # an earlier bucket's first barrier
        steps = bucket_steps(offset, numel, itemsize, rank, size, clock)
        assert steps[0] == Barrier(2) and steps[-1] == Barrier(3)
        assert clock.epoch == 3
        for step in steps[1:-1]:
            assert type(step) is Reduce and step.to_all  # into every rank's area
            assert step.src_byte == step.dst_byte  # in place
            first = (step.src_byte - offset) // itemsize
            covered.extend(range(first, first + step.numel))
    assert covered == list(range(numel))  # each element reduced once, by one rank


def test_bucket_descriptor_names_the_call():
    d = call_descriptor("bucket_all_reduce", 1000, torch.bfloat16, ReduceOp.SUM)
    assert d % 2 == 1 and 1 << 56 <= d < 1 << 63
    assert describe_call(d) == "bucket_all_reduce(bfloat16, 1000 elements, op sum)"


# ---------------------------------------------------------------------- CPU twin, processes
AREA = 64 << 10  # bytes of buckets per rank
TWIN_SPINS = 10**9  # the tests that time out pass their own bound


def _twin_region(name: str, max_spins: int = TWIN_SPINS) -> tuple[PeerBucketRegion, list]:
    """A region over every rank's area mapped in this process (zero-filled, as a CUDA area's
    memset leaves it): the layout, tables and control block of a `CudaBucketRegion`, on CPU."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    layout = region_layout(AREA, world, 16)
    maps = map_peer_files(name, "ipcregion", layout.total_bytes)
    raw = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    bases = torch.tensor([t.data_ptr() for t in raw], dtype=torch.int64)
    control = torch.zeros(CONTROL_WORDS, dtype=torch.int64)
    region = PeerBucketRegion(rank, world, layout, raw[rank], bases, control, max_spins, 30.0)
    return region, maps


def _close_twin(region, maps) -> None:
    region.close()
    region.area = None
    for m in maps:
        m.close()


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BUCKETS = [(0, 1), (ALIGN, 3), (2 * ALIGN, 1001), (20 * ALIGN, 2049)]  # (offset, numel)


def twin_all_reduce(name: str, dtype_name: str, iterations: int, factor: float):
    """Buckets of every size class launched ``iterations`` times; per launch, every rank's
    area (as this rank maps it) against the reference, as raw bits, and the stats."""
    from fastcomm.kernels import peer_reduce_reference

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dtype = DTYPES[dtype_name]
    as_int = torch.int16 if dtype.itemsize == 2 else torch.int32
    region, maps = _twin_region(name)
    try:
        raw = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        buckets = [region.bucket(i, off, dtype, n) for i, (off, n) in enumerate(BUCKETS)]
        # the protocol DDP types against (fastcomm.comm.bucket_region)
        assert isinstance(region, BucketRegion)
        assert all(isinstance(b, RegionBucket) for b in buckets)
        out = []
        for it in range(iterations):
            for b, (off, n) in zip(buckets, BUCKETS, strict=True):
                gen = torch.Generator().manual_seed(1000 * it + n)
                terms = [torch.randn(n, generator=gen).to(dtype) for _ in range(world)]
                b.flat.copy_(terms[rank])  # the gradients, written where the peers read them
                work = region.launch(b, factor)
                work.wait()
                want = torch.empty(n, dtype=dtype)
                peer_reduce_reference(terms, [want], op="sum", scale=factor)
                areas = [r[off : off + n * dtype.itemsize].view(dtype) for r in raw]
                out.append(([a.view(as_int).tolist() for a in areas],
                            want.view(as_int).tolist()))
            region.settle()
        assert region.control.tolist() == [0] * CONTROL_WORDS
        stats = region.stats
        return out, (stats.buckets, stats.gradient_bytes, stats.written, stats.peer_read,
                     stats.per_gradient_byte()["moved"])
    finally:
        _close_twin(region, maps)


def twin_disagree(name: str, numel: int):
    """An agreed bucket, then one of ``numel`` elements (this rank's); returns the error text,
    the seconds to it, and whether the next launch was refused."""
    region, maps = _twin_region(name)
    try:
        region.launch(region.bucket(0, 0, torch.float32, 8), 1.0)
        bucket = region.bucket(1, ALIGN, torch.float32, numel)
        start = time.monotonic()
        try:
            region.launch(bucket, 1.0)
        except FastcommError as exc:
            text, elapsed = str(exc), time.monotonic() - start
        else:
            raise AssertionError("a bucket its peer launched otherwise was reduced")
        try:
            region.launch(bucket, 1.0)
        except CommAbortedError:
            return text, elapsed, True
        return text, elapsed, False
    finally:
        _close_twin(region, maps)


def twin_missing(name: str, absent: int):
    """Every rank but ``absent`` launches a bucket; returns the error text and its type."""
    rank = int(os.environ["RANK"])
    region, maps = _twin_region(name, max_spins=200)
    try:
        if rank == absent:
            return None
        try:
            region.launch(region.bucket(0, 0, torch.float32, 64), 0.5)
        except CommTimeoutError as exc:
            return type(exc).__name__, str(exc)
        raise AssertionError("a bucket was reduced without its peer")
    finally:
        _close_twin(region, maps)


twin = pool_fixture([2, 3], env=INTERPRETED_KERNELS, timeout=240)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_twin_buckets_reduce_in_place_into_every_area(twin, dtype_name, unique_name):
    world = twin.world_size
    factor = 1.0 / world
    per_rank = twin.run(twin_all_reduce, unique_name, dtype_name, 2, factor)
    for k in range(2 * len(BUCKETS)):
        what = f"launch {k} of {dtype_name} on {world} ranks"
        areas0, want = per_rank[0][0][k]
        for areas, _ in (results[0][k] for results in per_rank):
            # every rank sees the same bits in every rank's area: nothing left to copy
            assert all(a == areas0[0] for a in areas), what
            assert areas == areas0, what
        if dtype_name == "bfloat16":
            # the interpreter truncates fp32 -> bf16: at most 1 ulp toward zero
            assert max((abs(a - b) for a, b in zip(areas0[0], want, strict=True)), default=0) <= 1
        else:
            assert areas0[0] == want, what
    itemsize = DTYPES[dtype_name].itemsize
    grad_bytes = 2 * sum(n * itemsize for _, n in BUCKETS)
    total_written = 0
    for buckets, gradient_bytes, written, peer_read, moved in (r[1] for r in per_rank):
        assert (buckets, gradient_bytes) == (2 * len(BUCKETS), grad_bytes)
        # each rank writes its chunk into every area and reads it out of every area
        assert peer_read * world == written * (world - 1)
        total_written += written
        assert moved <= 2.0 + 0.02
    assert total_written == world * grad_bytes  # the chunks partition every bucket
    if world == 2:
        assert all(r[1][4] == pytest.approx(1.5, abs=0.02) for r in per_rank)


def test_twin_ranks_launching_other_buckets_raise_on_every_rank(twin, unique_name):
    numels = [(1024,)] + [(1000,)] * (twin.world_size - 1)
    results = twin.run(twin_disagree, unique_name, per_rank=numels)
    for rank, (text, elapsed, refused) in enumerate(results):
        assert text.startswith(f"rank {rank}: bucket_all_reduce: collective mismatch"), text
        mine = 1024 if rank == 0 else 1000
        called = f"rank {rank} called bucket_all_reduce(float32, {mine} elements, op sum)"
        assert called in text, text
        assert elapsed < 60, (rank, elapsed)
        assert refused, f"rank {rank}: a failed region accepted another launch"


def test_twin_rank_that_never_launches_times_out_named(twin, unique_name):
    results = twin.run(twin_missing, unique_name, twin.world_size - 1)
    absent = twin.world_size - 1
    for rank, result in enumerate(results[:absent]):
        kind, text = result
        assert kind == "CommTimeoutError", (rank, result)
        assert f"rank {rank}: bucket_all_reduce" in text, text
        assert f"rank(s) [{absent}] never reached barrier 1" in text, text


# ---------------------------------------------------------------------- DDP on the twin
def _twin_comm(name: str):
    """The pool's shm communicator, its bucket memory a twin region (what ``ipc`` hands a
    CUDA model, here over CPU tables)."""
    comm = rank_comm("shm")
    made = []

    def bucket_region(area_bytes, max_buckets, cap_bytes=None, device="cpu"):
        rank, world = comm.rank, comm.size
        layout = region_layout(area_bytes, world, max_buckets)
        maps = map_peer_files(f"{name}-{len(made)}", "ddptwin", layout.total_bytes)
        raw = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        bases = torch.tensor([t.data_ptr() for t in raw], dtype=torch.int64)
        control = torch.zeros(CONTROL_WORDS, dtype=torch.int64)
        region = PeerBucketRegion(rank, world, layout, raw[rank], bases, control, TWIN_SPINS,
                                  30.0)
        region.comm_stats = comm.stats
        made.append((region, maps))
        return region

    comm.bucket_region = bucket_region
    return comm, made


def check_ddp_on_twin(name: str, divide_by_initial: bool | None):
    """fastcomm DDP with its buckets in a twin region against torch DDP (Gloo): the same
    parameters, bit for bit (2 ranks: one addition and a scale by a power of two per element);
    ``divide_by_initial`` not None: uneven inputs under ``join``."""
    from fastcomm.ddp import DDP
    from tests.ddp.common import assert_same_state, batches, build, init_torch_dist, step

    init_torch_dist()
    comm, made = _twin_comm(name)
    try:
        ours = DDP(build("mlp"), comm=comm, gradient_as_bucket_view=True)
        theirs = torch.nn.parallel.DistributedDataParallel(build("mlp"))
        assert ours.shared_buckets and isinstance(ours.reducer.shared.region, PeerBucketRegion)
        opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (ours, theirs)]
        comm.stats.reset()
        region = ours.reducer.shared.region
        if divide_by_initial is None:
            for x, y in batches("mlp", 4):
                for model, opt in opts:
                    step(model, opt, "mlp", x, y)
        else:
            rank = comm.rank
            for model, opt in opts:
                with model.join(divide_by_initial_world_size=divide_by_initial):
                    for x, y in batches("mlp", 2 + 2 * rank):
                        step(model, opt, "mlp", x, y)
        assert_same_state(ours, theirs)
        base = region.area.data_ptr()
        in_area = all(base <= p.grad.data_ptr() < base + region.nbytes
                      for p in ours.module.parameters())
        calls = dict(comm.stats.calls)
        return in_area, region.stats.per_gradient_byte(), calls.get("all_reduce", 0), calls.get(
            "shared_all_reduce", 0)
    finally:
        for region, maps in made:
            _close_twin(region, maps)


ddp_pool = pool_fixture(2, env=INTERPRETED_KERNELS, timeout=240)


def test_ddp_trains_on_twin_buckets_like_torch(ddp_pool, unique_name):
    for in_area, per_byte, all_reduces, shared in ddp_pool.run(check_ddp_on_twin, unique_name,
                                                               None):
        assert in_area  # .grad is the bucket in the area the peers read
        assert per_byte["moved"] == pytest.approx(1.5, abs=0.02)
        assert all_reduces == 0 and shared > 0  # no collective staged a bucket


@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_ddp_join_on_twin_buckets_like_torch(ddp_pool, unique_name, divide_by_initial):
    results = ddp_pool.run(check_ddp_on_twin, unique_name, divide_by_initial)
    assert all(r[0] for r in results)


def check_ipc_offers_cuda_buckets(name: str):
    """The ipc communicator's offer, and what it answers where CUDA cannot run."""
    from tests.harness import fresh_comm

    comm = fresh_comm("ipc", name)
    try:
        offered = comm.capabilities.shared_buckets
        try:
            comm.bucket_region(4096, 1, device="meta")
        except ValueError as exc:
            refused = str(exc)
        else:
            raise AssertionError("a bucket region on the meta device was made")
        # every rank gets the reason, none waits on a transport its peers lack
        answer = comm.bucket_region(4096, 1, device="cuda:0") if not torch.cuda.is_available() \
            else None
        return sorted(offered), refused, answer
    finally:
        comm.close()


def test_ipc_offers_cuda_buckets_and_falls_back_without_a_gpu(ddp_pool, unique_name):
    for offered, refused, answer in ddp_pool.run(check_ipc_offers_cuda_buckets, unique_name):
        assert offered == ["cuda"]
        assert "bucket memory on cpu or cuda, got meta" in refused
        if not torch.cuda.is_available():
            assert isinstance(answer, str) and "CUDA IPC transport is unavailable" in answer


# ---------------------------------------------------------------------- GPU


def gpu_ddp(name: str, dtype_name: str, steps: int):
    """fastcomm DDP on an ``ipc`` communicator, the model on GPU 0 (every rank), against the
    reference: each rank computes every rank's gradients itself and averages them."""
    from fastcomm.ddp import DDP
    from tests.ddp.common import batches, build, loss_of
    from tests.harness import fresh_comm

    dtype = DTYPES[dtype_name]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    comm = fresh_comm("ipc", name)
    try:
        # the test model's gradients are tiny: shared on request (the default shares models
        # whose gradients average 16 KiB or more)
        ours = DDP(build("mlp").to("cuda:0", dtype), comm=comm, gradient_as_bucket_view=True)
        ref = build("mlp").to("cuda:0", dtype)
        assert ours.shared_buckets, "the ipc communicator did not hand out shared buckets"
        region = ours.reducer.shared.region
        errors = []
        for it, (x, y) in enumerate(batches("mlp", steps)):
            ours.zero_grad(set_to_none=it % 2 == 0)
            loss_of("mlp", ours(x.to("cuda:0", dtype)), y.to("cuda:0")).backward()
            # the reference: every rank's batch of this step through one model, averaged
            grads = []
            for r in range(world):
                rx, ry = batches("mlp", steps, seed=100 + r)[it]
                ref.zero_grad(set_to_none=True)
                loss_of("mlp", ref(rx.to("cuda:0", dtype)), ry.to("cuda:0")).backward()
                grads.append([p.grad.float().clone() for p in ref.parameters()])
            want = [sum(g[i] for g in grads) / world for i in range(len(grads[0]))]
            for p, w in zip(ours.module.parameters(), want, strict=True):
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                if not torch.allclose(p.grad.float(), w, rtol=tol, atol=tol):
                    errors.append(f"step {it}: {(p.grad.float() - w).abs().max().item()}")
        torch.cuda.synchronize()
        base = region.area.data_ptr()
        in_area = all(base <= p.grad.data_ptr() < base + region.nbytes
                      for p in ours.module.parameters())
        calls = dict(comm.stats.calls)
        digest = [p.grad.float().sum().item() for p in ours.module.parameters()]
        return (errors, in_area, region.stats.per_gradient_byte()["moved"],
                calls.get("all_reduce", 0), digest, rank)
    finally:
        comm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_gpu_ddp_on_ipc_reduces_in_the_peers_areas(gpu_pool, dtype_name, unique_name):
    results = gpu_pool.run(gpu_ddp, unique_name, dtype_name, 4)
    for errors, in_area, moved, all_reduces, _, rank in results:
        assert not errors, (rank, errors[:5])
        assert in_area, f"rank {rank}: .grad is not in the shared area"
        assert moved == pytest.approx(1.5, abs=0.02), (rank, moved)
        assert all_reduces == 0, f"rank {rank}: a bucket went through all_reduce"
    assert results[0][4] == results[1][4]  # both ranks hold the same gradients
