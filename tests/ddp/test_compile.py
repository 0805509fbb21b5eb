"""fastcomm DDP under ``torch.compile``: overlap kept, results and features as eager's.

2 CPU ranks over Gloo (torch's default group; fastcomm DDP on it, torch DDP beside it). The
model is 8 x ``Linear(512, 512)`` (1 MiB weights) with ``bucket_cap_mb=1``: 8 buckets. A comm
hook records, for each bucket it is handed, whether the input's gradient exists yet: the
buckets handed over before it were launched while the backward still ran. Compiled, the
default for CPU parameters (``compiled_backward="auto"``: ``"traced"``) calls the module
through taps whose backward hands each gradient to its bucket from inside the one compiled
backward (``fastcomm.ddp.taps``); there the input's gradient comes after the whole compiled
backward, so the launch points are read from the profiler instead. ``"split"`` and
``DDP(torch.compile(m))`` have torch's DDPOptimizer split the graph at the buckets' boundaries
(fastcomm's DDP is torch's active DDP module while its module runs), so each bucket is handed
over as its part of the backward ends.

The compiler backend is ``aot_eager`` (AOTAutograd's forward/backward split, eager kernels):
results, recompiles and the split do not depend on it, and it compiles in a second where
inductor takes tens on 2 cores. Where each tapped bucket is launched is inductor's schedule:
that test compiles with inductor. ``bench/test_ddp_compile.py`` measures with inductor.
"""

from __future__ import annotations

import pytest
import torch

from tests.ddp.common import LinearStack
from tests.harness import RankPool

BACKEND = "aot_eager"
WIDTH, DEPTH = 512, 8


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, timeout=240) as p:
        yield p


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return LinearStack(WIDTH, DEPTH)


class _WithSpare(torch.nn.Module):
    """The MLP and a layer its forward never uses (``find_unused_parameters``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()
        self.spare = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.body(x)


class _WithSparse(torch.nn.Module):
    """The MLP plus rows of an embedding with sparse gradients (their own bucket, reduced
    from their eager hook, not through a tap)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()
        self.emb = torch.nn.Embedding(16, WIDTH, sparse=True)
        self.register_buffer("rows", torch.tensor([1, 3, 3, 7]))

    def forward(self, x):
        return self.body(x) + self.emb(self.rows)


class _WithBreak(torch.nn.Module):
    """The MLP with a graph break between its halves."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = LinearStack(WIDTH, DEPTH // 2), LinearStack(WIDTH, DEPTH // 2)

    def forward(self, x):
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


def _batch(step: int):
    import os

    g = torch.Generator().manual_seed(100 * step + int(os.environ["RANK"]))
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


class _Recorder:
    """A comm hook (the plain all-reduce) that records each bucket it is handed: its index,
    and whether the input's gradient existed then."""

    def __init__(self) -> None:
        self.input_done = False
        self.handed: list[tuple[int, bool]] = []

    def hook(self, state, bucket):
        import torch.distributed as dist

        self.handed.append((bucket.index(), not self.input_done))
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def _wrap(kind: str, compiled: str, backend: str = BACKEND, **ddp_kwargs):
    """(the model to call, the DDP) for `kind` (``fastcomm``/``torch``) and `compiled`
    (``no``, ``outer``: ``torch.compile(DDP(m))``, ``inner``: ``DDP(torch.compile(m))``)."""
    from fastcomm.ddp import DDP

    cls = DDP if kind == "fastcomm" else torch.nn.parallel.DistributedDataParallel
    ddp_kwargs.setdefault("bucket_cap_mb", 1)
    model_class = ddp_kwargs.pop("model_class", _mlp)
    module = _WithSpare() if ddp_kwargs.get("find_unused_parameters") else model_class()
    if compiled == "inner":
        module = torch.compile(module, backend=backend)
    ddp = cls(module, **ddp_kwargs)
    model = torch.compile(ddp, backend=backend) if compiled == "outer" else ddp
    return model, ddp


