"""One side of an A/B: the key figures of the tree on ``sys.path``, 2 CPU ranks, as JSON.

Run by ``bench/ab.py`` once per round in each tree; uses public API only (``torch.distributed``
on backend ``"fastcomm"``, ``fastcomm.ddp.DDP``), so older commits run it unchanged.

Figures (median over blocks of the slower rank's time per call or step):

- ``us``: 4 KiB fp32 calls through ``torch.distributed`` on the fastcomm default group:
  ``all_reduce``, ``send_recv`` (one exchange), ``batch_isend_irecv``, ``gather``, ``scatter``,
  ``all_to_all_single`` with split sizes; ``batch_isend_irecv_1mib``: a 1 MiB exchange (many
  chunks: the engine's progress and thread);
- ``ms``: a training step of the 1.6M MLP (6 x Linear(512, 512) + ReLU, batch 64, SGD): fastcomm
  DDP on the default group (shm), fastcomm DDP on a torch Gloo group, torch DDP on that Gloo
  group, no DDP; the DDP providers interleaved step by step.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CALLS, BLOCKS, STEPS = 500, 9, 60


def _ops(rank: int, world: int) -> dict:
    x = torch.ones(1024)
    out = torch.empty(1024)
    outs = [torch.empty(1024) for _ in range(world)]
    ins = [torch.ones(1024) for _ in range(world)]
    split = [1024 // world] * world
    peer = (rank + 1) % world
    big, big_out = torch.ones(1 << 18), torch.empty(1 << 18)

    def send_recv():
        if rank == 0:
            dist.send(x, 1)
            dist.recv(out, 1)
        else:
            dist.recv(out, 0)
            dist.send(x, 0)

    def batch():
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, out, peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    def batch_1mib():
        ops = [dist.P2POp(dist.isend, big, peer), dist.P2POp(dist.irecv, big_out, peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "send_recv": send_recv,
        "batch_isend_irecv": batch,
        "batch_isend_irecv_1mib": batch_1mib,
        "gather": lambda: dist.gather(x, outs if rank == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(out, ins if rank == 0 else None, src=0),
        "all_to_all_single": lambda: dist.all_to_all_single(out, x, split, split),
    }


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _time_ops(rank: int, world: int) -> dict:
    result = {}
    for name, fn in _ops(rank, world).items():
        for _ in range(CALLS // 5):
            fn()
        blocks = []
        for _ in range(BLOCKS):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            blocks.append(_slowest((time.perf_counter() - start) / CALLS * 1e6))
        result[name] = statistics.median(blocks)
    return result


def _time_ddp(rank: int) -> dict:
    from torch import nn

    import fastcomm.ddp

    gloo = dist.new_group(backend="gloo")
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 512, generator=gen), torch.randn(64, 512, generator=gen)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(512, 512), nn.ReLU())])

    providers = {
        "fastcomm-shm": fastcomm.ddp.DDP(model()),
        "fastcomm-over-gloo": fastcomm.ddp.DDP(model(), process_group=gloo),
        "torch": nn.parallel.DistributedDataParallel(model(), process_group=gloo),
        "no-comm": model(),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in providers.items()}
    times: dict = {k: [] for k in providers}
    for step in range(STEPS + 5):
        for name, m in providers.items():
            dist.barrier(group=gloo)
            start = time.perf_counter()
            opts[name].zero_grad(set_to_none=True)
            nn.functional.mse_loss(m(x), y).backward()
            opts[name].step()
            elapsed = _slowest(time.perf_counter() - start)
            if step >= 5:
                times[name].append(elapsed * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import fastcomm  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    dist.init_process_group("fastcomm")
    figures = {"us": _time_ops(rank, world), "ms": _time_ddp(rank)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(figures, f)
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, out), nprocs=2)


if __name__ == "__main__":
    main()
