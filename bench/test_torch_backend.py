"""torch's own training on the ``fastcomm`` torch.distributed backend against Gloo, 2 CPU ranks.

Every provider is a model of its own in the same 2 rank processes, whose default group is of
the fastcomm backend with a Gloo group beside it (``new_group(backend="gloo")``):

- ``test_ddp_step``: torch's ``DistributedDataParallel`` on a ``Linear(1024, 1024) + ReLU`` x 10
  MLP (~10.5M parameters), ``bucket_cap_mb`` 1 and 25, over the fastcomm group or the Gloo one.
- ``test_fsdp2_step``: ``fully_shard`` on every ``Linear`` and the root of an MLP: 512 x 6
  (~1.6M parameters, 6 units) and 1024 x 10 (~10.5M, 10 units), Adam, on a ``DeviceMesh`` of
  either group.
- ``test_moe_step``: a mixture-of-experts layer, one expert per rank: a replicated gate routes
  each of 128 tokens (width 128) to one expert, ``all_to_all_single`` with the uneven splits
  (torch's autograd form, ``torch.distributed.nn.functional``) takes them there and back, the
  expert is ``Linear(128, 256) + GELU + Linear(256, 128)``, the gate's gradients are
  all-reduced; fastcomm and Gloo stepped in turn, 30 rounds, the slower rank's median.
- ``test_all_reduce_call``: one 4 KiB all-reduce four ways: the group's communicator called
  directly (``comm``: ``group.communicator.all_reduce``), the group's own method as torch calls
  it (``pg-fastcomm``: ``group.allreduce([t], opts)``), ``dist.all_reduce`` on the fastcomm
  group (``dist-fastcomm``) and on the Gloo group (``dist-gloo``). ``pg-fastcomm`` minus
  ``comm`` is what the adapter adds to a call; ``dist-fastcomm`` minus ``pg-fastcomm`` is
  torch's own ``dist.all_reduce`` layer, the same for every backend. A round is 200 calls in
  the ranks (``extra_info["us_per_call"]``: the slower rank's median over rounds). The models
  are built on the first training step, so ``-k test_all_reduce_call`` builds none.

Batch 64 per rank, one intra-op thread per rank. A round of a training provider is one step as
seen from the parent (``pool.run`` round trip included, ~1 ms), preceded, untimed, by a step of
the other provider of its pair. The ratios (fastcomm over Gloo) come from ``test_ratios``: every
round steps each provider of a pair once, a barrier before each step, and the figure is the
median over rounds of the slower rank's time (rounds seconds apart on a shared machine; the
per-provider rounds are minutes apart).

Quick mode (``--benchmark-disable`` or ``FASTCOMM_BENCH_QUICK=1``): 256 x 4 models, a few steps
and calls -- a smoke test that finishes in seconds.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
from _ddp_common import BATCH, build_mlp, quick, rank_batch, slowest_rank_median
from _torch_groups import init_groups

from tests.harness import STATE, RankPool

DDP_SHAPE = (1024, 10)
FSDP_SHAPES = ((512, 6), (1024, 10))
QUICK_SHAPE = (256, 4)
CAPS = (1, 25)
BACKENDS = ("fastcomm", "gloo")
CALLS = ("comm", "pg-fastcomm", "dist-fastcomm", "dist-gloo")
CALLS_PER_ROUND = 200
_RATIOS: list[dict] = []


# ---------------------------------------------------------------------- rank side
def _shape(shape: tuple[int, int], quick_mode: bool) -> tuple[int, int]:
    return QUICK_SHAPE if quick_mode else shape


def setup_ranks(quick_mode: bool) -> None:
    """The fastcomm default group and a Gloo group beside it (the models come later)."""
    groups = init_groups("bench-torch-backend", 120)
    STATE["torch_backend"] = {"quick": quick_mode, "groups": groups, "models": None,
                              "batches": {}, "times": {}}


def model_sizes() -> dict[str, int]:
    """Parameters of each model (built now if not yet: every rank calls it at once)."""
    return {name: sum(p.numel() for p in model.parameters())  # a DTensor's numel is global
            for name, (model, _, _) in _models().items()}


def _models() -> dict:
    """Every provider's ``(model, optimizer, width)``, built and warmed up on first use."""
    b = STATE["torch_backend"]
    if b["models"] is None:
        b["models"] = _build_models(b["groups"], b["quick"])
        b["times"] = {name: [] for name in b["models"]}
        for name in b["models"]:  # warm-up: DDP rebuilds its buckets, FSDP2 allocates
            for _ in range(2):
                train_step(name)
        _clear()
    return b["models"]


