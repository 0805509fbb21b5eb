"""Large gradients reduced in place (``fastcomm/ddp/in_place.py``): torch DDP's results, bit for
bit, over the Gloo group and over shm.

The checks of ``test_ddp.py`` and ``test_torch_parity.py`` run again with the size above which a
gradient is reduced in place lowered to 512 bytes, so the small test models mix both kinds
(e.g. the MLP's weights in place, its biases staged): plain steps, many buckets, unused
parameters (a ``None`` gradient is staged in its bucket view), ``no_sync``, tied weights,
uneven inputs under ``join`` (the joined rank's shadow collectives must match the others'),
``create_graph`` and the gradient norm from the write-back. Each check also counts the buckets
reduced in place, so a run in which the path was not taken fails. The in-place gradients go to
the communicator as ``PremulSum`` all-reduces: shm folds the multiply into its reduction, Gloo
multiplies first. Parameters are compared with ``atol=0`` (see ``tests/ddp/common.py`` for why).
"""

from __future__ import annotations

import pytest
import torch

from tests.ddp import test_ddp as base
from tests.ddp import test_dropin_shm as dropin
from tests.ddp import test_torch_parity as parity
from tests.ddp.common import build
from tests.harness import pool_fixture, rank_comm

SMALL_THRESHOLD = 512  # bytes: the test models' weights are above it, their biases below
# Gloo does not fold the PremulSum, so by default it takes a bucket in place only as one
# collective or with 4 MiB in place per extra one; the checks lift that limit (no bytes needed)
# to run mixed buckets (weights in place, biases staged) on Gloo as well
ANY_COLLECTIVES = 0


# ---------------------------------------------------------------------- checks (every rank)
def run_in_place(check_name: str, module: str, *args, threshold: int = SMALL_THRESHOLD):
    """Runs `check_name` of `module` with the lowered threshold; returns the in-place launches."""
    from fastcomm.ddp import config, in_place

    checks = {"base": base, "parity": parity, "dropin": dropin}[module]
    launches = []
    real_launch = in_place.launch_in_place  # what InPlaceAllReduce calls, launch and shadow

    def counting_launch(bucket, plan, grads, *rest):
        launches.append(grads is None)
        return real_launch(bucket, plan, grads, *rest)

    saved = config.IN_PLACE_MIN_BYTES, config.UNFOLDED_MIN_BYTES_PER_EXTRA
    config.IN_PLACE_MIN_BYTES, config.UNFOLDED_MIN_BYTES_PER_EXTRA = threshold, ANY_COLLECTIVES
    in_place.launch_in_place = counting_launch
    try:
        getattr(checks, check_name)(*args)
    finally:
        config.IN_PLACE_MIN_BYTES, config.UNFOLDED_MIN_BYTES_PER_EXTRA = saved
        in_place.launch_in_place = real_launch
    return len(launches), sum(launches)  # (launches, of which a joined rank's shadows)


def check_plan_follows_layout_independence():
    """In place where the reduced value cannot depend on the layout, packed elsewhere."""
    from fastcomm.comm import Capabilities
    from fastcomm.ddp import DDPConfig
    from fastcomm.ddp.bucket import Bucket
    from fastcomm.ddp.plan import in_place_plan

    model = build("mlp")
    params = list(model.parameters())
    names = [str(i) for i in range(len(params))]
    bucket = Bucket(0, list(range(len(params))), params, names)
    small = DDPConfig(in_place_min_bytes=SMALL_THRESHOLD, unfolded_min_bytes_per_extra=0)
    gloo = rank_comm("gloo")
    plan = in_place_plan(bucket, gloo.capabilities, small)
    assert plan is not None and gloo.size == 2
    large = [params[k].numel() * 4 >= SMALL_THRESHOLD for k in range(len(params))]
    assert plan.large == [k for k, is_large in enumerate(large) if is_large]
    assert plan.small == [k for k, is_large in enumerate(large) if not is_large]
    assert plan.staging.numel() == sum(params[k].numel() for k in plan.small)

    # the plan asks the communicator's capabilities, never its name
    assert gloo.capabilities.layout_free, "two terms commute"
    # Gloo's ring order depends on the layout from three ranks on; shm's never does
    assert in_place_plan(bucket, Capabilities(layout_free=False), small) is None
    assert in_place_plan(bucket, Capabilities(layout_free=True), small) is not None
    half_params = list(build("mlp").half().parameters())
    half_bucket = Bucket(1, list(range(len(half_params))), half_params, names)
    assert in_place_plan(half_bucket, gloo.capabilities, small) is None, "fp16 packs"
    huge = DDPConfig(in_place_min_bytes=1 << 40, unfolded_min_bytes_per_extra=0)
    assert in_place_plan(bucket, gloo.capabilities, huge) is None, "no large gradient: packed"
    return True


