"""The ipc communicator on CPU: the shm schedules with the ``peer_reduce`` kernel as reduction.

2, 3 and 4 real ranks run the kernel in Triton's interpreter (``FASTCOMM_KERNELS=triton`` and
``TRITON_INTERPRET=1`` in their environment, on a CUDA machine too), reading each other's slots
at the addresses where each process mapped the shared segment. 4 KiB slots make every size
class cheap: 1 element, 7 (not divisible by any world size here), a two-step all-reduce of one
round, and a tensor of three and a bit slots, which streams through the workspace in four
rounds of reduce-scatter + all-gather.

References: the kernel accumulates in fp32 and rounds once, so the oracle is
``peer_reduce_reference`` over every rank's input (the same seeded tensors on every rank),
compared bit for bit. One exception, computed the same way rather than with a tolerance: the
interpreter converts fp32 to bf16 by truncating the low 16 bits, so bf16 sums and averages are
checked against the fp32 reference truncated likewise (max and min never round). ``PRODUCT``
and integer dtypes are no kernel case: they take the torch reduction of the shm schedules and
are checked against it. Every rank must also hold the very same bits.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time

import pytest
import torch

from fastcomm import CommTimeoutError, ReduceOp
from fastcomm.comm.shm.segment import PREFIX, SHM_DIR
from tests.comm.test_collectives import make_input, reduce_reference
from tests.harness import (
    INTERPRETED_KERNELS,
    STATE,
    fresh_comm,
    poll_keys,
    pool_fixture,
    rank_store,
)

pytestmark = [
    pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs POSIX shared memory"),
    pytest.mark.timeout(300),
]

SMALL = dict(slot_bytes=4096, one_shot_max=1024, mbox_bytes=4096)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KERNEL_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MAX: "max",
              ReduceOp.MIN: "min"}
OP_TIMEOUT = 2.0  # where the timeout is the thing tested


# ------------------------------------------------------------------ rank side
def ipc_comm():
    """A cached ipc communicator with 4 KiB slots over all ranks of the pool."""
    from fastcomm.comm import ShmOptions, new_communicator

    comm = STATE.get("ipc-small")
    if comm is None or comm.closed:
        torch.set_num_threads(1)  # 4 ranks on 2 cores: no intra-op threads competing
        STATE["gen"] = STATE.get("gen", 0) + 1
        rank = int(os.environ["RANK"])
        comm = STATE["ipc-small"] = new_communicator(
            "ipc",
            store=rank_store().prefixed(f"ipc-small-{STATE['gen']}", rank=rank),
            rank=rank,
            size=int(os.environ["WORLD_SIZE"]),
            timeout=30.0,
            options=ShmOptions(**SMALL),
        )
    return comm


def sizes(dtype: torch.dtype) -> list[int]:
    """1, 7, a one-round two-step all-reduce, and one of four rounds through the slots."""
    esize = torch.empty(0, dtype=dtype).element_size()
    return [1, 7, SMALL["one_shot_max"] // esize + 3, 3 * SMALL["slot_bytes"] // esize + 5]


def kernel_reference(inputs: list[torch.Tensor], name: str) -> torch.Tensor:
    """What ``peer_reduce`` computes from ``inputs`` in this process's kernel mode."""
    from fastcomm.kernels import kernel_backend, peer_reduce_reference

    dtype = inputs[0].dtype
    acc = torch.empty(inputs[0].shape)  # fp32: the kernel's accumulator, before the cast
    peer_reduce_reference([x.float() for x in inputs], [acc], op=name)
    if dtype == torch.bfloat16 and kernel_backend(acc) == "triton":
        acc = (acc.view(torch.int32) & -65536).view(torch.float32)  # the interpreter truncates
    return acc.to(dtype)