def _build_models(groups: dict, quick_mode: bool) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    models = {}
    width, depth = _shape(DDP_SHAPE, quick_mode)
    for backend, group in groups.items():
        for cap in CAPS:
            model = DistributedDataParallel(build_mlp(width, depth, torch.device("cpu")),
                                            process_group=group, bucket_cap_mb=cap)
            models[f"ddp-{cap}-{backend}"] = (model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                              width)
        for shape in FSDP_SHAPES:
            w, d = _shape(shape, quick_mode)
            mesh = DeviceMesh.from_group(group, "cpu")
            model = build_mlp(w, d, torch.device("cpu"))
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            models[f"fsdp2-{shape[0]}x{shape[1]}-{backend}"] = (
                model, torch.optim.Adam(model.parameters(), lr=1e-4), w)
    return models


def _clear() -> None:
    for times in STATE["torch_backend"]["times"].values():
        times.clear()


def train_step(name: str) -> float:
    b = STATE["torch_backend"]
    model, opt, width = (b["models"] or _models())[name]
    if width not in b["batches"]:
        b["batches"][width] = rank_batch(BATCH, width, torch.device("cpu"))
    x, y = b["batches"][width]
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    elapsed = time.perf_counter() - start
    b["times"][name].append(elapsed)
    return elapsed


def step_times(name: str) -> list[float]:
    times = list(STATE["torch_backend"]["times"][name])
    _clear()
    return times


def interleaved(names: list[str], rounds: int) -> dict[str, list[float]]:
    """``rounds`` rounds of one step of each of ``names`` in turn, a barrier before each."""
    import torch.distributed as dist

    _models()
    _clear()
    for _ in range(rounds):
        for name in names:
            dist.barrier(group=STATE["torch_backend"]["groups"]["gloo"])
            train_step(name)
    times = {name: list(STATE["torch_backend"]["times"][name]) for name in names}
    _clear()
    return times


def _ways() -> dict:
    """The ways to all-reduce 4 KiB (``CALLS``), as callables."""
    import torch.distributed as dist

    groups = STATE["torch_backend"]["groups"]
    fastcomm, gloo = groups["fastcomm"], groups["gloo"]
    comm = fastcomm.communicator
    t = torch.ones(1024)
    opts = dist.AllreduceOptions()  # what dist.all_reduce(t) hands the group
    opts.reduceOp = dist.ReduceOp.SUM
    opts.asyncOp = False
    return {
        "comm": lambda: comm.all_reduce(t),
        "pg-fastcomm": lambda: fastcomm.allreduce([t], opts),
        "dist-fastcomm": lambda: dist.all_reduce(t, group=fastcomm),
        "dist-gloo": lambda: dist.all_reduce(t, group=gloo),
    }


def _time_calls(call, calls: int) -> float:
    import torch.distributed as dist

    dist.barrier(group=STATE["torch_backend"]["groups"]["gloo"])
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def call_way(way: str, calls: int) -> float:
    """Microseconds per call of one way, over ``calls`` calls."""
    return _time_calls(_ways()[way], calls)


def call_rounds(rounds: int, calls: int) -> dict[str, list[float]]:
    """Microseconds per 4 KiB all-reduce, per round of ``calls`` calls, each way in turn."""
    ways = _ways()
    per_call = {name: [] for name in ways}
    for _ in range(rounds + 1):  # the first round warms up
        for name, call in ways.items():
            per_call[name].append(_time_calls(call, calls))
    return {name: values[1:] for name, values in per_call.items()}


# pipeline parallelism: Schedule1F1B over the two ranks (stage r on rank r)
PIPE_WIDTH, PIPE_LAYERS, PIPE_MICROBATCHES, PIPE_ROWS = 256, 4, 8, 8


