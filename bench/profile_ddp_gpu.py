"""Where one rank's DDP step goes on a GPU: fastcomm DDP (NCCL) against torch DDP.

    python bench/profile_ddp_gpu.py            # timings, torch.profiler tables, cProfile
    FASTCOMM_PROFILE_QUICK=1 python bench/profile_ddp_gpu.py   # the timings alone

One process, one GPU, the benchmark's 1024x10 MLP. Prints per model the median wall and CPU
time of a synchronized step, and the host time of a step left unsynchronized (a host-bound
step shows it close to the wall time). ``FASTCOMM_PROFILE_ROOT`` imports fastcomm from another
checkout (an A/B in one call).
"""

import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.abspath(os.environ.get("FASTCOMM_PROFILE_ROOT", os.getcwd())))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import fastcomm  # noqa: E402
from fastcomm.comm import new_communicator  # noqa: E402
from fastcomm.comm.store import Store  # noqa: E402
from fastcomm.ddp import DDP  # noqa: E402

DEV = torch.device("cuda", 0)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(10) for m in (nn.Linear(1024, 1024), nn.ReLU())]
    return nn.Sequential(*layers).to(DEV)


def main() -> None:
    print("fastcomm from", fastcomm.__file__)
    store = Store("127.0.0.1", 0, is_server=True, timeout=30, rank=0)
    dist.init_process_group("nccl", store=dist.TCPStore("127.0.0.1", 0, 1, True), rank=0,
                            world_size=1)
    comm = new_communicator("nccl", store=store.prefixed("p", rank=0), rank=0, size=1,
                            timeout=30, device=0)
    x, y = torch.randn(64, 1024, device=DEV), torch.randn(64, 1024, device=DEV)
    models = {"no-comm": mlp(), "fastcomm": DDP(mlp(), comm=comm),
              "torch": nn.parallel.DistributedDataParallel(mlp(), device_ids=[0])}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

    def step(k: str) -> None:
        opts[k].zero_grad(set_to_none=True)
        nn.functional.mse_loss(models[k](x), y).backward()
        opts[k].step()

    for k in models:
        for _ in range(5):
            step(k)
    torch.cuda.synchronize()
    wall: dict[str, list[float]] = {k: [] for k in models}
    cpu: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(60):  # the models alternate, as in bench/test_ddp.py
        for k in models:
            t, c = time.perf_counter(), time.process_time()
            step(k)
            torch.cuda.synchronize()
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    for k in models:
        w, c = sorted(wall[k]), sorted(cpu[k])
        print(f"{k:10s} wall median {w[len(w) // 2] * 1e3:.3f} ms  "
              f"cpu median {c[len(c) // 2] * 1e3:.3f} ms")
    for k in models:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            step(k)
        host = (time.perf_counter() - t) / 20
        torch.cuda.synchronize()
        print(f"{k:10s} host per step (no sync) {host * 1e3:.3f} ms")
    if not os.environ.get("FASTCOMM_PROFILE_QUICK"):
        from torch.profiler import ProfilerActivity, profile

        for k in ("fastcomm", "torch"):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    step(k)
                torch.cuda.synchronize()
            print(f"===== {k}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(50):
            step("fastcomm")
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
