"""Zero-copy buckets (``fastcomm/ddp/shared.py``): DDP's buckets in shared memory, all-reduced
in place out of the peers' buckets, on 2 CPU ranks over shm. The ranks share every model's
buckets (``FASTCOMM_DDP_SHARED_MIN_MEAN_BYTES=0``), the test models' tiny ones included.

Each check trains fastcomm DDP (the default on an shm communicator: shared buckets) and torch
DDP over Gloo on identical models and compares the parameters with ``atol=0`` (two ranks: one
addition per element, see ``tests/ddp/common.py``). It also proves that the shared path ran and
that nothing was staged: the gradients live in the region, the communicator's ``all_reduce``
was not called for them (``CommStats``), and the region's counters show ``B`` bytes written and
``B / 2`` read from the peer per gradient byte ``B``: ``1.5 B`` moved (each rank's slice of the
result is pushed into the peer's bucket; the communicator's two-step schedule writes ``2 B``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.ddp import test_ddp as base
from tests.ddp import test_health as health
from tests.ddp import test_torch_parity as parity
from tests.ddp.common import (
    assert_same_state,
    batches,
    build,
    init_torch_dist,
    loss_of,
    step,
    wrap_pair,
)
from tests.harness import pool_fixture, rank_comm

TIMEOUT = 30.0


# ---------------------------------------------------------------------- checks (every rank)
def _pair(model_name: str = "mlp", *, comm=None, model_kwargs=None, **kwargs):
    from fastcomm.ddp import DDP

    init_torch_dist()
    torch_kwargs = {k: v for k, v in kwargs.items() if k not in ("shared_bucket_cap_mb",)}
    comm = rank_comm("shm") if comm is None else comm
    ours = DDP(build(model_name, **(model_kwargs or {})), comm=comm, **kwargs)
    theirs = nn.parallel.DistributedDataParallel(
        build(model_name, **(model_kwargs or {})), **torch_kwargs
    )
    return ours, theirs


def _in_region(ddp, tensor: torch.Tensor) -> bool:
    region = ddp.reducer.shared.region
    base = region._u8.data_ptr()
    return base <= tensor.data_ptr() < base + region.nbytes


def check_trains_like_torch(model_name: str, steps: int, set_to_none: bool, **kwargs):
    ours, theirs = _pair(model_name, **kwargs)
    assert ours.reducer.shared is not None and ours.grads_are_bucket_views
    comm = ours.comm
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (ours, theirs)]
    comm.stats.reset()
    ours.reducer.shared.stats.reset()
    for x, y in batches(model_name, steps):
        for model, opt in opts:
            opt.zero_grad(set_to_none=set_to_none)
            loss_of(model_name, model(x), y).backward()
            opt.step()
    assert_same_state(ours, theirs)
    for p, q in zip(ours.module.parameters(), theirs.module.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
        assert _in_region(ours, p.grad)  # .grad is the shared bucket: nothing unpacked
    stats = ours.reducer.shared.stats
    grad_bytes = sum(p.numel() * p.element_size() for p in ours.module.parameters())
    calls = dict(comm.stats.calls)
    return stats.gradient_bytes, grad_bytes * steps, stats.per_gradient_byte(), calls


def check_fallback_under_cap():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, theirs = _pair("mlp", shared_bucket_cap_mb=0.001)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not ours.shared_buckets and not ours.grads_are_bucket_views
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (ours, theirs)]
    for x, y in batches("mlp", 3):
        for model, opt in opts:
            step(model, opt, "mlp", x, y)
    assert_same_state(ours, theirs)
    return messages


def run_shared(check_name: str, module: str, *args):
    """Runs `check_name` of `module` (fastcomm DDP on the default group: shm, shared buckets)
    counting the shared buckets launched: ``(launches, of which a joined rank's shadows)``."""
    from fastcomm.comm.shm.buckets import ShmBucketRegion

    checks = {"base": base, "parity": parity, "health": health}[module]
    launches = []
    real_launch = ShmBucketRegion.launch
    real_comm = checks.rank_comm  # the health checks' Gloo communicator becomes shm here
    checks.rank_comm = lambda backend="gloo", **kw: rank_comm("shm", **kw)

    def counting_launch(self, bucket, factor):
        # a joined rank's shadow: zeros (with the training ranks' factor)
        launches.append(bool(torch.count_nonzero(bucket.flat) == 0))
        return real_launch(self, bucket, factor)

    ShmBucketRegion.launch = counting_launch
    try:
        getattr(checks, check_name)(*args)
    finally:
        ShmBucketRegion.launch = real_launch
        checks.rank_comm = real_comm
    return len(launches), sum(launches)


def check_default_dropin_is_shared():
    ours, _ = wrap_pair("mlp")
    return ours.comm.backend, ours.shared_buckets, ours.grads_are_bucket_views, (
        ours.gradient_as_bucket_view
    )


def check_hook_gets_the_shared_bucket(hook_name: str):
    """A comm hook gets the shared bucket as its buffer (and may return another tensor)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ours, theirs = _pair("mlp")
    seen = []
    hook = getattr(default_hooks, hook_name)

    def spying_hook(state, bucket):
        seen.append(_in_region(ours, bucket.buffer()))
        return hook(state, bucket)

    ours.register_comm_hook(dist.group.WORLD, spying_hook)
    theirs.register_comm_hook(dist.group.WORLD, hook)
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (ours, theirs)]
    for x, y in batches("mlp", 3):
        for model, opt in opts:
            step(model, opt, "mlp", x, y)
    assert_same_state(ours, theirs)
    assert seen and all(seen), seen
    return len(seen)


def check_deepcopy_and_save():
    import copy
    import io

    ours, theirs = wrap_pair("mlp")
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (ours, theirs)]
    for x, y in batches("mlp", 2):
        for model, opt in opts:
            step(model, opt, "mlp", x, y)
    twin = copy.deepcopy(ours)  # a new DDP: its own shared region (a collective)
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert twin.shared_buckets and loaded.shared_buckets
    opts = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (twin, loaded, theirs)]
    for x, y in batches("mlp", 2, seed=5):
        for model, opt in opts:
            step(model, opt, "mlp", x, y)
    assert_same_state(twin, theirs)
    assert_same_state(loaded, theirs)


def check_rank_killed_mid_step(name: str):
    """The last rank SIGKILLs itself in backward once its first of two buckets is published:
    the others raise from their backward, naming it, well before the timeout. (Not after the
    last one: a rank that published every bucket may have reduced and pushed its slice of each
    into the peers' buckets already, its whole part of the step; the peers then finish it.)"""
    import os
    import signal
    import time

    from fastcomm.comm.shm.buckets import ShmBucketRegion
    from fastcomm.ddp import DDP
    from tests.harness import fresh_comm

    comm = fresh_comm("shm", name, timeout=TIMEOUT)
    model = DDP(build("mlp"), comm=comm, bucket_cap_mb=0.001)  # the smallest buckets
    assert model.shared_buckets
    x, y = batches("mlp", 1)[0]
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), "mlp", x, y)
    assert len(model.reducer.buckets) >= 2  # the death comes before the last bucket
    if comm.rank == comm.size - 1:
        real_launch = ShmBucketRegion.launch

        def dying_launch(self, bucket, factor):
            real_launch(self, bucket, factor)
            if bucket.index == 0:
                os.kill(os.getpid(), signal.SIGKILL)

        ShmBucketRegion.launch = dying_launch
    start = time.monotonic()
    try:
        loss_of("mlp", model(x), y).backward()
    except Exception as exc:  # the error the peer's death raised, for the pytest side
        return type(exc).__name__, str(exc), time.monotonic() - start
    raise AssertionError("backward finished although the peer died mid-step")


