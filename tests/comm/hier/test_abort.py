"""hier's abort: a rank on another host is lost in the middle of an all-reduce; once the loss
is known (``abort``, from another thread, as in-place recovery's watch does) the calls pending
on every rank of the other host raise ``CommAbortedError`` naming it, under a 60 s timeout:

- ``silent``: the lost host's ranks never join (a powered-off node: its Gloo peer says nothing);
- ``closed``: they close their communicator (a killed process: Gloo sees the socket close
  first, and the call waits for the abort to name the loss, ``loss_grace``).

4 ranks as hosts ``a, b, a, b``; host ``b`` (ranks 1, 3) is the lost one.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from fastcomm.comm.errors import CommAbortedError
from fastcomm.comm.shm.segment import SHM_DIR
from tests.comm.hier.test_communicator import set_host
from tests.harness import env_rank, fresh_comm, poll_keys, pool_fixture, rank_store

pytestmark = [
    pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs POSIX shared memory"),
    pytest.mark.timeout(200),
]

pool = pool_fixture(4, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120,
                    setup=lambda pool: pool.run(set_host, ["a", "b", "a", "b"]))


def check_abort(case: str) -> str | None:
    rank, store = env_rank(), rank_store()
    comm = fresh_comm("hier", f"abort-{case}", timeout=60)
    keys = [f"abort-{case}/done{r}" for r in (0, 2)]
    if rank in (1, 3):  # host b: lost
        poll_keys(store, [f"abort-{case}/pending{r}" for r in (0, 2)])
        if case == "silent":
            poll_keys(store, keys)
        comm.close()
        return None
    if case == "closed":
        comm.loss_grace = 30.0
    loss = CommAbortedError("rank 1 (host b) was lost: powered off")
    work = comm.all_reduce(torch.ones(100_000), async_op=True)
    store.set(f"abort-{case}/pending{rank}", "1")
    timer = threading.Timer(1.0, comm.abort, [loss])
    timer.start()
    try:
        work.wait()
        outcome = "returned"
    except CommAbortedError as exc:
        outcome = str(exc)
    timer.join()
    later = ""
    try:
        comm.all_reduce(torch.ones(4))
    except CommAbortedError as exc:
        later = str(exc)
    store.set(f"abort-{case}/done{rank}", "1")
    comm.close()
    return outcome + " | " + later


@pytest.mark.parametrize("case", ["silent", "closed"])
def test_a_lost_host_stops_the_pending_calls(pool, case):
    results = pool.run(check_abort, case)
    assert results[1] is None and results[3] is None
    for rank in (0, 2):
        outcome, later = results[rank].split(" | ")
        # rank 2 may hear it first from its host's leader, over shm (then its shm rank names it)
        assert outcome.startswith(f"rank {rank}: all_reduce failed after ") or (
            rank == 2 and "failed after" in outcome and "rank 0 aborted" in outcome), outcome
        assert outcome.endswith("rank 1 (host b) was lost: powered off"), outcome
        assert later == f"rank {rank}: all_reduce refused: rank 1 (host b) was lost: powered off"
