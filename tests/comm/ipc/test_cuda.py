"""The CUDA IPC transport: its host logic on CPU, its schedule across processes, its GPU path.

- The plan (rounds, one-shot/two-shot, per-rank chunks), the workspace layout and the epoch
  bookkeeping are plain functions, checked exactly.
- The *CPU twin*: every rank maps its peers' workspaces (same layout) in POSIX shared memory and
  executes the transport's own steps (`all_reduce_steps` through `run_steps`) with the same
  kernels (`peer_signal`, `peer_reduce_table`, in Triton's interpreter) and plain memory copies
  in place of ``cudaMemcpyAsync``: all ops, dtypes and size classes (1 element, not divisible by
  the world size, larger than the workspace, empty) against the torch reference, ranks whose
  calls differ in element count, dtype or reduce op (every rank gets the error naming both
  calls, with the barrier kernel and with its torch reference), and a rank that never arrives.
  Only the CUDA calls differ on a GPU.
- GPU (``@pytest.mark.gpu``, skipped without CUDA): 2 ranks sharing GPU 0 through
  `CudaIpcTransport` itself, a missing rank timing out, a disagreement raising on both ranks,
  and nothing leaked.
"""

from __future__ import annotations

import ctypes
import os
import time

import pytest
import torch

from fastcomm import settings
from fastcomm.comm.errors import CommAbortedError, FastcommError
from fastcomm.comm.ipc import descriptor as ipc_descriptor
from fastcomm.comm.ipc import plan as ipc_plan
from fastcomm.comm.ipc.plan import (
    Barrier,
    CopyIn,
    CopyOut,
    EpochClock,
    IpcCudaOptions,
    Reduce,
    all_reduce_steps,
    plan_rounds,
    two_shot_chunk,
    workspace_layout,
)
from fastcomm.comm.types import ReduceOp
from fastcomm.kernels._peer_signal import CONTROL_WORDS, DISAGREE, flag_area_words
from tests.harness import INTERPRETED_KERNELS, STATE, RankPool, map_peer_files, rank_store
from tests.kernels.helpers import needs_interpreter

pytestmark = pytest.mark.timeout(300)

# A tiny workspace, so that a few hundred elements already take several rounds of both kinds.
SMALL = dict(workspace_bytes=2048, two_shot_bytes=256)


# ---------------------------------------------------------------------- plan and layout
def test_options_defaults_env_and_validation():
    default = IpcCudaOptions.from_env({})
    assert default.workspace_bytes == 32 << 20
    env = {settings.IPC_CUDA_WORKSPACE_BYTES.name: "4096",
           settings.IPC_CUDA_TWO_SHOT_BYTES.name: " 1000 "}
    assert IpcCudaOptions.from_env(env).workspace_bytes == 4096
    assert IpcCudaOptions.from_env(env).two_shot_bytes == 1000
    with pytest.raises(ValueError, match="FASTCOMM_IPC_CUDA_WORKSPACE_BYTES='32M'"):
        IpcCudaOptions.from_env({settings.IPC_CUDA_WORKSPACE_BYTES.name: "32M"})
    with pytest.raises(ValueError, match="workspace_bytes=1000 must be a positive multiple"):
        IpcCudaOptions(workspace_bytes=1000)
    with pytest.raises(ValueError, match="two_shot_bytes=0"):
        IpcCudaOptions(two_shot_bytes=0)


@pytest.mark.parametrize("size", [1, 2, 3, 16])
@pytest.mark.parametrize("sizes", [dict(workspace_bytes=32 << 20), SMALL,
                                   dict(workspace_bytes=1024, two_shot_bytes=1 << 20)])
