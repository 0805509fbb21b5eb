"""Data-parallel training of a small MLP classifier with fastcomm's DDP.

    fastcomm-run --nproc-per-node 2 examples/train.py [--hook none|fp16|bf16|int8|powersgd]
                                                      [--device cpu|cuda] [--steps N]
    fastcomm-run --nproc-per-node 3 --recover in-process [--max-restarts N] examples/train.py
                                                      # goes on after a loss (and regrows)

Every rank generates the same synthetic data set from a fixed seed (inputs from a Gaussian,
labels from a fixed random "teacher" network, so the task is learnable) and trains on its own
shard. ``--device`` defaults to ``cuda`` when every local rank has a GPU of its own (rank
LOCAL_RANK takes GPU LOCAL_RANK; fastcomm then picks NCCL), else ``cpu`` (e.g. 2 ranks on a
1-GPU machine). ``--device cuda`` with fewer GPUs than ranks shares them (GPU LOCAL_RANK modulo
their number); fastcomm then moves the CUDA tensors through Gloo unless NCCL allows sharing.
Rank 0 shows a progress bar and prints a summary: final loss, steps/s, and the payload bytes
this rank handed to the communicator per step.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

import fastcomm
from fastcomm.comm.world import cuda_device_count
from fastcomm.ddp import DDP, hooks


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="fastcomm DDP training example")
    p.add_argument("--hook", choices=["none", "fp16", "bf16", "int8", "powersgd"], default="none")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default=None, help="gloo, shm, nccl (default: fastcomm picks)")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where to train (default: cuda when every local rank has its own GPU, else cpu)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def make_data(args, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(samples, args.features, generator=gen)
    teacher_in = torch.randn(args.features, 32, generator=gen)
    teacher_out = torch.randn(32, args.classes, generator=gen)
    y = (torch.tanh(x @ teacher_in) @ teacher_out).argmax(dim=1)
    return x, y


def make_model(args) -> nn.Module:
    torch.manual_seed(args.seed + 1)
    return nn.Sequential(
        nn.Linear(args.features, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.classes),
    )


def register_hook(ddp: DDP, name: str, comm) -> None:
    if name == "fp16":
        ddp.register_comm_hook(None, hooks.fp16_compress_hook)
    elif name == "bf16":
        ddp.register_comm_hook(None, hooks.bf16_compress_hook)
    elif name == "int8":
        ddp.register_comm_hook(hooks.QuantizeState(comm), hooks.int8_compress_hook)
    elif name == "powersgd":
        state = hooks.PowerSGDState(comm, matrix_approximation_rank=4, start_powerSGD_iter=10)
        ddp.register_comm_hook(state, hooks.powersgd_hook)


def progress(iterable, enabled: bool, total: int):
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is optional: pip install "fastcomm[examples]"
        return iterable
    return tqdm(iterable, total=total, desc="train", unit="step", dynamic_ncols=True)


def pick_device(requested: str | None) -> torch.device:
    """``requested``, or cuda when every local rank has a GPU of its own, else cpu."""
    gpus = cuda_device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if requested is None:
        requested = "cuda" if gpus and local_rank < gpus and local_world <= gpus else "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if gpus == 0:
        raise SystemExit(f"--device cuda: rank {os.environ.get('RANK', 0)} sees no CUDA device")
    return torch.device("cuda", local_rank % gpus)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = pick_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    comm = fastcomm.init(backend=args.backend, device=device)
    # the job's size at launch: a replacement (--recover in-process --max-restarts) makes the
    # same data set as the ranks it joins
    world = int(os.environ.get("WORLD_SIZE", comm.size))

    x, y = make_data(args, samples=args.batch_size * world * 50)
    model = DDP(make_model(args).to(device), comm=comm)
    comm = model.comm  # a replacement's is the one it joined
    register_hook(model, args.hook, comm)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model.register_state("opt", opt)  # streamed to a replacement when it joins
    loss_fn = nn.CrossEntropyLoss()

    shard = {}

    def reshard(change=None) -> None:
        """This rank's shard of the data set; again after a lost or a joining rank
        (``--recover in-process``): the ranks split the whole set among themselves."""
        r, w = model.rank, model.world_size
        shard["x"], shard["y"] = x[r::w].to(device), y[r::w].to(device)
        shard["batches"] = shard["x"].shape[0] // args.batch_size
        if change is not None:
            print(f"rank {r} of {w} now ({change.where}, lost rank(s) {list(change.lost)}); "
                  "re-sharded", flush=True)

    reshard()
    model.on_membership_change(reshard)
    steps = range(model.join_step, args.steps)  # a replacement starts where it joined
    bar = progress(steps, model.rank == 0 and not args.no_progress, len(steps))
    comm.stats.reset()
    start = time.perf_counter()
    last = start
    for step in bar:
        i = step % shard["batches"]
        xb = shard["x"][i * args.batch_size : (i + 1) * args.batch_size]
        yb = shard["y"][i * args.batch_size : (i + 1) * args.batch_size]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()
        now = time.perf_counter()
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss.item():.4f}", step_ms=f"{1e3 * (now - last):.1f}")
        last = now
    elapsed = time.perf_counter() - start
    sent = model.comm.stats.total_bytes  # the communicator in use (a new one after a loss)

    with torch.no_grad():
        full = loss_fn(model(x.to(device)), y.to(device)).item()
        accuracy = (model(x.to(device)).argmax(1) == y.to(device)).float().mean().item()
    if model.rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"hook={args.hook} ranks={model.world_size} device={device.type} "
            f"backend={model.comm.backend} "
            f"params={params:,}\n"
            f"final loss {full:.4f}  accuracy {accuracy:.3f}  "
            f"{len(steps) / elapsed:.1f} steps/s  "
            f"{sent / len(steps) / 1e6:.3f} MB communicated per step (rank 0)",
            flush=True,
        )
    fastcomm.shutdown()


if __name__ == "__main__":
    main()
