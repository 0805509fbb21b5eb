"""A communicator builds its successor over new members (``reconfigured``), and a rank that
joins them, holding none of that kind, builds the same from the kind's name
(``world.for_new_members``): shm keeps its options and goes to hier where the members span
hosts, ipc keeps its Gloo fallback, a torch group's adapter gives Gloo, NCCL keeps its GPU.
Real communicators over 2 ranks, each checked with an ``all_reduce``."""

from __future__ import annotations

import pytest
import torch

from fastcomm.comm import new_communicator
from fastcomm.comm.shm import ShmOptions
from fastcomm.comm.store import Store
from fastcomm.comm.world import for_new_members, replace_world
from tests.ddp.common import init_torch_dist, rank
from tests.harness import pool_fixture, rank_store

pool = pool_fixture(2, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)


def _store(name: str) -> Store:
    return rank_store().prefixed(name, rank=rank())


def check_successor(backend: str, joiner: bool, spans_hosts: bool, tag: str) -> dict:
    """Both ranks hold a `backend` communicator and call ``reconfigured``; or (`joiner`) rank 0
    alone holds one (of itself) and rank 1 joins it, building its side from the kind's name."""
    me = rank()
    options = ShmOptions(spin_us=0.0) if backend == "shm" else None
    old = None
    if me == 0 or not joiner:
        old = new_communicator(backend, store=_store(f"{tag}/old"), rank=me,
                               size=1 if joiner else 2, timeout=30, options=options, watch=False)
    if old is not None:
        new = old.reconfigured(_store(f"{tag}/new"), me, 2, spans_hosts=spans_hosts)
    else:
        new = for_new_members(backend, store=_store(f"{tag}/new"), rank=me, size=2, timeout=30,
                              spans_hosts=spans_hosts)
    try:
        x = torch.full((5,), float(me + 1))
        new.all_reduce(x)
        return {
            "kind": type(new).__name__,
            "fallback": None if new.fallback is None else type(new.fallback).__name__,
            "spin_us": getattr(getattr(new, "options", None), "spin_us", None),
            "sum": x.tolist(),
        }
    finally:
        new.close()
        if old is not None:
            old.close()


@pytest.mark.parametrize("backend, spans_hosts, kind, fallback", [
    ("gloo", False, "GlooCommunicator", None),
    ("shm", False, "ShmCommunicator", None),
    ("shm", True, "HierCommunicator", "GlooCommunicator"),
    ("hier", False, "HierCommunicator", "GlooCommunicator"),
    ("ipc", False, "IpcCommunicator", "GlooCommunicator"),
])
@pytest.mark.parametrize("joiner", [False, True])
def test_the_successor_is_the_same_built_either_way(pool, backend, spans_hosts, kind,
                                                    fallback, joiner):
    tag = f"{backend}-{spans_hosts}-{joiner}"
    results = pool.run(check_successor, backend, joiner, spans_hosts, tag)
    for me, found in enumerate(results):
        assert found["kind"] == kind and found["fallback"] == fallback, (me, found)
        assert found["sum"] == [3.0] * 5
    if kind == "ShmCommunicator":  # the old one's options, where there was one
        assert results[0]["spin_us"] == 0.0
        assert results[1]["spin_us"] == (None if joiner else 0.0)


def check_torch_group_successor() -> dict:
    from fastcomm.comm import group_communicator

    init_torch_dist("gloo")
    me = rank()
    adapter = group_communicator(None)
    new = adapter.reconfigured(_store("torch/new"), me, 2)
    x = torch.full((3,), float(me + 1))
    new.all_reduce(x)
    replace_world(adapter, new, (0, 1))
    found = {"adapter": type(adapter).__name__, "kind": type(new).__name__, "sum": x.tolist(),
             "followed": adapter.replaced_by is new, "first": new.first_members}
    new.close()
    return found


def test_a_torch_group_is_followed_by_gloo(pool):
    for found in pool.run(check_torch_group_successor):
        assert found == {"adapter": "TorchPGCommunicator", "kind": "GlooCommunicator",
                         "sum": [3.0] * 3, "followed": True, "first": (0, 1)}


def test_an_unknown_kind_is_named():
    with pytest.raises(ValueError, match="unknown backend 'mpi'; allowed: gloo, nccl, shm, "
                                         "hier, ipc, torch"):
        for_new_members("mpi", store=None, rank=0, size=1)


def check_nccl_successor() -> dict:
    me = rank()
    old = new_communicator("nccl", store=_store("nccl/old"), rank=me, size=2, timeout=60,
                           device=0, watch=False)
    new = old.reconfigured(_store("nccl/new"), me, 2)
    x = torch.full((4,), float(me + 1), device="cuda:0")
    new.all_reduce(x)
    found = {"device": str(new.device), "sum": x.tolist(),
             "sees": new.capabilities.sees_lost_peers,
             "shrinks": new.capabilities.shrinks_across_hosts}
    new.close()
    old.close()
    return found


@pytest.mark.gpu
def test_nccl_keeps_its_gpu(gpu_pool):
    """Both ranks on GPU 0 (``NCCL_MULTI_RANK_GPU_ENABLE=1`` and NCCL >= 2.30, else skipped)."""
    from fastcomm.comm.world import nccl_fit

    if not nccl_fit(0, 2).ok:
        pytest.skip(nccl_fit(0, 2).reason)
    for found in gpu_pool.run(check_nccl_successor):
        assert found == {"device": "cuda:0", "sum": [3.0] * 4, "sees": False, "shrinks": True}
