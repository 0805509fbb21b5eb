"""Every dtype and reduce op of ``all_reduce``/``reduce``, several tensors in one call, and
autograd-tracked tensors on the ``fastcomm`` backend, against Gloo on 2 and 3 CPU ranks.

Each rank makes the default group of the fastcomm backend and a Gloo group beside it
(``new_group(backend="gloo")``) and issues the same call on both. Where Gloo computes a result,
the fastcomm group's is the same, bit for bit (small integer-valued terms: no rounding); where
Gloo refuses the pair, the fastcomm group either refuses it too (the bitwise ops of a floating
tensor, ``AVG`` of ``bool``, a dtype torch cannot reduce) or, for a pair the communicator's
contract adds (``int16``, the unsigned dtypes with the ops torch computes for them, integer
``AVG`` truncating as NCCL's), gives torch's own reduction of the ranks' terms in rank order.
Every fastcomm call is counted: none reaches the Gloo group beside the communicator. Also
``fastcomm.monitored_barrier`` (torch's refuses the backend by name), with ranks that arrive
late.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fastcomm  # noqa: F401 - registers the backend
from fastcomm.comm.c10d import FastcommProcessGroup
from fastcomm.comm.types import BitwiseOp, PremulSum, ReduceOp
from tests.harness import (
    STATE,
    env_rank,
    env_world,
    poll_keys,
    pool_fixture,
    rank_comm,
    rank_store,
)

pytestmark = pytest.mark.timeout(300)

DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
    torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.float8_e4m3fn,
)
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
# the pairs Gloo refuses that the contract reduces (compared with torch's reduction instead)
_EXTENDED = {torch.int16, torch.uint16, torch.uint32, torch.uint64}
_FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_TORCH_FNS = {
    "SUM": torch.add, "AVG": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum,
    "MAX": torch.maximum, "BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
    "BXOR": torch.bitwise_xor,
}


def _groups():
    """``(fastcomm group, gloo group)`` of this rank, made once per pool."""
    if "dtype_groups" not in STATE:
        store = dist.PrefixStore("c10d-dtypes", rank_store().torch_store)
        dist.init_process_group("fastcomm", store=store, rank=env_rank(), world_size=env_world(),
                                timeout=timedelta(seconds=60))
        STATE["dtype_groups"] = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return STATE["dtype_groups"]


@contextmanager
def _no_gloo(group: FastcommProcessGroup):
    """Counts the calls the fastcomm group hands to its Gloo group (and the agreements that
    would precede them) while inside; the caller asserts the count."""
    forwarded = Counter()
    cls = type(group)
    forward = cls._forward

    def counted(self, op, *args, **kwargs):
        forwarded[op] += 1
        return forward(self, op, *args, **kwargs)

    cls._forward = counted
    agreed = Counter(group.agreed)
    try:
        yield forwarded
    finally:
        cls._forward = forward
        forwarded.update(Counter(group.agreed) - agreed)


def _terms(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s term: small integers (products of 3 ranks fit every dtype but int8,
    whose wrap-around both sides compute alike); bools in every combination over the ranks."""
    index = torch.arange(8)
    if dtype is torch.bool:
        return ((index >> rank) & 1).bool()
    return ((index * (rank + 1) + rank) % 7).to(dtype)


def _reference(dtype: torch.dtype, op: str) -> torch.Tensor:
    """torch's reduction of every rank's term in rank order (``AVG``: truncating division)."""
    fn = _TORCH_FNS[op]
    out = _terms(0, dtype)
    for q in range(1, env_world()):
        out = fn(out, _terms(q, dtype))
    if op == "AVG":
        out = out.div(env_world(), rounding_mode="trunc") if not out.is_floating_point() \
            else out.div(env_world())
    return out


def _outcome(call) -> tuple[str, object]:
    try:
        return "ok", call()
    except (RuntimeError, ValueError, TypeError) as exc:
        return "error", f"{type(exc).__name__}: {exc}"


def _run_pair(kind: str, dtype: torch.dtype, op: str, group) -> tuple[str, object]:
    t = _terms(env_rank(), dtype)
    reduce_op = getattr(dist.ReduceOp, op)

    def call():
        if kind == "all_reduce":
            dist.all_reduce(t, op=reduce_op, group=group, async_op=True).wait()
        else:
            dist.reduce(t, dst=env_world() - 1, op=reduce_op, group=group, async_op=True).wait()
        return t

    return _outcome(call)


