"""The shm communicator on 2, 3 and 4 real ranks: every op x dtype x size against torch.

A tiny segment (4 KiB slots and mailboxes) makes the edge cases cheap: one element, sizes not
divisible by the world size, both sides of the one-shot/two-step crossover, and tensors larger
than the whole segment (which stream through it chunk by chunk). Inputs are small integers, so
sums, products and extrema are exact in every dtype: comparisons use ``atol=0``. The generic
collectives/errors suites (``test_collectives.py``, ``test_errors.py``) also run on ``shm``.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from fastcomm import ReduceOp
from fastcomm.comm import SUPPORTED_DTYPES, ShmCommunicator, ShmOptions
from fastcomm.comm.shm import core
from tests.comm.test_collectives import make_input, reduce_reference
from tests.harness import STATE, pool_fixture, rank_store

SMALL = dict(slot_bytes=4096, one_shot_max=1024, mbox_bytes=4096)


def small_comm(timeout: float = 30.0, compiled: bool = True) -> ShmCommunicator:
    """A cached shm communicator with a 4 KiB-slot segment over all ranks of the pool
    (``compiled=False``: small all-reduces take the Python path)."""
    key = "shm-small" if compiled else "shm-small-python"
    comm = STATE.get(key)
    if comm is None or comm.closed:
        # one torch thread per rank: 4 ranks x 2 OpenMP threads spinning on 2 cores crawl
        torch.set_num_threads(1)
        STATE["gen"] = STATE.get("gen", 0) + 1
        rank = int(os.environ["RANK"])
        comm = STATE[key] = ShmCommunicator(
            rank_store().prefixed(f"{key}-{STATE['gen']}", rank=rank),
            rank,
            int(os.environ["WORLD_SIZE"]),
            timeout,
            options=ShmOptions(**SMALL, compiled=compiled),
        )
    return comm


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-exact equality (``torch.testing`` would import sympy: seconds per rank)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
    if not torch.equal(actual, expected):
        bad = (actual != expected).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"mismatch at {bad}: got {actual.flatten()[:8]}, "
                             f"expected {expected.flatten()[:8]}")


def sizes(comm: ShmCommunicator, dtype: torch.dtype) -> list[int]:
    """1 element, a prime, just past the one-shot limit, and more than the whole segment."""
    esize = torch.empty(0, dtype=dtype).element_size()
    total = comm._seg.layout.total
    return [1, 7, SMALL["one_shot_max"] // esize + 3, total // esize + 13]


# ------------------------------------------------------------------ checks (run on every rank)
def check_every_op(dtype):
    comm = small_comm()
    n, rank = comm.size, comm.rank
    all_ops = list(ReduceOp)
    for salt, numel in enumerate(sizes(comm, dtype)):
        inputs = [make_input(r, (numel,), dtype, salt) for r in range(n)]
        ops, srcs = all_ops, range(n)
        if numel * inputs[0].element_size() > comm._seg.layout.total:
            # larger than the segment: SUM, AVG and one more op per dtype (all ops across the
            # dtypes), one source, to keep the many-chunk streaming cheap
            extra = all_ops[2 + SUPPORTED_DTYPES.index(dtype) % 3]
            ops, srcs = [ReduceOp.SUM, ReduceOp.AVG, extra], [SUPPORTED_DTYPES.index(dtype) % n]
        for op in ops:
            t = inputs[rank].clone()
            comm.all_reduce(t, op=op)
            exact(t, reduce_reference(inputs, op))
            root = (salt + all_ops.index(op)) % n
            t = inputs[rank].clone()
            comm.reduce(t, root, op=op)
            exact(t, reduce_reference(inputs, op) if rank == root else inputs[rank])
        for src in srcs:
            t = make_input(rank, (numel,), dtype, salt)
            comm.broadcast(t, src=src)
            exact(t, inputs[src])
        out = torch.full((n, numel), 9, dtype=dtype)
        comm.all_gather(out, inputs[rank])
        exact(out, torch.stack(inputs))
        stacked = [make_input(r, (n, numel), dtype, salt) for r in range(n)]
        for op in ops:
            out = torch.full((numel,), 9, dtype=dtype)
            comm.reduce_scatter(out, stacked[rank], op=op)
            exact(out, reduce_reference(stacked, op)[rank])
        out = torch.full((n, numel), 9, dtype=dtype)
        comm.all_to_all(out, stacked[rank])
        exact(out, torch.stack([stacked[r][rank] for r in range(n)]))
        right, left = (rank + 1) % n, (rank - 1) % n
        got = torch.empty(numel, dtype=dtype)
        send = comm.send(inputs[rank], right, async_op=True)
        comm.recv(got, left)
        send.wait(timeout=30)
        exact(got, inputs[left])
    comm.barrier()
    return comm._flags.seq


def check_results_identical_across_ranks():
    """Float sums round; every rank must still hold the very same bits (rank-order reduction)."""
    comm = small_comm()
    gen = torch.Generator().manual_seed(comm.rank)
    out = []
    for numel in (5, 300, 5000):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            t = torch.randn(numel, generator=gen).to(dtype)
            comm.all_reduce(t, op=ReduceOp.AVG)
            out.append(t.view(torch.uint8).clone() if dtype != torch.float32 else t.clone())
    return out


def fold(inputs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The reduction as torch computes it in rank order, one rounding per term (the shm
    schedules' order): the reference for non-integer floats, where the order shows."""
    fn = torch.mul if op is ReduceOp.PRODUCT else torch.add
    out = inputs[0].clone()
    for term in inputs[1:]:
        fn(out, term, out=out)
    if op is ReduceOp.AVG:  # integers truncate toward zero, as NCCL's ncclAvg
        out.div_(len(inputs), rounding_mode=None if out.is_floating_point() else "trunc")
    return out


