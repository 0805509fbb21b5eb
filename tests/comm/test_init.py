"""``fastcomm.init()`` from torchrun's environment, and reuse of torch.distributed's store."""

from __future__ import annotations

import pytest
import torch

import fastcomm
from tests.harness import RankPool


def check_init_from_env():
    try:
        fastcomm.get_world()
    except RuntimeError as exc:
        assert "before fastcomm.init()" in str(exc)
    else:
        raise AssertionError("get_world() before init() must raise")
    comm = fastcomm.init(timeout=30)
    # one host, CPU tensors: the shared-memory communicator (FASTCOMM_BACKEND=gloo forces Gloo)
    assert fastcomm.get_world() is comm and comm.backend == "shm"
    try:
        fastcomm.init()
    except RuntimeError as exc:
        assert "already called" in str(exc)
    else:
        raise AssertionError("a second init() must raise")
    t = torch.tensor([comm.rank + 1.0])
    comm.all_reduce(t)
    fastcomm.shutdown()
    assert comm.closed and not fastcomm.is_initialized()
    return (comm.rank, comm.size, t.item())


def check_init_reuses_torch_store():
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    try:
        comm = fastcomm.init(timeout=30)
        # same MASTER_PORT, no second bind: both groups work side by side
        a, b = torch.ones(2), torch.ones(2)
        comm.all_reduce(a)
        dist.all_reduce(b)
        assert torch.equal(a, b)
        assert comm.store.port == int(os.environ["MASTER_PORT"])
        fastcomm.shutdown()
    finally:
        dist.destroy_process_group()
    return True


def check_bad_backend():
    try:
        fastcomm.init(backend="mpi")
    except ValueError as exc:
        return str(exc)
    raise AssertionError("unknown backend accepted")


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, timeout=60) as p:
        yield p


def test_init_reads_torchrun_environment(pool):
    assert pool.run(check_init_from_env) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_init_reuses_initialized_torch_distributed(pool):
    assert pool.run(check_init_reuses_torch_store) == [True, True]


def test_unknown_backend(pool):
    for message in pool.run(check_bad_backend):
        assert "'mpi'" in message and "gloo" in message


def test_single_process_init_without_environment(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    comm = fastcomm.init(timeout=10)
    try:
        assert (comm.rank, comm.size) == (0, 1)
        t = torch.arange(4.0)
        comm.all_reduce(t, op="avg")
        assert torch.equal(t, torch.arange(4.0))
    finally:
        fastcomm.shutdown()


def test_missing_rank_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK is not set"):
        fastcomm.init()
