"""Liveness for in-place recovery: a member on another host is alive until the launcher names
it lost in the job's store (a real TCPStore), and the watch then aborts the communicator in use
(a real ``hier`` one): its calls raise ``CommAbortedError`` naming it. On this host, for the
backends whose waits cannot see a dead peer (Gloo here), the watch reads ``/proc``: a real
process killed aborts a real Gloo communicator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from fastcomm.comm import new_communicator
from fastcomm.comm.errors import CommAbortedError
from fastcomm.comm.shm.segment import pid_start_time
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
        # a TCPStore set is not acknowledged: a get on the same connection returns once the
        # server applied it, which the watch's own connection then sees
        store.root().get(lost_rank_key(5))
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


@pytest.mark.parametrize("backend, sees, shrinks", [("gloo", False, True), ("ipc", False, False),
                                                    ("shm", True, False), ("hier", True, True)])
def test_what_a_communicator_says_recovery_needs(store, backend, sees, shrinks):
    """Whether the watch must read ``/proc`` for this host's members (not where the waits see
    a dead peer themselves) and whether a loss on another host can be shrunk away: each
    communicator declares it (NCCL, which needs a GPU: tests/comm/test_successor.py)."""
    comm = new_communicator(backend, store=store.prefixed("comm", rank=0), rank=0, size=1,
                            timeout=30, watch=False)
    try:
        assert comm.capabilities.sees_lost_peers is sees
        assert comm.capabilities.shrinks_across_hosts is shrinks
    finally:
        comm.close()


def _wait_for(condition, what: str, timeout_s: float = 10.0) -> float:
    """Seconds until `condition()` held; fails naming `what` after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        elapsed = time.monotonic() - start
        assert elapsed < timeout_s, f"{what}: not within {elapsed:.1f} s"
        time.sleep(0.001)
    return time.monotonic() - start


@pytest.mark.parametrize("pidfd", ["1", "0"])
def test_the_watch_aborts_gloo_when_a_member_here_dies(store, monkeypatch, pidfd):
    """Member 0 is a real process of this host (``sleep``), member 1 this one. With a pidfd the
    watch's thread wakes at the exit itself (its store look is an hour away); without one
    (``FASTCOMM_PIDFD=0``, as where the kernel has no pidfd_open) it reads ``/proc`` every
    ``poll_s``."""
    monkeypatch.setenv("FASTCOMM_PIDFD", pidfd)
    how, poll_s = ("pidfd", 3600) if pidfd == "1" else ("poll", 0.05)
    if how == "pidfd" and not hasattr(os, "pidfd_open"):
        pytest.skip("no os.pidfd_open in this Python")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = pid_start_time(child.pid)
        identity = [[host_id(), child.pid, start, 4], [host_id(), os.getpid(), 0, 7]]
        membership = Membership.adopt(store.prefixed("ddp-recover"), {
            "epoch": 0, "members": [0, 1], "identity": identity})
        comm = new_communicator("gloo", store=store.prefixed("comm", rank=0), rank=0, size=1,
                                timeout=30, watch=False)
        watch = LossWatch(membership, lambda: comm, poll_s=poll_s, here=True)
        blind = LossWatch(membership, lambda: None, poll_s=3600)  # the launcher's keys only
        try:
            assert watch.look() == [] and membership.alive(0)
            comm.all_reduce(torch.ones(4))
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            assert not membership.alive(0)
            assert blind.look() == []
            seconds = _wait_for(lambda: watch.lost, "the watch's thread to see the exit")
            assert seconds < 2.0  # an hour's poll never looked: the event woke it
            assert watch.look() == []  # once
            assert watch.lost == {0: "exited"} and watch.seen_by == {0: how}
            with pytest.raises(CommAbortedError, match=(
                    rf"rank 0: all_reduce refused: member 0 \(launcher rank 4, pid {child.pid}, "
                    rf"this host\) exited \(seen by {how}\)")):
                comm.all_reduce(torch.ones(4))
        finally:
            watch.close()
            blind.close()
            comm.close()
    finally:
        child.kill()
        child.wait(timeout=30)
