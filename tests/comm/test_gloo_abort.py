"""The Gloo communicator's abort: rank 2 is lost in the middle of an all-reduce; once the loss
is known (``abort``, from another thread, as in-place recovery's watch does) the calls pending
on ranks 0 and 1 raise ``CommAbortedError`` naming it, later calls are refused, and ``close``
does not wait on the stranded group (all under a 60 s collective timeout):

- ``silent``: rank 2 never joins (a powered-off host: its Gloo peer says nothing);
- ``closed``: it closes its communicator (a killed process: Gloo sees the socket close first,
  and the call waits ``loss_grace`` for the abort to name the loss);
- ``future``: ``silent``, waited through ``get_future()`` (a comm hook's way).

A call that completed before the abort, waited only after it, still returns its result.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fastcomm.comm.errors import CommAbortedError, FastcommError
from tests.harness import env_rank, fresh_comm, poll_keys, pool_fixture, rank_store

pytestmark = pytest.mark.timeout(200)

pool = pool_fixture(3, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)

LOSS = "member 2 (launcher rank 2, pid 1, this host) exited"


def check_abort(case: str) -> str | None:
    rank, store = env_rank(), rank_store()
    comm = fresh_comm("gloo", f"gloo-abort-{case}", timeout=60)
    comm.all_reduce(torch.ones(4))  # the mesh works before the loss
    if rank == 2:  # lost
        poll_keys(store, [f"gloo-abort-{case}/pending{r}" for r in (0, 1)])
        if case != "closed":
            poll_keys(store, [f"gloo-abort-{case}/done{r}" for r in (0, 1)])
        comm.close()
        return None
    comm.loss_grace = 30.0 if case != "silent" else 0.0
    work = comm.all_reduce(torch.ones(100_000), async_op=True)
    store.set(f"gloo-abort-{case}/pending{rank}", "1")
    timer = threading.Timer(1.0, comm.abort, [CommAbortedError(LOSS)])
    timer.start()
    try:
        if case == "future":
            work.get_future().wait()
        else:
            work.wait()
        outcome = "returned"
    except FastcommError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    timer.join()
    try:
        comm.all_reduce(torch.ones(4))
        later = "returned"
    except FastcommError as exc:
        later = f"{type(exc).__name__}: {exc}"
    comm.close()  # strands the group: it does not wait for the pending operation
    store.set(f"gloo-abort-{case}/done{rank}", "1")
    return outcome + " | " + later


@pytest.mark.parametrize("case", ["silent", "closed", "future"])
def test_a_lost_rank_stops_the_pending_calls(pool, case):
    results = pool.run(check_abort, case)
    assert results[2] is None
    for rank in (0, 1):
        outcome, later = results[rank].split(" | ")
        assert outcome.startswith(f"CommAbortedError: rank {rank}: all_reduce failed after "), \
            outcome
        assert outcome.endswith(LOSS), outcome
        assert later == f"CommAbortedError: rank {rank}: all_reduce refused: {LOSS}"


def check_no_grace() -> str | None:
    """Without ``loss_grace`` nor an abort, a peer's closed connection is Gloo's own error."""
    rank, store = env_rank(), rank_store()
    comm = fresh_comm("gloo", "gloo-no-grace", timeout=10)
    if rank == 2:
        poll_keys(store, [f"gloo-no-grace/pending{r}" for r in (0, 1)])
        comm.close()
        return None
    work = comm.all_reduce(torch.ones(100_000), async_op=True)
    store.set(f"gloo-no-grace/pending{rank}", "1")
    try:
        work.wait()
        return "returned"
    except FastcommError as exc:
        return type(exc).__name__
    finally:
        comm.abort(CommAbortedError("done"))  # the survivors' group may wait on rank 2 still
        comm.close()


def test_a_closed_peer_without_grace_is_not_taken_for_a_loss(pool):
    results = pool.run(check_no_grace)
    # rank 0 or 1 may wait on the other's failed ring step: the abort above releases it
    assert set(results[:2]) <= {"FastcommError", "CommTimeoutError"}, results
    assert "CommAbortedError" not in results


def check_done_before_the_abort() -> list[float] | None:
    """An all-reduce that completed on every rank, waited only after the communicator was
    aborted (a waiter that came late, as a slow survivor's wait on the step before the loss):
    its result stands; the next call is refused."""
    rank, store = env_rank(), rank_store()
    comm = fresh_comm("gloo", "gloo-abort-late", timeout=60)
    values = torch.full((4,), float(rank + 1))
    work = comm.all_reduce(values, async_op=True)
    handle, deadline = work._handle, time.monotonic() + 30
    while not handle.is_completed():  # the backend finished it; nobody waited yet
        assert time.monotonic() < deadline, f"rank {rank}: Gloo's all_reduce never completed"
        time.sleep(0.001)
    comm.abort(CommAbortedError(LOSS))
    work.wait()
    with pytest.raises(CommAbortedError):
        comm.all_reduce(torch.ones(4))
    comm.close()
    store.set(f"gloo-abort-late/done{rank}", "1")
    return values.tolist()


def test_a_call_done_before_the_abort_keeps_its_result(pool):
    assert pool.run(check_done_before_the_abort) == [[6.0] * 4] * 3
