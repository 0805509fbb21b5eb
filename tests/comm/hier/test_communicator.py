"""The hierarchical communicator and ``init()``'s backend choice, on simulated hosts.

Each rank sets ``FASTCOMM_HOST_ID`` before it builds a communicator, so 4 ranks on this machine
look like 2 hosts (interleaved: ranks 0, 2 on host a; 1, 3 on host b) and 3 ranks like a host of
2 and a lone rank. The generic checks of ``test_collectives.py`` then run on ``hier``.
"""

from __future__ import annotations

import os

import pytest
import torch

import fastcomm
from fastcomm import ReduceOp
from fastcomm.comm import HierCommunicator
from tests.comm import test_collectives as generic
from tests.harness import STATE, pool_fixture, rank_comm

LAYOUTS = {4: ["a", "b", "a", "b"], 3: ["a", "a", "b"]}


def fake_hosts(hosts: list[str]) -> None:
    """This rank's host in ``hosts`` (one per rank), with the local rank and local world size a
    launcher would give it there."""
    rank = int(os.environ["RANK"])
    here = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    os.environ.update(FASTCOMM_HOST_ID=hosts[rank], LOCAL_RANK=str(here.index(rank)),
                      LOCAL_WORLD_SIZE=str(len(here)))


def set_host(hosts: list[str]) -> None:
    fake_hosts(hosts)
    torch.set_num_threads(1)
    STATE.pop("comm/hier", None)  # rebuilt with the new host identity


def check_topology():
    comm = rank_comm("hier")
    assert isinstance(comm, HierCommunicator)
    return (
        comm.hosts,
        comm.local_rank,
        comm.is_leader,
        comm.intra.size if comm.intra is not None else None,
        comm.leaders is not None,
    )


def check_large_all_reduce(dtype):
    """Through both levels: two-step shm chunks inside hosts, Gloo across leaders."""
    comm = rank_comm("hier")
    numel = 300_001  # > the 1 MiB shm slot for 4-byte types
    inputs = [generic.make_input(r, (numel,), dtype, 5) for r in range(comm.size)]
    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
        t = inputs[comm.rank].clone()
        comm.all_reduce(t, op=op)
        assert torch.equal(t, generic.reduce_reference(inputs, op)), op


def check_init_choice(hosts, forced):
    saved = {k: os.environ.get(k) for k in ("FASTCOMM_HOST_ID", "FASTCOMM_BACKEND",
                                            "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    fake_hosts(hosts)
    if forced:
        os.environ["FASTCOMM_BACKEND"] = forced
    try:
        comm = fastcomm.init(timeout=30)
        t = torch.tensor([comm.rank + 1.0])
        comm.all_reduce(t)
        backend = comm.backend
        fastcomm.shutdown()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return backend, t.item()


def _native_threads() -> set[str]:
    """The ids of this process's OS threads (Python's and C++'s alike)."""
    return set(os.listdir("/proc/self/task"))


def check_shutdown_joins_gloo_threads():
    """A leader's Gloo group is destroyed by ``shutdown()`` although the caller still holds the
    communicator: its worker threads must not outlive it into the interpreter's exit (where a
    thread releasing the last collective's tensors aborted the process)."""
    before = _native_threads()
    comm = fastcomm.init(timeout=30)
    t = torch.full((2000,), comm.rank + 1.0)  # beyond the agreement's ride: Gloo's all-reduce
    comm.all_reduce(t)
    during = _native_threads() - before
    fastcomm.shutdown()
    left = (_native_threads() - before) & during
    return comm.is_leader, bool(during), sorted(left), t[0].item()


# CPU tensors on simulated hosts; GPUs hidden so that init()'s choice checked below is the
# CPU one on any machine (NCCL selection is tested in test_init.py with faked devices)
pool = pool_fixture(
    [4, 3], env={"CUDA_VISIBLE_DEVICES": ""}, timeout=90,
    setup=lambda pool: pool.run(set_host, LAYOUTS[pool.world_size]),
)


def test_topology(pool):
    results = pool.run(check_topology)
    layout = LAYOUTS[pool.world_size]
    hosts = [sorted(set(layout), key=layout.index).index(h) for h in layout]
    for rank, (seen_hosts, local_rank, leader, intra_size, has_leaders) in enumerate(results):
        mates = [r for r in range(pool.world_size) if hosts[r] == hosts[rank]]
        assert seen_hosts == hosts
        assert local_rank == mates.index(rank) and leader == (local_rank == 0)
        assert intra_size == (len(mates) if len(mates) > 1 else None)
        assert has_leaders == leader


@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda o: o.name)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int32, torch.uint8], ids=str
)
def test_all_reduce(pool, dtype, op):
    pool.run(generic.check_all_reduce, "hier", dtype, op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_large_all_reduce(pool, dtype):
    pool.run(check_large_all_reduce, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8], ids=str)
