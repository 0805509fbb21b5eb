"""fastcomm DDP under compiled autograd: the reductions traced into the compiled backward.

2 CPU ranks (the pool's, as ``test_compile.py``: 8 x ``Linear(512, 512)``, ``bucket_cap_mb=1``,
8 buckets). ``torch._dynamo.config.compiled_autograd`` is on and the training step (forward and
``backward()``) is compiled, so compiled autograd traces the backward, the DDP's gradient hooks
included, into one graph. A recording backend keeps the graphs Dynamo compiles; the backward's
is the one with ``fastcomm::bucket_launch`` nodes. Asserted: eager's parameters after 5
steps; one launch per bucket, in bucket order, each before the matrix products of the layers
below its bucket (issued while the backward still runs, not after it); one wait per bucket, in
order, after the backward's last matrix product (the reductions overlap the backward); no
recompilation after step 3. Also under compiled autograd: ``no_sync`` (no reduction in its
backward, the sum reduced at the next) and inductor compiling the traced backward.
"""

from __future__ import annotations

import pytest
import torch

from tests.ddp.test_compile import _batch, _wrap
from tests.harness import RankPool

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, timeout=240) as p:
        yield p


def _make_hook_recorder(hook, order: list[int]):
    """`hook`, noting each bucket's index as the hook is called (inside the op, at run time)."""

    def recording(state, bucket):
        order.append(bucket.index())
        return hook(state, bucket)

    return recording


def check_traced(variant: str, compiled_autograd: bool, steps: int = 5,
                 overlap: str = "on") -> dict:
    """`steps` steps of fastcomm DDP (``variant``: ``shm``, the pool's default communicator;
    ``gloo``; ``fp16`` / ``bf16``: those compression hooks), compiled autograd on or off, with
    ``FASTCOMM_DDP_COMPILED_OVERLAP`` set to `overlap`."""
    import os

    import torch._dynamo
    from torch._dynamo.backends.debugging import aot_eager

    from fastcomm.ddp import hooks
    from tests.ddp.common import init_torch_dist
    from tests.harness import rank_comm

    init_torch_dist()
    torch._dynamo.reset()
    os.environ["FASTCOMM_DDP_COMPILED_OVERLAP"] = overlap  # read as the DDP lays out its buckets
    kwargs = {"comm": rank_comm("gloo")} if variant == "gloo" else {}
    model, ddp = _wrap("fastcomm", "outer" if compiled_autograd else "no", **kwargs)
    order: list[int] = []
    if variant in ("fp16", "bf16"):
        hook = getattr(hooks, f"{variant}_compress_hook")
        ddp.register_comm_hook(None, _make_hook_recorder(hook, order))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def step(x, y):
        torch.nn.functional.mse_loss(model(x), y).backward()

    counters = torch._dynamo.utils.counters
    unique = [counters["stats"]["unique_graphs"]]
    per_step: list[list[int]] = []
    # read when torch.compile wraps the function: its calls run backward under compiled autograd
    with torch._dynamo.config.patch(compiled_autograd=compiled_autograd):
        compiled_step = torch.compile(step, backend=recording_backend)
        for i in range(steps):
            x, y = _batch(i)
            opt.zero_grad(set_to_none=True)
            order.clear()
            (compiled_step if compiled_autograd else step)(x, y)
            opt.step()
            per_step.append(list(order))
            unique.append(counters["stats"]["unique_graphs"])
    backward = [g for g in graphs if _bucket_nodes(g)]
    return {
        "params": [p.detach().clone() for p in ddp.module.parameters()],
        "unique": unique,
        "hook_order": per_step,
        "buckets": len(ddp.reducer.buckets),
        "graph": _summary(backward[-1]) if backward else [],
        "captures": counters["compiled_autograd"]["captures"],
        "overlap": ddp.reducer.traced.overlap,
    }


def _bucket_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if "bucket_launch" in str(n.target)]


def _summary(gm) -> list[tuple[str, int]]:
    """The backward graph's bucket launches (``("bucket", index)``), waits (``("wait",
    index)``) and matrix products (``("mm", 0)``), in graph order."""
    out = []
    for n in gm.graph.nodes:
        if "bucket_launch" in str(n.target):
            out.append(("bucket", n.args[3]))
        elif "bucket_wait" in str(n.target):
            out.append(("wait", n.args[4]))
        elif str(n.target) == "aten.mm.default":
            out.append(("mm", 0))
    return out