def test_layout_areas_are_aligned_and_disjoint(size, sizes):
    options = IpcCudaOptions(**sizes)
    layout = workspace_layout(options, size)
    areas = [
        (layout.data_offsets[0], layout.buffer_bytes),
        (layout.data_offsets[1], layout.buffer_bytes),
        (layout.result_offset, layout.result_bytes),
        (layout.flags_offset, 8 * flag_area_words(size)),
    ]
    for (start, n), (nxt, _) in zip(areas, areas[1:], strict=False):
        assert start % ipc_plan.ALIGN == 0 and start + n <= nxt
    assert layout.flags_offset + 8 * flag_area_words(size) <= layout.total_bytes
    assert layout.buffer_bytes * 2 == options.workspace_bytes
    # every one-shot round fits the result buffer
    assert layout.result_bytes >= min(options.two_shot_bytes, layout.buffer_bytes)


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("numel", [0, 1, 255, 256, 257, 1000, 4097])
def test_rounds_cover_the_tensor_and_pick_the_schedule_by_size(numel, itemsize):
    options = IpcCudaOptions(**SMALL)
    layout = workspace_layout(options, 2)
    rounds = plan_rounds(numel, itemsize, layout, options.two_shot_bytes)
    assert sum(r.numel for r in rounds) == numel
    assert [r.start for r in rounds] == [sum(r.numel for r in rounds[:i])
                                         for i in range(len(rounds))]
    for r in rounds:
        assert 0 < r.numel * itemsize <= layout.buffer_bytes
        assert r.two_shot == (r.numel * itemsize >= options.two_shot_bytes)


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("size", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("numel", [1, 2, 7, 64, 100, 1001, 4096])
def test_two_shot_chunks_partition_the_round(numel, size, itemsize):
    chunks = [two_shot_chunk(numel, itemsize, size, r) for r in range(size)]
    covered = [i for lo, hi in chunks for i in range(lo, hi)]
    assert covered == list(range(numel))  # each element exactly once, in rank order
    for lo, hi in chunks:
        assert lo <= hi
        if hi > lo:
            assert lo * itemsize % ipc_plan.CHUNK_ALIGN == 0  # aligned starts
    assert max(hi - lo for lo, hi in chunks) <= -(-numel // size) + 16 // itemsize


def test_steps_alternate_buffers_and_number_barriers_across_calls():
    options = IpcCudaOptions(**SMALL)
    layout = workspace_layout(options, 3)
    clock = EpochClock()
    # 700 fp32 = 2800 bytes: rounds of 1024, 1024, 752 bytes, all two-shot
    steps = all_reduce_steps(700, 4, 1, 3, layout, options.two_shot_bytes, clock)
    kinds = [type(s).__name__ for s in steps]
    assert kinds == ["CopyIn", "Barrier", "Reduce", "Barrier", "CopyOut"] * 3
    copy_ins = [s for s in steps if isinstance(s, CopyIn)]
    assert [s.ws_byte for s in copy_ins] == [0, 1024, 0]
    assert [s.tensor_byte for s in copy_ins] == [0, 1024, 2048]
    assert [s.epoch for s in steps if isinstance(s, Barrier)] == [1, 2, 3, 4, 5, 6]
    reduces = [s for s in steps if isinstance(s, Reduce)]
    # rank 1's chunk: ceil(256 / 3) = 86 -> 88 elements (16-byte aligned), from element 88
    assert reduces[0] == Reduce(88 * 4, 88 * 4, 88, True)
    assert reduces[2] == Reduce(64 * 4, 64 * 4, 64, True)  # ceil(188 / 3) = 63 -> 64
    # the next call: a one-shot round, in the other buffer, one barrier
    steps = all_reduce_steps(3, 4, 1, 3, layout, options.two_shot_bytes, clock)
    assert steps == [
        CopyIn(0, 1024, 12),
        Barrier(7),
        Reduce(1024, layout.result_offset, 3, False),
        CopyOut(layout.result_offset, 0, 12),
    ]
    # an empty call meets the peers' call at one barrier (and is compared with it)
    assert all_reduce_steps(0, 4, 1, 3, layout, options.two_shot_bytes, clock) == [Barrier(8)]
    assert (clock.epoch, clock.rounds) == (8, 4)


def test_a_rank_with_an_empty_chunk_still_meets_both_barriers():
    options = IpcCudaOptions(workspace_bytes=2048, two_shot_bytes=4)
    layout = workspace_layout(options, 4)
    steps = all_reduce_steps(2, 4, 3, 4, layout, options.two_shot_bytes, EpochClock())
    assert [type(s).__name__ for s in steps] == ["CopyIn", "Barrier", "Barrier", "CopyOut"]


def test_spin_bound_and_timeout_message():
    assert ipc_plan.max_spins_for(2.0, 1000) == 2001
    assert ipc_plan.max_spins_for(1e30, 10**9) == 1 << 62
    text = ipc_descriptor.timeout_message(0, "all_reduce", 3.25, 3.0, 0b1010, 9)
    assert "rank 0: all_reduce" in text and "3.2 s" in text
    assert "rank(s) [1, 3] never reached barrier 9" in text


def test_call_descriptor_packs_every_field_into_one_odd_word():
    from fastcomm.comm.ipc.descriptor import call_descriptor, describe_call

    base = call_descriptor("all_reduce", 1024, torch.float32, ReduceOp.SUM)
    variants = [
        base,
        call_descriptor("all_reduce", 1000, torch.float32, ReduceOp.SUM),
        call_descriptor("all_reduce", 1024 + (1 << 39), torch.float32, ReduceOp.SUM),
        call_descriptor("all_reduce", 0, torch.float32, ReduceOp.SUM),
        call_descriptor("all_reduce", 1024, torch.float16, ReduceOp.SUM),
        call_descriptor("all_reduce", 1024, torch.bfloat16, ReduceOp.SUM),
        call_descriptor("all_reduce", 1024, torch.float32, ReduceOp.AVG),
        call_descriptor("all_reduce", 1024, torch.float32, ReduceOp.MIN),
        ipc_descriptor.SETUP_DESCRIPTOR,
    ]
    assert len(set(variants)) == len(variants)  # any one field differing is seen
    for d in variants:
        # one compiled barrier for all: odd, 64-bit, positive (see the layout's comment)
        assert d % 2 == 1 and 1 << 56 <= d < 1 << 63, hex(d)
    assert describe_call(base) == "all_reduce(float32, 1024 elements, op sum)"
    assert describe_call(variants[2]) == f"all_reduce(float32, {1024 + (1 << 39)} elements, op sum)"
    assert describe_call(variants[5]) == "all_reduce(bfloat16, 1024 elements, op sum)"
    assert describe_call(variants[7]) == "all_reduce(float32, 1024 elements, op min)"
    assert describe_call(ipc_descriptor.SETUP_DESCRIPTOR) == "barrier()"


def test_disagreement_message_names_both_calls():
    from fastcomm.comm.ipc.descriptor import call_descriptor

    mine = call_descriptor("all_reduce", 1024, torch.float32, ReduceOp.SUM)
    theirs = call_descriptor("all_reduce", 1000, torch.float32, ReduceOp.SUM)
    text = ipc_descriptor.disagreement_message(0, DISAGREE | 0b10, 5, mine, theirs)
    assert text.startswith("rank 0: all_reduce: collective mismatch: rank 0 called all_reduce"
                           "(float32, 1024 elements, op sum) but rank 1 called all_reduce("
                           "float32, 1000 elements, op sum)")
    text = ipc_descriptor.disagreement_message(1, DISAGREE | 0b101, 5, theirs, mine)
    assert "rank 0 called" in text and "(ranks [0, 2] disagree with it)" in text


def test_transport_verdict_on_a_control_block():
    """The transport's own failure methods over a control block as the barrier leaves it (no
    GPU here to build a whole transport: the object holds only what they read)."""
    from fastcomm.comm.ipc.cuda import CudaIpcTransport
    from fastcomm.comm.ipc.descriptor import call_descriptor

    mine = call_descriptor("all_reduce", 8, torch.float32, ReduceOp.SUM)
    theirs = call_descriptor("all_reduce", 8, torch.float32, ReduceOp.MAX)
    words = (ctypes.c_int64 * CONTROL_WORDS)()
    t = CudaIpcTransport.__new__(CudaIpcTransport)
    t.rank, t._words, t._failure, t._closed = 1, words, None, False
    assert t.failure() is None and t._barrier_report() is None
    words[1], words[2], words[3] = DISAGREE | 1, 4, mine  # the peer's word not seen yet
    assert t.failure() is None
    words[4] = theirs
    error = t._barrier_report()
    assert isinstance(error, FastcommError)
    assert "rank 0 called all_reduce(float32, 8 elements, op max)" in str(error)
    assert t.failure() is error  # sticky
    with pytest.raises(CommAbortedError, match="aborted CUDA IPC transport: rank 1: all_reduce: "
                       "collective mismatch: rank 1 called"):
        t._raise_if_unusable("all_reduce")


def test_operands_are_checked_before_anything_is_enqueued():
    check, cpu = ipc_plan.check_all_reduce, torch.device("cpu")
    assert check(torch.ones(2), "avg", cpu) is ReduceOp.AVG
    with pytest.raises(TypeError, match="got torch.float64"):
        check(torch.ones(2, dtype=torch.float64), "sum", cpu)
    with pytest.raises(ValueError, match="runs SUM, AVG, MAX, MIN; got PRODUCT"):
        check(torch.ones(2), ReduceOp.PRODUCT, cpu)
    with pytest.raises(ValueError, match="not contiguous"):
        check(torch.ones(4, 4).t(), "sum", cpu)
    with pytest.raises(ValueError, match="this transport runs on cuda:0"):
        check(torch.ones(2), "sum", torch.device("cuda", 0))
    meta = torch.device("meta")  # a tensor of 2**40 elements without the memory
    with pytest.raises(ValueError, match="1099511627776 elements.*fewer than 2"):
        check(torch.empty(1 << 40, device=meta), "sum", meta)
    assert check(torch.empty((1 << 40) - 1, device=meta), "sum", meta) is ReduceOp.SUM


# ---------------------------------------------------------------------- CPU twin, processes
class _ShmOps:
    """`StepOps` over mapped shared memory: the transport's steps with CPU copies, the barrier
    by the kernel or, over the flag areas as tensors (`areas`), by its torch reference."""

    def __init__(self, bases, rank, layout, control, max_spins, areas=None):
        self.bases, self.rank, self.layout = bases, rank, layout
        self.control, self.max_spins, self.areas = control, max_spins, areas
        self.dtype, self.op = torch.float32, "sum"
        self.descriptor = ipc_descriptor.SETUP_DESCRIPTOR

    def copy(self, dst_addr, src_addr, nbytes):
        ctypes.memmove(dst_addr, src_addr, nbytes)

    def barrier(self, epoch):
        from fastcomm.kernels import peer_signal, peer_signal_reference

        if self.areas is not None:
            peer_signal_reference(self.areas, rank=self.rank, epoch=epoch, control=self.control,
                                  max_spins=self.max_spins, descriptor=self.descriptor)
            return
        peer_signal(self.bases, flags_offset=self.layout.flags_offset, rank=self.rank,
                    epoch=epoch, control=self.control, max_spins=self.max_spins,
                    descriptor=self.descriptor)

    def reduce(self, step):
        own = self.bases[self.rank : self.rank + 1]
        ipc_plan.reduce_step(step, self.bases, own, self.dtype, self.op)


def _twin_state(name: str, impl: str = "kernel") -> dict:
    """Maps every rank's workspace (zero-filled, as cudaMemset leaves the GPU's) into this rank;
    `impl`: the barrier's kernel or its reference."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = IpcCudaOptions(**SMALL)
    layout = workspace_layout(options, world)
    maps = map_peer_files(name, "ipctwin", layout.total_bytes)
    raw = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    bases = torch.tensor([t.data_ptr() for t in raw], dtype=torch.int64)
    control = torch.zeros(CONTROL_WORDS, dtype=torch.int64)
    areas = None
    if impl == "reference":
        flags = slice(layout.flags_offset, layout.flags_offset + 8 * flag_area_words(world))
        areas = [t[flags].view(torch.int64) for t in raw]
    return {
        "maps": maps, "raw": raw, "options": options, "layout": layout, "clock": EpochClock(),
        "ops": _ShmOps(bases, rank, layout, control, max_spins=10**9, areas=areas),
    }


def _twin_open(name: str) -> None:
    STATE["twin"] = _twin_state(name)


def _close_state(twin: dict | None) -> None:
    if twin is not None:
        del twin["raw"], twin["ops"]
        for m in twin["maps"]:
            m.close()


def _twin_close() -> None:
    _close_state(STATE.pop("twin", None))


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _inputs(world, numel, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen).to(dtype) for _ in range(world)]


def twin_all_reduce(dtype_name: str, cases: list) -> list:
    """Runs each (op, numel, seed) through the transport's steps; returns (got, want) bits."""
    from fastcomm.kernels import peer_reduce_reference

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    twin, dtype = STATE["twin"], DTYPES[dtype_name]
    ops = twin["ops"]
    out = []
    for op, numel, seed in cases:
        inputs = _inputs(world, numel, dtype, seed)
        tensor = inputs[rank].clone()
        _twin_call(twin, tensor, op)
        want = torch.empty(numel, dtype=dtype)
        peer_reduce_reference(inputs, [want], op=op)
        as_int = torch.int16 if dtype.itemsize == 2 else torch.int32
        out.append((tensor.view(as_int).tolist(), want.view(as_int).tolist()))
    assert ops.control.tolist() == [0] * CONTROL_WORDS
    return out


def _twin_call(twin: dict, tensor: torch.Tensor, op: str) -> None:
    """One allreduce of `tensor` as the transport runs it (its steps, its call's descriptor)."""
    from fastcomm.comm.ipc.descriptor import call_descriptor
    from fastcomm.comm.ipc.plan import all_reduce_steps, run_steps

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ops = twin["ops"]
    steps = all_reduce_steps(tensor.numel(), tensor.element_size(), rank, world,
                             twin["layout"], twin["options"].two_shot_bytes, twin["clock"])
    ops.dtype, ops.op = tensor.dtype, op
    ops.descriptor = call_descriptor("all_reduce", tensor.numel(), tensor.dtype,
                                     ReduceOp.coerce(op))
    run_steps(steps, ops, tensor.data_ptr(), int(ops.bases[rank]))


def twin_disagree(name: str, impl: str, op: str, numel: int, dtype_name: str):
    """On fresh workspaces: an agreed allreduce, then this rank's (`op`, `numel`, dtype); returns
    the error the transport would raise (its text), the seconds from the call to the verdict,
    the control block and the call's result."""
    rank = int(os.environ["RANK"])
    twin = _twin_state(name, impl)
    try:
        control = twin["ops"].control
        _twin_call(twin, torch.ones(4), "sum")  # the ranks start the next call together
        assert control.tolist() == [0] * CONTROL_WORDS
        start = time.monotonic()
        tensor = torch.ones(numel, dtype=DTYPES[dtype_name])
        _twin_call(twin, tensor, op)
        error = ipc_descriptor.disagreement_error(rank, control)
        elapsed = time.monotonic() - start
        return (None if error is None else str(error)), elapsed, control.tolist()
    finally:
        _close_state(twin)


def twin_without(absent: int, max_spins: int):
    """Every rank but `absent` starts an allreduce; returns the barrier's report."""
    from fastcomm.comm.ipc.plan import all_reduce_steps, run_steps
    from fastcomm.kernels import missing_ranks

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == absent:
        return None
    twin = STATE["twin"]
    ops = twin["ops"]
    ops.max_spins = max_spins
    tensor = torch.ones(300)  # two-shot: two barriers, the second returns at once
    steps = all_reduce_steps(300, 4, rank, world, twin["layout"], twin["options"].two_shot_bytes,
                             twin["clock"])
    start = time.monotonic()
    run_steps(steps, ops, tensor.data_ptr(), int(ops.bases[rank]))
    control = ops.control
    return missing_ranks(int(control[1])), int(control[2]), time.monotonic() - start


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def twin(request):
    with RankPool(request.param, env=INTERPRETED_KERNELS, timeout=240) as p:
        p.run(_twin_open, f"w{request.param}-{os.getpid()}")
        yield p
        p.run(_twin_close)


# 1 element, fewer than the ranks, one-shot not divisible, two-shot not divisible,
# larger than the workspace (several rounds, the last one one-shot for fp32)
SIZES = [1, 2, 61, 101, 570, 0]
OPS = ["sum", "avg", "max", "min"]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_twin_all_reduce_matches_reference(twin, dtype_name):
    cases = [(op, n, 31 * n + i) for i, op in enumerate(OPS) for n in SIZES]
    per_rank = twin.run(twin_all_reduce, dtype_name, cases)
    for k, (op, numel, _) in enumerate(cases):
        what = f"{op} of {numel} x {dtype_name} on {twin.world_size} ranks"
        got0, want = per_rank[0][k]
        for results in per_rank:
            assert results[k][0] == got0, f"{what}: ranks disagree"
        if dtype_name == "bfloat16" and op in ("sum", "avg"):
            # the interpreter truncates fp32 -> bf16: at most 1 ulp toward zero
            assert max((abs(a - b) for a, b in zip(got0, want, strict=True)), default=0) <= 1, (
                what)
        else:
            assert got0 == want, what


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize(
    ("agreed", "other"),
    [
        (("sum", 1024, "float32"), ("sum", 1000, "float32")),
        (("avg", 300, "float32"), ("avg", 300, "float16")),
        (("sum", 64, "bfloat16"), ("max", 64, "bfloat16")),
        (("min", 0, "float16"), ("min", 5, "float16")),  # an empty call against a real one
    ],
    ids=["count", "dtype", "op", "empty"],
)
def test_twin_disagreement_raises_on_every_rank_naming_both(twin, impl, agreed, other,
                                                            unique_name):
    from fastcomm.comm.ipc.descriptor import call_descriptor, describe_call

    world = twin.world_size
    calls = [agreed] * (world - 1) + [other]  # the last rank differs

    def text(call):
        op, numel, dtype_name = call
        return describe_call(call_descriptor("all_reduce", numel, DTYPES[dtype_name],
                                             ReduceOp.coerce(op)))

    results = twin.run(twin_disagree, unique_name, impl,
                       per_rank=[tuple(call) for call in calls])
    for rank, (message, elapsed, control) in enumerate(results):
        assert message is not None, f"rank {rank} saw no disagreement: {control}"
        peer = 0 if rank == world - 1 else world - 1
        assert message.startswith(f"rank {rank}: all_reduce: collective mismatch"), message
        assert f"rank {rank} called {text(calls[rank])}" in message, message
        assert f"rank {peer} called {text(calls[peer])}" in message, message
        # at the call's first barrier (epoch 2: no setup barrier, one agreed call before),
        # within a second where the spin bound is minutes: the comparison ended the wait
        # (0.09 s at most measured on 3 ranks in the interpreter)
        assert control[2] == 2, control
        assert elapsed < 1.0, (rank, elapsed)


def test_twin_rank_that_never_arrives_is_named(twin):
    # last check on this pool: the ranks' epochs diverge from here
    absent = twin.world_size - 1
    results = twin.run(twin_without, absent, 300)
    for rank, result in enumerate(results[:absent]):
        missing, epoch, _ = result
        assert missing == [absent], f"rank {rank}: {result}"
        assert epoch == results[0][1]


# ---------------------------------------------------------------------- GPU
GPU_SMALL = dict(workspace_bytes=64 << 10, two_shot_bytes=4 << 10)


def _transport(name: str, timeout: float = 60.0, **sizes):
    from fastcomm.comm.ipc.cuda import CudaIpcTransport

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = rank_store().prefixed(name, rank=rank)
    options = IpcCudaOptions(**sizes) if sizes else None
    return CudaIpcTransport(store, rank, world, timeout, 0, options=options)


def gpu_all_reduce(name: str, dtype_name: str, cases: list, sizes: dict) -> list:
    """Each (op, numel, seed) through a transport on GPU 0, checked against the reference here;
    returns per case the error text (or None) and a digest of the result's bits."""
    import hashlib

    from fastcomm.kernels import peer_reduce_reference

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dtype = DTYPES[dtype_name]
    as_int = torch.int16 if dtype.itemsize == 2 else torch.int32
    transport = _transport(name, **sizes)
    out = []
    try:
        for op, numel, seed in cases:
            inputs = _inputs(world, numel, dtype, seed)
            tensor = inputs[rank].cuda()
            transport.all_reduce(tensor, op).wait()
            got = tensor.cpu()
            want = torch.empty(numel, dtype=dtype)
            peer_reduce_reference(inputs, [want], op=op)
            error = None
            try:
                # the compiled kernel and the reference round fp32 -> low precision alike,
                # but the compiler may contract the fp32 sums differently (FMA)
                torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype_name], atol=1e-6)
            except AssertionError as exc:
                error = str(exc)[:500]
            digest = hashlib.sha1(got.view(as_int).numpy().tobytes()).hexdigest()
            out.append((error, digest))
    finally:
        transport.close()
    return out


