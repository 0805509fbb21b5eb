"""`peer_reduce` across real processes: each rank maps its peers' POSIX shared-memory slots.

This is the kernel collectives' data path on CPU. Every rank exports one segment of its own
(an input slot and a result slot) and maps every peer's, so the same slot sits at a different
address in each process and each rank's kernel follows the addresses of its own mappings, as
it follows CUDA IPC mappings on a GPU. The two allreduce schedules run as in a transport:

- one-shot: every rank reduces all input slots into its own output;
- two-shot: rank ``r`` reduces chunk ``r`` of every input slot and pushes the result into
  chunk ``r`` of every rank's result slot (reduce-scatter and all-gather in one kernel).

Between the steps the ranks meet at a store barrier (a transport uses flags in the segment).
The kernels run in Triton's interpreter (`tests.harness.INTERPRETED_KERNELS`, on a CUDA machine
too); every rank checks its result against the torch reference over the same seeded inputs, bit
for bit except for bf16's interpreter truncation, and all ranks must agree exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import INTERPRETED_KERNELS, STATE, RankPool, map_peer_files, rank_store

from .helpers import HAS_TRITON

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory"),
    pytest.mark.timeout(300),
]

SLOT_BYTES = 1 << 16  # 64 KiB input slot + 64 KiB result slot per rank
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------- rank side
def _map_slots(name: str) -> None:
    """Maps every rank's segment (an input and a result slot) into this rank."""
    maps = map_peer_files(name, "peertest", 2 * SLOT_BYTES)
    raw = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    STATE["peer"] = {"maps": maps, "raw": raw, "name": name, "step": 0}


def _unmap() -> None:
    peer = STATE.pop("peer", None)
    if peer is None:
        return
    del peer["raw"]
    for m in peer["maps"]:
        m.close()


def _barrier(tag: str) -> None:
    peer = STATE["peer"]
    peer["step"] += 1
    rank_store().barrier(f"{peer['name']}/{tag}{peer['step']}", int(os.environ["WORLD_SIZE"]), 30)


def _inputs(world: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen).to(dtype) for _ in range(world)]


def allreduce_check(schedule: str, dtype_name: str, op: str, numel: int, seed: int):
    """Runs one allreduce through the peers' slots; returns (result, reference) as raw bits."""
    from fastcomm.kernels import peer_reduce, peer_reduce_reference

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dtype = DTYPES[dtype_name]
    raw = STATE["peer"]["raw"]
    inputs = [r[:SLOT_BYTES].view(dtype) for r in raw]  # every rank's input slot
    results = [r[SLOT_BYTES:].view(dtype) for r in raw]  # every rank's result slot
    mine = _inputs(world, numel, dtype, seed)
    inputs[rank][:numel].copy_(mine[rank])
    _barrier("in")
    out = torch.empty(numel, dtype=dtype)
    if schedule == "one-shot":
        peer_reduce([s[:numel] for s in inputs], [out], op=op)
    else:
        chunk = -(-numel // world)
        lo, hi = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
        if hi > lo:
            peer_reduce([s[lo:hi] for s in inputs], [d[lo:hi] for d in results], op=op)
        _barrier("pushed")
        out.copy_(results[rank][:numel])
    _barrier("read")  # nobody overwrites a slot another rank still reads
    want = torch.empty(numel, dtype=dtype)
    peer_reduce_reference(mine, [want], op=op)
    as_int = torch.int16 if dtype.itemsize == 2 else torch.int32
    return out.view(as_int).tolist(), want.view(as_int).tolist()


def allreduce_cases(schedule: str, dtype_name: str, cases: list[tuple[str, int, int]]):
    """`allreduce_check` for each (op, numel, seed): one round trip for many collectives."""
    return [allreduce_check(schedule, dtype_name, *case) for case in cases]


def mapped_addresses() -> list[int]:
    return [int(t.data_ptr()) for t in STATE["peer"]["raw"]]


# ---------------------------------------------------------------------- tests
@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"world{n}")
def pool(request):
    with RankPool(request.param, env=INTERPRETED_KERNELS, timeout=120) as p:
        p.run(_map_slots, f"w{request.param}-{os.getpid()}")
        yield p
        p.run(_unmap)


def test_each_process_maps_its_peers_at_its_own_addresses(pool):
    addresses = pool.run(mapped_addresses)
    # the same slot of rank r, seen from two processes, is (almost surely) at two addresses;
    # what matters is that every process reads through its own table, not the exporter's
    assert all(len(set(a)) == pool.world_size for a in addresses)


# 1 element, fewer elements than ranks, not divisible by the world size, several blocks
SIZES = [1, 3, 1001, 2 * 2048 + 5]
OPS = ["sum", "avg", "max", "min"]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("schedule", ["one-shot", "two-shot"])
def test_allreduce_through_peer_slots(pool, schedule, dtype_name):
    cases = [(op, n, n * 7 + i) for i, op in enumerate(OPS) for n in SIZES]
    per_rank = pool.run(allreduce_cases, schedule, dtype_name, cases)
    for k, (op, numel, _) in enumerate(cases):
        what = f"{schedule} {op} of {numel} x {dtype_name} on {pool.world_size} ranks"
        got0, want = per_rank[0][k]
        for got, _ in (results[k] for results in per_rank):
            assert got == got0, f"{what}: ranks disagree (results must be bit-identical)"
        if dtype_name == "bfloat16" and op in ("sum", "avg"):
            # the interpreter truncates fp32 -> bf16: at most 1 ulp toward zero
            assert max(abs(a - b) for a, b in zip(got0, want, strict=True)) <= 1, what
        else:
            assert got0 == want, what
