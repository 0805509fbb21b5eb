"""DDP training steps on a GPU: fastcomm DDP against torch DDP and no DDP, interleaved.

Groups (each a model and its providers, every provider a copy of the model in the same rank
processes):

- ``mlp``: the 10 x ``Linear(1024, 1024)`` MLP of ``test_ddp.py`` (10.5M parameters, 3
  buckets), batch 64, SGD, one rank. Host-bound: it shows what DDP adds on the host.
- ``mlp-scaled``: the same, with fastcomm's averaging factor set to 0.5: one rank averages
  over 1, which makes the pack a plain copy; at 0.5 the fused Triton pack runs, as it does on
  every multi-rank job.
- ``gpt2``: a decoder stack shaped like GPT-2 small (12 layers, width 768, 12 heads, tied
  50257-token embedding: 124M parameters), built here, sequence 512, batch 8, bf16 autocast,
  AdamW. GPU-bound.
- ``ipc-2ranks``: the MLP on 2 ranks sharing the GPU: fastcomm over ``fastcomm.init()``
  (``ipc``: the all-reduce by Triton kernels over CUDA IPC) against torch DDP over Gloo
  (torch's NCCL refuses two ranks on one GPU).

Providers: ``no-comm`` (the step without DDP), ``torch`` (torch DDP over NCCL), ``fastcomm``
(fastcomm DDP over its NCCL communicator, buckets replayed from CUDA graphs: the default),
``fastcomm-eager`` (the same with ``cuda_graphs=False``). Every group runs ``ROUNDS`` rounds;
a round runs ``steps`` steps of each provider in turn. Reported per provider (``extra_info``):
the median step over every round's steps, the spread (the lowest and highest round median),
the median host time of a step (until ``optimizer.step()`` returns, before the synchronize: a
host-bound step shows it close to the step), the host time per bucket beyond no DDP's, and
the ratios to torch DDP and to no DDP (the headline: the interleaved ratio).

Without a GPU the groups run on CPU in quick mode (``--benchmark-disable``), on one rank over
Gloo, with small shapes: the code runs, no figure is reported. GPU figures: the GPU round
(``bench/gpu_round.sh``).
"""

from __future__ import annotations

import math
import statistics
import time

import pytest
import torch
from _ddp_common import ON_GPU, build_mlp, quick, rank_batch

from tests.harness import STATE, RankPool

ROUNDS = 3
GROUPS = ["mlp", "mlp-scaled", "gpt2", "ipc-2ranks"]
PROVIDERS = ["no-comm", "torch", "fastcomm", "fastcomm-eager"]
#: steps per provider per round (quick mode: 2)
STEPS = {"mlp": 30, "mlp-scaled": 30, "gpt2": 8, "ipc-2ranks": 20}


# ---------------------------------------------------------------------- the GPT-2 stack
class Block(torch.nn.Module):
    """A pre-norm GPT-2 block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.out = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """Token and position embeddings, `layers` blocks, a final norm, the tied output layer."""

    def __init__(self, vocab: int, seq: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(seq, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()  # tied with the embedding, as GPT-2's


def gpt_shape(quick_mode: bool) -> dict:
    if quick_mode:
        return {"vocab": 256, "seq": 32, "width": 64, "layers": 2, "heads": 4, "batch": 2}
    return {"vocab": 50257, "seq": 512, "width": 768, "layers": 12, "heads": 12, "batch": 8}


# ---------------------------------------------------------------------- rank side
def setup_group(group: str, quick_mode: bool) -> dict:
    """Builds the group's providers in this rank; what the report needs of them."""
    import os

    import torch.distributed as dist

    from fastcomm.ddp import DDP
    from tests.harness import rank_comm

    gpu = ON_GPU
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    two = group == "ipc-2ranks"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if gpu and not two else "gloo",
                                device_id=device if gpu and not two else None)
    if two:
        import fastcomm

        comm = fastcomm.get_world() if fastcomm.is_initialized() else fastcomm.init(timeout=120)
    else:
        comm = rank_comm("nccl" if gpu else "gloo")
    if group == "gpt2":
        shape = gpt_shape(quick_mode)

        def build():
            torch.manual_seed(0)
            return GPT(shape["vocab"], shape["seq"], shape["width"], shape["layers"],
                       shape["heads"]).to(device)

        gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
        idx = torch.randint(shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=gen)
        x, y = idx[:, :-1].to(device), idx[:, 1:].to(device)
        opt = torch.optim.AdamW
    else:
        width, depth = (256, 4) if quick_mode else (1024, 10)

        def build():
            return build_mlp(width, depth, device)

        x, y = rank_batch(64, width, device)
        opt = torch.optim.SGD
    models = {"no-comm": build()}
    ids = [0] if gpu else None
    models["torch"] = torch.nn.parallel.DistributedDataParallel(build(), device_ids=ids)
    models["fastcomm"] = DDP(build(), comm=comm)
    models["fastcomm-eager"] = DDP(build(), comm=comm, cuda_graphs=False)
    if group == "mlp-scaled":
        for name in ("fastcomm", "fastcomm-eager"):
            models[name].reducer.scale = 0.5
    STATE["gpu_bench"] = {
        "models": models,
        "opts": {k: opt(m.parameters(), lr=1e-4) for k, m in models.items()},
        "x": x, "y": y, "gpt": group == "gpt2", "gpu": gpu,
    }
    for name in models:  # warm-up: the rebuild, the capture, the kernels' compilation
        for _ in range(4):
            step(name)
    buckets = len(models["fastcomm"].reducer.buckets)
    return {"buckets": buckets, "params": sum(p.numel() for p in models["no-comm"].parameters())}


