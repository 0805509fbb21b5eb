"""hier and ipc on CPU: ranks that disagree all raise, naming both calls.

The cases of ``shm/test_agree.py`` (op, element count, dtype, reduce op, src/root, one call
against another) and an empty tensor on one rank only, through the public API, each with one
rank disagreeing: every rank must raise within a second, under a 60 s timeout, with a message
naming both calls.

- ``ipc`` (2 and 3 ranks): the shm segment and schedules with the ``peer_reduce`` reference
  as reduction; a fresh communicator per case (a failed shm collective breaks it).
- ``hier`` (4 ranks as 2 hosts x 2, interleaved, and 3 ranks as a host of 2 and a lone rank,
  the layouts of ``hier/test_communicator.py``): the disagreeing rank is the last one (a
  non-leader of the second host, or a lone leader) and then rank 1 (that host's leader, or a
  non-leader of the first host). hier compares the call before any caller's tensor changes, so
  one communicator serves every case and must still give the right sum after each. Its
  all-reduce of at most 4 KiB rides in that comparison: a count on either side of 4 KiB is a
  case too, and ``reduce`` (which now keeps its root) is checked for torch's bits on every
  root, on both sides of 4 KiB.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from fastcomm import ReduceOp
from fastcomm.comm import FastcommError, ShmOptions, new_communicator
from fastcomm.comm.shm.segment import SHM_DIR
from tests.comm.hier.test_communicator import LAYOUTS, set_host
from tests.comm.shm.test_agree import CASES, _assert_all_raised, ones
from tests.comm.shm.test_communicator import SMALL
from tests.comm.test_collectives import exact, make_input, reduce_reference
from tests.harness import STATE, pool_fixture, rank_store

pytestmark = [
    pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs POSIX shared memory"),
    pytest.mark.timeout(300),
]

OP_TIMEOUT = 60.0
RAISED = (FastcommError, ValueError, TypeError)

# shm's cases reach empty tensors through its schedules; these go through the public API,
# which hands empty tensors to the backend like any other (every rank takes part)
EMPTY_CASES = {
    "all_reduce/empty": (lambda c, n: c.all_reduce(ones(0)), lambda c, n: c.all_reduce(ones(10)),
                         ["0 elements", "10 elements"]),
    "reduce/empty": (lambda c, n: c.reduce(ones(10), 0), lambda c, n: c.reduce(ones(0), 0),
                     ["10 elements", "0 elements"]),
    "broadcast/empty": (lambda c, n: c.broadcast(ones(0), 0), lambda c, n: c.broadcast(ones(10), 0),
                        ["0 elements", "10 elements"]),
    "all_gather/empty": (lambda c, n: c.all_gather(torch.empty(0), ones(0)),
                         lambda c, n: c.all_gather(torch.empty(n), ones(1)),
                         ["0 elements", "1 elements"]),
    "reduce_scatter/empty": (lambda c, n: c.reduce_scatter(torch.empty(0), ones(0)),
                             lambda c, n: c.reduce_scatter(torch.empty(2), ones(n * 2)),
                             ["0 elements", "2 elements"]),
    "all_to_all/empty": (lambda c, n: c.all_to_all(torch.empty(0), ones(0)),
                         lambda c, n: c.all_to_all(torch.empty(n), ones(n)),
                         lambda n: ["0 elements", f"{n} elements"]),
}
# hier sends an all-reduce of at most 4 KiB with its agreement and a larger one after it
RIDE_CASES = {
    "all_reduce/count across 4 KiB": (lambda c, n: c.all_reduce(ones(1024)),
                                      lambda c, n: c.all_reduce(ones(1025)),
                                      ["1024 elements", "1025 elements"]),
    "reduce/root past 4 KiB": (lambda c, n: c.reduce(ones(1500), 0),
                               lambda c, n: c.reduce(ones(1500), 1), ["root 0", "root 1"]),
}
ALL_CASES = {k: v for k, v in CASES.items() if not k.endswith("/empty")} | EMPTY_CASES \
    | RIDE_CASES


# ------------------------------------------------------------------ checks (run on every rank)
def _outcome(call, comm, n: int) -> tuple:
    """``(error type, message, seconds)`` of one call (``None`` for a call that returned)."""
    start = time.monotonic()
    try:
        call(comm, n)
    except RAISED as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "returned", time.monotonic() - start


def check_ipc_disagreements(name: str) -> dict:
    """Every case on a fresh ipc communicator: ``{case: (error type, message, seconds)}``."""
    torch.set_num_threads(1)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    outcomes = {}
    for i, (case, (agree, differ, _)) in enumerate(ALL_CASES.items()):
        comm = new_communicator(
            "ipc", store=rank_store().prefixed(f"{name}-{i}", rank=rank), rank=rank, size=n,
            timeout=OP_TIMEOUT, fallback=False, options=ShmOptions(**SMALL),
        )
        comm.barrier()  # every rank set up: the time measured is the call's alone
        outcomes[case] = _outcome(differ if rank == n - 1 else agree, comm, n)
        comm.close()
    return outcomes


def hier_comm():
    """A cached hier communicator over the pool's simulated hosts, 4 KiB shm slots."""
    comm = STATE.get("agree/hier")
    if comm is None or comm.closed:
        rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        STATE["gen"] = STATE.get("gen", 0) + 1
        comm = STATE["agree/hier"] = new_communicator(
            "hier", store=rank_store().prefixed(f"agree-hier-{STATE['gen']}", rank=rank),
            rank=rank, size=n, timeout=OP_TIMEOUT, options=ShmOptions(**SMALL),
        )
    return comm