def check_plan_counts_collectives_where_multiply_is_a_pass():
    """Where the communicator does not fold the multiply (Gloo), a bucket goes in place as one
    collective (a large gradient alone), or with ``unfolded_min_bytes_per_extra`` in place per
    extra collective; one that folds it (shm) takes mixed plans."""
    from fastcomm.comm import Capabilities
    from fastcomm.ddp import DDPConfig
    from fastcomm.ddp.bucket import Bucket
    from fastcomm.ddp.plan import in_place_plan

    params = list(build("mlp").parameters())  # weight, bias, weight, bias, ...
    names = [str(i) for i in range(len(params))]
    mixed = Bucket(0, list(range(len(params))), params, names)
    weights = Bucket(1, [0, 2], params, names)
    alone = Bucket(2, [0], params, names)

    # the plan asks the communicator's capabilities, never its name
    unfolded = Capabilities(layout_free=True, premul_dtypes=frozenset())
    folded = Capabilities(layout_free=True, premul_dtypes=frozenset({torch.float32}))

    def config(per_extra=None):
        if per_extra is None:
            return DDPConfig(in_place_min_bytes=SMALL_THRESHOLD)
        return DDPConfig(in_place_min_bytes=SMALL_THRESHOLD, unfolded_min_bytes_per_extra=per_extra)

    assert config().unfolded_min_bytes_per_extra == 4 << 20
    assert in_place_plan(mixed, unfolded, config()) is None, "weights + staged biases"
    assert in_place_plan(weights, unfolded, config()) is None, "two collectives for one"
    plan = in_place_plan(alone, unfolded, config())
    assert plan is not None and plan.large == [0] and plan.small == []
    # enough bytes in place per extra collective: the copies saved pay for it
    both = (params[0].numel() + params[2].numel()) * params[0].element_size()
    assert in_place_plan(weights, unfolded, config(both)).large == [0, 1], "2 weights, 1 extra"
    assert in_place_plan(mixed, unfolded, config(both)) is None, "3 weights, 3 extra: short"
    assert in_place_plan(weights, unfolded, config(both + 1)) is None
    assert in_place_plan(mixed, folded, config()) is not None
    assert in_place_plan(weights, folded, config()).large == [0, 1]
    gloo = rank_comm("gloo").capabilities
    assert torch.float32 not in gloo.premul_dtypes
    assert in_place_plan(mixed, gloo, config()) is None
    assert in_place_plan(alone, gloo, config()) is not None
    return True


def check_large_gradients_go_as_premul(backend: str, bucket_view: bool = False):
    """The in-place gradients (``bucket_view``: the buckets of ``gradient_as_bucket_view``)
    reach the communicator as one ``PremulSum(1/size)`` each (no separate multiply on shm
    where its compiled core folds it into the reduction; ``mul_`` + ``SUM`` on Gloo), with
    torch DDP's bits. Returns how many PremulSums went out, how many times the default path
    multiplied, and whether the communicator fuses float32."""
    from fastcomm.comm import PremulSum, adapt
    from fastcomm.ddp import config
    from tests.ddp.common import assert_same_state, train_both

    comm = rank_comm(backend)
    ops, multiplies = [], [0]
    real_all_reduce, real_premultiplied = comm.all_reduce, adapt.premultiplied

    def recording(tensor, op="sum", async_op=False):
        ops.append(op)
        return real_all_reduce(tensor, op, async_op)

    def counting(task, tensor, factor):
        multiplies[0] += 1
        return real_premultiplied(task, tensor, factor)

    saved = config.IN_PLACE_MIN_BYTES, config.UNFOLDED_MIN_BYTES_PER_EXTRA
    if not bucket_view:
        config.IN_PLACE_MIN_BYTES = SMALL_THRESHOLD
        config.UNFOLDED_MIN_BYTES_PER_EXTRA = ANY_COLLECTIVES
    comm.all_reduce, adapt.premultiplied = recording, counting
    try:
        ours, theirs = train_both("mlp", steps=3, comm=comm, gradient_as_bucket_view=bucket_view)
    finally:
        config.IN_PLACE_MIN_BYTES, config.UNFOLDED_MIN_BYTES_PER_EXTRA = saved
        del comm.all_reduce  # the class's method again
        adapt.premultiplied = real_premultiplied
    assert_same_state(ours, theirs)
    premuls = [op for op in ops if isinstance(op, PremulSum)]
    assert premuls and all(op.factor == 0.5 for op in premuls), ops
    flat = ours.reducer.buckets[0].flat
    return len(premuls), multiplies[0], flat.dtype in comm.capabilities.premul_dtypes