def _pipelines() -> dict:
    """Per backend: ``(schedule, optimizer, stage module)``, built on first use."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    b = STATE["torch_backend"]
    if "pipelines" not in b:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        b["pipelines"] = {}
        for backend, group in b["groups"].items():
            torch.manual_seed(rank)
            block = torch.nn.Sequential(*[m for _ in range(PIPE_LAYERS) for m in (
                torch.nn.Linear(PIPE_WIDTH, PIPE_WIDTH), torch.nn.GELU())])
            stage = PipelineStage(block, rank, world, torch.device("cpu"), group=group)
            schedule = Schedule1F1B(stage, n_microbatches=PIPE_MICROBATCHES,
                                    loss_fn=torch.nn.MSELoss())
            b["pipelines"][backend] = (schedule, torch.optim.SGD(block.parameters(), lr=1e-3),
                                       block)
        gen = torch.Generator().manual_seed(7)
        rows = PIPE_MICROBATCHES * PIPE_ROWS
        b["pipe_batch"] = (torch.randn(rows, PIPE_WIDTH, generator=gen),
                           torch.randn(rows, PIPE_WIDTH, generator=gen))
        for backend in b["pipelines"]:  # warm-up: shapes exchanged, buffers allocated
            pipeline_step(backend)
    return b["pipelines"]


def pipeline_step(backend: str) -> float:
    """One Schedule1F1B training step on ``backend``'s group; seconds."""
    schedule, opt, _ = _pipelines()[backend]
    x, y = STATE["torch_backend"]["pipe_batch"]
    rank = int(os.environ["RANK"])
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=[])
    opt.step()
    return time.perf_counter() - start


def pipeline_rounds(rounds: int) -> dict[str, list[float]]:
    """``rounds`` rounds of one step on each backend in turn, a barrier before each."""
    import torch.distributed as dist

    _pipelines()
    times = {backend: [] for backend in BACKENDS}
    for _ in range(rounds):
        for backend in BACKENDS:
            dist.barrier(group=STATE["torch_backend"]["groups"]["gloo"])
            times[backend].append(pipeline_step(backend))
    return times


def pipeline_params() -> int:
    return sum(p.numel() for p in _pipelines()["fastcomm"][2].parameters())


# MoE: tokens per rank, model width, expert hidden width; one expert per rank (2 at 2 ranks)
MOE_SHAPE = (128, 128, 256)
MOE_QUICK_SHAPE = (32, 32, 64)


def _moe_layers() -> dict:
    """Per backend: ``(gate, expert, optimizer, batch, target)``, the same seeds on both."""
    b = STATE["torch_backend"]
    if "moe" not in b:
        import torch.distributed as dist

        tokens, width, hidden = MOE_QUICK_SHAPE if b["quick"] else MOE_SHAPE
        rank, world = dist.get_rank(), dist.get_world_size()
        b["moe"] = {}
        for backend in BACKENDS:
            torch.manual_seed(0)
            gate = torch.nn.Linear(width, world)
            torch.manual_seed(1 + rank)
            expert = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(),
                                         torch.nn.Linear(hidden, width))
            opt = torch.optim.SGD([*gate.parameters(), *expert.parameters()], lr=1e-2)
            torch.manual_seed(100 + rank)
            batch = torch.randn(tokens, width), torch.randn(tokens, width)
            b["moe"][backend] = (gate, expert, opt, *batch)
    return b["moe"]


def moe_step(backend: str) -> float:
    """One training step of a mixture-of-experts layer: a replicated gate routes each token
    to one expert (uneven splits), ``all_to_all_single`` (torch's autograd form) takes the
    tokens there and back, the gate's gradients are all-reduced. Returns seconds."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn

    group = STATE["torch_backend"]["groups"][backend]
    gate, expert, opt, x, target = _moe_layers()[backend]
    world = dist.get_world_size()
    start = time.perf_counter()
    scores = gate(x).softmax(-1)
    choice = scores.argmax(-1)
    order = torch.argsort(choice, stable=True)
    sends = torch.bincount(choice, minlength=world)
    recvs = torch.empty_like(sends)
    dist.all_to_all_single(recvs, sends, group=group)
    sends, recvs = sends.tolist(), recvs.tolist()
    width = x.shape[1]
    arrived = dist_fn.all_to_all_single(torch.empty(sum(recvs), width), x[order], recvs, sends,
                                        group=group)
    back = dist_fn.all_to_all_single(torch.empty(len(x), width), expert(arrived), sends, recvs,
                                     group=group)
    out = torch.empty_like(back).index_copy(0, order, back) * scores.gather(1, choice[:, None])
    torch.nn.functional.mse_loss(out, target).backward()
    for p in gate.parameters():
        dist.all_reduce(p.grad, group=group)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def moe_rounds(rounds: int) -> dict[str, list[float]]:
    """``rounds`` rounds of one MoE step per backend in turn (after one untimed), a barrier
    before each."""
    import torch.distributed as dist

    times = {backend: [] for backend in BACKENDS}
    for _ in range(rounds + 1):
        for backend in BACKENDS:
            dist.barrier(group=STATE["torch_backend"]["groups"]["gloo"])
            times[backend].append(moe_step(backend))
    return {backend: values[1:] for backend, values in times.items()}


def teardown_ranks() -> None:
    import torch.distributed as dist

    STATE.pop("torch_backend", None)
    dist.destroy_process_group()


# ---------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def ranks(request):
    quick_mode = quick(request.config)
    plugins = request.config.pluginmanager
    if not plugins.has_plugin("fastcomm-torch-backend-ratios"):
        plugins.register(_RatiosTable(), "fastcomm-torch-backend-ratios")
    with RankPool(2, env={"TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}, timeout=300) as pool:
        pool.run(setup_ranks, quick_mode)
        yield pool, _LazySizes(pool), quick_mode
        pool.run(teardown_ranks)


class _LazySizes:
    """Each model's parameter count, asked of the ranks (building the models) on first use."""

    def __init__(self, pool: RankPool) -> None:
        self._pool, self._sizes = pool, None

    def __getitem__(self, name: str) -> int:
        if self._sizes is None:
            self._sizes = self._pool.run(model_sizes)[0]
        return self._sizes[name]


