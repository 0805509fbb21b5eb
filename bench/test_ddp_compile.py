"""DDP training steps under ``torch.compile``: fastcomm DDP against torch DDP, eager and
compiled, interleaved.

Groups, each on 2 ranks (CPU over Gloo; on a GPU, one rank over NCCL):

- ``mlp``: 8 x ``Linear(512, 512)`` (1 MiB weights) in a module class of its own (so that
  Dynamo compiles it under torch DDP as well), ``bucket_cap_mb=1``: 8 buckets, batch 32, SGD;
- ``transformer``: a 4-layer decoder stack of width 256 (the GPT-2 block of
  ``test_ddp_gpu.py``), sequence 64, batch 8, AdamW.

Providers: ``no-comm`` (no DDP, compiled), ``no-comm-eager`` (no DDP, eager), ``torch-eager``,
``torch-compiled``, ``fastcomm-eager``, ``fastcomm-compiled`` (``compiled_backward="traced"``,
CPU's default: one backward graph, the buckets launched from inside it),
``fastcomm-split`` (``"split"``: DDPOptimizer's graph per bucket, torch DDP's way); compiled
means ``torch.compile(DDP(model))`` with the default backend (inductor). Every round runs
``steps`` steps of each provider in turn, a barrier before each; reported (``extra_info``): the
median step of every provider over the rounds, the lowest and highest round median, the ratios
the targets read (fastcomm compiled over torch compiled, and over fastcomm eager), what
compiling does to the model alone, and the time each DDP adds to its model, eager or compiled.
Also recorded: how many buckets each compiled DDP hands over before its backward's last matrix
product starts (``aten::mm`` in the profiler), in the last round.

Quick mode (``--benchmark-disable`` or ``FASTCOMM_BENCH_QUICK=1``): small shapes, the
``aot_eager`` backend, 2 steps: the code runs, no figure.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from _ddp_common import ON_GPU, quick

from tests.ddp.common import LinearStack
from tests.harness import STATE, RankPool

ROUNDS = 3
STEPS = {"mlp": 20, "transformer": 10}
PROVIDERS = ["no-comm-eager", "no-comm", "torch-eager", "torch-compiled", "fastcomm-eager",
             "fastcomm-compiled", "fastcomm-split"]


def _models(group: str, quick_mode: bool, device: torch.device):
    from test_ddp_gpu import GPT

    if group == "mlp":
        width = 64 if quick_mode else 512

        def build():
            torch.manual_seed(0)
            return LinearStack(width, 8).to(device)

        import os

        g = torch.Generator().manual_seed(int(os.environ["RANK"]))
        x, y = torch.randn(32, width, generator=g), torch.randn(32, width, generator=g)
        return build, (x.to(device), y.to(device)), torch.optim.SGD
    shape = (128, 16, 32, 2, 2) if quick_mode else (512, 64, 256, 4, 4)
    vocab, seq, width, layers, heads = shape

    def build():
        torch.manual_seed(0)
        return GPT(vocab, seq, width, layers, heads).to(device)

    import os

    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    idx = torch.randint(vocab, (8, seq + 1), generator=g).to(device)
    return build, (idx[:, :-1], idx[:, 1:]), torch.optim.AdamW


def setup_group(group: str, quick_mode: bool) -> int:
    import torch.distributed as dist

    from fastcomm.ddp import DDP

    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if ON_GPU else torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if ON_GPU else "gloo")
    backend = "aot_eager" if quick_mode else "inductor"
    build, batch, opt = _models(group, quick_mode, device)
    ids = [0] if ON_GPU else None
    torch_ddp = torch.nn.parallel.DistributedDataParallel
    models = {
        # a frame of its own: compiled as the module's own frame, its graph (no DDPOptimizer
        # split) would be the one Dynamo finds for torch DDP's call of the same module class
        "no-comm": torch.compile(_own_frame(build()), backend=backend),
        "no-comm-eager": build(),
        "torch-eager": torch_ddp(build(), device_ids=ids, bucket_cap_mb=1),
        "torch-compiled": torch.compile(torch_ddp(build(), device_ids=ids, bucket_cap_mb=1),
                                        backend=backend),
        "fastcomm-eager": DDP(build(), bucket_cap_mb=1),
        "fastcomm-compiled": torch.compile(
            DDP(build(), bucket_cap_mb=1, compiled_backward="traced"), backend=backend
        ),
        "fastcomm-split": torch.compile(
            DDP(build(), bucket_cap_mb=1, compiled_backward="split"), backend=backend
        ),
    }
    # the buckets handed over early are counted on models of their own, with a recording comm
    # hook (Gloo's all-reduce): the timed models keep each DDP's own reduction path
    handed, probes = {}, {}
    for name, wrap, kw in (
        ("torch-compiled", torch_ddp, {}),
        ("fastcomm-compiled", DDP, {"compiled_backward": "traced"}),
        ("fastcomm-split", DDP, {"compiled_backward": "split"}),
    ):
        handed[name] = _Recorder()
        inner = wrap(build(), bucket_cap_mb=1, **kw)
        inner.register_comm_hook(None, handed[name].hook)
        probes[name] = torch.compile(inner, backend=backend)
    STATE["compile_bench"] = {
        "models": models, "batch": batch, "gpt": group == "transformer", "handed": handed,
        "opts": {k: opt(m.parameters(), lr=1e-4) for k, m in models.items()},
        "probes": probes,
        "probe_opts": {k: opt(m.parameters(), lr=1e-4) for k, m in probes.items()},
    }
    for name in models:  # warm-up: compile, rebuild
        for _ in range(3):
            step(name)
    for name in probes:
        for _ in range(3):
            step(name, probe=True)
    return sum(p.numel() for p in models["torch-eager"].parameters())


def _own_frame(module: torch.nn.Module):
    def call(x):
        return module(x)

    call.parameters = module.parameters
    return call


class _Recorder:
    """The plain all-reduce as a comm hook, each call a profiler range: a probe step counts
    the buckets handed over before the backward's last matrix product starts."""

    def __init__(self) -> None:
        self.early = self.total = 0

    def hook(self, state, bucket):
        import torch.distributed as dist

        with torch.profiler.record_function("probe.bucket"):
            buffer = bucket.buffer().div_(dist.get_world_size())
            work = dist.all_reduce(buffer, async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    def count(self, prof) -> None:
        events = prof.events()
        last_mm = max(e.time_range.start for e in events if e.name == "aten::mm")
        starts = [e.time_range.start for e in events if e.name == "probe.bucket"]
        self.total, self.early = len(starts), sum(t < last_mm for t in starts)


def step(name: str, probe: bool = False) -> float:
    b = STATE["compile_bench"]
    models, opts = (b["probes"], b["probe_opts"]) if probe else (b["models"], b["opts"])
    model, opt = models[name], opts[name]
    x, y = b["batch"]
    recorder = b["handed"][name] if probe else None
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    if b["gpt"]:
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    else:
        loss = torch.nn.functional.mse_loss(model(x), y)
    if recorder is not None:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss.backward()
        recorder.count(prof)
    else:
        loss.backward()
    opt.step()
    if ON_GPU:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def interleaved(steps: int) -> dict:
    import torch.distributed as dist

    out = {}
    for name in STATE["compile_bench"]["models"]:
        dist.barrier()
        out[name] = [step(name) for _ in range(steps)]
    for name in STATE["compile_bench"]["probes"]:
        dist.barrier()
        step(name, probe=True)
    handed = {k: (r.early, r.total) for k, r in STATE["compile_bench"]["handed"].items()}
    return {"times": out, "handed": handed}


def teardown_group() -> None:
    import torch._dynamo
    import torch.distributed as dist

    STATE.pop("compile_bench", None)
    torch._dynamo.reset()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("group", ["mlp", "transformer"])
def test_ddp_compile_step(benchmark, request, group):
    quick_mode = quick(request.config)
    world = 1 if ON_GPU else 2
    env = {"CUDA_VISIBLE_DEVICES": "0"} if ON_GPU else {}
    steps = 2 if quick_mode else STEPS[group]
    with RankPool(world, env=env, timeout=900) as pool:
        params = pool.run(setup_group, group, quick_mode)[0]
        rounds = []

        def run():
            for _ in range(1 if quick_mode else ROUNDS):
                rounds.append(pool.run(interleaved, steps))

        benchmark.pedantic(run, rounds=1, iterations=1)
        pool.run(teardown_group)
    medians, spread = {}, {}
    for name in PROVIDERS:
        per_round = [[max(r["times"][name][i] for r in ranks) for i in range(steps)]
                     for ranks in rounds]
        medians[name] = statistics.median(t for rnd in per_round for t in rnd)
        round_medians = [statistics.median(rnd) for rnd in per_round]
        spread[name] = [round(1e3 * min(round_medians), 3), round(1e3 * max(round_medians), 3)]
    handed = rounds[-1][0]["handed"]
    info = {
        "group": group, "ranks": world, "params": params, "steps_per_round": steps,
        "median_step_ms": {n: round(1e3 * t, 3) for n, t in medians.items()},
        "round_median_spread_ms": spread,
        "handed_before_backward_ends": handed,
        "ratio_fastcomm_compiled_over_torch_compiled": round(
            medians["fastcomm-compiled"] / medians["torch-compiled"], 4),
        "ratio_fastcomm_compiled_over_fastcomm_eager": round(
            medians["fastcomm-compiled"] / medians["fastcomm-eager"], 4),
        "ratio_fastcomm_compiled_over_fastcomm_split": round(
            medians["fastcomm-compiled"] / medians["fastcomm-split"], 4),
        # what compiling does to the model alone, and the time each DDP adds to its model
        "ratio_no_comm_compiled_over_eager": round(
            medians["no-comm"] / medians["no-comm-eager"], 4),
        "ddp_added_ms": {
            name: round(1e3 * (medians[name] - medians[base]), 3)
            for name, base in (
                ("fastcomm-eager", "no-comm-eager"), ("torch-eager", "no-comm-eager"),
                ("fastcomm-compiled", "no-comm"), ("torch-compiled", "no-comm"),
                ("fastcomm-split", "no-comm"),
            )
        },
    }
    benchmark.extra_info.update(info)
    for name, ms in info["median_step_ms"].items():
        assert ms > 0, (name, info)
    print(f"\n{group}: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in info["median_step_ms"].items())
          + f"; handed before backward ends {handed}; fastcomm compiled / torch compiled "
          f"{info['ratio_fastcomm_compiled_over_torch_compiled']:.3f}, / fastcomm eager "
          f"{info['ratio_fastcomm_compiled_over_fastcomm_eager']:.3f}, / split "
          f"{info['ratio_fastcomm_compiled_over_fastcomm_split']:.3f}; the model alone compiled / "
          f"eager {info['ratio_no_comm_compiled_over_eager']:.3f}; DDP's added ms "
          f"{info['ddp_added_ms']}")
