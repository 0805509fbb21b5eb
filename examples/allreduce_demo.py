"""Two CPU ranks on this machine all-reduce a tensor with fastcomm (no launcher needed).

    python examples/allreduce_demo.py [--world-size 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os

import torch

import fastcomm


def rank_main(rank: int, world_size: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    comm = fastcomm.init(backend="gloo", timeout=60)
    grad = torch.full((4,), float(rank + 1))
    comm.all_reduce(grad, op=fastcomm.ReduceOp.AVG)
    print(f"rank {rank}/{world_size}: averaged {grad.tolist()}", flush=True)
    fastcomm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    store = fastcomm.Store(is_server=True, timeout=60)  # port 0: a free port
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, args.world_size, store.port))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