def _next_call_refused(transport) -> bool:
    """Whether a transport that failed refuses its next allreduce (``CommAbortedError``)."""
    try:
        transport.all_reduce(torch.ones(4, device="cuda"), "sum")
    except CommAbortedError:
        return True
    return False


def gpu_missing_rank(name: str, timeout: float):
    from fastcomm.comm.errors import CommTimeoutError

    rank = int(os.environ["RANK"])
    store = rank_store().prefixed(name, rank=rank)
    # CUDA up on both ranks first: the short timeout also bounds the transport's setup
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    store.barrier("cuda-up", int(os.environ["WORLD_SIZE"]), 60)
    transport = _transport(name, timeout=timeout, **GPU_SMALL)
    try:
        if rank == 1:
            store.wait(["failed"], 120)  # close only once rank 0 has given up
            return None
        start = time.monotonic()
        work = transport.all_reduce(torch.ones(1000, device="cuda"), "sum")
        try:
            work.synchronize()
        except CommTimeoutError as exc:
            elapsed, text = time.monotonic() - start, str(exc)
        else:
            raise AssertionError("an allreduce without its peer completed")
        refused = _next_call_refused(transport)
        store.set("failed", b"1")
        return elapsed, text, refused
    finally:
        transport.close()


def gpu_disagree(name: str, numel: int):
    """An agreed allreduce, then one of `numel` elements (this rank's); returns the error's
    text, the seconds to it, and whether the next call was refused."""
    rank = int(os.environ["RANK"])
    transport = _transport(name, **GPU_SMALL)
    try:
        transport.all_reduce(torch.ones(8, device="cuda"), "sum").synchronize()
        start = time.monotonic()
        work = transport.all_reduce(torch.ones(numel, device="cuda"), "sum")
        try:
            work.synchronize()
        except FastcommError as exc:
            elapsed, text = time.monotonic() - start, str(exc)
        else:
            raise AssertionError(f"rank {rank}: an allreduce its peer called otherwise completed")
        refused = _next_call_refused(transport)
        return text, elapsed, refused
    finally:
        transport.close()


