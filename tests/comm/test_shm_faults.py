"""shm failures: a rank that raises, is killed, closes or never joins; segment cleanup.

Faults are injected into the real code path of one rank (its reduction raises, or its process
SIGKILLs itself in the middle of a multi-chunk all-reduce); the other ranks must raise well
within the communicator's timeout, naming the rank and the operation, and ``/dev/shm`` must end
up with nothing of fastcomm's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from fastcomm import CommTimeoutError, FastcommError
from fastcomm.comm import CommAbortedError, _shm_algos, _shm_segment
from fastcomm.comm._shm_segment import SHM_DIR, sweep_stale
from tests.harness import RankPool, fresh_comm

TIMEOUT = 30.0  # the communicators' timeout; detection must be far quicker
BIG = 3 << 20  # 3 MiB of float32 = 3 rounds through the default 1 MiB slots


def _fault_on_second_reduce(action):
    calls = []
    original = _shm_algos.reduce_into

    def faulty(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # round 2 of the two-step all-reduce: peers are mid-collective
            action()
        return original(*args, **kwargs)

    _shm_algos.reduce_into = faulty


def _raise_injected():
    raise RuntimeError("injected fault")


def _collect(comm, fn):
    start = time.monotonic()
    try:
        fn()
    except FastcommError as exc:
        return comm.rank, type(exc).__name__, round(time.monotonic() - start, 2), str(exc)
    raise AssertionError(f"rank {comm.rank}: no error")


# ------------------------------------------------------------------ checks (run on every rank)
def check_rank_raises_mid_collective(name):
    torch.set_num_threads(1)
    comm = fresh_comm("shm", name, timeout=TIMEOUT)
    comm.all_reduce(torch.ones(8))
    if comm.rank == 1:
        _fault_on_second_reduce(_raise_injected)
    first = _collect(comm, lambda: comm.all_reduce(torch.ones(BIG // 4)))
    # the communicator is now unusable, and says why, at once
    again = _collect(comm, lambda: comm.all_reduce(torch.ones(2)))
    comm.close()
    return first, again


def check_rank_killed_mid_collective(name):
    torch.set_num_threads(1)
    comm = fresh_comm("shm", name, timeout=TIMEOUT)
    comm.all_reduce(torch.ones(8))
    if comm.rank == comm.size - 1:
        _fault_on_second_reduce(lambda: os.kill(os.getpid(), signal.SIGKILL))
    return _collect(comm, lambda: comm.all_reduce(torch.ones(BIG // 4)))


def check_missing_rank_is_named(name):
    comm = fresh_comm("shm", name, timeout=2.0)
    if comm.rank == comm.size - 1:
        time.sleep(3.0)  # connected, never joins; closes only after the others timed out
        comm.close()
        return None
    result = _collect(comm, lambda: comm.all_reduce(torch.ones(4)))
    comm.close()
    return result


def check_peer_closed(name):
    comm = fresh_comm("shm", name, timeout=TIMEOUT)
    comm.barrier()
    if comm.rank == 1:
        comm.close()
        return None
    return _collect(comm, lambda: comm.broadcast(torch.ones(4), src=1))


def check_segment_unlinked_after_setup(name):
    comm = fresh_comm("shm", name)
    exists = os.path.exists(os.path.join(SHM_DIR, comm.segment_name))
    comm.close()
    return exists


def check_setup_killed_before_unlink(name):
    from tests.harness import rank_store

    rank = int(os.environ["RANK"])
    if rank == 0:  # dies after creating and publishing the file, before anyone unlinks it
        _shm_segment.Segment._put = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm = fresh_comm("shm", name, timeout=3.0)
    except FastcommError as exc:
        name = rank_store().prefixed(name).get("shm/name", 1).decode()
        return name, str(exc)
    comm.close()
    raise AssertionError("setup succeeded although rank 0 was killed")


# ------------------------------------------------------------------ pytest side
@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def pool(request):
    with RankPool(request.param, timeout=60) as p:
        yield p


def test_rank_that_raises_mid_collective_fails_the_others_fast(pool, unique_name):
    for (rank, kind, elapsed, message), again in pool.run(
        check_rank_raises_mid_collective, unique_name
    ):
        if rank == 1:
            assert "injected fault" in message and "all_reduce" in message, message
        else:
            assert kind == "CommAbortedError", message
            assert "rank 1 aborted" in message and "injected fault" in message, message
            assert elapsed < TIMEOUT / 3, (elapsed, message)
        assert again[1] == "CommAbortedError" and "failed earlier" in again[3], again


def test_rank_killed_mid_collective_fails_the_others_fast(pool, unique_name):
    failure = pool.expect_failure(check_rank_killed_mid_collective, unique_name)
    dead = pool.world_size - 1
    assert list(failure.errors) == [dead] and "died" in failure.errors[dead]
    for rank in range(dead):
        _, kind, elapsed, message = failure.results[rank]
        assert kind == "CommAbortedError", message
        assert f"rank {dead}" in message and "exited" in message and "all_reduce" in message
        assert elapsed < TIMEOUT / 3, (elapsed, message)


def test_rank_that_never_joins_is_named_in_the_timeout(pool, unique_name):
    results = pool.run(check_missing_rank_is_named, unique_name)
    missing = pool.world_size - 1
    for rank, kind, elapsed, message in results[:-1]:
        assert kind == "CommTimeoutError" and issubclass(CommTimeoutError, TimeoutError)
        assert f"rank {rank}: all_reduce timed out" in message, message
        assert f"[{missing}] never arrived" in message, message
        assert 1.9 <= elapsed < 6, (elapsed, message)


def test_peer_that_closed_is_reported(pool, unique_name):
    for result in pool.run(check_peer_closed, unique_name):
        if result is not None:
            rank, kind, elapsed, message = result
            assert kind == CommAbortedError.__name__ and "rank 1 closed" in message, message
            assert elapsed < TIMEOUT / 3


def test_segment_is_unlinked_once_every_rank_mapped_it(pool, unique_name):
    assert pool.run(check_segment_unlinked_after_setup, unique_name) == [False] * pool.world_size


def test_segment_of_a_creator_killed_during_setup_is_swept(pool, unique_name):
    failure = pool.expect_failure(check_setup_killed_before_unlink, unique_name)
    assert 0 in failure.errors and "died" in failure.errors[0]
    names = {name for name, _ in failure.results.values()}
    assert len(names) == 1
    (name,) = names
    assert os.path.exists(os.path.join(SHM_DIR, name)), "the leftover was not created"
    assert name in sweep_stale()
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_sweep_leaves_live_creators_alone(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_name = f"fastcomm-{int(dead.stdout)}-feedface-0"
    live_name = f"fastcomm-{os.getpid()}-feedface-1"
    for name in (dead_name, live_name):
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"x")
    try:
        removed = sweep_stale()
        assert dead_name in removed and live_name not in removed
        assert os.path.exists(os.path.join(SHM_DIR, live_name))
    finally:
        for name in (dead_name, live_name):
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