def check_every_pair(kind: str):
    """``kind`` (``all_reduce`` or ``reduce``) of every dtype with every op: Gloo's values,
    Gloo's refusals, or torch's reduction where only the contract reduces the pair."""
    fast, gloo = _groups()
    report = {}
    with _no_gloo(fast) as forwarded:
        for dtype in DTYPES:
            for op in OPS:
                theirs = _run_pair(kind, dtype, op, gloo)
                mine = _run_pair(kind, dtype, op, fast)
                dist.barrier(fast)
                name = f"{kind}({str(dtype).removeprefix('torch.')}, {op})"
                root_or_all = kind == "all_reduce" or env_rank() == env_world() - 1
                if theirs[0] == "ok":
                    assert mine[0] == "ok", f"{name}: Gloo reduces it, fastcomm: {mine[1]}"
                    # a reduce's non-roots: Gloo leaves a partial result, fastcomm the input
                    want = theirs[1] if root_or_all else _terms(env_rank(), dtype)
                    # torch hands Gloo a complex reduce as complex (its AVG divides with
                    # complex arithmetic), the contract reduces the real view: x / 3 may
                    # differ in the last bit
                    rtol = 1e-6 if dtype.is_complex and op == "AVG" else 0
                    torch.testing.assert_close(mine[1], want, rtol=rtol, atol=0,
                                               msg=f"{name}: values differ from Gloo's")
                    report[name] = "gloo's values"
                elif (dtype in _EXTENDED or (op == "AVG" and not dtype.is_floating_point
                                             and dtype is not torch.bool)) \
                        and mine[0] == "ok":
                    want = _reference(dtype, op) if root_or_all else _terms(env_rank(), dtype)
                    torch.testing.assert_close(mine[1], want, rtol=0, atol=0,
                                               msg=f"{name}: values differ from torch's")
                    report[name] = "torch's values"
                else:
                    assert mine[0] == "error", f"{name}: Gloo refuses ({theirs[1]}), fastcomm " \
                                               f"gave {mine[1]}"
                    report[name] = "refused"
                    if op.startswith("B") and dtype in _FLOATS:
                        assert "non-integral dtype" in mine[1], mine[1]
    assert not forwarded, f"handed to Gloo: {forwarded}"
    return report