def _registered(ptr: int) -> bool:
    """Whether the CUDA driver still knows `ptr` (allocated or opened, not yet freed)."""
    from cupy.cuda import runtime

    try:
        return runtime.pointerGetAttributes(ptr).type != 0  # 0: cudaMemoryTypeUnregistered
    except runtime.CUDARuntimeError:  # an address the driver never knew
        return False


def gpu_leak_check(name: str) -> tuple[list, int, int]:
    """Three transports made and closed: their own and opened peer addresses, whether each is
    still registered afterwards, and torch's allocated bytes before and after. Per process:
    the GPU's free memory moves with every other test on it."""
    world = int(os.environ["WORLD_SIZE"])
    store = rank_store()
    warm = _transport(f"{name}/warm")  # kernels loaded before the first measurement
    warm.all_reduce(torch.ones(1 << 20, device="cuda"), "sum").synchronize()
    warm.close()
    torch.cuda.synchronize()
    store.barrier(f"{name}/before", world, 60)
    allocated = torch.cuda.memory_allocated()
    pointers = []
    for i in range(3):
        transport = _transport(f"{name}/{i}")
        transport.all_reduce(torch.ones(1 << 20, device="cuda"), "sum").synchronize()
        made = [transport._base, *transport._opened]
        assert all(_registered(p) for p in made), made
        transport.close()
        # looked at before the next transport may get the same addresses again
        pointers += [(p, _registered(p)) for p in made]
    store.barrier(f"{name}/after", world, 60)
    torch.cuda.synchronize()
    return pointers, allocated, torch.cuda.memory_allocated()


TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("sizes", [GPU_SMALL, {}], ids=["small-workspace", "default"])
def test_gpu_two_ranks_sharing_gpu0_match_reference(gpu_pool, dtype_name, sizes, unique_name):
    # 1 element, odd, one-shot/two-shot crossover, several rounds of a 64 KiB workspace
    numels = [1, 3, 1001, 4097, 70_001] + ([9 << 20] if not sizes else [])
    cases = [(op, n, 7 * n + i) for i, op in enumerate(OPS) for n in numels]
    per_rank = gpu_pool.run(gpu_all_reduce, unique_name, dtype_name, cases, sizes)
    for k, (op, numel, _) in enumerate(cases):
        what = f"{op} of {numel} x {dtype_name}"
        for rank, results in enumerate(per_rank):
            assert results[k][0] is None, f"{what} on rank {rank}: {results[k][0]}"
        assert per_rank[0][k][1] == per_rank[1][k][1], f"{what}: ranks disagree"


@pytest.mark.gpu
def test_gpu_rank_that_never_arrives_times_out(gpu_pool, unique_name):
    timeout = 5.0
    results = gpu_pool.run(gpu_missing_rank, unique_name, timeout)
    elapsed, text, refused = results[0]
    assert timeout <= elapsed < timeout + 10, text
    assert "all_reduce" in text and "rank(s) [1]" in text, text
    assert refused, "an aborted transport accepted another collective"


