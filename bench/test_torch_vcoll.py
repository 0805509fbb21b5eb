"""The ``torch.distributed`` calls of unequal sizes on backend ``fastcomm`` beside a Gloo group
and MPICH, 4 KiB to 64 MiB, 2 and 4 ranks.

Ops (fp32; ``nbytes`` the root's whole buffer, or each rank's input, as nccl-tests counts):

- ``v_gather``: ``dist.gather`` to rank 0 (MPICH: ``Gatherv``);
- ``v_scatter``: ``dist.scatter`` from rank 0 (``Scatterv``);
- ``v_all_to_all_uneven``: ``dist.all_to_all_single`` with split sizes, rank ``q`` sending rank
  ``r`` one unit or two by ``(q + r) % 2`` (``Alltoallv``, the same counts);
- ``v_all_to_all_list``: ``dist.all_to_all`` of ``n`` tensors (equal sizes: Gloo refuses
  others; ``Alltoallv``).

The ranks (a pool started once per world size) hold the fastcomm default group and a Gloo group
beside it (``new_group(backend="gloo")``). A round times a block of ``k`` calls on each group in
turn, a barrier before each block; a figure is the median over rounds of the slower rank's
time per call, so the two backends' figures come from the same rounds (ratios in one run).
MPICH's row is one ``mpiexec -n N`` run of ``bench/mpi_collectives.py`` right after, with the
same block length. ``busbw = nbytes / time * (n - 1) / n``.

``test_call_cost``: where a 4 KiB all-to-all's time goes on the fastcomm group (the
communicator's even call, its v-call, ``dist.all_to_all_single`` without and with split sizes),
200 calls a round, 15 rounds, in ``extra_info["us_per_call"]``.

Filters: ``FASTCOMM_BENCH_VCOLL_OPS``, ``FASTCOMM_BENCH_WORLDS`` (default ``2,4``),
``FASTCOMM_BENCH_SIZES`` (default 4 KiB, 64 KiB, 1 MiB, 16 MiB, 64 MiB). Quick mode
(``--benchmark-disable``): 4 KiB, 2 ranks, one round of one call, no MPICH. Rows go to the
JSON's ``"collectives"`` list (``python bench/plot.py`` charts one figure per op).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from _torch_groups import init_groups
from mpi_collectives import uneven_counts
from test_collectives import (
    KIB,
    MIB,
    MPI_MAX_SECONDS,
    _env_list,
    _mpiexec,
    _parse_size,
    _parse_world,
    iterations_for,
    size_id,
)

from tests.harness import STATE, RankPool

QUICK = bool(os.environ.get("FASTCOMM_BENCH_QUICK")) or "--benchmark-disable" in sys.argv
ALL_OPS = ["v_gather", "v_scatter", "v_all_to_all_uneven", "v_all_to_all_list"]
OPS = _env_list("FASTCOMM_BENCH_VCOLL_OPS", ",".join(ALL_OPS), ALL_OPS)
SIZES = _env_list("FASTCOMM_BENCH_SIZES", "4KiB" if QUICK else "4KiB,64KiB,1MiB,16MiB,64MiB",
                  None, _parse_size)
WORLDS = _env_list("FASTCOMM_BENCH_WORLDS", "2" if QUICK else "2,4", None, _parse_world)
BACKENDS = ("fastcomm", "gloo")
TIMEOUT = 600.0


# ---------------------------------------------------------------------- rank side
def setup_ranks() -> None:
    STATE["vcoll"] = init_groups("bench-torch-vcoll", TIMEOUT)


def teardown_ranks() -> None:
    import torch.distributed as dist

    STATE.pop("vcoll", None)
    dist.destroy_process_group()


def make_call(op: str, nbytes: int, group):
    """The timed call of ``op`` on ``group`` (buffers made here) and a check of its result."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    numel = nbytes // 4 // n * n
    part = torch.full((numel // n,), float(rank + 1))
    rows = [torch.full((numel // n,), float(rank + 1)) for _ in range(n)]
    landing = [torch.empty(numel // n) for _ in range(n)]
    counts = uneven_counts(numel, n)
    sends, recvs = counts[rank], [counts[q][rank] for q in range(n)]
    inp = torch.full((sum(sends),), float(rank + 1))
    out = torch.empty(sum(recvs))
    senders = [float(q + 1) for q in range(n)]
    calls = {
        "v_gather": (lambda: dist.gather(part, landing if rank == 0 else None, 0, group=group),
                     lambda: rank != 0 or [t[0].item() for t in landing] == senders),
        "v_scatter": (lambda: dist.scatter(part, rows if rank == 0 else None, 0, group=group),
                      lambda: part[0].item() == 1.0),
        "v_all_to_all_uneven": (
            lambda: dist.all_to_all_single(out, inp, recvs, sends, group=group),
            lambda: [t[0].item() for t in out.split(recvs)] == senders),
        "v_all_to_all_list": (lambda: dist.all_to_all(landing, rows, group=group),
                              lambda: [t[0].item() for t in landing] == senders),
    }
    return calls[op]


def rounds(op: str, nbytes: int, count: int, calls: int) -> dict[str, list[float]]:
    """``count`` rounds (and one untimed first): per backend, microseconds per call."""
    import torch.distributed as dist

    groups = STATE["vcoll"]
    fns = {name: make_call(op, nbytes, group) for name, group in groups.items()}
    times: dict[str, list[float]] = {name: [] for name in groups}
    for _ in range(count + 1):
        for name, (fn, _) in fns.items():
            dist.barrier(group=groups["gloo"])
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    for name, (_, check) in fns.items():
        assert check(), f"rank {dist.get_rank()}: {op} on {name} gave a wrong result"
    return {name: values[1:] for name, values in times.items()}


def call_costs(count: int, calls: int) -> dict[str, list[float]]:
    """Where a 4 KiB all-to-all's time goes on the fastcomm group, per call: the communicator's
    even ``all_to_all`` (one C call), its ``all_to_all_v`` of the same pieces as tensors (one
    C call for the round, the plan in Python), ``dist.all_to_all_single`` without and with
    split sizes (torch's layer and the adapter on top of each)."""
    import torch.distributed as dist

    group = STATE["vcoll"]["fastcomm"]
    comm, n = group.communicator, dist.get_world_size()
    inp, out = torch.ones(1024), torch.empty(1024)
    ins, outs = list(inp.split(1024 // n)), list(out.split(1024 // n))
    splits = [1024 // n] * n
    ways = {
        "comm.all_to_all": lambda: comm.all_to_all(out, inp),
        "comm.all_to_all_v": lambda: comm.all_to_all_v(outs, ins),
        "dist even": lambda: dist.all_to_all_single(out, inp, group=group),
        "dist split sizes": lambda: dist.all_to_all_single(out, inp, splits, splits,
                                                            group=group),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(count + 1):
        for name, fn in ways.items():
            dist.barrier(group=STATE["vcoll"]["gloo"])
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: values[1:] for name, values in times.items()}


# ---------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"{n}ranks")
def ranks(request):
    with RankPool(request.param, env={"OMP_NUM_THREADS": "1"}, timeout=TIMEOUT) as pool:
        pool.run(setup_ranks)
        yield pool, request.param
        pool.run(teardown_ranks)


def _mpich(op: str, nbytes: int, world: int, calls: int, count: int) -> float | None:
    """MPICH's microseconds per call (``None`` without mpi4py or mpiexec)."""
    mpiexec = _mpiexec()
    if mpiexec is None or QUICK or importlib.util.find_spec("mpi4py") is None:
        return None
    script = Path(__file__).with_name("mpi_collectives.py")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mpi.json"
        cmd = [mpiexec, "-n", str(world), sys.executable, str(script), "--out", str(path),
               "--sizes", str(nbytes), "--ops", op, "--rounds", str(count), "--warmup", "1",
               "--iterations", str(calls), "--max-seconds", str(MPI_MAX_SECONDS)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}"
        (row,) = json.loads(path.read_text())
    return row["us"]


@pytest.mark.parametrize("nbytes", SIZES, ids=size_id)
@pytest.mark.parametrize("op", OPS)
def test_vcoll(benchmark, ranks, collectives_report, op, nbytes):
    pool, world = ranks
    calls = 1 if QUICK else iterations_for(nbytes)
    count = 1 if QUICK else (15 if nbytes <= 64 * KIB else 7 if nbytes <= MIB else 4)
    per_rank: list[dict] = []

    def one_run():
        per_rank.extend(pool.run(rounds, op, nbytes, count, calls))

    benchmark.group = f"{op} {size_id(nbytes)} {world} ranks"
    benchmark.pedantic(one_run, rounds=1, iterations=1)
    us = {name: statistics.median(max(r[name][i] for r in per_rank) for i in range(count))
          for name in BACKENDS}
    mpich = _mpich(op, nbytes, world, calls, count)
    if mpich is not None:
        us["mpich"] = mpich
    benchmark.extra_info.update({f"{k}_us": round(v, 1) for k, v in us.items()},
                                ratio_gloo=round(us["fastcomm"] / us["gloo"], 3))
    if QUICK:
        return
    for provider, value in us.items():
        algbw = nbytes / (value * 1e-6) / 1e9
        collectives_report.append(dict(
            op=op, provider=provider if provider == "mpich" else f"torch-{provider}",
            bytes=nbytes, world=world, us=round(value, 1), algbw=algbw,
            busbw=algbw * (world - 1) / world))


def test_call_cost(benchmark, ranks):
    """The 4 KiB all-to-all four ways (``call_costs``), in the same rounds."""
    pool, world = ranks
    count, calls = (1, 2) if QUICK else (15, 200)
    per_rank: list[dict] = []
    benchmark.pedantic(lambda: per_rank.extend(pool.run(call_costs, count, calls)),
                       rounds=1, iterations=1)
    us = {name: round(statistics.median(max(r[name][i] for r in per_rank)
                                        for i in range(count)), 1) for name in per_rank[0]}
    benchmark.extra_info.update(world=world, us_per_call=us)
