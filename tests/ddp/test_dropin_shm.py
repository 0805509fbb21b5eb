"""The drop-in path on one host: ``init_process_group("gloo")`` then ``DDP(model)`` reduces over
fastcomm's shared-memory communicator, with torch DDP's results.

Two real ranks share one host, so the default group's ranks all run here: DDP given no
communicator must pick ``shm`` (one segment per group, shared by every DDP), unless
``FASTCOMM_BACKEND`` names another backend or the script passes ``process_group=``/``comm=``.
Parameters are compared with ``atol=0`` (see ``tests/ddp/common.py`` for why).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from tests.ddp.common import assert_same_state, init_torch_dist, train_both
from tests.harness import pool_fixture, rank_comm


# ---------------------------------------------------------------------- checks (every rank)
def check_default_group_on_one_host_picks_shm(bucket_cap_mb: float):
    from fastcomm.comm.shm import ShmCommunicator

    torch.set_num_threads(1)
    ours, theirs = train_both("mlp", steps=5, bucket_cap_mb=bucket_cap_mb)
    assert_same_state(ours, theirs)
    assert isinstance(ours.comm, ShmCommunicator), type(ours.comm).__name__
    assert ours.comm.fallback is None, "a CPU-only DDP needs no Gloo group beside the segment"
    return ours.comm.backend, id(ours.comm)


def check_forced_backend_keeps_gloo_adapter(value: str):
    from fastcomm.comm.pg.torch_pg import TorchPGCommunicator

    os.environ["FASTCOMM_BACKEND"] = value
    try:
        ours, theirs = train_both("convbn", steps=3)
    finally:
        del os.environ["FASTCOMM_BACKEND"]
    assert_same_state(ours, theirs)
    assert isinstance(ours.comm, TorchPGCommunicator), type(ours.comm).__name__
    return ours.comm.pg_backend


def check_explicit_arguments_win():
    import torch.distributed as dist

    from fastcomm.comm.pg.torch_pg import TorchPGCommunicator

    init_torch_dist()
    ours, theirs = train_both("mlp", steps=3, process_group=dist.group.WORLD)
    assert_same_state(ours, theirs)
    assert isinstance(ours.comm, TorchPGCommunicator)
    gloo = rank_comm("gloo")
    ours, theirs = train_both("mlp", steps=3, comm=gloo)
    assert_same_state(ours, theirs)
    assert ours.comm is gloo


def check_closed_with_its_group():
    """A group's shm communicator closes when the group is destroyed, and leaves no file."""
    import torch.distributed as dist

    from fastcomm.comm import ShmCommunicator, group_communicator
    from fastcomm.comm.shm.segment import PREFIX, SHM_DIR

    init_torch_dist()
    group = dist.new_group([0, 1])
    comm = group_communicator(group, cpu_only=True, timeout=30)
    assert isinstance(comm, ShmCommunicator), comm
    assert group_communicator(group, cpu_only=True) is comm, "cached per group"
    t = torch.full((5,), float(comm.rank + 1))
    comm.all_reduce(t)
    assert torch.equal(t, torch.full((5,), 3.0))
    comm.barrier()
    dist.destroy_process_group(group)
    del group
    gc.collect()
    assert comm.closed, "destroying the group closes its shm communicator"
    mine = [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}{os.getpid()}-")]
    assert not mine, f"segments of this process left in {SHM_DIR}: {mine}"


# ---------------------------------------------------------------------- pytest side
pool = pool_fixture(2, timeout=90)


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.0002], ids=["one_bucket", "many_buckets"])
def test_default_group_on_one_host_reduces_over_shm(pool, bucket_cap_mb):
    (backend0, id0), (backend1, _) = pool.run(
        check_default_group_on_one_host_picks_shm, bucket_cap_mb
    )
    assert backend0 == backend1 == "shm"


def test_every_ddp_of_a_group_shares_one_segment(pool):
    first = pool.run(check_default_group_on_one_host_picks_shm, 25)
    second = pool.run(check_default_group_on_one_host_picks_shm, 1)
    assert [i for _, i in first] == [i for _, i in second]


@pytest.mark.parametrize("value", ["gloo", "GLOO ", "hier"])
def test_fastcomm_backend_other_than_shm_keeps_the_gloo_adapter(pool, value):
    assert pool.run(check_forced_backend_keeps_gloo_adapter, value) == ["gloo", "gloo"]


def test_process_group_or_comm_argument_wins(pool):
    pool.run(check_explicit_arguments_win)


def test_shm_communicator_closes_with_its_group(pool):
    pool.run(check_closed_with_its_group)
