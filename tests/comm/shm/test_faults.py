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
from datetime import timedelta

import pytest
import torch

from fastcomm import CommTimeoutError, FastcommError
from fastcomm.comm import PeerLostError
from fastcomm.comm import reduction as _reduction
from fastcomm.comm.shm import segment as _shm_segment
from fastcomm.comm.shm.segment import SHM_DIR, sweep_stale
from tests.harness import fresh_comm, poll_keys, pool_fixture

TIMEOUT = 30.0  # setup and the communicators' timeout; detection must be far quicker
OP_TIMEOUT = 1.0  # where the timeout is the thing tested, and the missing rank truly absent
BIG = 3 << 20  # 3 MiB of float32 = 3 rounds through the default 1 MiB slots


def _fault_on_second_reduce(action):
    calls = []
    original = _reduction.reduce_into

    def faulty(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # round 2 of the two-step all-reduce: peers are mid-collective
            action()
        return original(*args, **kwargs)

    _reduction.reduce_into = faulty


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


def check_recv_from_a_killed_rank(name):
    torch.set_num_threads(1)
    comm = fresh_comm("shm", name, timeout=TIMEOUT)
    comm.all_reduce(torch.ones(8))
    dead = comm.size - 1
    if comm.rank == dead:
        os.kill(os.getpid(), signal.SIGKILL)
    return _collect(comm, lambda: comm.recv(torch.empty(4), dead))


def short_op_timeout(comm, seconds: float) -> None:
    """Shortens the timeout of ``comm``'s later operations only: setup ran under the generous
    one, so a busy machine cannot fire it before the peers have even connected."""
    comm.timeout = timedelta(seconds=seconds)  # Gloo reads it at every issue
    sync = getattr(comm, "_flags", None)  # shm copied it into its waits at setup
    if sync is not None:
        sync.timeout_s = seconds
    fallback = getattr(comm, "fallback", None)
    if fallback is not None:
        fallback.timeout = comm.timeout


def check_missing_rank_is_named(name):
    comm = fresh_comm("shm", name, timeout=TIMEOUT)
    absent = comm.size - 1
    short_op_timeout(comm, OP_TIMEOUT)
    if comm.rank == absent:
        # connected, never joins; stays away until every other rank has timed out (a fixed
        # sleep could end before a rank that started late timed out)
        poll_keys(comm.store, [f"timed-out/{r}" for r in range(absent)], timeout=TIMEOUT)
        comm.close()
        return None
    result = _collect(comm, lambda: comm.all_reduce(torch.ones(4)))
    comm.store.set(f"timed-out/{comm.rank}", "1")
    comm.close()
    return result


def check_close_right_after_a_collective_a_peer_still_waits_in(name):
    """Rank 0 finishes a broadcast and closes while rank 1, preempted between reading rank 0's
    progress word and its state word, still waits in it: the step rank 0 joined must count."""
    from fastcomm.comm.shm import ShmOptions

    # no spinning or yielding: rank 1 goes straight to the loop that reads both words
    options = ShmOptions(spin_us=0.0, yield_us=0.0)
    from fastcomm.comm import ShmCommunicator
    from tests.harness import rank_store

    rank = int(os.environ["RANK"])
    comm = ShmCommunicator(
        rank_store().prefixed(name, rank=rank), rank, 2, TIMEOUT, options=options
    )
    comm.barrier()
    t = torch.full((4,), 7.0) if rank == 0 else torch.zeros(4)
    store = rank_store().prefixed(f"{name}-steps")
    if rank == 1:
        sync = comm._flags
        sync.words = _HeldStateRead(sync.words, sync.state_idx[0], store)
        comm.broadcast(t, src=0)
        comm.close()
        return t.tolist()
    # rank 1 has read our progress word (not yet published) and is held in its read of our
    # state word: an event, not a sleep (a fixed sleep could end before rank 1 got there)
    poll_keys(store, ["reading"], timeout=TIMEOUT)
    comm.broadcast(t, src=0)
    comm.close()  # rank 1 reads our state word only after this
    store.set("closed", "1")
    return t.tolist()


class _HeldStateRead:
    """The segment's words as one rank sees them, its first read of one word held until the
    peer has closed: the rank is preempted right before it looks at a peer's state (as on a
    loaded machine). ``reading`` and ``closed`` in `store` mark the two events."""

    def __init__(self, words, slow_index: int, store) -> None:
        self._words, self._slow, self._store = words, slow_index, store
        self._held = False

    def __getitem__(self, index):
        if index == self._slow and not self._held:
            self._held = True
            self._store.set("reading", "1")
            poll_keys(self._store, ["closed"], timeout=TIMEOUT)
        return self._words[index]

    def __setitem__(self, index, value):
        self._words[index] = value

    def release(self):
        self._words.release()


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
    start = time.monotonic()
    try:
        comm = fresh_comm("shm", name, timeout=TIMEOUT)
    except FastcommError as exc:
        name = rank_store().prefixed(name).get("shm/name", 1).decode()
        return name, type(exc).__name__, time.monotonic() - start, str(exc)
    comm.close()
    raise AssertionError("setup succeeded although rank 0 was killed")


def check_setup_peer_killed_after_mapping(name):
    """Rank 1 dies once it has mapped the segment and recorded its pid, before it says so.
    Rank 2 (of 3) maps only once rank 0 has given up and removed the file: it reads why."""
    from tests.harness import rank_store

    rank = int(os.environ["RANK"])
    if rank == 2:
        attach = _shm_segment.attach_segment

        def attach_late(path, *args):
            store = rank_store().prefixed(name)
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline and not (
                    store.check(["shm/mapped/0"])
                    and store.get("shm/mapped/0").startswith(b"lost: ")
                    and not os.path.exists(path)):  # rank 0 says why, then removes the file
                time.sleep(0.01)
            return attach(path, *args)

        _shm_segment.attach_segment = attach_late
    if rank == 1:
        put = _shm_segment.Segment._put
        calls = []

        def put_then_die(self, offset, value):
            calls.append(offset)
            if len(calls) == 2:  # its pid is recorded; its start time is the second word
                os.kill(os.getpid(), signal.SIGKILL)
            put(self, offset, value)

        _shm_segment.Segment._put = put_then_die
    start = time.monotonic()
    try:
        fresh_comm("shm", name, timeout=TIMEOUT)
    except FastcommError as exc:
        return type(exc).__name__, time.monotonic() - start, str(exc)
    raise AssertionError("setup succeeded although rank 1 was killed")


def check_setup_rank_slow_to_map(name):
    """The last rank joins the communicator but does not map the segment within the timeout
    (it gives up after three timeouts): the others time out, naming it."""
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        def never_maps(*args):
            time.sleep(3 * OP_TIMEOUT)
            raise FastcommError("injected: did not map")

        _shm_segment.attach_segment = never_maps
    try:
        fresh_comm("shm", name, timeout=OP_TIMEOUT)
    except FastcommError as exc:
        return type(exc).__name__, str(exc)
    raise AssertionError("setup succeeded without the last rank")


# ------------------------------------------------------------------ pytest side
pool = pool_fixture([2, 3], timeout=60)


def test_rank_that_raises_mid_collective_fails_the_others_fast(pool, unique_name):
    for (rank, kind, elapsed, message), again in pool.run(
        check_rank_raises_mid_collective, unique_name
    ):
        if rank == 1:
            assert "injected fault" in message and "all_reduce" in message, message
        else:
            assert kind == "PeerLostError", message  # a CommAbortedError: the peer's mark
            assert "rank 1 aborted" in message and "injected fault" in message, message
            assert elapsed < TIMEOUT / 3, (elapsed, message)
        assert again[1] == "CommAbortedError" and "failed earlier" in again[3], again


def test_rank_killed_mid_collective_fails_the_others_fast(pool, unique_name):
    failure = pool.expect_failure(check_rank_killed_mid_collective, unique_name)
    dead = pool.world_size - 1
    assert list(failure.errors) == [dead] and "died" in failure.errors[dead]
    for rank in range(dead):
        _, kind, elapsed, message = failure.results[rank]
        assert kind == "PeerLostError", message  # a CommAbortedError naming the peer
        assert f"rank {dead}" in message and "exited" in message and "all_reduce" in message
        assert elapsed < TIMEOUT / 3, (elapsed, message)


def test_recv_from_a_killed_rank_fails_fast(pool, unique_name):
    """A point-to-point wait looks at its peer's process too (every 50 ms), not only at the
    timeout."""
    failure = pool.expect_failure(check_recv_from_a_killed_rank, unique_name)
    dead = pool.world_size - 1
    assert list(failure.errors) == [dead] and "died" in failure.errors[dead]
    for rank in range(dead):
        _, kind, elapsed, message = failure.results[rank]
        assert kind == "PeerLostError", message
        assert "recv" in message and f"rank {dead}" in message and "exited" in message, message
        assert elapsed < TIMEOUT / 3, (elapsed, message)


def test_rank_that_never_joins_is_named_in_the_timeout(pool, unique_name):
    results = pool.run(check_missing_rank_is_named, unique_name)
    missing = pool.world_size - 1
    for rank, kind, elapsed, message in results[:-1]:
        assert kind == "CommTimeoutError" and issubclass(CommTimeoutError, TimeoutError)
        assert f"rank {rank}: all_reduce timed out" in message, message
        assert f"[{missing}] never arrived" in message, message
        assert OP_TIMEOUT - 0.1 <= elapsed < TIMEOUT / 2, (elapsed, message)


def test_close_does_not_fail_a_peer_inside_a_collective_the_closer_joined(pool, unique_name):
    if pool.world_size != 2:
        pytest.skip("a two-rank scenario; one world size is enough")
    assert pool.run(check_close_right_after_a_collective_a_peer_still_waits_in, unique_name) == [
        [7.0] * 4
    ] * 2


def test_peer_that_closed_is_reported(pool, unique_name):
    for result in pool.run(check_peer_closed, unique_name):
        if result is not None:
            rank, kind, elapsed, message = result
            assert kind == PeerLostError.__name__ and "rank 1 closed" in message, message
            assert elapsed < TIMEOUT / 3


def test_segment_is_unlinked_once_every_rank_mapped_it(pool, unique_name):
    assert pool.run(check_segment_unlinked_after_setup, unique_name) == [False] * pool.world_size


def test_segment_of_a_creator_killed_during_setup_is_swept(pool, unique_name):
    failure = pool.expect_failure(check_setup_killed_before_unlink, unique_name)
    assert 0 in failure.errors and "died" in failure.errors[0]
    names = {name for name, *_ in failure.results.values()}
    assert len(names) == 1
    (name,) = names
    for rank, (_, kind, elapsed, message) in failure.results.items():
        # seen through the creator's pid in the segment's name, not at the timeout; the other
        # ranks mapped the file (their error is the dead creator, not a missing file)
        assert kind == "PeerLostError", (rank, message)
        assert "rank 0 (pid" in message and "shm setup" in message, message
        assert elapsed < TIMEOUT / 3, (rank, elapsed, message)
    if os.path.exists(os.path.join(SHM_DIR, name)):
        # else a segment created meanwhile elsewhere on this host swept it already
        assert name in sweep_stale() or not os.path.exists(os.path.join(SHM_DIR, name))
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_a_rank_killed_after_mapping_ends_the_others_setup(pool, unique_name):
    failure = pool.expect_failure(check_setup_peer_killed_after_mapping, unique_name)
    assert set(failure.errors) == {1} and "died" in failure.errors[1]
    for rank, (kind, elapsed, message) in failure.results.items():
        assert kind == "PeerLostError", (rank, message)
        assert "rank 1 (pid" in message and f"rank {rank}: shm setup" in message, message
        assert elapsed < TIMEOUT / 3, (rank, elapsed, message)
        if rank == 2:  # it found the file gone, and rank 0's word on why
            assert "shm setup failed on rank 0: rank 0: shm setup: rank 1" in message, message


def test_a_rank_that_does_not_map_in_time_is_named_at_the_timeout(pool, unique_name):
    if pool.world_size != 2:
        pytest.skip("waits out a timeout; one world size is enough")
    *others, (kind, message) = pool.run(check_setup_rank_slow_to_map, unique_name)
    last = pool.world_size - 1
    assert kind == "FastcommError" and "injected: did not map" in message, message
    for rank, (kind, message) in enumerate(others):
        assert kind == "StoreTimeoutError", (rank, message)
        assert f"rank(s) [{last}] did not map the segment within" in message, message
    assert not [n for n in os.listdir(SHM_DIR) if unique_name in n]


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def _touch_segments(*names):
    for name in names:
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"x")


