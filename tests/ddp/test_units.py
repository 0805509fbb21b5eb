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
