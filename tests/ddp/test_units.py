"""Single-process pieces: bucket assignment, the GradBucket contract, world size 1."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastcomm.comm import GlooCommunicator, Store
from fastcomm.ddp import DDP, DDPConfig, GradBucket
from fastcomm.ddp.bucket import assign_buckets
from fastcomm.ddp.config import MB


@pytest.fixture(scope="module")
def comm():
    c = GlooCommunicator(Store(is_server=True, timeout=10), 0, 1, timeout=10)
    yield c
    c.close()


def test_default_caps_are_torchs():
    assert DDPConfig().bucket_caps_bytes == [1 * MB, 25 * MB]
    assert DDPConfig(bucket_cap_mb=10).bucket_caps_bytes == [10 * MB]
    assert DDPConfig(bucket_cap_mb_list=[2, 4]).bucket_caps_bytes == [2 * MB, 4 * MB]
    assert DDPConfig(bucket_cap_mb=5).bucket_bytes_cap == 5 * MB


def test_assignment_closes_buckets_at_their_cap_in_order():
    params = [torch.empty(n) for n in (10, 10, 10, 10, 10)]  # 40 bytes each
    order = [4, 3, 2, 1, 0]
    # first cap 40 bytes: one tensor; then 80 bytes: two per bucket; the last repeats
    assert assign_buckets(params, order, [40, 80]) == [[4], [3, 2], [1, 0]]
    assert assign_buckets(params, order, [1000]) == [[4, 3, 2, 1, 0]]


def test_assignment_keeps_dtypes_apart():
    params = [torch.empty(4), torch.empty(4, dtype=torch.float64), torch.empty(4)]
    assert assign_buckets(params, [2, 1, 0], [10**6]) == [[2, 0], [1]]


def test_grad_bucket_contract_world_one(comm):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref.load_state_dict(net.state_dict())
    model = DDP(net, comm=comm)
    seen = []

    def hook(state, bucket: GradBucket):
        buf = bucket.buffer()
        grads = bucket.gradients()
        params = bucket.parameters()
        assert [g.shape for g in grads] == [p.shape for p in params]
        assert all(g.data_ptr() >= buf.data_ptr() for g in grads), "gradients view the buffer"
        seen.append((bucket.index(), bucket.is_last(), len(params), state))
        bucket.set_buffer(buf * 2)  # torch's wrappers replace the buffer; the value wins
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer() / 2)
        return fut

    model.register_comm_hook("state", hook)
    x = torch.randn(5, 4)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert seen == [(0, True, 4, "state")]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0)


def test_world_one_matches_local_training(comm):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref.load_state_dict(net.state_dict())
    model = DDP(net, comm=comm, bucket_cap_mb=0.0001, gradient_as_bucket_view=True)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(5, 4)
        for m, o in ((model, opt_a), (ref, opt_b)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for p, q in zip(model.module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    # 104-byte caps: [bias2, weight2, bias1] (104 bytes) closes, weight1 alone
    assert model.reducer.bucket_indices() == [[3, 2, 1], [0]] and model.reducer.rebuilt


def test_hooks_accept_a_fastcomm_comm_as_state(comm):
    from fastcomm.ddp import hooks

    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 3), comm=comm)
    model.register_comm_hook(comm, hooks.bf16_compress_hook)
    x = torch.randn(6, 4)
    model(x).sum().backward()
    expected = torch.ones(6, 3).t() @ x  # d(sum)/dW
    torch.testing.assert_close(model.module.weight.grad, expected.to(torch.bfloat16).float())


def test_buckets_launch_during_backward(comm):
    """Overlap: the first bucket is handed to the communicator while backward still has the
    earlier layers' gradients to compute, and every bucket before the end-of-backward step."""
    from fastcomm.ddp import hooks

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    model = DDP(net, comm=comm, bucket_cap_mb=0.0005)  # ~one layer per bucket
    first_layer = net[0].weight
    pending_at_launch = []

    def hook(state, bucket):
        pending_at_launch.append(first_layer.grad is None)
        return hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    model(torch.randn(4, 16)).sum().backward()
    assert len(pending_at_launch) == len(model.reducer.buckets) >= 6
    # every bucket but the one holding the first layer launched before its gradient existed
    assert pending_at_launch[:-1] == [True] * (len(pending_at_launch) - 1)
    assert first_layer.grad is not None


# ---------------------------------------------------------------------- bucket strategies
class _Mixed(nn.Module):
    """A sparse embedding, one large weight (reduced in place at a 512-byte threshold) and
    small ones: every strategy a bucket can take."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.big = nn.Linear(4, 64)  # weight: 1 KiB
        self.head = nn.Linear(64, 2)  # weight: 512 bytes, bias: 8 bytes

    def forward(self, idx):
        return self.head(torch.tanh(self.big(self.emb(idx)))).sum()


def _strategy_kinds(model) -> dict[str, str]:
    """Each bucket's strategy (``inner`` of a hook joined with a colon), keyed by its first
    parameter's name."""
    kinds = {}
    for bucket, s in zip(model.reducer.buckets, model.reducer.strategies, strict=True):
        kind = type(s).__name__
        if hasattr(s, "inner"):
            kind += ":" + type(s.inner).__name__
        kinds[bucket.names[0]] = kind
    return kinds