def _remove_segments(*names):
    for name in names:
        if os.path.exists(os.path.join(SHM_DIR, name)):
            os.unlink(os.path.join(SHM_DIR, name))


def test_sweep_removes_only_segments_whose_creator_is_provably_gone():
    """Swept: a dead creator of this PID namespace, and a live pid whose start time differs
    from the name's (the pid was reused). Kept: a live creator, a creator of another PID
    namespace (a container sharing /dev/shm), a name without start time or namespace."""
    me, ns = os.getpid(), _shm_segment.pid_namespace()
    start = _shm_segment.pid_start_time(me)
    dead = _dead_pid()
    swept = [
        f"fastcomm-{dead}-{start}-{ns}-feedface-0",
        f"fastcomm-{me}-{start + 1}-{ns}-feedface-1",  # this pid, another process's start
    ]
    kept = [
        _shm_segment.segment_name("feedface-2"),  # this very process: alive
        f"fastcomm-{dead}-{start}-{ns + 1}-feedface-3",  # dead here, but another namespace's
        f"fastcomm-{dead}-feedface-4",  # the old name: nothing can be proven
        f"fastcomm-{dead}-0-{ns}-feedface-5",  # no start time recorded
    ]
    _touch_segments(*swept, *kept)
    try:
        removed = sweep_stale()
        assert sorted(set(removed) & set(swept + kept)) == sorted(swept)
        assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in kept)
        assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in swept)
    finally:
        _remove_segments(*swept, *kept)