def check_overlap(kind: str, compiled: str, steps: int = 6) -> dict:
    """Trains `steps` steps with the recording hook; what the test asserts (``outer-split``:
    ``outer`` with fastcomm's ``compiled_backward="split"``)."""
    import torch._dynamo

    from tests.ddp.common import init_torch_dist

    init_torch_dist()
    torch._dynamo.reset()
    kwargs = {}
    if compiled == "outer-split":
        compiled = "outer"
        if kind == "fastcomm":
            kwargs["compiled_backward"] = "split"
    model, ddp = _wrap(kind, compiled, **kwargs)
    recorder = _Recorder()
    ddp.register_comm_hook(None, recorder.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    counters = torch._dynamo.utils.counters
    handed, graphs = [], [counters["stats"]["unique_graphs"]]  # before, then after each step
    breaks = sum(counters["graph_break"].values())
    for step in range(steps):
        x, y = _batch(step)
        x.requires_grad_(True)
        x.register_hook(lambda g: setattr(recorder, "input_done", True))
        recorder.input_done, recorder.handed = False, []
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        handed.append(list(recorder.handed))
        graphs.append(counters["stats"]["unique_graphs"])
    return {
        "handed": handed,
        "graphs": graphs,
        "breaks": sum(counters["graph_break"].values()) - breaks,
        "traced": kind == "fastcomm" and ddp.reducer.traced_step,
        "params": [p.detach().clone() for p in ddp.module.parameters()],
    }


@pytest.mark.parametrize("compiled", ["outer", "outer-split", "inner"])
def test_compiled_backward_hands_buckets_over_as_it_runs(pool, compiled):
    eager = pool.run(check_overlap, "fastcomm", "no")
    ours = pool.run(check_overlap, "fastcomm", compiled)
    theirs = pool.run(check_overlap, "torch", compiled)
    for rank in range(2):
        last = ours[rank]["handed"][-1]
        early = sum(before for _, before in last)
        torch_early = sum(before for _, before in theirs[rank]["handed"][-1])
        # as many buckets handed over before backward ends as torch DDP compiled: 7 (of 8
        # buckets; of 9 where the compiled module's gradients arrive weight before bias, for
        # both DDPs); the first layer's bucket is the input's own
        assert early >= torch_early, (last, theirs[rank]["handed"][-1])
        # ... and torch DDP's module was compiled, not run eagerly
        assert theirs[rank]["graphs"][1] > theirs[rank]["graphs"][0], theirs[rank]["graphs"]
        assert early >= 7, last
        # CPU parameters: the default ("auto") took the taps
        assert ours[rank]["traced"] == (compiled == "outer"), (compiled, ours[rank]["traced"])
        # every bucket, in index order, the same every step (compiled, the gradients of a
        # layer arrive weight before bias: the rebuild in arrival order makes 9 buckets of
        # them where eager's order makes 8, as torch DDP's does)
        first = ours[rank]["handed"][2]
        assert [i for i, _ in first] == list(range(len(first))), first
        assert len(first) in (len(eager[rank]["handed"][2]), len(eager[rank]["handed"][2]) + 1)
        for step, record in enumerate(ours[rank]["handed"][2:], start=2):
            assert record == first, (step, record, first)
        # eager's parameters
        for a, b in zip(ours[rank]["params"], eager[rank]["params"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        # compiled at the first step, no recompilation after step 3
        graphs = ours[rank]["graphs"]
        assert graphs[0] < graphs[1], graphs
        assert graphs[3:] == [graphs[3]] * (len(graphs) - 3), graphs
        # Dynamo runs DDP.forward as Python and compiles only the module's call: no graph
        # breaks (tracing the forward broke it three times, each break a resume frame per step)
        assert ours[rank]["breaks"] == 0, ours[rank]["breaks"]


def check_launch_points(compiled_backward: str, steps: int = 4) -> dict:
    """``torch.compile(DDP(m, compiled_backward=...))`` with inductor: the last step's
    backward under the profiler; each bucket's launch (``fastcomm.ddp.bucket<i>``) against the
    backward's matrix products (``aten::mm``), by start time."""
    import torch._dynamo
    from torch.profiler import ProfilerActivity, profile

    from tests.ddp.common import init_torch_dist

    init_torch_dist()
    torch._dynamo.reset()
    model, ddp = _wrap("fastcomm", "outer", "inductor", compiled_backward=compiled_backward)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == steps - 1:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                loss.backward()
        else:
            loss.backward()
        opt.step()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    mm = [e.time_range.start for e in events if e.name == "aten::mm"]
    launches = [(e.name, e.time_range.start) for e in events
                if e.name.startswith("fastcomm.ddp.bucket")]
    return {
        "launches": [name for name, _ in launches],
        "before_last_mm": sum(t < mm[-1] for _, t in launches),
        "mm": len(mm),
        "buckets": len(ddp.reducer.buckets),
        "traced": ddp.reducer.traced_step,
        "graphs": counters["stats"]["unique_graphs"] - before,
        "params": [p.detach().clone() for p in ddp.module.parameters()],
    }


def test_traced_backward_launches_each_bucket_between_its_kernels(pool):
    """``compiled_backward="traced"`` (CPU's default): one compiled backward, each bucket launched
    by the op that hands its last gradient over, between the backward's matrix products (not
    after them); the same parameters as DDPOptimizer's split (``"split"``). Inductor, not
    ``aot_eager``: the op's place is inductor's schedule (taps.py)."""
    traced = pool.run(check_launch_points, "traced")
    split = pool.run(check_launch_points, "split")
    for rank in range(2):
        t, s = traced[rank], split[rank]
        assert t["traced"] and not s["traced"], (t["traced"], s["traced"])
        assert t["graphs"] == 1, t["graphs"]  # one Dynamo graph, no break
        # every bucket, in index order; all but the first layer's launched while matrix
        # products of the backward were still to come (15 of them: the input needs none)
        assert t["launches"] == [f"fastcomm.ddp.bucket{i}" for i in range(t["buckets"])], t
        assert t["mm"] == 2 * DEPTH - 1, t["mm"]
        assert t["before_last_mm"] >= t["buckets"] - 1, t
        assert s["before_last_mm"] >= s["buckets"] - 2, s
        for a, b in zip(t["params"], s["params"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def check_pickled_copy(steps: int = 3) -> dict:
    """A compiled DDP pickled after training (``torch.save``), loaded, compiled and trained on
    the same batches as the original."""
    import io

    import torch._dynamo

    from tests.ddp.common import init_torch_dist

    init_torch_dist()
    torch._dynamo.reset()
    model, ddp = _wrap("fastcomm", "outer", compiled_backward="traced")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def train(model, opt, first):
        for step in range(first, first + steps):
            x, y = _batch(step)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    train(model, opt, 0)
    buf = io.BytesIO()
    torch.save(ddp, buf)
    buf.seek(0)
    copy = torch.load(buf, weights_only=False)
    copy_model = torch.compile(copy, backend=BACKEND)
    copy_opt = torch.optim.SGD(copy_model.parameters(), lr=0.05)
    train(model, opt, steps)
    train(copy_model, copy_opt, steps)
    return {
        "own_taps": copy._taps is not None and copy._taps is not ddp._taps
        and copy._taps.key != ddp._taps.key,
        "traced": copy.reducer.traced_step and ddp.reducer.traced_step,
        "same": all(torch.equal(a, b) for a, b in
                    zip(ddp.module.parameters(), copy.module.parameters(), strict=True)),
    }


def test_a_pickled_compiled_ddp_takes_taps_of_its_own(pool):
    """The taps are not pickled: the loaded copy makes its own, whose op hands the gradients to
    the copy's reducer, and trains as the original does."""
    for rank, result in enumerate(pool.run(check_pickled_copy)):
        assert result == {"own_taps": True, "traced": True, "same": True}, (rank, result)


def test_compiled_backward_option_is_checked():
    from fastcomm.ddp.config import DDPConfig

    assert DDPConfig().compiled_backward == "auto"
    assert DDPConfig(compiled_backward="split").compiled_backward == "split"
    with pytest.raises(ValueError, match=r"compiled_backward must be one of 'auto', 'traced', "
                                         r"'split', got 'graph'"):
        DDPConfig(compiled_backward="graph")


def check_feature(feature: str, compiled: str, steps: int = 5,
                  compiled_backward: str = "traced") -> list[torch.Tensor]:
    """`steps` steps of fastcomm DDP with `feature`, compiled as `compiled` (with
    `compiled_backward`); its parameters (and, for ``clip``, the norms)."""
    import torch._dynamo

    from fastcomm.ddp import hooks
    from tests.ddp.common import init_torch_dist

    init_torch_dist()
    torch._dynamo.reset()
    kwargs = {"compiled_backward": compiled_backward}
    if feature == "sparse":
        kwargs["model_class"] = _WithSparse
    if feature == "graph_break":
        kwargs["model_class"] = _WithBreak
    if feature == "static_graph":
        kwargs["static_graph"] = True
    if feature == "unused":
        kwargs["find_unused_parameters"] = True
    if feature == "shm":  # shared buckets reduced in place, .grad their views
        from tests.harness import rank_comm

        kwargs["comm"] = rank_comm("shm")
    model, ddp = _wrap("fastcomm", compiled, **kwargs)
    if feature in ("fp16", "bf16"):
        ddp.register_comm_hook(None, getattr(hooks, f"{feature}_compress_hook"))
    if feature == "int8":
        ddp.register_comm_hook(hooks.QuantizeState(), hooks.int8_compress_hook)
    if feature == "powersgd":
        ddp.register_comm_hook(hooks.PowerSGDState(None, matrix_approximation_rank=2,
                                                   start_powerSGD_iter=2), hooks.powersgd_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out, graphs = [], []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        if feature == "no_sync" and step % 2 == 0:
            with ddp.no_sync():
                torch.nn.functional.mse_loss(model(x), y).backward()
            x, y = _batch(step + 50)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if feature == "clip":
            out.append(ddp.clip_grad_norm_(1.0).detach().clone())
        opt.step()
    if compiled == "outer" and compiled_backward == "traced":
        # the taps take every synchronized step, but where a graph break would leave them
        # in the first graph: there the DDP goes over to the split path (taps.py)
        breaks = feature == "graph_break"
        assert ddp._taps.broken == breaks and ddp.reducer.traced_step != breaks, feature
    return graphs, out + [p.detach().clone() for p in ddp.module.parameters()]


FEATURES = ["fp16", "bf16", "int8", "powersgd", "no_sync", "static_graph", "unused", "clip",
            "shm", "sparse", "graph_break"]


SPLIT_FEATURES = ["fp16", "no_sync", "static_graph", "unused", "shm"]


@pytest.mark.parametrize("feature", FEATURES)
def test_features_give_eager_results_compiled(pool, feature):
    """Each feature with the taps, and the split's own cases under DDPOptimizer's split too
    (CUDA's default: hooks between the parts, no_sync, a learned or unused set, shm)."""
    eager = pool.run(check_feature, feature, "no")
    for compiled_backward in ("traced", "split") if feature in SPLIT_FEATURES else ("traced",):
        compiled = pool.run(check_feature, feature, "outer", compiled_backward=compiled_backward)
        # int8 and PowerSGD carry state between steps (error feedback): same inputs, same
        # steps, same results, up to the compiled forward's rounding
        for rank in range(2):
            graphs, values = compiled[rank]
            for a, b in zip(values, eager[rank][1], strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            assert graphs[0] < graphs[1], (compiled_backward, graphs)  # compiled at step 1
            # none after step 3
            assert graphs[3:] == [graphs[3]] * (len(graphs) - 3), (compiled_backward, graphs)
