"""Liveness across hosts for in-place recovery: a member on another host is alive until the
launcher names it lost in the job's store (a real TCPStore), and the watch then aborts the
communicator in use (a real ``hier`` one): its calls raise ``CommAbortedError`` naming it."""

from __future__ import annotations

import os

import pytest
import torch

from fastcomm.comm import new_communicator
from fastcomm.comm.errors import CommAbortedError
from fastcomm.comm.store import Store, lost_rank_key
from fastcomm.comm.topology import host_id
from fastcomm.ddp.liveness import LossWatch
from fastcomm.ddp.recover import Membership, launch_rank

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store():
    server = Store(is_server=True, timeout=10, _secret=None)
    yield server.prefixed("job")
    del server


def _membership(store: Store) -> Membership:
    """Members 0 (here, alive), 1 (another host, launcher rank 5), 2 (another host, no
    launcher rank: a joiner's row) and 3 (this process, the last member: ``adopt``'s rule)."""
    identity = [[host_id(), os.getpid(), 0, 4], ["elsewhere", 1, 0, 5], ["elsewhere", 2, 0],
                [host_id(), os.getpid(), 0, 7]]
    return Membership.adopt(store.prefixed("ddp-recover"), {
        "epoch": 0, "members": [0, 1, 2, 3], "identity": identity})


def test_a_remote_member_is_alive_until_the_launcher_names_it(store):
    membership = _membership(store)
    assert membership.me == 3
    assert [membership.lost_key(r) for r in range(4)] == [None, lost_rank_key(5), None, None]
    assert all(membership.alive(r) for r in range(4))
    store.root().set(lost_rank_key(5), "node 1 (node1) was lost: no heartbeat")
    assert [membership.alive(r) for r in range(4)] == [True, False, True, True]


def test_the_watch_aborts_the_communicator_in_use(store):
    membership = _membership(store)
    comm = new_communicator("hier", store=store.prefixed("comm", rank=0), rank=0, size=1,
                            timeout=30, watch=False)
    watch = LossWatch(membership, lambda: comm, poll_s=3600)  # looked at by hand below
    try:
        assert watch.look() == []
        comm.all_reduce(torch.ones(4))  # still works
        store.root().set(lost_rank_key(5), "node 1 (node1) was lost: no heartbeat")
        assert watch.look() == [1]
        assert watch.look() == []  # once
        with pytest.raises(CommAbortedError, match=r"all_reduce refused: member 1 \(launcher "
                           r"rank 5, host elsewhere\) was lost: node 1 \(node1\) was lost"):
            comm.all_reduce(torch.ones(4))
    finally:
        watch.close()
        comm.close()


@pytest.mark.parametrize("text, rank", [("3", 3), ("", None), ("x", None), (" 12 ", 12)])
def test_launch_rank_reads_rank(text, rank):
    assert launch_rank({"RANK": text}) == rank
