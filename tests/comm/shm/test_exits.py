"""How a peer's exit is seen (``fastcomm.comm.shm.exits``, ``segment.process_exiting``): real
child processes, killed and reaped or not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fastcomm.comm.shm import exits
from fastcomm.comm.shm.segment import pid_start_time, process_exiting

pytestmark = pytest.mark.timeout(60)

# a child that holds 300 MB (its pages touched) and says when it does
_BIG = "b = b'x' * 300_000_000; print('ready', flush=True); import time; time.sleep(120)"


def _child(code: str = "import time; print('ready', flush=True); time.sleep(120)"):
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    return proc


def test_process_exiting_by_case():
    assert not process_exiting(os.getpid(), pid_start_time(os.getpid()))
    proc = _child()
    start = pid_start_time(proc.pid)
    try:
        assert not process_exiting(proc.pid, start)
        assert process_exiting(proc.pid, start + 1)  # another process under a reused pid
        proc.kill()
        deadline = time.monotonic() + 10
        while not process_exiting(proc.pid, start):  # exiting, then a zombie
            assert time.monotonic() < deadline, "the killed child never showed as exiting"
            time.sleep(0.001)
        assert process_exiting(proc.pid, start)  # a zombie: not reaped yet
    finally:
        proc.kill()
        proc.wait()
    assert process_exiting(proc.pid, start)  # reaped: no such process


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no os.pidfd_open in this Python")
def test_a_killed_peer_is_seen_exiting_with_a_pidfd(monkeypatch):
    """A SIGKILLed process is seen as it starts exiting (its flag in /proc) or, at the latest,
    when its pidfd becomes readable; ``how`` says which, and the exit stays seen."""
    monkeypatch.setenv("FASTCOMM_PIDFD", "1")
    proc = _child(_BIG)
    watch = exits.ProcessExits([("peer", proc.pid, pid_start_time(proc.pid))])
    try:
        if watch.how("peer") != exits.PIDFD:
            pytest.skip("no pidfd opens here (an old kernel, a sandbox)")
        assert not watch.exited("peer")
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not watch.exited("peer"):
            assert time.monotonic() < deadline, "the kill was never seen"
        assert watch.how("peer") in (exits.EXITING, exits.PIDFD)
        print(f"seen by {watch.how('peer')}")
        assert watch.exited("peer")
    finally:
        watch.close()
        proc.kill()
        proc.wait()


def _dead_identity() -> tuple[int, int]:
    proc = _child()
    identity = (proc.pid, pid_start_time(proc.pid))
    proc.kill()
    proc.wait()
    return identity


@pytest.mark.parametrize("who", ["the creator", "a peer"])
def test_a_survivor_lost_during_the_successor_setup(who):
    """``Segment.setup_successor`` (no store): a survivor that died before it made the segment
    (the new rank 0) or mapped it (another) ends the others' setup at once with
    ``PeerLostError`` naming it, and no file is left in /dev/shm."""
    from datetime import timedelta

    from fastcomm.comm.errors import PeerLostError
    from fastcomm.comm.shm.segment import Segment

    me = (os.getpid(), pid_start_time(os.getpid()))
    dead = _dead_identity()
    identities, rank = ([dead, me], 1) if who == "the creator" else ([me, dead], 0)
    before = set(os.listdir("/dev/shm"))
    start = time.monotonic()
    with pytest.raises(PeerLostError, match=rf"rank {1 - rank} \(pid {dead[0]}\) died before"):
        Segment.setup_successor(f"fastcomm-test-{os.getpid()}", identities, "epoch1/comm", rank,
                                4096, 4096, timedelta(seconds=30))
    assert time.monotonic() - start < 10  # not the timeout
    assert set(os.listdir("/dev/shm")) - before == set()