def test_other_ops(pool, dtype):
    pool.run(generic.check_broadcast, "hier", dtype)  # every src: own host first, then others
    pool.run(generic.check_all_gather, "hier", dtype)
    pool.run(generic.check_reduce_scatter, "hier", dtype, ReduceOp.SUM)
    pool.run(generic.check_all_to_all, "hier", dtype)
    pool.run(generic.check_send_recv_ring, "hier", dtype)


def test_barrier_async_split(pool):
    assert all(all(seen) for seen in pool.run(generic.check_barrier_orders_store_writes, "hier"))
    pool.run(generic.check_async_in_order, "hier")
    pool.run(generic.check_async_every_op, "hier")
    assert pool.run(generic.check_split, "hier") == [True] * pool.world_size


@pytest.mark.parametrize(
    "layout, forced, expected",
    [
        (lambda n: ["x"] * n, None, "shm"),
        (lambda n: ["x", "y"] * (n // 2) + ["x"] * (n % 2), None, "hier"),
        (lambda n: [f"h{r}" for r in range(n)], None, "gloo"),
        (lambda n: ["x"] * n, "gloo", "gloo"),
    ],
    ids=["one-host", "two-hosts", "one-rank-per-host", "forced-gloo"],
)
def test_init_picks_backend_by_host_layout(pool, layout, forced, expected):
    n = pool.world_size
    results = pool.run(check_init_choice, layout(n), forced)
    assert results == [(expected, float(sum(range(1, n + 1))))] * n


def test_shutdown_joins_the_gloo_threads_while_the_communicator_is_held(pool):
    results = pool.run(check_shutdown_joins_gloo_threads)
    total = float(sum(range(1, pool.world_size + 1)))
    for rank, (leader, started, left, value) in enumerate(results):
        assert value == total
        assert started, f"rank {rank}: init started no thread (Gloo's own are expected)"
        assert left == [], f"rank {rank} (leader {leader}): threads left after shutdown: {left}"


MINIMAL = """
import os
os.environ["FASTCOMM_HOST_ID"] = "host%d" % (int(os.environ["RANK"]) // 2)
import torch
import fastcomm
torch.set_num_threads(1)
comm = fastcomm.init(timeout=60)
t = torch.ones(4)
comm.all_reduce(t)
assert t.tolist() == [4.0] * 4, t
fastcomm.shutdown()
"""

#: Runs of the minimal program (4 ranks, 2 faked hosts): a leader used to abort at exit in
#: 10-36 % of them. check_shutdown_joins_gloo_threads above checks the cause itself,
#: deterministically, so the suite keeps the runs to two jobs at once (each is 4 processes
#: importing torch); FASTCOMM_EXIT_RUNS=200 is the measurement.
EXIT_RUNS = int(os.environ.get("FASTCOMM_EXIT_RUNS", "2"))


@pytest.mark.timeout(600)
def test_leaders_exit_cleanly_after_shutdown(tmp_path):
    """init with faked hosts, all_reduce, shutdown, end of script -- ``EXIT_RUNS`` times, 4 jobs
    at a time: every rank exits 0 (a leader's Gloo thread released the last collective's
    tensors during interpreter exit: ``terminate called without an active exception``)."""
    import socket
    import subprocess
    import sys

    program = tmp_path / "minimal.py"
    program.write_text(MINIMAL)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def start_job():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FASTCOMM_")}
        env.update(WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""))
        return [
            subprocess.Popen([sys.executable, str(program)], env={**env, "RANK": str(r),
                             "LOCAL_RANK": str(r % 2)}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
            for r in range(4)
        ]

    failures, started, running = [], 0, []
    while started < EXIT_RUNS or running:
        while len(running) < 4 and started < EXIT_RUNS:
            running.append(start_job())
            started += 1
        job = running.pop(0)
        for rank, proc in enumerate(job):
            try:
                _, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode != 0:
                failures.append((rank, proc.returncode, err[-300:]))
    assert failures == [], f"{len(failures)} rank exits failed in {EXIT_RUNS} runs: {failures}"
