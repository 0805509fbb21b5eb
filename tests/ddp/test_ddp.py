"""fastcomm DDP against torch DDP on 2 CPU ranks over Gloo: same seeds, same data, same result.

Parameters (and buffers) are compared with ``atol=0``: see ``tests/ddp/common.py`` for why
the two implementations compute bit-identical averages on two ranks.
"""

from __future__ import annotations

import pytest
import torch

from tests.ddp.common import (
    assert_same_state,
    batches,
    build,
    init_torch_dist,
    loss_of,
    rank,
    step,
    train_both,
    wrap_pair,
)
from tests.harness import pool_fixture, rank_comm


# ---------------------------------------------------------------------- checks (every rank)
def check_plain_mlp():
    ours, theirs = train_both("mlp", steps=5)
    assert_same_state(ours, theirs)
    assert ours.reducer.rebuilt, "buckets are rebuilt after the first iteration"
    return ours.reducer.bucket_indices()


def check_many_small_buckets():
    ours, theirs = train_both("mlp", steps=5, bucket_cap_mb=0.0002)
    assert_same_state(ours, theirs)
    return ours.reducer.bucket_indices()


def check_bucket_cap_list():
    ours, theirs = train_both("mlp", steps=3, bucket_cap_mb_list=[0.002, 0.004])
    assert_same_state(ours, theirs)
    return len(ours.reducer.buckets)


def check_conv_batchnorm():
    ours, theirs = train_both("convbn", steps=4)
    assert_same_state(ours, theirs)
    # each forward starts by broadcasting rank 0's buffers (eval: BN leaves them alone after)
    ours.eval()
    with torch.no_grad():
        ours(batches("convbn", 1)[0][0])
    stats = torch.cat([ours.module.bn.running_mean, ours.module.bn.running_var])
    return stats.tolist(), int(ours.module.bn.num_batches_tracked)


def check_unused_parameters(static_graph: bool):
    # static_graph: the used set must not change, so `skip` is always used there
    kw = {"find_unused_parameters": True} if not static_graph else {"static_graph": True}
    ours, theirs = train_both("branchy", steps=6, model_kwargs={"dynamic": not static_graph}, **kw)
    assert_same_state(ours, theirs)
    # `never` is unused on every rank: like torch, its .grad stays None
    assert ours.module.never.weight.grad is None
    assert theirs.module.never.weight.grad is None
    return [p.grad is None for p in ours.parameters()]


def check_static_graph():
    ours, theirs = train_both("mlp", steps=5, static_graph=True)
    assert_same_state(ours, theirs)
    return ours.reducer.static_learned


def check_no_sync():
    ours, theirs = wrap_pair("mlp")
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.1)
    data = batches("mlp", 6)
    comm = ours.comm
    for it in range(2):
        for model, opt in ((ours, opt_a), (theirs, opt_b)):
            opt.zero_grad()
            with model.no_sync():
                for x, y in data[3 * it : 3 * it + 2]:
                    loss_of("mlp", model(x), y).backward()
            local = [p.grad.clone() for p in model.parameters()]
            x, y = data[3 * it + 2]
            loss_of("mlp", model(x), y).backward()
            opt.step()
        # inside no_sync the gradients stayed local (they differ across ranks)
        gathered = comm.all_gather_object(local[0].sum().item())
        assert gathered[0] != gathered[1]
    assert_same_state(ours, theirs)


def check_gradient_as_bucket_view():
    ours, theirs = train_both("mlp", steps=4, gradient_as_bucket_view=True)
    assert_same_state(ours, theirs)
    flats = [(b.flat.data_ptr(), b.flat.numel() * b.flat.element_size())
             for b in ours.reducer.buckets]
    for p in ours.parameters():
        ptr = p.grad.data_ptr()
        assert any(lo <= ptr < lo + n for lo, n in flats), "every .grad is a bucket view"
    for pa, pb in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, atol=0, rtol=0)


def check_tied_weights():
    ours, theirs = train_both("tied", steps=4)
    assert_same_state(ours, theirs)
    assert ours.module.proj.weight is ours.module.embed.weight
    return len(list(ours.parameters()))


def check_join_uneven(divide_by_initial: bool):
    ours, theirs = wrap_pair("mlp")
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.1)
    data = batches("mlp", 3 + 2 * rank())  # rank 0: 3 batches, rank 1: 5
    for model, opt in ((ours, opt_a), (theirs, opt_b)):
        with model.join(divide_by_initial_world_size=divide_by_initial):
            for x, y in data:
                step(model, opt, "mlp", x, y)
    # one division differs in rounding (by 1 rank instead of 2 is exact, so atol=0 holds)
    assert_same_state(ours, theirs)
    return [p.sum().item() for p in ours.parameters()]


