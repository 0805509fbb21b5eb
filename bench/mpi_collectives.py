"""MPI reference for ``bench/test_collectives.py``: the same collectives and sizes under MPI.

Run as ``mpiexec -n 2 python bench/mpi_collectives.py --out mpi.json`` (``pip install -e
".[mpi]"``, or the ``test`` extra, brings mpi4py with MPICH, whose ranks on one host talk through
shared memory);
``bench/test_collectives.py`` runs it once per (op, size) with its own rounds and block length.
Each (op, size) is timed as the pytest benchmarks time theirs: ``--warmup`` blocks, then
``--rounds`` blocks (fewer past ``--max-seconds``) of ``--iterations`` back-to-back calls on
rank 0's clock, a sample being a block's time over its calls; the median sample gives ``us``,
``algbw`` and ``busbw`` (nccl-tests' definitions). Buffers are fp32 numpy arrays, ``nbytes``
the whole buffer (the all-gather output, the reduce-scatter and all-to-all input). Ops:

- ``all_reduce`` (in place, ``MPI.IN_PLACE``, as fastcomm's), ``broadcast`` (root 0),
  ``all_gather`` (``Allgather``), ``reduce_scatter`` (``Reduce_scatter_block``),
  ``all_to_all`` (``Alltoall``);
- ``all_gather_list`` / ``reduce_scatter_list``: MPI has no list form, so the flat call plus the
  copies torch's backends make for one (rows copied into ``n`` arrays; ``n`` arrays packed
  first), timed with it;
- ``send_recv``: ping-pong of pairs (0, 1), (2, 3)... at once; ``us`` is half a round trip;
- the v-forms of ``bench/test_torch_vcoll.py`` (``nbytes``: the root's whole buffer, or each
  rank's input): ``v_gather`` (``Gatherv`` to rank 0), ``v_scatter`` (``Scatterv`` from rank
  0), ``v_all_to_all_uneven`` (``Alltoallv``, rank ``q`` sending rank ``r`` one or two units
  by ``(q + r) % 2``), ``v_all_to_all_list`` (``Alltoallv`` of equal counts).

Rank 0 writes a JSON list of rows ``{op, provider: "mpich", bytes, world, us, algbw, busbw}``.

mpi4py is imported where MPI is called, not at module level: ``bench/test_torch_vcoll.py`` imports
:func:`uneven_counts` from here into a pytest process that may lack mpi4py (an extra), and
importing ``mpi4py.MPI`` would initialize MPI in that process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mpi4py import MPI

OPS = ("all_reduce", "all_reduce_async", "all_gather", "all_gather_list", "reduce_scatter",
       "reduce_scatter_list", "broadcast", "all_to_all", "send_recv", "v_gather", "v_scatter",
       "v_all_to_all_uneven", "v_all_to_all_list")


def bus_factor(op: str, n: int) -> float:
    if op in ("all_reduce", "all_reduce_async"):
        return 2 * (n - 1) / n
    return 1.0 if op in ("broadcast", "send_recv") else (n - 1) / n


def make_call(comm: MPI.Comm, op: str, nbytes: int):
    """The timed call of ``op`` on ``nbytes`` (buffers allocated here, outside it)."""
    from mpi4py import MPI

    n, rank = comm.Get_size(), comm.Get_rank()
    numel = nbytes // 4 // n * n
    big = np.full(numel, rank + 1.0, dtype=np.float32)
    out = np.empty_like(big)
    part = np.full(numel // n, rank + 1.0, dtype=np.float32)
    parts = [part.copy() for _ in range(n)]
    rows = big.reshape(n, -1)
    message = np.full(nbytes // 4, rank + 1.0, dtype=np.float32)
    peer = rank ^ 1  # an odd world's last rank sits out

    def all_gather_list() -> None:
        comm.Allgather(part, big)
        for row, dst in zip(rows, parts, strict=True):
            np.copyto(dst, row)

    def reduce_scatter_list() -> None:
        np.concatenate(parts, out=big)
        comm.Reduce_scatter_block(big, part, op=MPI.SUM)

    def send_recv() -> None:
        if peer >= n:
            return
        if rank % 2 == 0:
            comm.Send(message, dest=peer)
            comm.Recv(message, source=peer)
        else:
            comm.Recv(message, source=peer)
            comm.Send(message, dest=peer)

    calls = {
        "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, big, op=MPI.SUM),
        "all_reduce_async": lambda: comm.Iallreduce(MPI.IN_PLACE, big, op=MPI.SUM).Wait(),
        "all_gather": lambda: comm.Allgather(part, big),
        "all_gather_list": all_gather_list,
        "reduce_scatter": lambda: comm.Reduce_scatter_block(big, part, op=MPI.SUM),
        "reduce_scatter_list": reduce_scatter_list,
        "broadcast": lambda: comm.Bcast(big, root=0),
        "all_to_all": lambda: comm.Alltoall(big, out),
        "send_recv": send_recv,
        **_v_calls(comm, nbytes),
    }
    if op not in calls:
        raise ValueError(f"unknown op {op!r}; allowed: {', '.join(OPS)}")
    return calls[op]


def uneven_counts(numel: int, n: int) -> list[list[int]]:
    """Elements rank ``q`` sends rank ``r`` (``[q][r]``) in ``v_all_to_all_uneven``: one unit or
    two by ``(q + r) % 2``, about ``numel`` in all per rank (``bench/test_torch_vcoll.py`` uses
    the same rule)."""
    unit = max(1, numel // sum(1 + r % 2 for r in range(n)))
    return [[unit * (1 + (q + r) % 2) for r in range(n)] for q in range(n)]


def _v_calls(comm: MPI.Comm, nbytes: int) -> dict:
    """The v-forms (module docstring), buffers allocated here."""
    from mpi4py import MPI

    n, rank = comm.Get_size(), comm.Get_rank()
    numel = nbytes // 4 // n * n
    big = np.full(numel, rank + 1.0, dtype=np.float32)
    part = np.full(numel // n, rank + 1.0, dtype=np.float32)
    even = [numel // n] * n
    displs = [i * (numel // n) for i in range(n)]
    counts = uneven_counts(numel, n)
    sends, recvs = counts[rank], [counts[q][rank] for q in range(n)]
    out = np.empty(sum(recvs), dtype=np.float32)
    inp = np.full(sum(sends), rank + 1.0, dtype=np.float32)
    landing = np.empty_like(big)

    def starts(sizes: list[int]) -> list[int]:
        return [sum(sizes[:i]) for i in range(len(sizes))]

    return {
        "v_gather": lambda: comm.Gatherv(part, [big, even, displs, MPI.FLOAT], root=0),
        "v_scatter": lambda: comm.Scatterv([big, even, displs, MPI.FLOAT], part, root=0),
        "v_all_to_all_uneven": lambda: comm.Alltoallv(
            [inp, sends, starts(sends), MPI.FLOAT], [out, recvs, starts(recvs), MPI.FLOAT]),
        "v_all_to_all_list": lambda: comm.Alltoallv(
            [big, even, displs, MPI.FLOAT], [landing, even, displs, MPI.FLOAT]),
    }


def load_mpi():
    """``mpi4py.MPI`` for a script's ``main``, or an exit naming the extra that brings it."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise SystemExit(f'{e}: the MPI reference needs mpi4py: pip install -e ".[mpi]"') from None
    return MPI


