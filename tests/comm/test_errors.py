"""Bad input, closed communicators, timeouts and dying peers: clear errors, never a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch

from fastcomm import CommClosedError, CommTimeoutError, FastcommError, ReduceOp
from tests.comm.shm.test_faults import short_op_timeout
from tests.harness import fresh_comm, poll_keys, pool_fixture, rank_comm

BACKENDS = ["gloo", "shm"]


def _raises(fn, exc_type, *needles):
    try:
        fn()
    except exc_type as exc:
        message = str(exc)
        for needle in needles:
            assert needle in message, f"{needle!r} not in {message!r}"
        return message
    raise AssertionError(f"expected {exc_type.__name__}")


def check_bad_inputs_rejected_before_sending(backend):
    comm = rank_comm(backend)
    n = comm.size
    x = torch.ones(4, 4)
    _raises(lambda: comm.all_reduce(x.t()[0]), ValueError, "contiguous")
    _raises(lambda: comm.all_reduce([1.0]), TypeError, "torch.Tensor")
    _raises(lambda: comm.all_reduce(torch.ones(2, dtype=torch.float8_e4m3fn)), TypeError,
            "float8_e4m3fn", "allowed")
    _raises(lambda: comm.all_reduce(torch.ones(2, dtype=torch.bool), op=ReduceOp.AVG), TypeError,
            "AVG", "bool takes")
    _raises(lambda: comm.all_reduce(torch.ones(2), op="median"), ValueError, "median", "SUM")
    _raises(lambda: comm.broadcast(torch.ones(2), src=n), ValueError, f"src={n}", "out of range")
    _raises(lambda: comm.broadcast(torch.ones(2), src=-1), ValueError, "src=-1")
    _raises(
        lambda: comm.all_gather(torch.empty(n * 3 + 1), torch.ones(3)),
        ValueError, "all_gather", f"{n * 3 + 1}",
    )
    _raises(
        lambda: comm.all_gather(torch.empty(n * 3, dtype=torch.float64), torch.ones(3)),
        TypeError, "float64",
    )
    _raises(
        lambda: comm.reduce_scatter(torch.empty(3), torch.ones(n * 3 - 1)),
        ValueError, "reduce_scatter",
    )
    _raises(lambda: comm.all_to_all(torch.empty(n + 1), torch.ones(n + 1)), ValueError, "divisible")
    _raises(lambda: comm.send(torch.ones(2), comm.rank), ValueError, "itself")
    _raises(lambda: comm.recv(torch.ones(2), n + 5), ValueError, f"src={n + 5}")
    _raises(lambda: comm.split("red"), TypeError, "color")
    if torch.cuda.is_available():  # every backend here moves CUDA tensors (shm: via Gloo)
        c = torch.ones(2, device="cuda")
        comm.all_reduce(c)
        assert c.device.type == "cuda" and c.tolist() == [float(n)] * 2
    # nothing was sent: the communicator is still in step with its peers
    t = torch.ones(3)
    comm.all_reduce(t)
    torch.testing.assert_close(t, torch.full((3,), float(n)), atol=0, rtol=0)


def check_use_after_close(backend, name):
    comm = fresh_comm(backend, name)
    # every rank's connections are made before one closes (a Gloo mesh still connecting on a
    # peer fails with "Connection closed by peer")
    comm.barrier()
    comm.close()
    comm.close()  # idempotent
    for call in (
        lambda: comm.all_reduce(torch.ones(1)),
        lambda: comm.broadcast(torch.ones(1)),
        lambda: comm.barrier(),
        lambda: comm.split(0),
    ):
        _raises(call, CommClosedError, f"rank {comm.rank}", "after close()")


def check_missing_peer_times_out(backend, name):
    # set up under a generous timeout: only the collective's, the thing tested, is short
    comm = fresh_comm(backend, name, timeout=30.0)
    short_op_timeout(comm, 2.0)
    start = time.monotonic()
    if comm.rank == 0:
        message = _raises(lambda: comm.all_reduce(torch.ones(4)), CommTimeoutError, "rank 0",
                          "all_reduce")
        elapsed = time.monotonic() - start
        comm.store.set("timed-out", "1")
        comm.close()
        return elapsed, message
    # rank 1.. stay connected but never join the collective until rank 0 has timed out
    poll_keys(comm.store, ["timed-out"], timeout=30.0)
    comm.close()
    return None


def check_peer_dies_mid_collective(backend, name):
    comm = fresh_comm(backend, name, timeout=30.0)
    comm.all_reduce(torch.ones(2))  # connected and in step
    if comm.rank == comm.size - 1:
        os._exit(3)  # killed before the next collective
    start = time.monotonic()
    message = _raises(lambda: comm.all_reduce(torch.ones(1 << 16)), FastcommError, "all_reduce")
    return time.monotonic() - start, message


pool = pool_fixture(2, timeout=60)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs(pool, backend):
    pool.run(check_bad_inputs_rejected_before_sending, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_use_after_close(pool, backend, unique_name):
    pool.run(check_use_after_close, backend, unique_name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_collective_a_rank_never_joins_raises_within_timeout(pool, backend, unique_name):
    results = pool.run(check_missing_peer_times_out, backend, unique_name)
    elapsed, message = results[0]
    assert 1.9 <= elapsed < 15, (elapsed, message)
    assert "s" in message


@pytest.mark.parametrize("backend", BACKENDS)
def test_peer_killed_others_raise(pool, backend, unique_name):
    failure = pool.expect_failure(check_peer_dies_mid_collective, backend, unique_name)
    assert list(failure.errors) == [1] and "rank 1 died" in failure.errors[1]
    # rank 0 got a fastcomm error naming itself and the op, well within the timeout
    elapsed, message = failure.results[0]
    assert elapsed < 15 and "rank 0" in message and "all_reduce" in message, message


def check_cuda_tensors_go_through_gloo(backend):
    comm = rank_comm(backend)
    n = comm.size
    gloo = comm.fallback
    assert comm.route("cuda") is gloo and gloo.backend == "gloo"
    t = torch.full((1031,), comm.rank + 1.0, device="cuda")
    comm.all_reduce(t, op="avg")
    out = torch.empty(n, 3, device="cuda")
    comm.all_gather(out, torch.full((3,), float(comm.rank), device="cuda"))
    b = torch.full((5,), float(comm.rank), device="cuda")
    comm.broadcast(b, src=n - 1)
    torch.cuda.synchronize()
    assert torch.all(t == (n + 1) / 2).item()
    assert out[:, 0].tolist() == [float(r) for r in range(n)]
    assert b.tolist() == [float(n - 1)] * 5
    if backend == "shm":  # reduce: the root gets the sum, the others keep their tensor
        r = torch.full((4,), comm.rank + 1.0, device="cuda")
        comm.reduce(r, root=0)
        expected = n * (n + 1) / 2 if comm.rank == 0 else comm.rank + 1.0
        assert r.tolist() == [expected] * 4, r
    # CPU tensors still take shared memory, in step with the CUDA calls
    c = torch.ones(3)
    comm.all_reduce(c)
    assert c.tolist() == [float(n)] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["shm", "hier"])
def test_cuda_tensors_on_shm_and_hier_go_through_gloo(pool, backend):
    pool.run(check_cuda_tensors_go_through_gloo, backend)


def check_reduce_through_the_fallback(name):
    """shm's reduce of tensors it hands to Gloo (CUDA ones on a GPU machine), run here on CPU
    tensors by routing them the same way: the root gets the result, the others keep theirs."""
    comm = fresh_comm("shm", name)
    comm._target = lambda tensor, op: comm.fallback
    n = comm.size
    for op, on_root in (("sum", n * (n + 1) / 2), ("avg", (n + 1) / 2), ("max", float(n))):
        t = torch.full((5,), comm.rank + 1.0)
        comm.reduce(t, 1, ReduceOp.coerce(op), async_op=True).wait()
        expected = on_root if comm.rank == 1 else comm.rank + 1.0
        assert t.tolist() == [expected] * 5, (op, t)
    comm.close()


def test_shm_reduce_through_the_fallback_keeps_the_result_on_root(pool, unique_name):
    pool.run(check_reduce_through_the_fallback, unique_name)


# ---------------------------------------------------------------------- ipc CUDA agreement
# The transport itself needs CUDA and CuPy; its setup agreement is a plain function over the
# values every rank gathered, so every rank's verdict can be checked here.
def test_ipc_cuda_ranks_that_disagree_on_options_all_raise_naming_both_sides():
    from fastcomm.comm.ipc.plan import IpcCudaOptions, agreed_options, check_agreed_options

    same = [agreed_options(IpcCudaOptions()) for _ in range(3)]
    for rank in range(3):
        check_agreed_options(rank, same)  # agreement: nothing raised
    gathered = [
        agreed_options(IpcCudaOptions()),
        agreed_options(IpcCudaOptions(workspace_bytes=1 << 20)),
        agreed_options(IpcCudaOptions(two_shot_bytes=1024)),
    ]
    messages = [_raises(lambda r=r: check_agreed_options(r, gathered), FastcommError,
                        f"rank {r}:", "disagree") for r in range(3)]
    for message in messages:  # the first disagreeing peer, both values, the variable
        assert "rank 0 has 33554432, rank 1 has 1048576" in message, message
        assert "FASTCOMM_IPC_CUDA_WORKSPACE_BYTES" in message, message


_WORKSPACE, _TWO_SHOT = "FASTCOMM_IPC_CUDA_WORKSPACE_BYTES", "FASTCOMM_IPC_CUDA_TWO_SHOT_BYTES"


@pytest.mark.parametrize(
    "env, needles",
    [
        ({_WORKSPACE: "32M"}, [f"{_WORKSPACE}='32M'"]),
        ({_WORKSPACE: "100"}, ["workspace_bytes=100 must be a positive", f"{_WORKSPACE}=100"]),
        ({_TWO_SHOT: "0"}, ["two_shot_bytes=0 must be >= 1", f"{_TWO_SHOT}=0"]),
    ],
)
def test_ipc_cuda_environment_values_are_named(env, needles):
    from fastcomm.comm.ipc.plan import IpcCudaOptions

    _raises(lambda: IpcCudaOptions.from_env(env), ValueError, *needles)