def random_inputs(world: int, numel: int, dtype: torch.dtype, salt: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * salt + numel)
    return [torch.randn(numel, generator=gen).to(dtype) for _ in range(world)]


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def check_all_reduce(dtype_name: str):
    """Every op and size class of one dtype; returns each result's bits (for the cross-rank
    comparison) after checking it against its reference here."""
    comm = ipc_comm()
    dtype, rank, n = DTYPES[dtype_name], comm.rank, comm.size
    results = []
    for salt, numel in enumerate(sizes(dtype)):
        inputs = random_inputs(n, numel, dtype, salt)
        for op in ReduceOp:
            t = inputs[rank].clone()
            comm.all_reduce(t, op=op)
            if op in KERNEL_OPS:
                want = kernel_reference(inputs, KERNEL_OPS[op])
            else:  # PRODUCT: the torch reduction, in the dtype, in rank order
                want = functools.reduce(torch.mul, inputs)
            what = f"all_reduce {op.name} of {numel} x {dtype_name} on rank {rank} of {n}"
            assert torch.equal(t, want), (
                f"{what}: {(t != want).sum().item()} elements differ, first "
                f"{(t != want).nonzero()[:3].flatten().tolist()}"
            )
            results.append((what.split(" on ")[0], _bits(t)))
    return results


def check_other_reductions():
    """``reduce`` to a root and ``reduce_scatter`` (both through the kernel), and an integer
    all-reduce (the torch reduction)."""
    comm = ipc_comm()
    rank, n = comm.rank, comm.size
    for numel in (5, 1500):  # one shot and two rounds of two-step
        inputs = random_inputs(n, numel, torch.float16, 7)
        for root in {0, n - 1}:
            t = inputs[rank].clone()
            comm.reduce(t, root, op=ReduceOp.AVG)
            want = kernel_reference(inputs, "avg") if rank == root else inputs[rank]
            assert torch.equal(t, want), f"reduce AVG of {numel} to {root} on rank {rank}"
        stacked = [x.repeat(n).view(n, numel) * (r + 1) for r, x in enumerate(inputs)]
        out = torch.full((numel,), 9, dtype=torch.float16)
        comm.reduce_scatter(out, stacked[rank], op=ReduceOp.AVG)
        want = kernel_reference([s[rank] for s in stacked], "avg")
        assert torch.equal(out, want), f"reduce_scatter AVG of {numel} on rank {rank}"
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        ints = [make_input(r, (1500,), torch.int32, 3) for r in range(n)]
        t = ints[rank].clone()
        comm.all_reduce(t, op=op)
        assert torch.equal(t, reduce_reference(ints, op)), f"int32 {op.name} on rank {rank}"
    return comm.cpu._schedules.reduction.__name__


def check_other_collectives():
    """The ops ipc inherits from shm unchanged, once each through the 4 KiB slots."""
    comm = ipc_comm()
    rank, n = comm.rank, comm.size
    t = torch.full((1500,), float(rank), dtype=torch.bfloat16)
    comm.broadcast(t, src=n - 1)
    assert torch.equal(t, torch.full_like(t, n - 1))
    out = torch.empty(n, 1500)
    comm.all_gather(out, torch.full((1500,), float(rank)))
    assert torch.equal(out, torch.arange(float(n)).repeat_interleave(1500).view(n, 1500))
    send = torch.arange(float(n)) + 10 * rank
    got = torch.empty(n)
    comm.all_to_all(got, send)
    assert torch.equal(got, torch.arange(float(n)) * 10 + rank)
    right, left = (rank + 1) % n, (rank - 1) % n
    work = comm.send(torch.full((5000,), float(rank)), right, async_op=True)
    received = torch.empty(5000)
    comm.recv(received, left)
    work.wait(timeout=30)
    assert torch.equal(received, torch.full((5000,), float(left)))
    comm.barrier()


def check_rank_never_arrives(name: str):
    """Every rank but the last calls all_reduce; the last builds the communicator and waits."""
    comm = fresh_comm("ipc", name, timeout=OP_TIMEOUT)
    absent = comm.size - 1
    store = rank_store().prefixed(f"{name}-gave-up")
    if comm.rank == absent:  # alive, never arriving, until every other rank gave up
        poll_keys(store, [str(r) for r in range(absent)])
        comm.close()
        return None
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(600), op=ReduceOp.AVG)  # two-step: the kernel path
    except CommTimeoutError as exc:
        elapsed, message = time.monotonic() - start, str(exc)
    else:
        raise AssertionError(f"rank {comm.rank}: all_reduce returned without rank {absent}")
    finally:
        store.set(str(comm.rank), "1")
    comm.close()
    return elapsed, message