def default_rounds(nbytes: int) -> tuple[int, int, int]:
    """(rounds, warmup, iterations) for about 0.3 s per size when run on its own."""
    iterations = max(1, min(100, int(1e-3 / (10e-6 + nbytes / 1e9))))
    estimate = (30e-6 + nbytes / 4e9) * iterations
    return max(5, min(300, int(0.3 / estimate))), 3, iterations


def time_call(comm: MPI.Comm, call, rounds: int, warmup: int, iterations: int,
              max_seconds: float) -> float:
    """Median seconds per ``call()`` over blocks of ``iterations`` back-to-back calls; warm-up
    and timing each stop after ``max_seconds`` (at least 5 timed blocks), rank 0's call sent to
    the others between blocks: with more ranks than cores MPICH's ranks poll for one another,
    and a block can take a thousand times its idle-machine time."""
    comm.Barrier()
    deadline = time.perf_counter() + max_seconds
    for _ in range(warmup):
        for _ in range(iterations):
            call()
        if comm.bcast(time.perf_counter() > deadline, root=0):
            break
    samples: list[float] = []
    deadline = time.perf_counter() + max_seconds
    while len(samples) < rounds:
        start = time.perf_counter()
        for _ in range(iterations):
            call()
        samples.append((time.perf_counter() - start) / iterations)
        if len(samples) >= 5 and comm.bcast(time.perf_counter() > deadline, root=0):
            break
    comm.Barrier()
    return statistics.median(samples)


def measure(comm: MPI.Comm, op: str, nbytes: int, rounds: int, warmup: int,
            iterations: int, max_seconds: float = 5.0) -> dict:
    """One row, timed by :func:`time_call`."""
    call = make_call(comm, op, nbytes)
    seconds = time_call(comm, call, rounds, warmup, iterations, max_seconds)
    seconds /= 2 if op == "send_recv" else 1
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
    parser.add_argument("--rounds", type=int, help="timed blocks (default: ~0.3 s per size)")
    parser.add_argument("--warmup", type=int, help="untimed blocks first (default 3)")
    parser.add_argument("--iterations", type=int, help="calls per block (default: by size)")
    parser.add_argument("--max-seconds", type=float, default=5.0,
                        help="stop an (op, size) after this many seconds of timed blocks")
    parser.add_argument("--quick", action="store_true", help="3 blocks of at most 10 calls")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    ops = args.ops.split(",")
    for op in ops:
        if op not in OPS:
            parser.error(f"--ops: unknown op {op!r}; allowed: {', '.join(OPS)}")
    comm = load_mpi().COMM_WORLD
    rows = []
    for op in ops:
        for nbytes in sizes:
            rounds, warmup, iterations = default_rounds(nbytes)
            if args.quick:
                rounds, warmup, iterations = 3, 1, min(iterations, 10)
            rows.append(measure(comm, op, nbytes, args.rounds or rounds,
                                warmup if args.warmup is None else args.warmup,
                                args.iterations or iterations, args.max_seconds))
    if comm.Get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
