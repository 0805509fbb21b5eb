"""Scripts torch DDP users write, on 2 CPU ranks over Gloo, against torch DDP itself.

Whole-module pickling (``torch.save(ddp_model)``), ``backward(create_graph=True)``, ``no_sync``
with ranks that use different parameters, sparse gradients (``nn.Embedding(sparse=True)``,
``nn.EmbeddingBag(sparse=True)``), the public attributes, ``register_comm_hook``'s argument
checks, ``join()``'s options, ``state_dict()`` keys and ``torch.compile``. Results are
compared with ``atol=0`` (see ``tests/ddp/common.py`` for why two ranks give bit-identical
averages; a sparse allreduce sums the same two halved values).
"""

from __future__ import annotations

import copy
import inspect
import io
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.ddp.common import (
    assert_same_state,
    batches,
    build,
    init_torch_dist,
    rank,
    step,
    train_both,
    wrap_pair,
)
from tests.harness import pool_fixture, rank_comm


def _allreduce_then_hook(state, bucket):
    """torch's suite hook: an allreduce whose future is post-processed by two ``then``."""
    world = dist.get_world_size()
    fut = dist.group.WORLD.allreduce([bucket.buffer()]).get_future()
    return fut.then(lambda f: 2 * f.wait()[0]).then(lambda f: f.wait() / (2 * world))


def _torch_hook(name: str):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if name == "allreduce_then":
        return _allreduce_then_hook
    return None if name == "none" else getattr(default_hooks, name)


def _train(models_and_opts, model_name: str, steps: int, seed: int | None = None) -> None:
    for x, y in batches(model_name, steps, seed=seed):
        for model, opt in models_and_opts:
            step(model, opt, model_name, x, y)


# ---------------------------------------------------------------------- pickling
def check_pickle_roundtrip(bucket_view: bool):
    from fastcomm.ddp import DDP

    ours, theirs = wrap_pair("mlp", gradient_as_bucket_view=bucket_view)
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (ours, theirs)]
    _train(opts, "mlp", 2)
    loaded = []
    for model in (ours, theirs):
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded.append(torch.load(buf, weights_only=False))
    ours2, theirs2 = loaded
    assert type(ours2) is DDP and ours2.comm is not None and ours2.comm.size == 2
    assert ours2.gradient_as_bucket_view == bucket_view
    assert_same_state(ours2, theirs2)
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (ours2, theirs2)]
    _train(opts, "mlp", 3, seed=7 + rank())
    assert_same_state(ours2, theirs2)
    # the loaded module can be wrapped again, and trains like torch's rewrapped one
    again = DDP(ours2.module)
    torch_again = nn.parallel.DistributedDataParallel(theirs2.module)
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (again, torch_again)]
    _train(opts, "mlp", 2, seed=17 + rank())
    assert_same_state(again, torch_again)
    # copy.deepcopy goes through the same __getstate__/__setstate__
    copies = [copy.deepcopy(m) for m in (again, torch_again)]
    assert copies[0].reducer is not again.reducer
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in copies]
    _train(opts, "mlp", 2, seed=27 + rank())
    assert_same_state(*copies)


def check_pickle_refuses_explicit_comm():
    from fastcomm.ddp import DDP

    init_torch_dist()
    model = DDP(build("mlp"), comm=rank_comm("gloo"))
    with pytest.raises(RuntimeError, match="only supported when using DDP with the default"):
        torch.save(model, io.BytesIO())