def check_cuda_transport_unavailable_falls_back(name: str):
    """Without CUDA (and CuPy) the transport cannot be built on any rank: every rank agrees,
    logs one line, and CUDA all-reduces would take Gloo."""
    comm = fresh_comm("ipc", name)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("fastcomm")
    logger.addHandler(handler)
    try:
        transport = comm._cuda_route(torch.device("cuda", 0))
        again = comm._cuda_route(torch.device("cuda", 0))  # decided once: no second log line
    finally:
        logger.removeHandler(handler)
    t = torch.full((3,), float(comm.rank))
    comm.all_reduce(t)  # the CPU path still in step after the two store rounds
    comm.close()
    lines = [r.getMessage() for r in records]
    return transport, again, lines, t.tolist()


def check_cuda_routes(name: str):
    """Every rank on GPU 0: the kernel ops through the CUDA transport, the rest through Gloo."""
    comm = fresh_comm("ipc", name)
    device, n, rank = torch.device("cuda", 0), comm.size, comm.rank
    got = {}
    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.PRODUCT):
        for numel in (3, 300_001):  # one-shot and two-shot in the transport
            t = torch.full((numel,), float(rank + 1), device=device)
            comm.all_reduce(t, op=op)
            got[(op.name, numel)] = t.unique().tolist()
    t = torch.full((10,), float(rank), device=device)
    comm.broadcast(t, src=n - 1)
    built = comm.cuda_transport is not None
    comm.close()
    return built, got, t.tolist()


def check_init_ipc():
    import fastcomm

    comm = fastcomm.init("ipc", timeout=30)
    try:
        t = torch.full((5,), float(comm.rank))
        comm.all_reduce(t, op="avg")
        return comm.backend, type(comm).__name__, t.tolist()
    finally:
        fastcomm.shutdown()


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize(
    "devices, local_world, version, multi, expected",
    [
        (1, 2, (2, 28, 9), "", "ipc"),  # NCCL < 2.30 refuses two ranks on one GPU
        (2, 4, (2, 30, 0), "", "ipc"),  # 2.30 would share, but only when enabled
        (1, 2, None, "", "ipc"),  # no libnccl: the transport needs CuPy only
        (1, 2, (2, 30, 0), "1", None),  # NCCL shares the GPU itself
        (2, 2, (2, 28, 9), "", None),  # a GPU per rank: NCCL
        (2, 2, None, "", None),  # a GPU per rank, no NCCL: nothing is shared, so shm
        (0, 2, (2, 28, 9), "", None),  # no GPU: CPU selection as before
    ],
)
def test_ipc_is_chosen_exactly_where_ranks_share_a_gpu_nccl_cannot_share(
    devices, local_world, version, multi, expected
):
    from fastcomm.comm.world import nccl_fit, shared_gpu_backend

    env = {"NCCL_MULTI_RANK_GPU_ENABLE": multi}
    fit = nccl_fit(local_world - 1, local_world, device_count=devices, version=version, env=env)
    assert shared_gpu_backend(fit, local_world) == expected, fit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_reference_reduce_matches_the_kernel_reference_bit_for_bit(monkeypatch, dtype):
    """Without ``FASTCOMM_KERNELS=triton`` the reduction skips ``peer_reduce``'s checks but must
    compute exactly what ``peer_reduce_reference`` does (the ranks above run the kernel)."""
    from fastcomm.comm.ipc import cpu_reduction, reference_reduce
    from fastcomm.kernels import peer_reduce_reference

    monkeypatch.setenv("FASTCOMM_KERNELS", "torch")
    kernel_reduce = cpu_reduction()
    assert kernel_reduce is reference_reduce
    gen = torch.Generator().manual_seed(5)
    for n in (1, 2, 3, 5):
        terms = [torch.randn(777, generator=gen).to(dtype) for _ in range(n)]
        terms[0][:3] = torch.tensor([float("nan"), float("inf"), -0.0])
        for op, name in KERNEL_OPS.items():
            want = torch.empty_like(terms[0])
            peer_reduce_reference(terms, [want], op=name)
            out = torch.full_like(terms[0], 7.0)
            kernel_reduce(out, terms, op)
            assert _bits(out) == _bits(want), (dtype, n, name)
            aliased = [terms[0].clone(), *terms[1:]]  # out may be terms[0], as schedules allow
            kernel_reduce(aliased[0], aliased, op)
            assert _bits(aliased[0]) == _bits(want), (dtype, n, name, "aliased")


