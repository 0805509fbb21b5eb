"""A communicator's failure hooks (``comm.hooks``): registered by their owner, run once per
error a call fails with after anything was sent, told apart by type; a disagreement between
the ranks is a ``CollectiveMismatchError`` on every rank, and reaches the hooks as one."""

from __future__ import annotations

import os

import pytest
import torch

from fastcomm.comm.errors import (
    CollectiveMismatchError,
    CommClosedError,
    CommTimeoutError,
    FastcommError,
    SizesDisagreement,
)
from fastcomm.comm.hooks import CommHooks
from tests.harness import pool_fixture, rank_store

pool = pool_fixture(2, timeout=60)


def test_hooks_run_once_per_error_for_fastcomm_errors_only():
    hooks = CommHooks()
    seen: list = []
    remove = hooks.register_failure(seen.append)
    timeout, mismatch = CommTimeoutError("late"), CollectiveMismatchError("rank 0: x")
    for error in (timeout, timeout, mismatch, ValueError("bad argument"),
                  CommClosedError("closed")):
        hooks.failed(error)
    assert seen == [timeout, mismatch], seen  # once each; argument errors and close() none
    remove()
    hooks.failed(CommTimeoutError("later"))
    assert seen == [timeout, mismatch], seen


def test_a_hook_that_raises_hides_neither_the_error_nor_the_other_hooks(caplog):
    hooks = CommHooks()
    seen: list = []

    def broken(error):
        raise RuntimeError("the hook itself failed")

    hooks.register_failure(broken)
    hooks.register_failure(seen.append)
    error = FastcommError("rank 1: all_reduce failed")
    hooks.failed(error)
    assert seen == [error]
    assert "the hook itself failed" in caplog.text


def test_size_disagreements_are_mismatches_and_value_errors():
    assert issubclass(SizesDisagreement, CollectiveMismatchError)
    assert issubclass(SizesDisagreement, ValueError)
    assert issubclass(CollectiveMismatchError, FastcommError)


def check_mismatch_reaches_the_hooks(backend: str, name: str):
    """Rank 1 reduces another element count: every rank raises CollectiveMismatchError, and
    the failure hook registered on its communicator sees that error."""
    from fastcomm.comm import new_communicator

    if backend == "hier":  # two namespaced hosts of one rank each
        os.environ["FASTCOMM_HOST_ID"] = f"host{os.environ['RANK']}"
    rank = int(os.environ["RANK"])
    try:
        comm = new_communicator(backend, store=rank_store().prefixed(name, rank=rank),
                                rank=rank, size=2, timeout=20, watch=False)
    finally:
        os.environ.pop("FASTCOMM_HOST_ID", None)
    seen: list = []
    comm.hooks.register_failure(seen.append)
    try:
        with pytest.raises(CollectiveMismatchError) as info:
            comm.all_reduce(torch.ones(8 if rank == 0 else 9))
        assert seen == [info.value], seen
        assert "collective mismatch" in str(info.value)
        return type(info.value).__name__
    finally:
        comm.close()


@pytest.mark.parametrize("backend", ["shm", "hier"])
def test_a_mismatch_is_one_type_on_every_rank(pool, backend, unique_name):
    assert pool.run(check_mismatch_reaches_the_hooks, backend, unique_name) == [
        "CollectiveMismatchError"] * 2