def step(name: str) -> tuple[float, float]:
    """One training step of provider `name`: (wall seconds, host seconds)."""
    b = STATE["gpu_bench"]
    model, opt = b["models"][name], b["opts"][name]
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    if b["gpt"]:
        with torch.autocast(b["x"].device.type, dtype=torch.bfloat16, enabled=b["gpu"]):
            logits = model(b["x"])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 b["y"].flatten())
    else:
        loss = torch.nn.functional.mse_loss(model(b["x"]), b["y"])
    loss.backward()
    opt.step()
    host = time.perf_counter() - start
    if b["gpu"]:
        torch.cuda.synchronize()
    return time.perf_counter() - start, host


def interleaved(steps: int) -> dict[str, list[tuple[float, float]]]:
    """One round: `steps` steps of each provider in turn, a barrier before each run."""
    import torch.distributed as dist

    out = {}
    for name in STATE["gpu_bench"]["models"]:
        dist.barrier()
        out[name] = [step(name) for _ in range(steps)]
    return out


def teardown_group() -> None:
    import torch.distributed as dist

    import fastcomm

    STATE.pop("gpu_bench", None)
    if fastcomm.is_initialized():
        fastcomm.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------- pytest side
def _report(rounds: list[list[dict]], info: dict) -> dict:
    """The figures of `rounds` (per round, per rank: provider -> [(wall, host)])."""
    names = list(rounds[0][0])
    walls, hosts, spread = {}, {}, {}
    for name in names:
        # a step lasts as long as its slowest rank
        per_round = [[max(r[name][i][0] for r in ranks) for i in range(len(ranks[0][name]))]
                     for ranks in rounds]
        walls[name] = statistics.median(w for rnd in per_round for w in rnd)
        medians = [statistics.median(rnd) for rnd in per_round]
        spread[name] = (min(medians), max(medians))
        hosts[name] = statistics.median(h for ranks in rounds for r in ranks
                                        for _, h in r[name])
    report = {
        "median_step_ms": {n: round(1e3 * walls[n], 3) for n in names},
        "round_median_spread_ms": {n: [round(1e3 * a, 3) for a in spread[n]] for n in names},
        "median_host_ms": {n: round(1e3 * hosts[n], 3) for n in names},
        **info,
    }
    for name in ("fastcomm", "fastcomm-eager"):
        report[f"ratio_{name}_over_torch"] = round(walls[name] / walls["torch"], 4)
        report[f"ratio_{name}_over_no_comm"] = round(walls[name] / walls["no-comm"], 4)
        added = walls[name] - walls["no-comm"]
        torch_added = walls["torch"] - walls["no-comm"]
        report[f"added_{name}_over_torch_added"] = (
            round(added / torch_added, 4) if torch_added > 0 else math.nan
        )
        report[f"host_us_per_bucket_{name}"] = round(
            1e6 * (hosts[name] - hosts["no-comm"]) / max(info["buckets"], 1), 1
        )
    return report


@pytest.mark.parametrize("group", GROUPS)
def test_ddp_gpu_step(benchmark, request, group):
    quick_mode = quick(request.config)
    if not ON_GPU and group == "ipc-2ranks":
        pytest.skip("two ranks sharing a GPU need a GPU")
    env = {"CUDA_VISIBLE_DEVICES": "0", "FASTCOMM_TEST_DEVICE": "0"} if ON_GPU else {}
    world = 2 if group == "ipc-2ranks" else 1
    steps = 2 if quick_mode else STEPS[group]
    with RankPool(world, env=env, timeout=600) as pool:
        info = pool.run(setup_group, group, quick_mode)[0]
        rounds = []

        def run():
            for _ in range(1 if quick_mode else ROUNDS):
                rounds.append(pool.run(interleaved, steps))

        benchmark.pedantic(run, rounds=1, iterations=1)
        pool.run(teardown_group)
    report = _report(rounds, {**info, "group": group, "ranks": world,
                              "device": "cuda" if ON_GPU else "cpu",
                              "steps_per_round": steps})
    benchmark.extra_info.update(report)
    for name, ms in report["median_step_ms"].items():
        assert ms > 0, (name, report)
    print(f"\n{group}: " + ", ".join(
        f"{n} {ms:.3f} ms (host {report['median_host_ms'][n]:.3f})"
        for n, ms in report["median_step_ms"].items()
    ) + f"; fastcomm/torch {report['ratio_fastcomm_over_torch']:.3f}, eager/torch "
        f"{report['ratio_fastcomm-eager_over_torch']:.3f}; host per bucket "
        f"{report['host_us_per_bucket_fastcomm']} us (eager "
        f"{report['host_us_per_bucket_fastcomm-eager']} us)")