@pytest.mark.parametrize("variant", ["shm", "gloo", "fp16", "bf16"])
def test_reductions_are_traced_into_the_compiled_backward(pool, variant):
    eager = pool.run(check_traced, variant, False)
    traced = pool.run(check_traced, variant, True)  # FASTCOMM_DDP_COMPILED_OVERLAP=on
    for rank in range(2):
        ours, ref = traced[rank], eager[rank]
        assert ours["captures"] >= 1, ours  # compiled autograd ran the backward
        # eager's parameters (the compiled forward rounds differently)
        for a, b in zip(ours["params"], ref["params"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        # one launch and one wait per bucket, each in bucket order, in the compiled backward
        graph = ours["graph"]
        buckets = [i for kind, i in graph if kind == "bucket"]
        assert buckets == list(range(ours["buckets"])), graph
        waits = [(k, i) for k, (kind, i) in enumerate(graph) if kind == "wait"]
        assert [i for _, i in waits] == buckets, graph
        # launched as the backward runs: every bucket but the last (the first layer's) before
        # the last matrix product, i.e. before the first layer's gradients exist; waited for
        # after it (the reductions run while the layers below are differentiated)
        last_mm = max(k for k, (kind, _) in enumerate(graph) if kind == "mm")
        early = [i for k, (kind, i) in enumerate(graph) if kind == "bucket" and k < last_mm]
        assert len(early) >= ours["buckets"] - 1, graph
        assert all(k > last_mm for k, _ in waits), graph
        assert ours["overlap"] is True
        # a comm hook goes through the op: called once per bucket, in order, every step
        if variant in ("fp16", "bf16"):
            for record in ours["hook_order"]:
                assert record == sorted(record) and len(record) >= 8, ours["hook_order"]
            assert ours["hook_order"][2:] == ref["hook_order"][2:], ours["hook_order"]
        # compiled at the first step; nothing compiled after step 3
        unique = ours["unique"]
        assert unique[0] < unique[1], unique
        assert unique[3:] == [unique[3]] * (len(unique) - 3), unique


def test_cpu_buckets_wait_at_once_by_default(pool):
    """``auto`` (the default) on CPU buckets: each wait right after its launch, the same
    parameters as eager and as overlap."""
    eager = pool.run(check_traced, "shm", False)
    traced = pool.run(check_traced, "shm", True, overlap="auto")
    for rank in range(2):
        ours = traced[rank]
        assert ours["overlap"] is False and ours["captures"] >= 1, ours
        for a, b in zip(ours["params"], eager[rank]["params"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        graph = [(kind, i) for kind, i in ours["graph"] if kind != "mm"]
        pairs = [("bucket", b) if k % 2 == 0 else ("wait", b)
                 for b in range(ours["buckets"]) for k in (0, 1)]
        assert graph == pairs, ours["graph"]
        unique = ours["unique"]
        assert unique[3:] == [unique[3]] * (len(unique) - 3), unique


def check_unsupported() -> str:
    """A DDP with ``find_unused_parameters=True`` under compiled autograd: the error."""
    import torch._dynamo

    from tests.ddp.common import init_torch_dist

    init_torch_dist()
    torch._dynamo.reset()
    model, _ = _wrap("fastcomm", "outer", find_unused_parameters=True)

    def step(x, y):
        torch.nn.functional.mse_loss(model(x), y).backward()

    x, y = _batch(0)
    with torch._dynamo.config.patch(compiled_autograd=True):
        step = torch.compile(step, backend="aot_eager")
        try:
            step(x, y)
        except RuntimeError as exc:
            return str(exc)
    return ""


def test_unsupported_option_raises_naming_it(pool):
    for message in pool.run(check_unsupported):
        assert "find_unused_parameters=True" in message, message
        assert "compiled autograd" in message, message


def check_step_variant(kind: str, compiled_autograd: bool, steps: int = 6) -> dict:
    """`steps` steps of fastcomm DDP, compiled autograd on or off: ``no_sync`` (every other
    step accumulates a ``no_sync`` backward first) or ``inductor`` (the training step compiled
    by inductor instead of ``aot_eager``)."""
    import torch._dynamo

    from tests.ddp.common import init_torch_dist

    init_torch_dist()
    torch._dynamo.reset()
    model, ddp = _wrap("fastcomm", "outer" if compiled_autograd else "no")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(x, y):
        torch.nn.functional.mse_loss(model(x), y).backward()

    def reductions() -> int:  # the communicator's (shared by the module's tests)
        calls = ddp.comm.stats.calls
        return calls.get("shared_all_reduce", 0) + calls.get("all_reduce", 0)

    before = reductions()
    counters = torch._dynamo.utils.counters
    unique = [counters["stats"]["unique_graphs"]]
    with torch._dynamo.config.patch(compiled_autograd=compiled_autograd):
        backend = "inductor" if kind == "inductor" else "aot_eager"
        run = torch.compile(step, backend=backend) if compiled_autograd else step
        for i in range(steps):
            x, y = _batch(i)
            opt.zero_grad(set_to_none=True)
            if kind == "no_sync" and i % 2 == 0:
                with ddp.no_sync():
                    run(x, y)
                x, y = _batch(i + 50)
            run(x, y)
            opt.step()
            unique.append(counters["stats"]["unique_graphs"])
    return {"params": [p.detach().clone() for p in ddp.module.parameters()], "unique": unique,
            "captures": counters["compiled_autograd"]["captures"],
            "launches": reductions() - before}


@pytest.mark.parametrize("kind", ["no_sync", "inductor"])
def test_no_sync_and_inductor_under_compiled_autograd(pool, kind):
    """``no_sync`` accumulates without a reduction and the next step reduces the sum, and
    inductor compiles the traced backward: eager's parameters either way, and nothing compiled
    after step 3."""
    eager = pool.run(check_step_variant, kind, False)
    traced = pool.run(check_step_variant, kind, True)
    for rank in range(2):
        ours, ref = traced[rank], eager[rank]
        assert ours["captures"] >= 1, ours
        for a, b in zip(ours["params"], ref["params"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        # as many reductions as eager: none in a no_sync backward
        assert ours["launches"] == ref["launches"] > 0, (ours["launches"], ref["launches"])
        unique = ours["unique"]
        assert unique[3:] == [unique[3]] * (len(unique) - 3), unique