def check_many_tensors():
    """``allreduce``/``broadcast``/``reduce`` of a list of tensors and
    ``all_reduce_coalesced``: one call each, Gloo's values (``reduce`` of a list, which Gloo
    refuses, and ``AVG``: torch's sum of every tensor of every rank, on the root's
    ``rootTensor``, over the ranks)."""
    fast, gloo = _groups()
    rank, world = env_rank(), env_world()
    last = world - 1

    def tensors(dtype=torch.float32, count=3):
        return [(torch.arange(5) + 10 * k + rank).to(dtype) for k in range(count)]

    results = {}
    with _no_gloo(fast) as forwarded:
        for dtype, op in ((torch.float32, "SUM"), (torch.int64, "MAX"), (torch.bool, "BOR"),
                          (torch.int32, "BXOR"), (torch.uint8, "PRODUCT")):
            got = {}
            for name, g in (("fast", fast), ("gloo", gloo)):
                ts = tensors(dtype)
                opts = dist.AllreduceOptions()
                opts.reduceOp = getattr(dist.ReduceOp, op)
                work = g.allreduce(ts, opts)
                assert work.wait()
                got[name] = ts
            for a, b in zip(got["fast"], got["gloo"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{dtype} {op}: {a} {b}")
            results[f"allreduce {dtype} {op}"] = got["fast"][0]
        # AVG: the sum of every tensor of every rank over the ranks (Gloo's own multi-tensor
        # AVG leaves the undivided sum in tensor 0)
        ts = tensors(torch.float64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.AVG
        fast.allreduce(ts, opts).wait()
        total = sum((torch.arange(5) + 10 * k + q) for k in range(3) for q in range(world))
        for t in ts:
            torch.testing.assert_close(t, total.double() / world, rtol=0, atol=0)
        got = {}
        for name, g in (("fast", fast), ("gloo", gloo)):
            ts = tensors(count=2)
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = last, 1
            g.broadcast(ts, opts).wait()
            got[name] = ts
        for a, b in zip(got["fast"], got["gloo"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        ts = tensors(torch.int64)
        opts = dist.ReduceOptions()
        opts.rootRank, opts.rootTensor = last, 2
        before = [t.clone() for t in ts]
        fast.reduce(ts, opts).wait()
        want = sum((torch.arange(5) + 10 * k + q) for k in range(3) for q in range(world))
        for k, (t, old) in enumerate(zip(ts, before, strict=True)):
            expected = want if (rank == last and k == 2) else old
            torch.testing.assert_close(t, expected, rtol=0, atol=0)
        got = {}
        for name, g in (("fast", fast), ("gloo", gloo)):
            ts = [(torch.arange(3) + rank).bool(), torch.tensor([True, rank == 0]),
                  torch.tensor([[rank == 1]])]
            with warnings.catch_warnings():  # torch: all_reduce_coalesced will be deprecated
                warnings.simplefilter("ignore")
                dist.all_reduce_coalesced(ts, op=dist.ReduceOp.BAND, group=g)
            got[name] = ts
        for a, b in zip(got["fast"], got["gloo"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # tensors of one call that differ: a ValueError naming them, on every rank
        with pytest.raises(ValueError, match="tensor 1 is torch.float32 \\(4,\\)"):
            fast.allreduce([torch.ones(5), torch.ones(4)])
    assert not forwarded, f"handed to Gloo: {forwarded}"
    return "ok"


def check_communicator_extended(backend: str):
    """The contract's own ``all_reduce``/``reduce`` of the bitwise ops and the extra dtypes,
    sync and async, on a backend that reduces them itself (shm) and on one where the contract
    gathers the ranks' bytes and reduces them (gloo): torch's reduction in rank order."""
    comm = rank_comm(backend)
    rank, world = comm.rank, comm.size
    cases = [(torch.bool, op) for op in ("BAND", "BOR", "BXOR", "SUM", "MIN")]
    cases += [(torch.int16, op) for op in ("SUM", "AVG", "MAX", "BXOR")]
    cases += [(torch.uint32, "BOR"), (torch.uint64, "PRODUCT"), (torch.int32, "BAND"),
              (torch.uint8, "BXOR")]
    for dtype, name in cases:
        op = BitwiseOp[name] if name.startswith("B") else ReduceOp[name]
        want = _reference(dtype, name)
        for async_op in (False, True):
            t = _terms(rank, dtype)
            work = comm.all_reduce(t, op, async_op)
            if async_op:
                work.wait()
            torch.testing.assert_close(t, want, rtol=0, atol=0, msg=f"{dtype} {name}")
            t = _terms(rank, dtype)
            work = comm.reduce(t, world - 1, op, async_op)
            if async_op:
                work.wait()
            expected = want if rank == world - 1 else _terms(rank, dtype)
            torch.testing.assert_close(t, expected, rtol=0, atol=0, msg=f"reduce {dtype} {name}")
    big = torch.full((70000,), 1 << rank, dtype=torch.int16)  # past one slot: streamed
    comm.all_reduce(big, "bor")
    assert big.eq((1 << world) - 1).all()
    empty = torch.empty(0, dtype=torch.bool)
    comm.all_reduce(empty, BitwiseOp.BXOR)
    for bad, words in (((torch.ones(2), "band"), "non-integral dtype torch.float32"),
                       ((torch.ones(2, dtype=torch.bool), "avg"), "AVG of dtype torch.bool"),
                       ((torch.ones(2, dtype=torch.uint16), "sum"), "uint16 takes"),
                       ((torch.ones(2, dtype=torch.float8_e4m3fn), "sum"), "float8_e4m3fn")):
        with pytest.raises(TypeError, match=words):
            comm.all_reduce(*bad)
    with pytest.raises(TypeError, match="BAND is reduced by all_reduce and reduce only"):
        comm.reduce_scatter(torch.zeros(1, dtype=torch.int32),
                            torch.ones(world, dtype=torch.int32), "band")
    with pytest.raises(TypeError, match="broadcast moves these"):
        comm.broadcast(torch.ones(2, dtype=torch.bool), 0)
    t = torch.ones(3)
    comm.all_reduce(t)  # still usable: every refusal came before anything was sent
    assert t.tolist() == [float(world)] * 3
    return "ok"


# ---------------------------------------------------------------------- autograd
class _Model(torch.nn.Module):
    """One parameter: torch's DDP refuses ``create_graph=True`` with several parameters in a
    bucket on every backend (its reducer copies into a leaf), so the program Gloo runs is
    this one."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w).pow(2).sum()


def _ddp_double_backward(group) -> tuple[list, list]:
    model = _Model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    x = torch.linspace(0.0, 1.0, 12).reshape(2, 6) + env_rank()
    with warnings.catch_warnings():  # torch warns that create_graph is not well supported
        warnings.simplefilter("ignore")
        ddp(x).backward(create_graph=True)
        grads = [p.grad for p in model.parameters()]
        assert all(g.requires_grad for g in grads), "the gradients must require grad"
        for p in model.parameters():
            p.grad = None
        sum(g.pow(2).sum() for g in grads).backward()  # the double backward
    return [g.detach() for g in grads], [p.grad.detach() for p in model.parameters()]


def check_ddp_create_graph():
    """torch's DDP with ``backward(create_graph=True)`` and a double backward: the gradients
    require grad and equal Gloo's, on the fastcomm group."""
    fast, gloo = _groups()
    with _no_gloo(fast) as forwarded:
        got = _ddp_double_backward(fast)
    want = _ddp_double_backward(gloo)
    assert not forwarded, forwarded
    # 3 ranks: Gloo's ring adds an element's terms in an order set by its place in the ring's
    # chunks, the shm communicator in rank order: the last bit may differ
    exact = env_world() <= 2
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-7)
    t = torch.ones(3)
    dist.all_reduce(t, group=fast)  # the communicator still works
    assert t.tolist() == [float(env_world())] * 3
    return "ok"


def check_communicator_tracked_tensors():
    """Every collective of the communicator writes into tensors autograd tracks (a leaf
    parameter, a non-leaf with a graph) as into plain ones: the values of the plain call, the
    graph left as it was, nothing recorded."""
    fast, _ = _groups()
    comm = fast.communicator
    rank, world = env_rank(), env_world()

    def pair(fn, make):
        plain, leaf = make(), make().requires_grad_(True)
        base = make().requires_grad_(True)
        nonleaf = base * 1.0  # a graph node
        grad_fn = nonleaf.grad_fn
        fn(plain)
        fn(leaf)
        fn(nonleaf)
        assert leaf.grad_fn is None and leaf.requires_grad
        assert nonleaf.grad_fn is grad_fn, "the collective entered the graph"
        for t in (leaf, nonleaf):
            torch.testing.assert_close(t.detach(), plain, rtol=0, atol=0)

    def vec(n=6):
        return lambda: torch.arange(float(n)) + rank

    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, PremulSum(0.5)):
        pair(lambda t, op=op: comm.all_reduce(t, op), vec())
        pair(lambda t, op=op: comm.all_reduce(t, op, True).wait(), vec(70000))
    pair(lambda t: comm.reduce(t, 0), vec())
    pair(lambda t: comm.broadcast(t, world - 1), vec())
    source = torch.arange(3.0) + rank
    pair(lambda t: comm.all_gather(t, source), lambda: torch.zeros(3 * world))
    pair(lambda t: comm.reduce_scatter(t, torch.arange(2.0 * world)), lambda: torch.zeros(2))
    pair(lambda t: comm.all_to_all(t, torch.arange(2.0 * world) + rank),
         lambda: torch.zeros(2 * world))
    return "ok"


def check_sync_handles():
    """A synchronous call's handle: each one a caller holds keeps its own outputs; one nobody
    holds any more is reused (torch's ``dist.all_reduce`` drops it after ``wait()``)."""
    fast, _ = _groups()
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    a, b = torch.ones(2), torch.ones(3)
    first = fast.allreduce([a], opts)
    second = fast.allreduce([b], opts)
    assert first is not second
    assert first.result()[0] is a and second.result()[0] is b
    assert first.get_future().value()[0] is a and first.wait() and first.is_completed()
    del first, second
    held = id(fast.allreduce([a], opts))  # dropped at once
    again = fast.allreduce([b], opts)
    assert id(again) == held and again.result()[0] is b
    assert a.tolist() == [env_world() ** 2] * 2 and b.tolist() == [env_world() ** 2] * 3
    return "ok"


# ---------------------------------------------------------------------- monitored barrier
def check_monitored_barrier():
    """``fastcomm.monitored_barrier``: every rank passes when all arrive; when the last rank
    (or, with ``wait_all_ranks``, every rank but 0) comes after the timeout, rank 0 raises
    naming it, so do the ranks that waited for rank 0's verdict, and the late ones when they
    come; the group's barrier works afterwards. torch's own call refuses the backend by name."""
    fast, gloo = _groups()
    rank, world = env_rank(), env_world()
    fastcomm.monitored_barrier(fast, timedelta(seconds=10))
    fast.monitored_barrier(timedelta(seconds=10), wait_all_ranks=True)
    fastcomm.monitored_barrier(gloo, timedelta(seconds=10))  # torch's, for a Gloo group
    with pytest.raises(ValueError, match="only implemented for GLOO"):
        dist.monitored_barrier(fast, timedelta(seconds=1))
    messages = {}
    for wait_all, late in ((False, {world - 1}), (True, set(range(1, world)))):
        # the late ranks come once rank 0 has given its verdict (not after a fixed sleep: a
        # rank 0 that a busy machine kept from the barrier that long found them all there)
        verdict = f"monitored/{STATE.setdefault('monitored', 0)}/verdict"
        STATE["monitored"] += 1
        if rank in late:
            poll_keys(rank_store(), [verdict], timeout=60)
        start = time.monotonic()
        with pytest.raises(fastcomm.CommTimeoutError) as info:
            fastcomm.monitored_barrier(fast, timedelta(seconds=1.0), wait_all_ranks=wait_all)
        if rank == 0:
            assert 0.9 < time.monotonic() - start < 5, time.monotonic() - start
            rank_store().set(verdict, "1")
        messages[wait_all] = str(info.value)
        dist.barrier(fast)
    fastcomm.monitored_barrier(fast, timedelta(seconds=10))  # in step again
    return messages


# ---------------------------------------------------------------------- the checks
pool = pool_fixture([2, 3], env={"OMP_NUM_THREADS": "1"}, timeout=280)


@pytest.mark.parametrize("kind", ["all_reduce", "reduce"])
def test_every_dtype_and_op_against_gloo(pool, kind):
    reports = pool.run(check_every_pair, kind)
    assert len(reports[0]) == len(DTYPES) * len(OPS)
    assert all(r == reports[0] for r in reports)
    # the contract's own additions were reduced, not refused
    assert reports[0][f"{kind}(int16, SUM)"] == "torch's values"
    assert reports[0][f"{kind}(bool, BXOR)"] == "gloo's values"
    assert reports[0][f"{kind}(float32, BAND)"] == "refused"


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_communicator_bitwise_and_extra_dtypes(pool, backend):
    assert pool.run(check_communicator_extended, backend) == ["ok"] * pool.world_size


def test_monitored_barrier_names_the_missing_ranks(pool):
    world = pool.world_size
    messages = pool.run(check_monitored_barrier)
    first = f"rank {world - 1} did not reach the monitored barrier within 1 s"
    every = (f"ranks {', '.join(map(str, range(1, world)))}" if world > 2 else "rank 1") + \
        " did not reach the monitored barrier within 1 s"
    for rank, texts in enumerate(messages):
        assert texts[False].startswith(f"rank {rank}: monitored_barrier of group"), texts
        assert first in texts[False], texts
        assert every in texts[True], texts


def test_synchronous_handles_keep_their_outputs(pool):
    assert pool.run(check_sync_handles) == ["ok"] * pool.world_size


def test_several_tensors_in_one_call(pool):
    assert pool.run(check_many_tensors) == ["ok"] * pool.world_size


def test_torch_ddp_create_graph_double_backward(pool):
    assert pool.run(check_ddp_create_graph) == ["ok"] * pool.world_size


def test_communicator_writes_tracked_tensors_outside_autograd(pool):
    assert pool.run(check_communicator_tracked_tensors) == ["ok"] * pool.world_size