def check_process_group_and_torch_hooks(hook_name: str):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    init_torch_dist()
    group = dist.new_group([0, 1])
    ours, theirs = wrap_pair("mlp", process_group=group)
    hook = getattr(default_hooks, hook_name)
    ours.register_comm_hook(group, hook)
    theirs.register_comm_hook(group, hook)
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.1)
    for x, y in batches("mlp", 4):
        step(ours, opt_a, "mlp", x, y)
        step(theirs, opt_b, "mlp", x, y)
    assert_same_state(ours, theirs)
    return type(ours.comm).__name__


def check_fastcomm_comm():
    ours, theirs = train_both("convbn", steps=3, comm=rank_comm("gloo"))
    assert_same_state(ours, theirs)
    return ours.comm.backend


def check_state_dict_roundtrip():
    ours, theirs = train_both("convbn", steps=2)
    state = ours.state_dict()
    assert list(state) == list(theirs.state_dict())
    assert all(k.startswith("module.") for k in state)
    fresh, _ = wrap_pair("convbn")
    fresh.load_state_dict(state)
    assert_same_state(fresh, ours)
    assert isinstance(fresh.module, torch.nn.Module) and fresh.module.bn.num_batches_tracked == 2


def check_mixed_precision_reduce_dtype():
    from torch.nn.parallel.distributed import _MixedPrecision

    from fastcomm.ddp import DDP

    init_torch_dist()
    model = DDP(build("mlp"), mixed_precision=_MixedPrecision(reduce_dtype=torch.bfloat16))
    ref = torch.nn.parallel.DistributedDataParallel(build("mlp"))
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches("mlp", 3):
        step(model, opt_a, "mlp", x, y)
        step(ref, opt_b, "mlp", x, y)
    # gradients travelled in bf16 (8 bits of mantissa): params agree to bf16 rounding of
    # a 0.1-scaled gradient over 3 steps
    assert_same_state(model, ref, atol=2e-3, rtol=0)
    assert model.reducer.comm_hook.__name__ == "reduce_in_bfloat16_hook"


def check_buckets_match_across_ranks():
    ours, _ = train_both("mlp", steps=2, bucket_cap_mb=0.002)
    return ours.reducer.bucket_indices()


# ---------------------------------------------------------------------- pytest side
pool = pool_fixture(2, timeout=90)


def test_plain_mlp(pool):
    buckets = pool.run(check_plain_mlp)
    assert buckets[0] == buckets[1]


def test_many_small_buckets(pool):
    buckets = pool.run(check_many_small_buckets)
    assert buckets[0] == buckets[1] and len(buckets[0]) >= 3


def test_bucket_cap_mb_list(pool):
    assert pool.run(check_bucket_cap_list)[0] >= 2


def test_conv_batchnorm_buffers(pool):
    (stats0, n0), (stats1, n1) = pool.run(check_conv_batchnorm)
    assert stats0 == stats1 and n0 == n1 == 4


@pytest.mark.parametrize("static_graph", [False, True], ids=["find_unused", "static_graph"])
def test_unused_parameters(pool, static_graph):
    pool.run(check_unused_parameters, static_graph)


def test_static_graph(pool):
    assert pool.run(check_static_graph) == [True, True]


def test_no_sync_accumulates_locally(pool):
    pool.run(check_no_sync)


def test_gradient_as_bucket_view(pool):
    pool.run(check_gradient_as_bucket_view)


def test_tied_weights(pool):
    pool.run(check_tied_weights)


@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_join_uneven_inputs(pool, divide_by_initial):
    sums = pool.run(check_join_uneven, divide_by_initial)
    assert sums[0] == sums[1], "after join every rank holds the same model"


@pytest.mark.parametrize("hook_name", ["allreduce_hook", "fp16_compress_hook"])
def test_process_group_with_torch_hooks(pool, hook_name):
    assert pool.run(check_process_group_and_torch_hooks, hook_name)[0] == "TorchPGCommunicator"


def test_fastcomm_communicator(pool):
    assert pool.run(check_fastcomm_comm) == ["gloo", "gloo"]


def test_state_dict(pool):
    pool.run(check_state_dict_roundtrip)


def test_mixed_precision_reduce_dtype(pool):
    pool.run(check_mixed_precision_reduce_dtype)


def test_bucket_order_identical_on_every_rank(pool):
    order = pool.run(check_buckets_match_across_ranks)
    assert order[0] == order[1]
