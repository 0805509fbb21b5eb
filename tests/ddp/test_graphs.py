"""CUDA buckets replayed from CUDA graphs (``fastcomm.ddp.graphs``).

On CPU: the capture-safe hot path stays so (its source is read for the calls a step's launch
must not make), the choice of strategy, the option. On a GPU (one rank over NCCL): a DDP that
replays its buckets trains to the same bits as one that does not, through gradients that move,
a misaligned gradient, a changed averaging factor, and gives the same norm and NaN verdict.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

from fastcomm.comm import graph_lane
from fastcomm.ddp import graphs
from fastcomm.ddp.config import DDPConfig
from fastcomm.kernels import _relocate
from tests.harness import RankPool

# ---------------------------------------------------------------------- CPU: the rules

#: (module, qualified function) of every function on a replayed bucket's path in a step
HOT_PATH = [
    (graphs, "GraphedAllReduce.launch"),
    (graphs, "GraphedAllReduce.wait"),
    (graphs, "GraphedAllReduce.write_back"),
    (graphs, "GraphedAllReduce._caller_stream"),
    (graphs, "GraphedAllReduce._done_of"),
    (graphs, "_addresses"),
    (graphs, "_stats_of"),
    (graph_lane, "GraphLane.replay"),
    (_relocate, "RelocatablePlan.set_addresses"),
    (_relocate, "RelocatablePlan.aligned"),
]
#: calls a step's launch must not make: a query syncs with the device's progress, pinning
#: and new events cost host time per call (and pinning is not allowed in a capture)
FORBIDDEN = {"query", "pin_memory", "Event", "synchronize", "empty", "zeros", "tensor",
             "device_synchronize", "wait_stream"}
#: the exceptions, each with its reason
ALLOWED = {
    # a host buffer is reused only once its copy (made two address changes ago) is done:
    # no wait in practice, and only on a step where an address changed
    ("RelocatablePlan.set_addresses", "synchronize"),
}


def _function(module, qualname: str) -> ast.FunctionDef:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return ast.parse(textwrap.dedent(inspect.getsource(obj))).body[0]


def _calls(fn: ast.FunctionDef) -> list[str]:
    names = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            names.append(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


@pytest.mark.parametrize("module, qualname", HOT_PATH, ids=[q for _, q in HOT_PATH])
def test_the_replay_path_makes_no_forbidden_call(module, qualname):
    fn = _function(module, qualname)
    assert fn.name == qualname.rsplit(".", 1)[-1]  # the function itself was read
    calls = _calls(fn)
    bad = [c for c in calls if c in FORBIDDEN and (qualname, c) not in ALLOWED]
    assert not bad, f"{qualname} calls {bad} on a replayed bucket's path"


def test_the_hot_path_was_read():
    calls = [c for m, q in HOT_PATH for c in _calls(_function(m, q))]
    assert {"replay", "record", "wait_event", "set_addresses"} <= set(calls), calls


def test_the_check_sees_a_forbidden_call():
    source = "def launch(self):\n    e = torch.cuda.Event()\n    e.query()\n"
    calls = _calls(ast.parse(source).body[0])
    assert {"Event", "query"} <= set(calls) and FORBIDDEN & set(calls)


def test_current_stream_is_looked_up_in_one_place():
    """The caller's stream: once per step, in `_caller_stream`, not per bucket elsewhere."""
    for module, qualname in HOT_PATH:
        if qualname == "GraphedAllReduce._caller_stream":
            continue
        assert "current_stream" not in _calls(_function(module, qualname)), qualname


def test_the_option(monkeypatch):
    assert DDPConfig().cuda_graphs is True
    assert DDPConfig(cuda_graphs=False).cuda_graphs is False
    monkeypatch.setenv("FASTCOMM_DDP_CUDA_GRAPHS", "0")
    assert DDPConfig().cuda_graphs is False
    with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
        DDPConfig(cuda_graphs="yes")


def test_only_packed_cuda_buckets_are_graphed():
    from fastcomm.comm.types import Capabilities
    from fastcomm.ddp.bucket import build_buckets
    from fastcomm.ddp.plan import choose_strategy
    from fastcomm.ddp.strategy import PACKED, VIEW

    params = [torch.nn.Parameter(torch.zeros(8)) for _ in range(3)]
    (bucket,) = build_buckets(params, ["a", "b", "c"], [2, 1, 0], [1 << 20], set())
    graphed = graphs.GraphedAllReduce(lane=None)
    caps = Capabilities(layout_free=False)
    config = DDPConfig(arrival_pack_max_grads=0)
    assert choose_strategy(bucket, caps, config, None, False, graphed) is PACKED  # a CPU one
    bucket.device = torch.device("cuda", 0)  # what choose_strategy reads of a CUDA bucket
    assert choose_strategy(bucket, caps, config, None, False, graphed) is graphed
    assert choose_strategy(bucket, caps, config, None, True, graphed) is VIEW
    hooked = choose_strategy(bucket, caps, config, lambda s, b: None, False, graphed)
    assert type(hooked).__name__ == "CommHook"


def test_communicators_without_a_lane_plan_no_graph():
    """Gloo offers no graph lane: a CUDA-capable option changes nothing there."""
    pool_result = _run_one(_plan_on_gloo)
    assert pool_result == ["ArrivalPackedAllReduce"] * pool_result.__len__()
    assert pool_result