@pytest.mark.parametrize("bucket_view", [False, True])
def test_each_bucket_gets_its_strategy(comm, monkeypatch, bucket_view):
    from fastcomm.ddp import config, hooks

    monkeypatch.setattr(config, "IN_PLACE_MIN_BYTES", 1024)
    torch.manual_seed(0)
    net, ref = _Mixed(), _Mixed()
    ref.load_state_dict(net.state_dict())
    # a 1-byte cap: one parameter per bucket
    model = DDP(net, comm=comm, bucket_cap_mb=1e-6, gradient_as_bucket_view=bucket_view)
    # a CPU fp32 bucket packs each gradient as it arrives
    dense = "ViewAllReduce" if bucket_view else "ArrivalPackedAllReduce"
    expected = {
        "head.bias": dense,
        "head.weight": dense,  # 512 bytes: below the threshold
        "big.bias": dense,
        "big.weight": dense if bucket_view else "InPlaceAllReduce",  # 1 KiB
        "emb.weight": "SparseAllReduce",
    }
    assert _strategy_kinds(model) == expected
    if not bucket_view:
        big = model.reducer.strategies[3]
        assert big.plan.large == [0] and big.plan.small == [], big

    # one step and the rebuild: the same choices, torch's gradients (world 1: the sums)
    idx = torch.tensor([1, 3, 3, 7])
    for _ in range(2):
        for m in (model, ref):
            m.zero_grad()
            m(idx).backward()
        for p, q in zip(model.module.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense(), atol=0, rtol=0)
    assert model.reducer.rebuilt and _strategy_kinds(model) == expected

    # a comm hook wraps every bucket's plain strategy (no in-place, no pack on arrival: the
    # hook packs)
    hooked = DDP(_Mixed(), comm=comm, bucket_cap_mb=1e-6, gradient_as_bucket_view=bucket_view)
    hooked.register_comm_hook(None, hooks.allreduce_hook)
    plain = "ViewAllReduce" if bucket_view else "PackedAllReduce"
    wrapped = {
        name: "CommHook:" + (kind if kind == "SparseAllReduce" else plain)
        for name, kind in expected.items()
    }
    assert _strategy_kinds(hooked) == wrapped
    assert all(s.hook is hooks.allreduce_hook for s in hooked.reducer.strategies)


def test_half_built_reducer_is_deleted_quietly(comm, monkeypatch):
    """A constructor that raises leaves no ``Exception ignored in __del__`` and no autograd
    hook behind."""
    import gc
    import sys

    from fastcomm.ddp.reducer import Reducer

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(AttributeError, match="NoneType"):  # before any attribute: no comm
        Reducer([torch.zeros(2, requires_grad=True)], ["w"], None, DDPConfig())
    leaf = torch.zeros(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="non-leaf"):  # after the leaf's hook
        Reducer([leaf, leaf * 2], ["leaf", "non_leaf"], comm, DDPConfig())
    Reducer.__new__(Reducer).__del__()  # nothing set at all
    gc.collect()
    assert unraisable == [], [u.exc_value for u in unraisable]
    assert not leaf._post_accumulate_grad_hooks, "the half-built reducer removed its hook"


class _Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)
        self.extra = nn.Linear(8, 2)  # reached only with use_extra

    def forward(self, x, use_extra=True):
        h = torch.tanh(self.a(x))
        out = self.b(h)
        return (out + self.extra(h) if use_extra else out).square().sum()


@pytest.mark.filterwarnings("ignore:Using DistributedDataParallel with create_graph")
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_cpu_buckets_pack_each_gradient_as_it_arrives(comm):
    """A CPU fp32 bucket is packed gradient by gradient during backward; a bucket with a
    gradient that did not arrive (an unused parameter) or a ``create_graph`` backward is packed
    whole at launch; torch's gradients either way, and a bucket of more gradients than the pack
    multiplies one by one keeps the plain pack."""
    from fastcomm.ddp import strategy

    torch.manual_seed(0)
    net, ref = _Branch(), _Branch()
    ref.load_state_dict(net.state_dict())
    model = DDP(net, comm=comm, find_unused_parameters=True)  # one bucket: 6 gradients
    assert all(isinstance(s, strategy.ArrivalPackedAllReduce) for s in model.reducer.strategies)
    seen = []
    real = model.reducer.packed_on_arrival
    model.reducer.packed_on_arrival = lambda bucket: seen.append(real(bucket)) or seen[-1]
    x = torch.randn(3, 4)
    for use_extra, create_graph in ((True, False), (False, False), (True, True), (True, False)):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            m(x, use_extra).backward(create_graph=create_graph)
        for p, q in zip(model.module.parameters(), ref.parameters(), strict=True):
            if q.grad is None:
                assert p.grad is None
            else:
                torch.testing.assert_close(p.grad.detach(), q.grad.detach(), atol=0, rtol=0)
    assert seen == [True, False, False, True]

    many = DDP(nn.Sequential(*[nn.Linear(2, 2) for _ in range(20)]), comm=comm)  # 40 grads
    assert [type(s) for s in many.reducer.strategies] == [strategy.PackedAllReduce]