# ---------------------------------------------------------------------- create_graph
class _Square(nn.Module):
    """torch's suite model for ``create_graph``: one scalar parameter, squared."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return (self.p * x).pow(2).sum()


def check_create_graph(bucket_view: bool):
    """``backward(create_graph=True)``: the reduced gradients are the average of the local
    ones. References: torch DDP on torch's scalar model; on the MLP (where torch's own DDP
    raises an in-place error), the local gradients allreduced by hand."""
    from fastcomm.ddp import DDP

    init_torch_dist()
    ours = DDP(_Square(), gradient_as_bucket_view=bucket_view)
    theirs = nn.parallel.DistributedDataParallel(_Square(), gradient_as_bucket_view=bucket_view)
    for x, _ in batches("mlp", 3):
        for model in (ours, theirs):
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model(x).backward(create_graph=True)
        torch.testing.assert_close(ours.module.p.grad, theirs.module.p.grad, atol=0, rtol=0)

    ours = DDP(build("mlp"), gradient_as_bucket_view=bucket_view)
    local = build("mlp")
    for x, y in batches("mlp", 3):
        ours.zero_grad(set_to_none=True)
        local.zero_grad(set_to_none=True)
        with pytest.warns(UserWarning, match="create_graph=True  is not well-supported"):
            nn.functional.cross_entropy(ours(x), y).backward(create_graph=True)
        nn.functional.cross_entropy(local(x), y).backward(create_graph=True)
        for mine, p in zip(ours.parameters(), local.parameters(), strict=True):
            expected = p.grad.detach() * 0.5
            dist.all_reduce(expected)
            torch.testing.assert_close(mine.grad.detach(), expected, atol=0, rtol=0)
        with torch.no_grad():  # the same step on both, so the next iteration stays in sync
            for mine, p in zip(ours.parameters(), local.parameters(), strict=True):
                mine -= 0.1 * mine.grad
                p.copy_(mine)


def check_create_graph_gradient_penalty():
    """A gradient penalty (``autograd.grad(create_graph=True)`` then ``backward``)."""
    ours, theirs = wrap_pair("mlp")
    for x, y in batches("mlp", 3):
        grads = []
        for model in (ours, theirs):
            model.zero_grad(set_to_none=True)
            xr = x.clone().requires_grad_(True)
            loss = nn.functional.cross_entropy(model(xr), y)
            (gx,) = torch.autograd.grad(loss, xr, create_graph=True)
            (loss + gx.pow(2).sum()).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


# ---------------------------------------------------------------------- no_sync
class _Conditional(nn.Module):
    """torch's suite model: rank 0 uses nn1 then nn2, rank 1 uses nn3 then nn4."""

    def __init__(self, rank_: int):
        super().__init__()
        torch.manual_seed(0)
        self.rank = rank_
        self.nets = nn.ModuleList(nn.Linear(1, 1) for _ in range(4))
        self.state = 0

    def forward(self, x):
        first = 0 if self.rank == 0 else 2
        self.state ^= 1
        return self.nets[first + (1 - self.state)](x)


def check_no_sync_unused(bucket_view: bool, hook: str, accumulation: int):
    from fastcomm.ddp import DDP

    init_torch_dist()
    kwargs = {"find_unused_parameters": True, "gradient_as_bucket_view": bucket_view}
    ours = DDP(_Conditional(rank()), **kwargs)
    theirs = nn.parallel.DistributedDataParallel(_Conditional(rank()), **kwargs)
    if hook != "none":
        ours.register_comm_hook(None, _torch_hook(hook))
        theirs.register_comm_hook(None, _torch_hook(hook))
    gen = torch.Generator().manual_seed(rank())
    for _ in range(2):  # two accumulation rounds: the second starts from reduced grads
        data = [(torch.rand(1, generator=gen), torch.rand(1, generator=gen))
                for _ in range(accumulation)]
        for model in (ours, theirs):
            for i, (x, t) in enumerate(data):
                context = model.no_sync if i < accumulation - 1 else nullcontext
                with context():
                    nn.functional.mse_loss(model(x), t).backward()
        mine = [p.grad for p in ours.parameters()]
        torch_grads = [p.grad for p in theirs.parameters()]
        assert [g is None for g in mine] == [g is None for g in torch_grads], (mine, torch_grads)
        if accumulation == 2:
            assert all(g is not None for g in mine), "every parameter gets a gradient"
        for a, b in zip(mine, torch_grads, strict=True):
            if a is not None:
                torch.testing.assert_close(a, b, atol=0, rtol=0)
        flat = torch.cat([g.reshape(-1) for g in mine if g is not None])
        gathered = [torch.zeros_like(flat) for _ in range(2)]
        dist.all_gather(gathered, flat)
        assert torch.equal(gathered[0], gathered[1]), "identical on every rank"


# ---------------------------------------------------------------------- sparse gradients
class _Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 8, mode="sum", sparse=True)
        self.emb = nn.Embedding(30, 8, sparse=True)
        self.head = nn.Linear(16, 4)

    def forward(self, idx):
        h = torch.cat([self.bag(idx), self.emb(idx).mean(1)], dim=1)
        return self.head(torch.tanh(h))


def _sparse_batches(steps: int):
    gen = torch.Generator().manual_seed(200 + rank())
    return [
        (torch.randint(0, 30, (6, 4), generator=gen), torch.randint(0, 4, (6,), generator=gen))
        for _ in range(steps)
    ]