# ---------------------------------------------------------------------- tests (pytest side)
# the test models' gradients are tiny: share their buckets anyway (shared.py's default
# shares only models whose gradients average 16 KiB or more)
pool = pool_fixture(2, env={"FASTCOMM_DDP_SHARED_MIN_MEAN_BYTES": "0"}, timeout=120)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("model_name", ["mlp", "convbn", "tied"])
def test_trains_like_torch_without_staging(pool, model_name, set_to_none):
    results = pool.run(check_trains_like_torch, model_name, 4, set_to_none)
    for reduced, expected, per_byte, calls in results:
        assert reduced == expected  # every gradient byte went through the region
        # its slice written into both buckets, read out of the peer's once
        assert per_byte["peer_read"] == pytest.approx(per_byte["written"] / 2, rel=1e-12)
        assert "all_reduce" not in calls  # no collective staged the buckets
        assert calls.get("shared_all_reduce", 0) > 0  # the region's reductions are counted
    # a rank's slice of a tiny bucket may be empty (64-byte boundaries), the other's all of
    # it: together the ranks write B and read B / 2 out of the peer per gradient byte B
    for key, value in (("written", 1.0), ("peer_read", 0.5), ("moved", 1.5)):
        mean = sum(r[2][key] for r in results) / len(results)
        assert mean == pytest.approx(value, rel=1e-9), (key, [r[2] for r in results])


