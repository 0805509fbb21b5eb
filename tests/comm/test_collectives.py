"""Every collective x dtype x op on 2 and 3 real ranks, against a torch reference.

Each rank builds every rank's input from the same seeds, so it can compute the expected result
locally. Inputs are small integers stored in each dtype, which makes sums, products and
extrema exact in every dtype: comparisons use ``atol=0``.
"""

from __future__ import annotations

import pytest
import torch

from fastcomm import ReduceOp
from fastcomm.comm import SUPPORTED_DTYPES
from tests.harness import pool_fixture, rank_comm

BACKENDS = ["gloo", "shm"]
SHAPES = [(0,), (1,), (7,), (3, 5), (1031,)]
OPS = list(ReduceOp)


def make_input(rank: int, shape: tuple, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 17 * salt + sum(shape))
    low, high = (0, 4) if dtype == torch.uint8 else (-3, 4)
    return torch.randint(low, high, shape, generator=gen).to(dtype)


def reduce_reference(inputs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    stacked = torch.stack(inputs)
    dtype = stacked.dtype
    if op is ReduceOp.SUM:
        return stacked.sum(0, dtype=dtype)
    if op is ReduceOp.AVG:
        total = stacked.sum(0, dtype=dtype)
        if dtype.is_floating_point:
            return total / len(inputs)
        return torch.div(total, len(inputs), rounding_mode="trunc")
    if op is ReduceOp.PRODUCT:
        return stacked.prod(0, dtype=dtype)
    if op is ReduceOp.MAX:
        return stacked.amax(0)
    return stacked.amin(0)


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


# ------------------------------------------------------------------ checks (run on every rank)
def check_all_reduce(backend, dtype, op):
    comm = rank_comm(backend)
    for salt, shape in enumerate(SHAPES):
        inputs = [make_input(r, shape, dtype, salt) for r in range(comm.size)]
        tensor = inputs[comm.rank].clone()
        comm.all_reduce(tensor, op=op)
        exact(tensor, reduce_reference(inputs, op))


def check_broadcast(backend, dtype):
    comm = rank_comm(backend)
    for src in range(comm.size):
        for shape in SHAPES:
            tensor = make_input(comm.rank, shape, dtype)
            comm.broadcast(tensor, src=src)
            exact(tensor, make_input(src, shape, dtype))


def check_all_gather(backend, dtype):
    comm = rank_comm(backend)
    for shape in SHAPES:
        output = torch.full((comm.size, *shape), 99, dtype=dtype)
        comm.all_gather(output, make_input(comm.rank, shape, dtype))
        exact(output, torch.stack([make_input(r, shape, dtype) for r in range(comm.size)]))


def check_reduce_scatter(backend, dtype, op):
    comm = rank_comm(backend)
    for salt, chunk in enumerate([0, 1, 5, 333]):
        inputs = [make_input(r, (comm.size * chunk,), dtype, salt) for r in range(comm.size)]
        output = torch.empty(chunk, dtype=dtype)
        comm.reduce_scatter(output, inputs[comm.rank].clone(), op=op)
        expected = reduce_reference(inputs, op)[comm.rank * chunk : (comm.rank + 1) * chunk]
        exact(output, expected)


def check_all_to_all(backend, dtype):
    comm = rank_comm(backend)
    for chunk in [0, 1, 7]:
        inputs = [make_input(r, (comm.size, chunk), dtype) for r in range(comm.size)]
        output = torch.empty(comm.size, chunk, dtype=dtype)
        comm.all_to_all(output, inputs[comm.rank])
        exact(output, torch.stack([inputs[r][comm.rank] for r in range(comm.size)]))


def check_send_recv_ring(backend, dtype):
    comm = rank_comm(backend)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for shape in [(1,), (257,)]:
        received = torch.empty(shape, dtype=dtype)
        # even ranks send first; odd ranks receive first: no cycle of blocking sends
        if comm.rank % 2 == 0:
            comm.send(make_input(comm.rank, shape, dtype), right)
            comm.recv(received, left)
        else:
            comm.recv(received, left)
            comm.send(make_input(comm.rank, shape, dtype), right)
        exact(received, make_input(left, shape, dtype))


def check_barrier_orders_store_writes(backend):
    from tests.harness import rank_store

    comm = rank_comm(backend)
    store = rank_store().prefixed(f"barrier-{backend}-{comm.size}")
    # add() waits for the server's reply (set() does not), so the key is stored before the
    # barrier starts
    store.add(f"arrived/{comm.rank}", 1)
    comm.barrier()
    # after the barrier every rank's key must already be there: no waiting allowed
    return [store.check([f"arrived/{r}"]) for r in range(comm.size)]


def check_async_in_order(backend):
    comm = rank_comm(backend)
    tensors = [torch.full((100 + i,), float(comm.rank + i)) for i in range(16)]
    works = [comm.all_reduce(t, async_op=True) for t in tensors]
    futures = [w.get_future() for w in works]
    total = sum(range(comm.size))
    for i, (work, fut) in enumerate(zip(works, futures, strict=True)):
        value = fut.wait()
        assert value is tensors[i], "future must resolve to the output tensor itself"
        assert work.wait() is True and work.is_completed()
        exact(value, torch.full((100 + i,), float(total + comm.size * i)))
    # futures chain like torch's: then() sees the reduced tensor
    t = torch.ones(4)
    chained = comm.all_reduce(t, op="avg", async_op=True).get_future().then(
        lambda f: f.value() * 10
    )
    exact(chained.wait(), torch.full((4,), 10.0))


def check_async_every_op(backend):
    comm = rank_comm(backend)
    n = comm.size
    gathered = torch.empty(n, 3)
    scattered = torch.empty(2)
    exchanged = torch.empty(n, 2)
    bcast = torch.full((5,), float(comm.rank))
    works = [
        comm.all_gather(gathered, torch.full((3,), float(comm.rank)), async_op=True),
        comm.reduce_scatter(scattered, torch.arange(2.0 * n), op=ReduceOp.MAX, async_op=True),
        comm.all_to_all(exchanged, torch.full((n, 2), float(comm.rank)), async_op=True),
        comm.broadcast(bcast, src=n - 1, async_op=True),
        comm.barrier(async_op=True),
    ]
    for w in works:
        w.wait(timeout=30)
    exact(gathered, torch.arange(float(n)).repeat_interleave(3).view(n, 3))
    exact(scattered, torch.arange(2.0 * n)[2 * comm.rank : 2 * comm.rank + 2])
    exact(exchanged, torch.arange(float(n)).repeat_interleave(2).view(n, 2))
    exact(bcast, torch.full((5,), float(n - 1)))


def check_wait_timeout_then_complete(backend):

    from fastcomm import CommTimeoutError
    from tests.harness import STATE

    comm = rank_comm(backend)
    # the same count on every rank (each runs the same checks in order): a fresh key per call
    STATE["wait-timeout"] = STATE.get("wait-timeout", 0) + 1
    timed_out = f"wait-timeout/{STATE['wait-timeout']}"
    t = torch.ones(8)
    if comm.rank == 0:
        work = comm.all_reduce(t, async_op=True)
        try:
            work.wait(timeout=0.2)
        except CommTimeoutError as exc:
            message = str(exc)
        else:
            raise AssertionError("wait(timeout=0.2) returned while a peer was still away")
        assert "rank 0" in message and "all_reduce" in message, message
        comm.store.set(timed_out, "1")
        work.wait(timeout=30)  # the collective itself still finishes
    else:
        # away until rank 0's wait has timed out, however late rank 0 got there
        comm.store.wait([timed_out], timeout=30)
        comm.all_reduce(t)
    exact(t, torch.full((8,), float(comm.size)))


def check_unwaited_async_progresses(backend, park: bool):
    """An ``async_op=True`` call nobody waits on still runs: the peers' synchronous calls
    return while its rank only sleeps, with the executor's thread polling, or parked
    (``park``: idle past ``PARK_S``, so the call must wake it)."""
    import time

    from fastcomm.comm import work as work_module
    from tests.harness import STATE

    comm = rank_comm(backend)
    STATE["unwaited"] = STATE.get("unwaited", 0) + 1
    key = f"unwaited/{STATE['unwaited']}"
    t = torch.full((16,), float(comm.rank))
    if comm.rank == 0:
        saved = work_module.PARK_S
        work_module.PARK_S = 0.05 if park else saved
        try:
            comm.all_reduce(torch.ones(1), async_op=True).wait()  # the thread is up
            # shm runs the call on its executor's thread, idle past PARK_S now: parked once it
            # has looked (waited for, not slept for; Gloo's own threads run Gloo's calls)
            executor, deadline = comm._executor, time.monotonic() + 30
            while park and backend == "shm" and not executor._parked:
                assert time.monotonic() < deadline, "rank 0: the executor's thread never parked"
                time.sleep(0.01)
            work = comm.all_reduce(t, async_op=True)
            deadline = time.monotonic() + 30
            # never wait(), is_completed() or get_future(): those start it themselves
            while not comm.store.check([f"{key}/{r}" for r in range(1, comm.size)]):
                assert time.monotonic() < deadline, "the peers' all_reduce never returned"
                time.sleep(0.01)
            work.wait(timeout=30)
        finally:
            work_module.PARK_S = saved
    else:
        comm.all_reduce(torch.ones(1))
        comm.all_reduce(t)
        comm.store.set(f"{key}/{comm.rank}", "1")
    exact(t, torch.full((16,), float(sum(range(comm.size)))))


def check_split(backend):
    comm = rank_comm(backend)
    color = comm.rank % 2
    # key reverses the order inside each color
    sub = comm.split(color, key=-comm.rank)
    members = [r for r in range(comm.size) if r % 2 == color]
    assert sub.size == len(members)
    assert sub.rank == list(reversed(members)).index(comm.rank)
    t = torch.tensor([float(comm.rank)])
    sub.all_reduce(t)
    exact(t, torch.tensor([float(sum(members))]))
    # a rank that opts out gets None; the rest form one communicator
    sub2 = comm.split(None if comm.rank == 0 else 7)
    if comm.rank == 0:
        assert sub2 is None
    else:
        assert sub2.size == comm.size - 1 and sub2.rank == comm.rank - 1
        u = torch.ones(2)
        sub2.all_reduce(u)
        exact(u, torch.full((2,), float(comm.size - 1)))
        sub2.close()
    sub.close()
    return sub.closed


# ------------------------------------------------------------------ pytest side
pool = pool_fixture([2, 3], timeout=60)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_all_reduce(pool, backend, dtype, op):
    pool.run(check_all_reduce, backend, dtype, op)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_broadcast_all_gather_all_to_all_send_recv(pool, backend, dtype):
    pool.run(check_broadcast, backend, dtype)
    pool.run(check_all_gather, backend, dtype)
    pool.run(check_all_to_all, backend, dtype)
    pool.run(check_send_recv_ring, backend, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_reduce_scatter(pool, backend, dtype, op):
    pool.run(check_reduce_scatter, backend, dtype, op)


@pytest.mark.parametrize("backend", BACKENDS)
def test_barrier(pool, backend):
    for seen in pool.run(check_barrier_orders_store_writes, backend):
        assert all(seen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_work_and_futures(pool, backend):
    pool.run(check_async_in_order, backend)
    pool.run(check_async_every_op, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("park", [False, True], ids=["polling", "parked"])
def test_unwaited_async_call_progresses(pool, backend, park):
    pool.run(check_unwaited_async_progresses, backend, park)


@pytest.mark.parametrize("backend", BACKENDS)
def test_work_wait_timeout(pool, backend):
    pool.run(check_wait_timeout_then_complete, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_split(pool, backend):
    assert pool.run(check_split, backend) == [True] * pool.world_size


def check_stats_count_payload_bytes(backend, name):
    from tests.harness import fresh_comm

    comm = fresh_comm(backend, name)
    comm.all_reduce(torch.ones(10))  # 40 bytes
    comm.all_reduce(torch.ones(5, dtype=torch.float16))  # 10 bytes
    comm.all_gather(torch.empty(comm.size * 3, dtype=torch.int64), torch.ones(3, dtype=torch.int64))
    stats = (dict(comm.stats.calls), dict(comm.stats.bytes), comm.stats.total_bytes)
    comm.close()
    return stats


@pytest.mark.parametrize("backend", BACKENDS)
def test_stats_count_payload_bytes(pool, backend, unique_name):
    for calls, nbytes, total in pool.run(check_stats_count_payload_bytes, backend, unique_name):
        assert calls == {"all_reduce": 2, "all_gather": 1}
        assert nbytes == {"all_reduce": 50, "all_gather": 24} and total == 74


def check_torch_process_group_adapter(op):
    """TorchPGCommunicator runs the same collectives on torch's own Gloo group."""
    import torch.distributed as dist

    from fastcomm.comm.pg.torch_pg import TorchPGCommunicator
    from tests.harness import STATE

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if "torch_pg" not in STATE:
        STATE["torch_pg"] = TorchPGCommunicator()
    comm = STATE["torch_pg"]
    n = comm.size
    inputs = [make_input(r, (n * 3,), torch.float32) for r in range(n)]
    reduced = inputs[comm.rank].clone()
    comm.all_reduce(reduced, op=op)
    exact(reduced, reduce_reference(inputs, op))
    # Gloo's reduce_scatter handle has no future: completion must not depend on one
    scattered = torch.empty(3)
    comm.reduce_scatter(scattered, inputs[comm.rank].clone(), op=op)
    exact(scattered, reduce_reference(inputs, op)[3 * comm.rank : 3 * comm.rank + 3])


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_torch_process_group_adapter(pool, op):
    pool.run(check_torch_process_group_adapter, op)
