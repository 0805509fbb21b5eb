"""MPI reference for ``bench/test_collectives.py``: the same collectives and sizes under MPI.

Run as ``mpiexec -n 2 python bench/mpi_collectives.py --out mpi.json`` (``pip install
'fastcomm[mpi]'`` brings mpi4py with MPICH, whose ranks on one host talk through shared memory).
Each (op, size) is timed like the pytest benchmarks: warm-up calls, then rounds of one call each,
every round's time being the slowest rank's (``MPI.MAX``); the median round gives ``us``,
``algbw`` and ``busbw`` (nccl-tests' definitions). Buffers are fp32 numpy arrays; ``all_reduce``
runs in place (``MPI.IN_PLACE``), as fastcomm's does. Rank 0 writes a JSON list of rows
``{op, provider: "mpich", bytes, world, us, algbw, busbw}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


def make_call(comm: MPI.Comm, op: str, nbytes: int):
    n = comm.Get_size()
    numel = nbytes // 4 // n * n
    big = np.full(numel, comm.Get_rank() + 1.0, dtype=np.float32)
    part = np.full(numel // n, comm.Get_rank() + 1.0, dtype=np.float32)
    if op == "all_reduce":
        return lambda: comm.Allreduce(MPI.IN_PLACE, big, op=MPI.SUM)
    if op == "all_gather":
        return lambda: comm.Allgather(part, big)
    if op == "reduce_scatter":
        return lambda: comm.Reduce_scatter_block(big, part, op=MPI.SUM)
    if op == "broadcast":
        return lambda: comm.Bcast(big, root=0)
    raise ValueError(f"unknown op {op!r}; allowed: {', '.join(OPS)}")


def measure(comm: MPI.Comm, op: str, nbytes: int, quick: bool) -> dict:
    call = make_call(comm, op, nbytes)
    estimate = 5e-6 + nbytes / 2e9
    rounds = 3 if quick else max(5, min(300, int(0.3 / estimate)))
    for _ in range(1 if quick else 3):
        call()
    times = []
    for _ in range(rounds):
        comm.Barrier()
        start = time.perf_counter()
        call()
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    seconds = statistics.median(times)
    n = comm.Get_size()
    algbw = nbytes / seconds / 1e9
    return dict(op=op, provider="mpich", bytes=nbytes, world=n, us=round(seconds * 1e6, 1),
                algbw=algbw, busbw=algbw * bus_factor(op, n))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, help="JSON file written by rank 0")
    parser.add_argument("--sizes", default="4096,262144,4194304,26214400",
                        help="comma-separated message sizes in bytes")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated ops")
    parser.add_argument("--quick", action="store_true", help="3 rounds per size")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    ops = args.ops.split(",")
    for op in ops:
        if op not in OPS:
            parser.error(f"--ops: unknown op {op!r}; allowed: {', '.join(OPS)}")
    comm = MPI.COMM_WORLD
    rows = [measure(comm, op, nbytes, args.quick) for op in ops for nbytes in sizes]
    if comm.Get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