def test_cap_falls_back_with_a_warning(pool):
    for messages in pool.run(check_fallback_under_cap):
        assert any("no shared-memory buckets" in m and "cap" in m for m in messages), messages


def test_default_dropin_on_one_host_shares_its_buckets(pool):
    for backend, shared, views, argument in pool.run(check_default_dropin_is_shared):
        # .grad aliases the bucket; the attribute reports the argument, as torch's does
        assert (backend, shared, views, argument) == ("shm", True, True, False)


BASE_CHECKS = [
    ("check_plain_mlp",),
    ("check_many_small_buckets",),
    ("check_bucket_cap_list",),
    ("check_conv_batchnorm",),
    ("check_unused_parameters", False),
    ("check_unused_parameters", True),
    ("check_static_graph",),
    ("check_no_sync",),
    ("check_gradient_as_bucket_view",),
    ("check_tied_weights",),
    ("check_state_dict_roundtrip",),
]
PARITY_CHECKS = [
    ("check_create_graph", True),
    ("check_no_sync_unused", True, "none", 2),
    ("check_no_sync_unused", True, "none", 3),
    ("check_pickle_roundtrip", True),
    ("check_set_static_graph",),
]
HEALTH_CHECKS = [
    ("check_clip_matches_torch", "few", True, "none", False),
    ("check_clip_matches_torch", "each", True, "none", True),
    ("check_nonfinite", True, False),
]


@pytest.mark.parametrize(
    "module, check",
    [("base", c) for c in BASE_CHECKS] + [("parity", c) for c in PARITY_CHECKS]
    + [("health", c) for c in HEALTH_CHECKS],
    ids=lambda c: c if isinstance(c, str) else "-".join(map(str, c)),
)
def test_torch_results_with_shared_buckets(pool, module, check):
    launches = pool.run(run_shared, check[0], module, *check[1:])
    assert all(n > 0 for n, _ in launches), launches


@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_join_shadows_shared_buckets(pool, divide_by_initial):
    launches = pool.run(run_shared, "check_join_uneven", "base", divide_by_initial)
    # rank 0 runs out of data first: its shadow steps take part in the shared reductions
    assert launches[0][1] > 0 and launches[1][0] > 0, launches


@pytest.mark.parametrize("hook_name", ["allreduce_hook", "fp16_compress_hook"])
def test_comm_hook_gets_the_shared_bucket(pool, hook_name):
    assert min(pool.run(check_hook_gets_the_shared_bucket, hook_name)) > 0


def test_deepcopy_and_torch_save_of_a_shared_model(pool):
    pool.run(check_deepcopy_and_save)


def test_rank_killed_mid_step_fails_the_others_fast(pool, unique_name):
    failure = pool.expect_failure(check_rank_killed_mid_step, unique_name)
    dead = pool.world_size - 1
    assert list(failure.errors) == [dead] and "died" in failure.errors[dead]
    for rank in range(dead):
        kind, message, elapsed = failure.results[rank]
        assert kind == "PeerLostError", message
        assert f"rank {dead}" in message and "exited" in message and "bucket" in message
        assert elapsed < TIMEOUT / 3, (elapsed, message)


def check_default_follows_gradient_size():
    import os

    from fastcomm.ddp import DDP

    os.environ.pop("FASTCOMM_DDP_SHARED_MIN_MEAN_BYTES")
    try:
        tiny = DDP(build("mlp"), comm=rank_comm("shm"))  # 16-32-32-4: bytes per gradient
        large = DDP(build("mlp", sizes=(128, 128, 4)), comm=rank_comm("shm"))
        forced = DDP(build("mlp"), comm=rank_comm("shm"), gradient_as_bucket_view=True)
    finally:
        os.environ["FASTCOMM_DDP_SHARED_MIN_MEAN_BYTES"] = "0"
    return tiny.shared_buckets, large.shared_buckets, forced.shared_buckets


def test_default_shares_models_whose_gradients_average_16_kib(pool):
    assert pool.run(check_default_follows_gradient_size) == [(False, True, True)] * 2