def check_norm_from_write_back():
    """``clip_grad_norm_`` takes the norm from what the write-back left, as from an unpack."""
    from fastcomm.ddp import DDP, config, in_place
    from tests.ddp.common import batches, loss_of

    saved = config.IN_PLACE_MIN_BYTES
    config.IN_PLACE_MIN_BYTES = SMALL_THRESHOLD
    try:
        ddp = DDP(build("mlp", sizes=(16, 64, 64, 4)), comm=rank_comm("shm"))
    finally:
        config.IN_PLACE_MIN_BYTES = saved
    assert any(isinstance(s, in_place.InPlaceAllReduce) for s in ddp.reducer.strategies)
    (x, y), = batches("mlp", 1)
    loss_of("mlp", ddp(x), y).backward()
    grads = [p.grad.clone() for p in ddp.parameters()]
    norm = ddp.clip_grad_norm_(1e-3)
    assert ddp.reducer.health.last_norm_source == "unpack"
    expected = torch.nn.utils.get_total_norm(grads)
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
    return float(norm)


# ---------------------------------------------------------------------- tests (parent)
# the in-place path is what runs where the buckets are not shared (shm's default: shared)
pool = pool_fixture(2, env={"FASTCOMM_DDP_SHARED_BUCKETS": "0"}, timeout=90)


BASE_CHECKS = [
    ("check_plain_mlp",),
    ("check_many_small_buckets",),
    ("check_conv_batchnorm",),
    ("check_unused_parameters", False),
    ("check_unused_parameters", True),
    ("check_no_sync",),
    ("check_tied_weights",),
    ("check_fastcomm_comm",),
]


@pytest.mark.parametrize("check", BASE_CHECKS, ids=lambda c: "-".join(map(str, c)))
def test_torch_results_with_in_place_buckets(pool, check):
    launches = pool.run(run_in_place, check[0], "base", *check[1:])
    assert all(n > 0 for n, _ in launches), launches


@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_join_shadows_in_place_buckets(pool, divide_by_initial):
    launches = pool.run(run_in_place, "check_join_uneven", "base", divide_by_initial)
    # rank 0 runs out of data first: its shadow steps issue the in-place collectives too
    assert launches[0][1] > 0 and launches[1][1] == 0, launches


@pytest.mark.parametrize("bucket_view", [False])
def test_create_graph_stages_every_gradient(pool, bucket_view):
    launches = pool.run(run_in_place, "check_create_graph", "parity", bucket_view)
    assert all(n > 0 for n, _ in launches), launches


def test_no_sync_unused_on_one_rank(pool):
    # Linear(1, 1) layers: 4-byte gradients, all reduced in place at a 4-byte threshold
    launches = pool.run(
        run_in_place, "check_no_sync_unused", "parity", False, "none", 2, threshold=4
    )
    assert all(n > 0 for n, _ in launches), launches


def test_torch_group_and_gloo_communicator(pool):
    launches = pool.run(run_in_place, "check_explicit_arguments_win", "dropin")
    assert all(n > 0 for n, _ in launches), launches


def test_plan_follows_layout_independence(pool):
    assert pool.run(check_plan_follows_layout_independence) == [True, True]


def test_plan_counts_collectives_where_multiply_is_a_pass(pool):
    assert pool.run(check_plan_counts_collectives_where_multiply_is_a_pass) == [True, True]


@pytest.mark.parametrize("bucket_view", [False, True], ids=["in-place", "bucket-view"])
@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_large_gradients_go_as_premul(pool, backend, bucket_view):
    counts = pool.run(check_large_gradients_go_as_premul, backend, bucket_view)
    assert counts[0] == counts[1] and counts[0][0] > 0, counts
    premuls, multiplies, fuses = counts[0]
    from fastcomm.comm.shm import core

    assert fuses == (backend == "shm" and core.BUILT), counts
    assert multiplies == (0 if fuses else premuls), counts


def test_norm_from_write_back(pool):
    norms = pool.run(check_norm_from_write_back)
    assert norms[0] == norms[1] > 0