@pytest.mark.gpu
def test_gpu_disagreement_raises_on_both_ranks(gpu_pool, unique_name):
    results = gpu_pool.run(gpu_disagree, unique_name, per_rank=[(1024,), (1000,)])
    for rank, (text, elapsed, refused) in enumerate(results):
        assert text.startswith(f"rank {rank}: all_reduce: collective mismatch"), text
        assert "rank 0 called all_reduce(float32, 1024 elements, op sum)" in text, text
        assert "rank 1 called all_reduce(float32, 1000 elements, op sum)" in text, text
        assert elapsed < 10, (rank, elapsed)  # the timeout is 60 s: not a timeout
        assert refused, f"rank {rank}: an aborted transport accepted another collective"


@pytest.mark.gpu
def test_gpu_transports_leave_no_memory_behind(gpu_pool, unique_name):
    for rank, (pointers, before, after) in enumerate(gpu_pool.run(gpu_leak_check, unique_name)):
        # each transport: its own workspace and the peer's opened one, both gone after close
        assert len(pointers) == 3 * 2, (rank, pointers)
        assert not [p for p, registered in pointers if registered], (rank, pointers)
        assert after == before, (rank, before, after)


# ---------------------------------------------------------------------- the data step alone
@needs_interpreter  # the kernel follows addresses of CPU tensors, in this process
@pytest.mark.parametrize("to_all", [False, True])
def test_reduce_step_reads_and_writes_at_the_offsets(monkeypatch, to_all):
    monkeypatch.setenv("FASTCOMM_KERNELS", "triton")
    # three "workspaces" of 64 floats; reduce elements [8, 13) of each into [40, 45)
    spaces = [torch.arange(64, dtype=torch.float32) * (r + 1) for r in range(3)]
    bases = torch.tensor([s.data_ptr() for s in spaces], dtype=torch.int64)
    before = [s.clone() for s in spaces]
    ipc_plan.reduce_step(Reduce(8 * 4, 40 * 4, 5, to_all), bases, bases[1:2], torch.float32,
                         "avg")
    want = torch.arange(8, 13, dtype=torch.float32) * 2  # (1 + 2 + 3) / 3
    for r, s in enumerate(spaces):
        written = to_all or r == 1
        assert torch.equal(s[40:45], want if written else before[r][40:45])
        s[40:45] = before[r][40:45]
        assert torch.equal(s, before[r])  # nothing else touched