def check_small_path_matches_torch_bits(compiled: bool):
    """Small all-reduces (in the compiled core, or NumPy-reduced, where the dtype and op allow)
    give torch's very bits: random floats that round, every shape and offset, a buffer reused
    under another dtype."""
    comm = small_comm(compiled=compiled)
    n, rank = comm.size, comm.rank
    checked = 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int8):
        esize = torch.empty((), dtype=dtype).element_size()
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MAX):
            for shape in ((1,), (7,), (3, 5), (SMALL["one_shot_max"] // esize,)):
                gens = [torch.Generator().manual_seed(100 * r + len(shape)) for r in range(n)]
                if dtype == torch.int8:  # large enough to wrap around
                    inputs = [torch.randint(-128, 128, shape, generator=g, dtype=dtype)
                              for g in gens]
                else:
                    inputs = [torch.randn(shape, generator=g).to(dtype) for g in gens]
                expected = reduce_reference(inputs, op) if op is ReduceOp.MAX else fold(
                    inputs, op)
                for _ in range(2):  # the planned path, then the cached one
                    t = inputs[rank].clone()
                    version = t._version
                    comm.all_reduce(t, op=op)
                    exact(t.view(torch.uint8), expected.view(torch.uint8))
                    assert t._version > version, "an in-place op must bump the version"
                    checked += 1
    # a tensor at an offset into a larger buffer: the bytes around it are not touched
    base = torch.arange(40, dtype=torch.float32) + rank
    t = base[3:35]
    comm.all_reduce(t)
    exact(base[:3], torch.arange(3, dtype=torch.float32) + rank)
    exact(base[35:], torch.arange(35, 40, dtype=torch.float32) + rank)
    exact(t, sum(torch.arange(3, 35, dtype=torch.float32) + r for r in range(n)))
    # the same memory as int32, then as float32: plans are per dtype, not per address
    buf = torch.full((16,), rank + 1, dtype=torch.int32)
    comm.all_reduce(buf)
    exact(buf, torch.full((16,), n * (n + 1) // 2, dtype=torch.int32))
    as_float = buf.view(torch.float32)
    as_float.fill_(0.5 * (rank + 1))
    comm.all_reduce(as_float)
    exact(as_float, torch.full((16,), 0.5 * n * (n + 1) / 2))
    plans = comm._schedules.reductions
    if compiled:
        assert any(plans.core_plans.values()), "the compiled path was never taken"
        assert not any(plans.numpy_plans.values()), "NumPy ran beside the compiled core"
    else:
        assert any(plans.numpy_plans.values()), "the NumPy path was never taken"
    # overflow gives inf quietly, as in torch (NumPy would warn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        huge = torch.full((8,), 3e38)
        comm.all_reduce(huge)
    exact(huge, torch.full((8,), float("inf")))
    assert not caught, [str(w.message) for w in caught]
    return checked


def check_async_many_in_flight():
    comm = small_comm()
    n, rank = comm.size, comm.rank
    done: list[int] = []
    tensors, works = [], []
    for i in range(40):
        numel = [1, 100, 3000, 20000][i % 4]
        tensors.append(torch.full((numel,), float(rank + i)))
        works.append(comm.all_reduce(tensors[-1], async_op=True))
        works[-1].get_future().add_done_callback(lambda _f, i=i: done.append(i))
    gathered = torch.empty(n, 3)
    last = comm.all_gather(gathered, torch.full((3,), float(rank)), async_op=True)
    sync_t = torch.ones(5)
    comm.all_reduce(sync_t)  # queued behind the 41 pending works, yet returns in order
    exact(sync_t, torch.full((5,), float(n)))
    last.wait(timeout=30)
    for i, (t, w) in enumerate(zip(tensors, works, strict=True)):
        assert w.wait(timeout=30) and w.get_future().value() is t
        exact(t, torch.full_like(t, float(sum(range(n)) + n * i)))
    exact(gathered, torch.arange(float(n)).repeat_interleave(3).view(n, 3))
    assert done == sorted(done) and len(done) == 40, done


def check_bad_input_writes_nothing():
    comm = small_comm()
    before = comm._flags.seq
    for call, exc in [
        (lambda: comm.reduce(torch.ones(2), root=comm.size), ValueError),
        (lambda: comm.reduce(torch.ones(2), root=0, op="mean"), ValueError),
        (lambda: comm.all_reduce(torch.ones(2, dtype=torch.complex64)), TypeError),
        (lambda: comm.all_gather(torch.empty(3), torch.ones(2)), ValueError),
        (lambda: comm.all_reduce(torch.ones(4, 4).t()), ValueError),
    ]:
        with pytest.raises(exc) as info:
            call()
        assert comm._flags.seq == before, f"seq moved after {info.value}"
    t = torch.ones(3)
    comm.all_reduce(t)  # still in step with the peers
    exact(t, torch.full((3,), float(comm.size)))
    return str(info.value)


def check_mismatch_detected(name):
    from tests.harness import fresh_comm

    comm = fresh_comm("shm", name, timeout=20.0)
    t = torch.ones(10 if comm.rank == 0 else 20)
    try:
        comm.all_reduce(t)
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        message = str(exc)
    else:
        raise AssertionError("mismatched all_reduce sizes were not detected")
    comm.close()
    return message


def check_compiled_core_resumes_after_python_waits(name):
    """A peer later than the core's spin: the core hands the wait to Python and resumes.

    Ranks alternate between the compiled core and the Python path (they share the protocol),
    so every pairing of the two meets. Returns the statuses this rank's core gave up with.
    """
    import time

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    comm = ShmCommunicator(
        rank_store().prefixed(name, rank=rank), rank, n, 30.0,
        options=ShmOptions(**SMALL, compiled=rank % 2 == 0),
    )
    sched, seen = comm._schedules, []
    if sched.compiled is not None:  # record the waits the core gave up on
        for method in ("_all_reduce", "_broadcast"):
            call = getattr(sched.compiled, method)
            setattr(sched.compiled, method, lambda *a, call=call: (
                lambda status: (status and seen.append(status), status)[1])(call(*a)))
    for late in range(n):  # each rank in turn arrives 50 ms late: far beyond any spin
        if rank == late:
            time.sleep(0.05)
        t = torch.full((9,), float(rank + 1))
        comm.all_reduce(t)
        exact(t, torch.full((9,), n * (n + 1) / 2))
    # rank 0 leaves the last round of a two-round broadcast at once (a source waits for its
    # peers in the first round only) and starts an all-reduce while the others, late, have not
    # yet entered that round: it must wait to enter, not rewrite the half they still read
    numel = SMALL["slot_bytes"] // 4 + 5
    b = torch.full((numel,), 7.0) if rank == 0 else torch.zeros(numel)
    if rank != 0:
        check = sched.rounds.check
        sched.rounds.check = lambda *a: (time.sleep(0.05), check(*a))[1]
    comm.broadcast(b, 0)
    if rank != 0:
        del sched.rounds.check
    exact(b, torch.full((numel,), 7.0))
    t = torch.arange(6, dtype=torch.float64) * (rank + 1)
    comm.all_reduce(t, op=ReduceOp.AVG)
    exact(t, torch.arange(6, dtype=torch.float64) * (n + 1) / 2)
    comm.close()
    return sorted(set(seen))


def check_fenced_path(name):
    """The weak-memory-order path (``membarrier`` fences), forced on this x86 machine."""
    from tests.harness import fresh_comm

    os.environ["FASTCOMM_SHM_FENCE"] = "1"
    try:
        comm = fresh_comm("shm", name)
    finally:
        del os.environ["FASTCOMM_SHM_FENCE"]
    inputs = [make_input(r, (300_001,), torch.float32, 3) for r in range(comm.size)]
    t = inputs[comm.rank].clone()
    comm.all_reduce(t)  # two-step: both publishes and waits fenced
    exact(t, reduce_reference(inputs, ReduceOp.SUM))
    small = torch.ones(3)
    comm.all_reduce(small)
    exact(small, torch.full((3,), float(comm.size)))
    fenced = comm._flags.fenced
    comm.close()
    return fenced


def check_p2p_never_blocks_collectives(name):
    """Sends larger than the mailboxes, in both directions at once and around a collective:
    each peer and direction has its own lane, as Gloo's transport has."""
    from tests.harness import fresh_comm

    comm = fresh_comm("shm", name)
    rank, n = comm.rank, comm.size
    peer = rank ^ 1
    numel = 1_000_003  # 4 MB: many 256 KiB mailbox chunks
    if peer < n:
        got = torch.empty(numel)
        work = comm.send(torch.full((numel,), float(rank)), peer, async_op=True)
        comm.recv(got, peer)  # both ranks send first: only lanes per direction avoid deadlock
        work.wait(timeout=30)
        exact(got, torch.full((numel,), float(peer)))
    if rank == 0:
        work = comm.send(torch.arange(numel, dtype=torch.float32), 1, async_op=True)
        t = torch.ones(4)
        comm.all_reduce(t)  # rank 1 reaches it before its recv: the send must not block it
        work.wait(timeout=30)
    elif rank == 1:
        t = torch.ones(4)
        comm.all_reduce(t)
        got = torch.empty(numel)
        comm.recv(got, 0)
        exact(got, torch.arange(numel, dtype=torch.float32))
    else:
        t = torch.ones(4)
        comm.all_reduce(t)
    exact(t, torch.full((4,), float(n)))
    comm.close()


def check_ddp_uses_shm_world():
    """``fastcomm.init()`` picks shm on one host, and ``fastcomm.ddp.DDP`` reduces over it."""
    import fastcomm
    from fastcomm.ddp import DDP

    torch.set_num_threads(1)
    comm = fastcomm.init(timeout=30)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        reference = [p.detach().clone() for p in model.parameters()]
        ddp = DDP(model)
        xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(r))
              for r in range(comm.size)]
        ddp(xs[comm.rank]).square().sum().backward()
        # expected: the mean over ranks of each rank's local gradient
        local = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        with torch.no_grad():
            for p, r in zip(local.parameters(), reference, strict=True):
                p.copy_(r)
        for x in xs:
            local(x).square().sum().backward()
        for p, q in zip(model.parameters(), local.parameters(), strict=True):
            # float sums in another order: equal to rounding
            assert torch.allclose(p.grad, q.grad / comm.size, rtol=1e-5, atol=1e-6)
        return comm.backend, ddp.comm.backend
    finally:
        fastcomm.shutdown()


# ------------------------------------------------------------------ pytest side
# CPU tensors only; GPUs hidden so that init() picks shm on any machine, as checked below
# (NCCL selection is tested in test_init.py with faked devices)
pool = pool_fixture([2, 3, 4], env={"CUDA_VISIBLE_DEVICES": ""}, timeout=90)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_every_op_dtype_size(pool, dtype):
    seqs = pool.run(check_every_op, dtype)
    assert len(set(seqs)) == 1 and seqs[0] > 0, seqs  # every rank published the same steps


def test_float_results_bit_identical_on_every_rank(pool):
    results = pool.run(check_results_identical_across_ranks)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_small_all_reduce_gives_torch_bits(pool, compiled):
    if compiled and not core.BUILT:
        pytest.skip("the compiled core was not built (no C compiler at install)")
    results = pool.run(check_small_path_matches_torch_bits, compiled)
    assert results == [4 * 4 * 4 * 2] * pool.world_size


def test_compiled_core_resumes_after_python_waits(pool, unique_name):
    if not core.BUILT:
        pytest.skip("the compiled core was not built (no C compiler at install)")
    seen = pool.run(check_compiled_core_resumes_after_python_waits, unique_name)
    # rank 0 (compiled) waited to enter once and, when others were late, for the exchange
    assert seen[0] == [1, 2], seen
    if pool.world_size > 2:  # rank 2 (compiled) waited for the exchange when others were late
        assert 2 in seen[2], seen


def test_async_ops_complete_in_issue_order(pool):
    pool.run(check_async_many_in_flight)


def test_bad_input_rejected_before_anything_is_written(pool):
    for message in pool.run(check_bad_input_writes_nothing):
        assert "contiguous" in message


def test_mismatched_collectives_raise(pool, unique_name):
    for message in pool.run(check_mismatch_detected, unique_name):
        assert "collective mismatch" in message and "all_reduce" in message, message


def test_route_sends_cuda_tensors_to_the_gloo_fallback_and_says_so(caplog):
    """The per-device decision, on any machine (the CUDA collectives themselves are in
    test_errors' GPU test): taken from the communicators' capabilities."""
    from fastcomm.comm import Store, new_communicator

    store = Store(is_server=True, timeout=30, rank=0)
    shm = new_communicator("shm", store=store.prefixed("shm"), rank=0, size=1, timeout=30)
    bare = ShmCommunicator(store.prefixed("bare"), 0, 1, 30)
    hier = new_communicator("hier", store=store.prefixed("hier"), rank=0, size=1, timeout=30)
    try:
        with caplog.at_level("INFO", logger="fastcomm"):
            assert shm.route("cpu") is shm and hier.route(torch.device("cpu")) is hier
            assert shm.route("cuda") is shm.fallback and shm.fallback.backend == "gloo"
            assert shm.route("cuda:0") is shm.fallback  # said once per communicator
            assert hier.route("cuda") is hier.flat and hier.flat.backend == "gloo"
        said = [r.getMessage() for r in caplog.records if r.name == "fastcomm"]
        assert len(said) == 2, said
        assert "cuda tensors go through its gloo fallback" in said[0], said
        assert "hier communicator" in said[1] and "gloo fallback" in said[1], said
        with pytest.raises(ValueError, match="no route for tensors on cuda.*no fallback"):
            bare.route("cuda")
        with pytest.raises(ValueError, match="no route for tensors on meta"):
            shm.route("meta")
        with pytest.raises(ValueError, match="no route for tensors on meta"):
            hier.route("meta")
    finally:
        for comm in (shm, bare, hier):
            comm.close()


def test_options_are_validated():
    with pytest.raises(ValueError, match="slot_bytes.*4096.*1000"):
        ShmOptions(slot_bytes=1000)
    with pytest.raises(ValueError, match="one_shot_max"):
        ShmOptions(one_shot_max=-1)
    with pytest.raises(ValueError, match="spin_us"):
        ShmOptions(spin_us=-5.0)
    with pytest.raises(ValueError, match="mbox_bytes"):
        ShmOptions(mbox_bytes=100)


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("FASTCOMM_SHM_SLOT_BYTES", "abc", "a positive multiple of 4096"),
        ("FASTCOMM_SHM_SLOT_BYTES", "1000", "a positive multiple of 4096"),
        ("FASTCOMM_SHM_ONE_SHOT_BYTES", "-1", "an integer >= 0"),
        ("FASTCOMM_SHM_SPIN_US", "nan", "a number in [0, 1e6]"),
        ("FASTCOMM_SHM_YIELD_US", "inf", "a number in [0, 1e7]"),
        ("FASTCOMM_SHM_COMPILED", "yes", "0 or 1"),
        ("FASTCOMM_SHM_FENCE", "on", "0 or 1"),
    ],
)
def test_a_bad_environment_value_names_the_variable_and_its_range(
    monkeypatch, name, value, allowed
):
    from fastcomm.comm.shm import flags

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        ShmOptions()
        flags.fences_needed()
    assert f"{name}={value!r}" in str(info.value) and allowed in str(info.value), info.value


