"""MPI reference for ``bench/test_torch_p2p.py``: the same point-to-point calls under MPICH.

Run as ``mpiexec -n 2 python bench/mpi_p2p.py --out mpi.json --ops torch_send_recv --sizes
4096``; ``bench/test_torch_p2p.py`` runs it once per (op, size, world) with its own rounds and
block length, timed as ``bench/mpi_collectives.py`` times its ops (warm-up blocks, then timed
blocks of back-to-back calls on rank 0's clock, each cut at ``--max-seconds``). Pairs (0, 1),
(2, 3)... at once, fp32 numpy buffers of ``nbytes``:

- ``torch_send_recv``: ping-pong (``Send`` then ``Recv`` on the even rank, the reverse on the
  odd one); ``us`` is half a round trip, the one-way time;
- ``torch_exchange``: ``Isend`` and ``Irecv`` both ways, then ``Waitall``: what
  ``batch_isend_irecv`` of one send and one receive per rank does; ``us`` is one exchange.

Rank 0 writes a JSON list of rows ``{op, provider: "mpich", bytes, world, us, algbw, busbw}``.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

import numpy as np
from mpi_collectives import load_mpi, time_call  # this script's folder is on sys.path

if TYPE_CHECKING:
    from mpi4py import MPI

OPS = ("torch_send_recv", "torch_exchange")


def make_call(comm: MPI.Comm, op: str, nbytes: int):
    from mpi4py import MPI

    rank, n = comm.Get_rank(), comm.Get_size()
    peer = rank ^ 1  # an odd world's last rank sits out
    message = np.full(nbytes // 4, rank + 1.0, dtype=np.float32)
    into = np.empty_like(message)

    def send_recv() -> None:
        if rank % 2 == 0:
            comm.Send(message, dest=peer)
            comm.Recv(message, source=peer)
        else:
            comm.Recv(message, source=peer)
            comm.Send(message, dest=peer)

    def exchange() -> None:
        MPI.Request.Waitall([comm.Isend(message, dest=peer), comm.Irecv(into, source=peer)])

    if peer >= n:
        return lambda: None
    return {"torch_send_recv": send_recv, "torch_exchange": exchange}[op]


def measure(comm: MPI.Comm, op: str, nbytes: int, rounds: int, warmup: int, iterations: int,
            max_seconds: float) -> dict:
    seconds = time_call(comm, make_call(comm, op, nbytes), rounds, warmup, iterations,
                        max_seconds)
    seconds /= 2 if op == "torch_send_recv" else 1
    algbw = nbytes / seconds / 1e9
    return dict(op=op, provider="mpich", bytes=nbytes, world=comm.Get_size(),
                us=round(seconds * 1e6, 2), algbw=algbw, busbw=algbw)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, help="JSON file written by rank 0")
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated ops")
    parser.add_argument("--rounds", type=int, default=15, help="timed blocks")
    parser.add_argument("--warmup", type=int, default=3, help="untimed blocks first")
    parser.add_argument("--iterations", type=int, default=10, help="calls per block")
    parser.add_argument("--max-seconds", type=float, default=2.0,
                        help="stop an (op, size) after this many seconds of timed blocks")
    args = parser.parse_args(argv)
    ops = args.ops.split(",")
    for op in ops:
        if op not in OPS:
            parser.error(f"--ops: unknown op {op!r}; allowed: {', '.join(OPS)}")
    comm = load_mpi().COMM_WORLD
    rows = [measure(comm, op, int(size), args.rounds, args.warmup, args.iterations,
                    args.max_seconds) for op in ops for size in args.sizes.split(",")]
    if comm.Get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