def _plan_on_gloo():
    from fastcomm.ddp import DDP
    from tests.harness import rank_comm

    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)),
                comm=rank_comm("gloo"), cuda_graphs=True)
    assert not model.comm.capabilities.graph_all_reduce
    return [type(s).__name__ for s in model.reducer.strategies]


def _run_one(fn, *args):
    with RankPool(1, timeout=120) as pool:
        return pool.run(fn, *args)[0]


# ---------------------------------------------------------------------- GPU: the results
def _model(device):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(6)] + [torch.nn.Linear(64, 8)]
    return torch.nn.Sequential(*[m for lay in layers for m in (lay, torch.nn.Tanh())][:-1]).to(
        device
    )


def check_graphed_training(steps: int = 8) -> dict:
    """Three DDPs on one NCCL communicator: replayed (``graphed``), eager (``eager``), and
    replayed with every step's gradients kept alive (so autograd allocates new ones
    elsewhere: ``moving``); the facts the test asserts."""
    from fastcomm.ddp import DDP
    from fastcomm.ddp.graphs import GraphedAllReduce
    from tests.harness import rank_comm

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    comm = rank_comm("nccl")
    kinds = ("graphed", "eager", "moving", "kept")
    models = {
        k: DDP(_model(device), comm=comm, bucket_cap_mb=0.02, cuda_graphs=k != "eager")
        for k in kinds
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05) for k, m in models.items()}
    gen = torch.Generator().manual_seed(3)
    held, ptrs_seen, calls = [], set(), {}
    norms = {k: [] for k in kinds}
    for m in models.values():  # a factor other than 1 (one rank): the scaled pack runs
        m.reducer.scale = 0.5
    for step in range(steps):
        x = torch.randn(32, 64, generator=gen).to(device)
        y = torch.randn(32, 8, generator=gen).to(device)
        if step == steps - 2:  # another factor (what join does): the captured graphs do not
            for m in models.values():  # hold it, so the buckets go eager
                m.reducer.scale = 1.0
        for k, model in models.items():
            opts[k].zero_grad(set_to_none=k != "kept")
            if k == "kept" and step == 5:  # a misaligned gradient: that bucket goes eager
                p = next(model.parameters())
                base = torch.zeros(p.numel() + 1, device=device)
                p.grad = base[1:].view_as(p)
            before = comm.stats.calls.get("all_reduce", 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
            calls.setdefault(k, []).append(comm.stats.calls.get("all_reduce", 0) - before)
            norms[k].append(float(model.clip_grad_norm_(1e9)))
            if k == "moving":
                held.append([p.grad for p in model.parameters()])
                graph = getattr(model.reducer.strategies[0], "_graphs", {}).get(0)
                if graph is not None:
                    ptrs_seen.add(tuple(graph.plan.ptrs))
            opts[k].step()
    torch.cuda.synchronize()
    strategies = {k: model.reducer.strategies for k, model in models.items()}
    graphed = strategies["graphed"][0]
    return {
        "n_buckets": len(models["graphed"].reducer.buckets),
        "graphed_types": {type(s).__name__ for s in strategies["graphed"]},
        "eager_types": {type(s).__name__ for s in strategies["eager"]},
        "captured": len(graphed._graphs) if isinstance(graphed, GraphedAllReduce) else -1,
        "moving_addresses": len(ptrs_seen),
        "calls": calls,
        "norms": norms,
        "norm_source": models["graphed"].reducer.health.last_norm_source,
        "same": {
            k: all(torch.equal(a, b) for a, b in zip(models["eager"].parameters(),
                                                     models[k].parameters(), strict=True))
            for k in kinds
        },
    }


def check_nonfinite_is_caught_when_replayed() -> str:
    from fastcomm.ddp import DDP
    from tests.harness import rank_comm

    device = torch.device("cuda", 0)
    model = DDP(_model(device), comm=rank_comm("nccl"), bucket_cap_mb=0.02, check_finite=True)
    x, y = torch.randn(4, 64, device=device), torch.randn(4, 8, device=device)
    for _ in range(3):  # eager, captured, replayed
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
    x[0, 0] = float("nan")
    model.zero_grad()
    with pytest.raises(FloatingPointError) as info:
        torch.nn.functional.mse_loss(model(x), y).backward()
    return str(info.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replayed_buckets_train_to_the_eager_bits():
    env = {"CUDA_VISIBLE_DEVICES": "0", "FASTCOMM_TEST_DEVICE": "0"}
    with RankPool(1, env=env, timeout=300) as pool:
        facts = pool.run(check_graphed_training)[0]
        message = pool.run(check_nonfinite_is_caught_when_replayed)[0]
    assert facts["n_buckets"] >= 3, facts
    assert facts["graphed_types"] == {"GraphedAllReduce"}, facts
    assert "GraphedAllReduce" not in facts["eager_types"], facts
    assert facts["captured"] == facts["n_buckets"], facts
    assert facts["moving_addresses"] >= 3, facts  # the relocation was exercised
    for kind, per_step in facts["calls"].items():  # every bucket reduced every step
        assert per_step == [facts["n_buckets"]] * len(per_step), (kind, facts)
    assert facts["same"] == dict.fromkeys(facts["same"], True), facts
    assert facts["norm_source"] == "unpack", facts
    for kind, norms in facts["norms"].items():
        assert norms == facts["norms"]["eager"], (kind, facts["norms"])
    assert "NaN or Inf" in message, message
