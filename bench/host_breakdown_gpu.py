"""Where fastcomm DDP's host time goes on one GPU, piece by piece, against the floors.

    python bench/host_breakdown_gpu.py

One process, one GPU, the benchmark's 1024x10 MLP, unsynchronized steps (host time). Prints
the median host time of a step of: no DDP; no DDP with a no-op Python post-accumulate-grad hook
per parameter (the floor of any reducer whose hooks are Python); the same plus a no-op
``queue_callback`` per backward; torch DDP; fastcomm DDP with buckets replayed from CUDA
graphs and eagerly. For fastcomm it also times, per step, the DDP's forward bookkeeping, the
hooks (all of them together, launches included), the bucket launches alone and the finalize,
by wrapping those methods with a timer, and the pieces of a replayed bucket's launch (the
address check, the address upload, the lane's replay and, inside it, the flight record, the
events, the graph's launch and the work).
"""

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from fastcomm.comm import new_communicator
from fastcomm.comm.store import Store
from fastcomm.ddp import DDP

DEV = torch.device("cuda", 0)
STEPS = 200


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(10) for m in (nn.Linear(1024, 1024), nn.ReLU())]).to(
        DEV
    )


class Timer:
    """Wraps `obj.name` to add its time to `self.total` (and count its calls)."""

    def __init__(self, obj, name: str) -> None:
        self.total = 0.0
        self.calls = 0
        real = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t
                self.calls += 1

        setattr(obj, name, timed)


def piece_timers() -> dict:
    """Timers around the pieces of a replayed bucket's launch (class-level: every caller)."""
    from fastcomm.comm import flight, graph_lane, stream
    from fastcomm.ddp import graphs
    from fastcomm.kernels import _relocate

    return {
        "addresses": Timer(graphs, "_addresses"),
        "set_addresses": Timer(_relocate.RelocatablePlan, "set_addresses"),
        "lane.replay": Timer(graph_lane.GraphLane, "replay"),
        "graph.replay": Timer(torch.cuda.CUDAGraph, "replay"),
        "flight.issue": Timer(flight.FlightRecorder, "issue"),
        "flight.finish": Timer(flight.FlightRecorder, "finish"),
        "event.record": Timer(torch.cuda.Event, "record"),
        "wait_event": Timer(torch.cuda.Stream, "wait_event"),
        "set_stream": Timer(torch.cuda, "set_stream"),
        "EventWork": Timer(stream.EventWork, "__init__"),
    }


def main() -> None:
    store = Store("127.0.0.1", 0, is_server=True, timeout=30, rank=0)
    dist.init_process_group("nccl", store=dist.TCPStore("127.0.0.1", 0, 1, True), rank=0,
                            world_size=1)
    comm = new_communicator("nccl", store=store.prefixed("p", rank=0), rank=0, size=1,
                            timeout=30, device=0)
    x, y = torch.randn(64, 1024, device=DEV), torch.randn(64, 1024, device=DEV)
    models = {
        "no-comm": mlp(),
        "no-op-hooks": mlp(),
        "no-op-hooks+callback": mlp(),
        "torch": nn.parallel.DistributedDataParallel(mlp(), device_ids=[0]),
        "fastcomm": DDP(mlp(), comm=comm),
        "fastcomm-eager": DDP(mlp(), comm=comm, cuda_graphs=False),
    }
    for name in ("no-op-hooks", "no-op-hooks+callback"):
        for p in models[name].parameters():
            p.register_post_accumulate_grad_hook(lambda p: None)
    engine = torch.autograd.Variable._execution_engine

    def queue(grad):
        engine.queue_callback(lambda: None)

    models["no-op-hooks+callback"][-2].weight.register_hook(queue)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

    def step(k: str) -> None:
        opts[k].zero_grad(set_to_none=True)
        nn.functional.mse_loss(models[k](x), y).backward()
        opts[k].step()

    for k in models:
        for _ in range(6):
            step(k)
    timers = {}
    for k in ("fastcomm", "fastcomm-eager"):
        reducer = models[k].reducer
        timers[k] = {
            "forward": [Timer(models[k], "_pre_forward"), Timer(models[k], "_post_forward")],
            "hooks": [Timer(reducer, "_on_grad")],
            "launches": [Timer(reducer, "_launch")],
            "finalize": [Timer(reducer, "_finalize")],
        }
    torch.cuda.synchronize()
    host = {k: [] for k in models}
    for _ in range(3):  # rounds, the models alternating
        for k in models:
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(STEPS // 3):
                step(k)
            host[k].append((time.perf_counter() - t) / (STEPS // 3))
            torch.cuda.synchronize()
    base = statistics.median(host["no-comm"])
    for k in models:
        h = statistics.median(host[k])
        print(f"{k:22s} host per step {h * 1e3:.3f} ms  (+{(h - base) * 1e3:.3f} ms)")
    n = 3 * (STEPS // 3) + 0  # steps timed by the wrappers (the rounds above)
    for k, parts in timers.items():
        line = ", ".join(f"{part} {sum(t.total for t in ts) / n * 1e6:.0f} us"
                         for part, ts in parts.items())
        print(f"{k}: per step: {line} ({len(models[k].reducer.buckets)} buckets)")
    pieces = piece_timers()
    for _ in range(STEPS):
        step("fastcomm")
    torch.cuda.synchronize()
    print(f"pieces of fastcomm's replayed launches, per step of {STEPS} (calls per step):")
    for name, t in pieces.items():
        print(f"  {name:14s} {t.total / STEPS * 1e6:8.1f} us  ({t.calls / STEPS:.2f})")
    graphs = models["fastcomm"].reducer.strategies[0]._graphs
    print(f"captured buckets: {len(graphs)} of {len(models['fastcomm'].reducer.buckets)}")
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