# Ranks whose CPU reduction is the kernel, interpreted (even on a CUDA machine).
pool = pool_fixture([2, 3, 4], env=INTERPRETED_KERNELS, timeout=120)


# Ranks sharing GPU 0 with triton compiled: the CUDA transport's kernels cannot run in
# the interpreter of `pool`'s ranks (it cannot follow device addresses).
cuda_pool = pool_fixture([2, 3, 4], env={"CUDA_VISIBLE_DEVICES": "0"}, timeout=300, needs_cuda=True)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_all_reduce_every_op_and_size_bit_identical_across_ranks(pool, dtype_name):
    per_rank = pool.run(check_all_reduce, dtype_name)
    assert len(per_rank[0]) == 4 * len(ReduceOp)
    for k, (what, bits) in enumerate(per_rank[0]):
        for rank, results in enumerate(per_rank[1:], 1):
            assert results[k] == (what, bits), f"{what}: rank {rank} differs from rank 0"


def test_reduce_reduce_scatter_and_torch_fallback_cases(pool):
    # the ranks reduced by peer_reduce launches (FASTCOMM_KERNELS=triton: the interpreter)
    assert pool.run(check_other_reductions) == ["kernel_reduce"] * pool.world_size


def test_the_collectives_inherited_from_shm(pool):
    pool.run(check_other_collectives)


def test_a_rank_that_never_arrives_makes_the_others_raise_naming_it(pool, unique_name):
    results = pool.run(check_rank_never_arrives, unique_name, timeout=60)
    absent = pool.world_size - 1
    assert results[absent] is None
    for rank, (elapsed, message) in enumerate(results[:absent]):
        # at the timeout, not at a later one: a multiple of it, as the overshoot (the kernel's
        # wait runs in Triton's interpreter here) reached 0.5 s with one core busy elsewhere
        assert OP_TIMEOUT <= elapsed < 3 * OP_TIMEOUT, (rank, elapsed, message)
        assert f"rank(s) [{absent}] never arrived" in message, message
        assert message.startswith(f"rank {rank}: all_reduce"), message


def test_cuda_transport_failure_means_gloo_with_one_log_line(pool, unique_name):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the transport may well build (tests/comm/ipc/test_cuda.py)")
    for transport, again, lines, total in pool.run(
        check_cuda_transport_unavailable_falls_back, unique_name
    ):
        assert transport is None and again is None
        assert len(lines) == 1 and "the CUDA IPC transport is unavailable" in lines[0], lines
        assert "Gloo fallback" in lines[0], lines
        assert total == [float(sum(range(pool.world_size)))] * 3


@pytest.mark.gpu
def test_cuda_all_reduce_takes_the_transport_and_the_rest_gloo(cuda_pool, unique_name):
    n = cuda_pool.world_size
    want = {"SUM": n * (n + 1) / 2, "AVG": (n + 1) / 2, "MAX": float(n),
            "PRODUCT": float(math.factorial(n))}
    for built, got, broadcast in cuda_pool.run(check_cuda_routes, unique_name):
        assert built, "the CUDA IPC transport was not built"
        for (op, numel), values in got.items():
            assert values == [want[op]], (op, numel, values)
        assert broadcast == [float(n - 1)] * 10


def test_init_ipc(pool):
    n = pool.world_size
    for backend, cls, values in pool.run(check_init_ipc):
        assert (backend, cls) == ("ipc", "IpcCommunicator")
        assert values == [sum(range(n)) / n] * 5


def test_nothing_left_in_dev_shm(pool):
    pids = set(pool.pids)
    left = [n for n in os.listdir(SHM_DIR)
            if n.startswith(PREFIX) and int(n[len(PREFIX):].split("-", 1)[0]) in pids]
    assert not left, f"segments of this module's ranks left in {SHM_DIR}: {left}"