def check_sparse(bucket_view: bool, hook: str, backend: str, static_graph: bool = False):
    from fastcomm.ddp import DDP

    init_torch_dist()
    seen_sparse = []

    def recording_hook(state, bucket):
        seen_sparse.append(bucket.buffer().is_sparse)
        return _torch_hook(hook)(state, bucket)

    comm = None if backend == "torch" else rank_comm(backend)
    torch.manual_seed(0)
    kwargs = {"gradient_as_bucket_view": bucket_view, "static_graph": static_graph}
    ours = DDP(_Embeddings(), comm=comm, **kwargs)
    torch.manual_seed(0)
    theirs = nn.parallel.DistributedDataParallel(_Embeddings(), **kwargs)
    if hook != "none":
        ours.register_comm_hook(None, recording_hook)
        theirs.register_comm_hook(None, _torch_hook(hook))
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.5)) for m in (ours, theirs)]
    for x, y in _sparse_batches(4):
        for model, opt in opts:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            if model is ours:
                assert ours.module.bag.weight.grad.is_sparse
                assert ours.module.emb.weight.grad.is_sparse
                assert not ours.module.head.weight.grad.is_sparse
            opt.step()
        assert_same_state(ours, theirs)
    sparse_buckets = [b for b in ours.reducer.buckets if b.sparse]
    assert sorted(b.names[0] for b in sparse_buckets) == ["bag.weight", "emb.weight"]
    assert all(len(b.params) == 1 and b.flat is None for b in sparse_buckets)
    if hook != "none":
        assert seen_sparse.count(True) == 2 * 4, seen_sparse


def check_sparse_no_sync_and_join():
    """Sparse gradients accumulated under ``no_sync``, then uneven inputs under ``join``."""
    from fastcomm.ddp import DDP

    init_torch_dist()
    torch.manual_seed(0)
    ours = DDP(_Embeddings(), find_unused_parameters=True)
    torch.manual_seed(0)
    theirs = nn.parallel.DistributedDataParallel(_Embeddings(), find_unused_parameters=True)
    data = _sparse_batches(3 + rank())
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        with model.no_sync():
            nn.functional.cross_entropy(model(data[0][0]), data[0][1]).backward()
        nn.functional.cross_entropy(model(data[1][0]), data[1][1]).backward()
        opt.step()
        with model.join():
            for x, y in data[2:]:
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
    assert_same_state(ours, theirs)


# ---------------------------------------------------------------------- public surface
_ATTRS = (
    "device_ids", "output_device", "process_group", "dim", "broadcast_buffers",
    "find_unused_parameters", "gradient_as_bucket_view", "static_graph",
)


def check_attributes():
    for kwargs in (
        {},
        {"broadcast_buffers": False, "find_unused_parameters": True},
        {"gradient_as_bucket_view": True, "static_graph": True, "dim": 1},
    ):
        ours, theirs = wrap_pair("mlp", **kwargs)
        assert type(ours.module) is type(theirs.module)
        for name in _ATTRS:
            assert getattr(ours, name) == getattr(theirs, name), (name, kwargs)
        assert ours.process_group is dist.distributed_c10d._get_default_group()
    # ignored parameters, as torch's static helpers mark and list them
    from fastcomm.ddp import DDP

    models = []
    for cls in (DDP, nn.parallel.DistributedDataParallel):
        model = build("convbn")
        cls._set_params_and_buffers_to_ignore_for_model(model, ["conv.bias", "bn.running_mean"])
        models.append(model)
        assert model.conv.bias._ddp_ignored and model.bn.running_mean._ddp_ignored
    names = []  # (torch's named_params=True lists ignored ones too: it tests the tuple)
    for cls, model in zip((DDP, nn.parallel.DistributedDataParallel), models, strict=True):
        name_of = {id(p): n for n, p in model.named_parameters()}
        names.append([name_of[id(p)] for p in cls._get_data_parallel_params(model)])
    assert names[0] == names[1] and "conv.bias" not in names[0], names


def check_set_static_graph():
    ours, theirs = wrap_pair(
        "branchy", model_kwargs={"dynamic": False}, find_unused_parameters=True
    )
    for model in (ours, theirs):
        with pytest.warns(UserWarning, match="find_unused_parameters=true"):
            model._set_static_graph()
        assert model.static_graph
        with pytest.warns(UserWarning, match="no need to set it again"):
            model._set_static_graph()
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (ours, theirs)]
    _train(opts, "branchy", 4)
    assert_same_state(ours, theirs)


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 -- the type is what is compared
        return type(exc), str(exc)
    return None, ""


def check_register_comm_hook_errors():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def bad_bucket(state, bucket: int):
        return default_hooks.allreduce_hook(state, bucket)

    def bad_return(state, bucket) -> int:
        return default_hooks.allreduce_hook(state, bucket)

    for hook in ("not callable", bad_bucket, bad_return):
        ours, theirs = wrap_pair("mlp")
        mine, torch_err = (_raised(m.register_comm_hook, None, hook) for m in (ours, theirs))
        assert torch_err[0] is not None and mine == torch_err, (mine, torch_err)
    ours, theirs = wrap_pair("mlp")
    for model in (ours, theirs):
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    mine, torch_err = (
        _raised(m.register_comm_hook, None, default_hooks.allreduce_hook) for m in (ours, theirs)
    )
    assert mine == torch_err and torch_err[0] is RuntimeError, (mine, torch_err)