def check_hier_disagreements(odd_rank: int) -> tuple[dict, list[str]]:
    """Every case on one hier communicator, ``odd_rank`` disagreeing: the outcomes, and the
    cases after which an agreed all_reduce gave a wrong sum."""
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    comm = hier_comm()
    assert comm.backend == "hier" and comm.num_hosts == 2, (comm.backend, comm.hosts)
    outcomes, broken = {}, []
    for case, (agree, differ, _) in ALL_CASES.items():
        comm.barrier()
        outcomes[case] = _outcome(differ if rank == odd_rank else agree, comm, n)
        t = torch.full((3,), rank + 1.0)
        comm.all_reduce(t)
        if not torch.equal(t, torch.full((3,), n * (n + 1) / 2)):
            broken.append(f"{case}: {t.tolist()}")
    return outcomes, broken


def check_hier_reduce() -> int:
    """``reduce`` to every root, at sizes that ride with the agreement and past it: torch's
    bits on the root, every other rank's tensor unchanged."""
    comm = hier_comm()
    checked = 0
    for root in range(comm.size):
        for salt, numel in enumerate((7, 1031, 5000)):
            for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
                inputs = [make_input(r, (numel,), torch.float32, salt) for r in range(comm.size)]
                t = inputs[comm.rank].clone()
                comm.reduce(t, root, op)
                exact(t, reduce_reference(inputs, op) if comm.rank == root else inputs[comm.rank])
                checked += 1
    return checked


# ------------------------------------------------------------------ pytest side
def _assert_cases(outcomes_per_rank: list[dict], n: int, what: str) -> None:
    for case, (_, _, names) in ALL_CASES.items():
        names = names(n) if callable(names) else names
        outcomes = [per_rank[case] for per_rank in outcomes_per_rank]
        _assert_all_raised(outcomes, ["collective mismatch", *names], f"{what} {case}")


ipc_pool = pool_fixture([2, 3], env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)


hier_pool = pool_fixture(
    [4, 3], env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120,
    setup=lambda pool: pool.run(set_host, LAYOUTS[pool.world_size]),
)


def test_ipc_ranks_that_disagree_all_raise_naming_both_calls(ipc_pool, unique_name):
    outcomes = ipc_pool.run(check_ipc_disagreements, unique_name)
    _assert_cases(outcomes, ipc_pool.world_size, "ipc")


@pytest.mark.parametrize("odd", ["last", "rank1"])
def test_hier_ranks_that_disagree_all_raise_naming_both_calls(hier_pool, odd):
    n = hier_pool.world_size
    results = hier_pool.run(check_hier_disagreements, n - 1 if odd == "last" else 1)
    _assert_cases([outcomes for outcomes, _ in results], n, f"hier ({odd} rank differs)")
    for rank, (_, broken) in enumerate(results):
        assert not broken, f"rank {rank}: wrong sums after a mismatch: {broken}"


def test_hier_reduce_gives_the_root_torch_bits_and_leaves_the_others(hier_pool):
    counts = hier_pool.run(check_hier_reduce)
    assert counts == [hier_pool.world_size * 9] * hier_pool.world_size