_FOREIGN_CREATOR = """
import os, sys
from fastcomm.comm.shm.segment import SHM_DIR, segment_name
name = segment_name("feedface-foreign")
open(os.path.join(SHM_DIR, name), "wb").close()
print(name, flush=True)
sys.stdin.read()  # alive until the test closes stdin
"""


def test_sweep_leaves_a_live_job_of_another_pid_namespace_alone():
    """A creator in its own PID namespace (``unshare``) that shares /dev/shm: its segment is
    never swept from here, neither while it runs nor after it exited."""
    try:
        probe = subprocess.run(
            ["unshare", "-Urpf", "--mount-proc", "true"], capture_output=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("unshare is not available")
    if probe.returncode != 0:
        pytest.skip(f"no unprivileged PID namespaces here: {probe.stderr.decode().strip()}")
    proc = subprocess.Popen(
        ["unshare", "-Urpf", "--mount-proc", sys.executable, "-c", _FOREIGN_CREATOR],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    name = None
    try:
        name = proc.stdout.readline().strip()
        assert name.startswith("fastcomm-"), name
        foreign_ns = int(name.split("-")[3])
        assert foreign_ns != _shm_segment.pid_namespace()
        assert name not in sweep_stale()
        assert os.path.exists(os.path.join(SHM_DIR, name))
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0
        assert name not in sweep_stale()  # gone, but not provably from this namespace
        assert os.path.exists(os.path.join(SHM_DIR, name))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if name:
            _remove_segments(name)


@pytest.mark.parametrize("foreign", [b"../../etc/passwd", b"fastcomm-1/../x", b"\xff\xfe"])
def test_a_foreign_segment_name_in_the_store_is_refused_and_reported(foreign):
    """A name read back from the store is joined into a path: only a segment name is taken,
    and the rank that refuses it says so under its key, so rank 0 raises too, not times out."""
    from fastcomm.comm.store import Store

    store = Store(is_server=True, timeout=10.0)
    store.set("shm/name", foreign)
    with pytest.raises(FastcommError, match="is not a segment name") as info:
        _shm_segment.Segment.setup(store, 1, 2, 4096, 4096, timedelta(seconds=10))
    assert repr(foreign[:80]) in str(info.value)
    assert store.get("shm/mapped/1", 1.0).startswith(b"error: rank 1: the store's shm/name")