def _pair(name: str) -> str:
    backend = name.rsplit("-", 1)[1]
    other = BACKENDS[1 - BACKENDS.index(backend)]
    return name[: -len(backend)] + other


def _measure(benchmark, ranks, name: str) -> None:
    pool, sizes, quick_mode = ranks
    rounds = 2 if quick_mode else 10

    def step():
        return max(pool.run(train_step, name))

    def other() -> None:  # untimed: the other backend's step before each timed one
        pool.run(train_step, _pair(name))

    benchmark.pedantic(step, setup=other, rounds=rounds, iterations=1,
                       warmup_rounds=0 if quick_mode else 1)
    per_rank = pool.run(step_times, name)
    benchmark.extra_info.update(
        provider=name.rsplit("-", 1)[1], params=sizes[name],
        rank_step_ms=round(slowest_rank_median(per_rank) * 1e3, 2),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"cap{c}")
def test_ddp_step(benchmark, ranks, cap, backend):
    _measure(benchmark, ranks, f"ddp-{cap}-{backend}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", FSDP_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_fsdp2_step(benchmark, ranks, shape, backend):
    _measure(benchmark, ranks, f"fsdp2-{shape[0]}x{shape[1]}-{backend}")


@pytest.mark.parametrize("way", CALLS)
def test_all_reduce_call(benchmark, ranks, way):
    pool, _, quick_mode = ranks
    calls = 5 if quick_mode else CALLS_PER_ROUND
    per_call: list[float] = []

    def one_round():
        per_call.append(max(pool.run(call_way, way, calls)))

    benchmark.pedantic(one_round, rounds=2 if quick_mode else 10, iterations=1,
                       warmup_rounds=0 if quick_mode else 1)
    benchmark.extra_info.update(provider=way, calls_per_round=calls,
                                us_per_call=round(statistics.median(per_call), 2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_pipeline_step(benchmark, ranks, backend):
    """One ``Schedule1F1B`` step (2 stages of 4 ``Linear(256)`` + GELU, 8 microbatches of 8
    rows) on each backend, the other backend's step before each round, untimed."""
    pool, _, quick_mode = ranks
    other = BACKENDS[1 - BACKENDS.index(backend)]
    per_rank: list[float] = []

    def step() -> None:
        per_rank.append(max(pool.run(pipeline_step, backend)))

    def setup() -> None:
        pool.run(pipeline_step, other)

    benchmark.pedantic(step, setup=setup,
                       rounds=2 if quick_mode else 15, iterations=1,
                       warmup_rounds=0 if quick_mode else 1)
    benchmark.extra_info.update(provider=backend,
                                rank_step_ms=round(statistics.median(per_rank) * 1e3, 3))


def test_pipeline_ratio(ranks):
    """Schedule1F1B step, fastcomm over Gloo, the two stepped in turn in the same rounds."""
    pool, _, quick_mode = ranks
    per_rank = pool.run(pipeline_rounds, 3 if quick_mode else 40)
    medians = {b: slowest_rank_median([r[b] for r in per_rank]) for b in BACKENDS}
    params = sum(pool.run(pipeline_params))
    _RATIOS.append(dict(what="Schedule1F1B step, 2x4 Linear(256)", params=params,
                        fastcomm_ms=medians["fastcomm"] * 1e3, gloo_ms=medians["gloo"] * 1e3,
                        ratio=medians["fastcomm"] / medians["gloo"]))
    assert medians["fastcomm"] > 0 and medians["gloo"] > 0


PAIRS = [
    *[(f"ddp-{cap}", "torch DDP, bucket_cap_mb", cap) for cap in CAPS],
    *[(f"fsdp2-{w}x{d}", "FSDP2 step, MLP", f"{w}x{d}") for w, d in FSDP_SHAPES],
]


def test_ratios(ranks):
    """fastcomm over Gloo, every pair stepped in turn in the same rounds; and the 4 KiB call."""
    pool, sizes, quick_mode = ranks
    rounds = 2 if quick_mode else 15
    names = [f"{prefix}-{backend}" for prefix, *_ in PAIRS for backend in BACKENDS]
    per_rank = pool.run(interleaved, names, rounds)
    medians = {n: slowest_rank_median([r[n] for r in per_rank]) for n in names}
    for prefix, what, value in PAIRS:
        fast, gloo = medians[f"{prefix}-fastcomm"], medians[f"{prefix}-gloo"]
        _RATIOS.append(dict(what=f"{what} {value}", params=sizes[f"{prefix}-fastcomm"],
                            fastcomm_ms=fast * 1e3, gloo_ms=gloo * 1e3, ratio=fast / gloo))
    calls = pool.run(call_rounds, 3 if quick_mode else 15, 5 if quick_mode else CALLS_PER_ROUND)
    per_way = {w: statistics.median(max(vals) for vals in zip(*(r[w] for r in calls),
                                                               strict=True)) for w in CALLS}
    _RATIOS.append(dict(what="4 KiB all_reduce", comm_us=per_way["comm"],
                        pg_us=per_way["pg-fastcomm"], fastcomm_us=per_way["dist-fastcomm"],
                        gloo_us=per_way["dist-gloo"],
                        adapter_us=per_way["pg-fastcomm"] - per_way["comm"]))
    assert all(r.get("ratio", 1) > 0 for r in _RATIOS)


def test_moe_step(benchmark, ranks):
    """An MoE step (``moe_step``) on fastcomm and on Gloo in the same rounds; the ratio joins
    ``test_ratios``'s table."""
    pool, _, quick_mode = ranks
    per_rank: list[dict] = []
    benchmark.pedantic(lambda: per_rank.extend(pool.run(moe_rounds, 2 if quick_mode else 30)),
                       rounds=1, iterations=1)
    count = len(per_rank[0]["fastcomm"])
    medians = {b: statistics.median(max(r[b][i] for r in per_rank) for i in range(count))
               for b in BACKENDS}
    tokens, width, hidden = MOE_QUICK_SHAPE if quick_mode else MOE_SHAPE
    params = width * len(per_rank) + len(per_rank) + 2 * width * hidden + hidden + width
    _RATIOS.append(dict(what=f"MoE step {tokens} tok {width}x{hidden}", params=params,
                        fastcomm_ms=medians["fastcomm"] * 1e3, gloo_ms=medians["gloo"] * 1e3,
                        ratio=medians["fastcomm"] / medians["gloo"]))
    benchmark.extra_info.update(fastcomm_ms=round(medians["fastcomm"] * 1e3, 3),
                                gloo_ms=round(medians["gloo"] * 1e3, 3),
                                ratio=round(medians["fastcomm"] / medians["gloo"], 3))


class _RatiosTable:
    """Prints ``test_ratios``'s figures at the end of the session and adds them to
    ``--benchmark-json`` as ``"torch_backend"`` (registered by ``ranks``)."""

    def pytest_terminal_summary(self, terminalreporter):
        if _RATIOS:
            _write_ratios(terminalreporter)

    def pytest_benchmark_update_json(self, config, benchmarks, output_json):
        if _RATIOS:  # the interleaved figures, charted by bench/plot.py
            output_json["torch_backend"] = list(_RATIOS)


def _write_ratios(terminalreporter) -> None:
    terminalreporter.section("fastcomm torch.distributed backend vs Gloo (interleaved rounds)")
    for row in _RATIOS:
        if "ratio" in row:
            terminalreporter.write_line(
                f"{row['what']:<28} {row['params'] / 1e6:6.1f}M params  fastcomm "
                f"{row['fastcomm_ms']:8.1f} ms  gloo {row['gloo_ms']:8.1f} ms  "
                f"ratio {row['ratio']:.2f}"
            )
        else:
            terminalreporter.write_line(
                f"{row['what']}: comm.all_reduce {row['comm_us']:.1f} us, group.allreduce "
                f"{row['pg_us']:.1f} us (adapter {row['adapter_us']:+.1f} us), "
                f"dist.all_reduce {row['fastcomm_us']:.1f} us, on Gloo {row['gloo_us']:.1f} us"
            )