def test_reduce_table_arguments_are_checked(monkeypatch):
    from fastcomm.kernels import peer_reduce_table

    monkeypatch.setenv("FASTCOMM_KERNELS", "triton")
    table = torch.zeros(2, dtype=torch.int64)
    kw = dict(numel=4, dtype=torch.float16)
    with pytest.raises(ValueError, match="src_offset=3 must be a non-negative multiple"):
        peer_reduce_table(table, table, src_offset=3, **kw)
    with pytest.raises(TypeError, match="dtype torch.int32 is not supported"):
        peer_reduce_table(table, table, numel=4, dtype=torch.int32)
    with pytest.raises(TypeError, match="dst_table has dtype torch.int32"):
        peer_reduce_table(table, table.int(), **kw)
    with pytest.raises(ValueError, match="src_table has 17 entries"):
        peer_reduce_table(torch.zeros(17, dtype=torch.int64), table, **kw)
    with pytest.raises(ValueError, match="op='prod'"):
        peer_reduce_table(table, table, op="prod", **kw)
    with pytest.raises(ValueError, match="max takes scale=1.0"):
        peer_reduce_table(table, table, op="max", scale=2.0, **kw)
    peer_reduce_table(table, table, numel=0, dtype=torch.float32)  # nothing to follow
    monkeypatch.setenv("FASTCOMM_KERNELS", "torch")
    with pytest.raises(RuntimeError, match="no torch path"):
        peer_reduce_table(table, table, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
def test_transport_refuses_to_start_without_cuda():
    from fastcomm.comm.ipc.cuda import CudaIpcTransport

    with pytest.raises(ValueError, match="spans 1..16 ranks, got 17"):
        CudaIpcTransport(None, 0, 17, 5.0, 0)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        CudaIpcTransport(None, 0, 2, 5.0, 0)