def test_fenced_path_for_weakly_ordered_machines(pool, unique_name):
    assert pool.run(check_fenced_path, unique_name) == [True] * pool.world_size


def test_send_recv_lanes_never_deadlock(pool, unique_name):
    pool.run(check_p2p_never_blocks_collectives, unique_name)


def test_init_picks_shm_and_ddp_reduces_over_it(pool):
    assert pool.run(check_ddp_uses_shm_world) == [("shm", "shm")] * pool.world_size


@pytest.mark.parametrize("spin_us", [None, 7.0], ids=["automatic", "explicit"])
def test_automatic_spin_stops_while_the_host_is_crowded(monkeypatch, spin_us):
    """The automatic spin yields at once when the load average says peers wait for a core;
    a spin set explicitly is kept whatever the load."""
    from fastcomm.comm.shm import flags as _shm_sync
    from fastcomm.comm.store import Store

    cores = len(os.sched_getaffinity(0))
    load = [0.0]
    monkeypatch.setattr(_shm_sync.os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    store = Store(is_server=True, timeout=10)
    comm = ShmCommunicator(store.prefixed("spin", rank=0), 0, 1, 10.0,
                           options=ShmOptions(spin_us=spin_us))
    try:
        sync = comm._flags
        spin = 20_000 if spin_us is None else 7_000
        budgets = []
        for value, sample_due in [(0.5 * cores, True), (2.0 * cores, False),
                                  (2.0 * cores, True), (1.0 * cores, True)]:
            load[0] = value
            if sample_due:
                sync._crowd_next = 0.0
            budgets.append(sync.spin_budget_ns())
        if spin_us is None:
            # sampled at most once a second: the crowd is seen at the next sample, then gone
            assert budgets == [spin, spin, 0, spin]
        else:
            assert budgets == [spin] * 4
        t = torch.arange(4.0)
        comm.all_reduce(t)  # the waits still work with either budget
        assert torch.equal(t, torch.arange(4.0))
    finally:
        comm.close()