def check_join_options():
    ours, theirs = wrap_pair("mlp")
    sig = inspect.signature(type(theirs).join)
    assert inspect.signature(type(ours).join).parameters.keys() == sig.parameters.keys()
    for model in (ours, theirs):  # a disabled join is a no-op: uneven inputs are the user's
        with model.join(enable=False):
            _train([(model, torch.optim.SGD(model.parameters(), lr=0.1))], "mlp", 2)
    assert_same_state(ours, theirs)
    for model in (ours, theirs):
        steps = 2 + rank()
        with pytest.raises(RuntimeError):
            with model.join(throw_on_early_termination=True):
                _train([(model, torch.optim.SGD(model.parameters(), lr=0.1))], "mlp", steps)
    for divide in (True, False):
        for model in (ours, theirs):
            with model.join(divide_by_initial_world_size=divide):
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                _train([(model, opt)], "mlp", 2 + rank(), seed=50 + rank())
        assert_same_state(ours, theirs)


def check_state_dict_keys():
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    ours, theirs = train_both("convbn", steps=2)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert all(k.startswith("module.") for k in ours.state_dict())
    assert list(ours.module.state_dict()) == list(theirs.module.state_dict())
    state = theirs.state_dict()
    consume_prefix_in_state_dict_if_present(state, "module.")
    fresh, _ = wrap_pair("convbn")
    fresh.module.load_state_dict(state)
    assert_same_state(fresh, theirs)
    fresh.load_state_dict(theirs.state_dict())
    assert_same_state(fresh, theirs)


def check_compile(option: str):
    """A compiled DDP trains as the eager one (find_unused: the graph walk from the outputs
    goes through the compiled backward node to the parameters)."""
    from fastcomm.ddp import DDP

    init_torch_dist()
    kwargs = {option: True} if option != "default" else {}
    eager = DDP(build("mlp"), **kwargs)
    compiled_ddp = DDP(build("mlp"), **kwargs)
    compiled = torch.compile(compiled_ddp)
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (eager, compiled)]
    _train(opts, "mlp", 3)
    # same arithmetic in another order inside the compiled graph: a few ulps of fp32
    assert_same_state(eager, compiled_ddp, atol=1e-6, rtol=1e-5)
    assert compiled_ddp.reducer.synced_iterations == 3, "the reducer's hooks ran every step"


# ---------------------------------------------------------------------- pytest side
pool = pool_fixture(2, timeout=180)


@pytest.mark.parametrize("bucket_view", [False, True])
def test_pickle_whole_module(pool, bucket_view):
    pool.run(check_pickle_roundtrip, bucket_view)


def test_pickle_refuses_explicit_comm(pool):
    pool.run(check_pickle_refuses_explicit_comm)


@pytest.mark.parametrize("bucket_view", [False, True])
def test_create_graph(pool, bucket_view):
    pool.run(check_create_graph, bucket_view)


def test_create_graph_gradient_penalty(pool):
    pool.run(check_create_graph_gradient_penalty)


@pytest.mark.parametrize("accumulation", [2, 3])
@pytest.mark.parametrize("hook", ["none", "allreduce_hook", "allreduce_then"])
@pytest.mark.parametrize("bucket_view", [False, True])
def test_no_sync_ranks_use_different_parameters(pool, bucket_view, hook, accumulation):
    pool.run(check_no_sync_unused, bucket_view, hook, accumulation)


@pytest.mark.parametrize(
    "bucket_view, hook, backend, static_graph",
    [
        (False, "none", "torch", False),
        (True, "none", "torch", False),
        (False, "allreduce_hook", "torch", False),
        (True, "allreduce_hook", "torch", False),
        (False, "none", "gloo", False),
        (True, "none", "shm", False),
        (False, "none", "torch", True),
    ],
)
def test_sparse_gradients(pool, bucket_view, hook, backend, static_graph):
    pool.run(check_sparse, bucket_view, hook, backend, static_graph)


def test_sparse_no_sync_and_join(pool):
    pool.run(check_sparse_no_sync_and_join)


def test_attributes(pool):
    pool.run(check_attributes)


def test_set_static_graph(pool):
    pool.run(check_set_static_graph)


def test_register_comm_hook_errors(pool):
    pool.run(check_register_comm_hook_errors)


def test_join_options(pool):
    pool.run(check_join_options)


def test_state_dict_keys(pool):
    pool.run(check_state_dict_keys)


@pytest.mark.parametrize(
    "option", ["default", "gradient_as_bucket_view", "find_unused_parameters"]
)
def test_torch_compile(pool, option):
    pool.run(check_compile, option)

