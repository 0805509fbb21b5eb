"""The ``torch.distributed`` calls of unequal sizes on the ``fastcomm`` backend, on 2 and 3 CPU
ranks: ``gather``, ``scatter``, ``all_to_all_single`` with split sizes, ``all_to_all`` of
lists, ``all_gather`` / ``reduce_scatter`` lists of unequal sizes, ``all_gather_coalesced``, the
object collectives, and an MoE-style layer routed by ``all_to_all_single`` through torch's
autograd-capable functional form, forward and backward.

Each rank makes the default group of the fastcomm backend and a Gloo group beside it; each call
runs on both and the results are compared exactly (data is only moved, or integers are summed);
where Gloo refuses the call (``all_gather`` of unequal sizes) against what the senders made.
Every call on the fastcomm group is checked not to reach Gloo (the group's ``_forward`` is
counted).
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_fn

import fastcomm  # noqa: F401 - registers the backend
from tests.harness import STATE, env_rank, env_world, pool_fixture, rank_store

pytestmark = pytest.mark.timeout(240)

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32",
          "int64", "bool", "complex64", "uint16"]


def _groups():
    """``(fastcomm group, gloo group)`` of this rank, made once per pool."""
    if "groups" not in STATE:
        store = dist.PrefixStore("c10d-vcoll", rank_store().torch_store)
        dist.init_process_group("fastcomm", store=store, rank=env_rank(), world_size=env_world(),
                                timeout=timedelta(seconds=60))
        STATE["groups"] = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return STATE["groups"]


@contextmanager
def _no_gloo(group):
    """Fails if a call inside hands anything to the Gloo group beside the communicator."""
    handed: list[str] = []
    forward = group._forward

    def counted(op, *args, **kwargs):
        handed.append(op)
        return forward(op, *args, **kwargs)

    group._forward = counted
    try:
        yield
    finally:
        del group._forward
    assert not handed, f"handed to Gloo: {handed}"


def _piece(q: int, r: int, n: int, dtype=torch.float32, width: int = 1) -> torch.Tensor:
    """What rank ``q`` sends rank ``r``: ``n`` rows of ``width``."""
    values = torch.arange(n * width, dtype=torch.int64).view(n, width) * 3 + 100 * q + 10 * r
    if dtype is torch.bool:
        return values % 3 == 0
    return (values % 120).to(dtype)


def _rows(q: int, r: int) -> int:
    """Rows rank ``q`` sends rank ``r``: uneven, zero for some pairs."""
    return (2 * q + 3 * r + 1) % 4


# ---------------------------------------------------------------------- one call, both groups
def _a2a_single(group, dtype, width, async_op, contiguous):
    me, n = env_rank(), env_world()
    sends = [_rows(me, r) for r in range(n)]
    recvs = [_rows(q, me) for q in range(n)]
    inp = torch.cat([_piece(me, r, sends[r], dtype, width) for r in range(n)])
    out = torch.zeros((sum(recvs), width), dtype=dtype)
    if not contiguous:  # the same values through a transposed view
        inp = inp.t().contiguous().t()
        out = torch.zeros((width, sum(recvs)), dtype=dtype).t()
    work = dist.all_to_all_single(out, inp, recvs, sends, group=group, async_op=async_op)
    if async_op:
        work.wait()
    return out


def _list_rows(q: int, r: int, uneven: bool) -> int:
    return _rows(q, r) + 1 if uneven else 3  # Gloo's all_to_all takes equal sizes only


def _a2a_list(group, dtype, async_op, contiguous, uneven=False):
    me, n = env_rank(), env_world()
    ins = [_piece(me, r, _list_rows(me, r, uneven), dtype, 2) for r in range(n)]
    outs = [torch.zeros((_list_rows(q, me, uneven), 2), dtype=dtype) for q in range(n)]
    if not contiguous:
        ins = [t.t().contiguous().t() for t in ins]
        outs = [torch.zeros((2, _list_rows(q, me, uneven)), dtype=dtype).t() for q in range(n)]
    work = dist.all_to_all(outs, ins, group=group, async_op=async_op)
    if async_op:
        work.wait()
    return torch.cat(outs)


def _gather_scatter(group, dtype, async_op, root):
    me, n = env_rank(), env_world()
    got = [torch.zeros((3, 2), dtype=dtype) for _ in range(n)] if me == root else None
    mine = _piece(me, root, 3, dtype, 2)
    work = dist.gather(mine, got, dst=root, group=group, async_op=async_op)
    if async_op:
        work.wait()
    out = torch.zeros((4,), dtype=dtype)
    sent = [_piece(root, r, 4, dtype).view(-1) for r in range(n)] if me == root else None
    work = dist.scatter(out, sent, src=root, group=group, async_op=async_op)
    if async_op:
        work.wait()
    gathered = torch.cat(got) if me == root else torch.zeros(0, 2, dtype=dtype)
    return torch.cat([gathered.view(-1), out])


def _coalesced(group):
    me, n = env_rank(), env_world()
    ins = [torch.full((2, 3), float(me)), torch.arange(5.0) + me, torch.tensor(me + 0.5)]
    outs = [[torch.empty(2, 3), torch.empty(5), torch.empty(())] for _ in range(n)]
    dist.all_gather_coalesced(outs, ins, group=group)
    return torch.cat([torch.cat([t.view(-1) for t in row]) for row in outs])


def check_same_as_gloo(case: str, *args):
    fast, gloo = _groups()
    fn = {"a2a_single": _a2a_single, "a2a_list": _a2a_list, "gather_scatter": _gather_scatter,
          "coalesced": _coalesced}[case]
    args = [getattr(torch, a) if isinstance(a, str) else a for a in args]
    # Gloo takes contiguous tensors only: its reference is the same call on contiguous ones
    want = fn(gloo, *args[:-1], True) if case.startswith("a2a") else fn(gloo, *args)
    with _no_gloo(fast):
        got = fn(fast, *args)
    assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
    return "ok"


def check_split_forms():
    """Split sizes given on one side only (the other even, as torch allows), and a call that
    moves nothing at all (every split zero): the same as Gloo, without Gloo."""
    fast, gloo = _groups()
    me, n = env_rank(), env_world()
    results = []
    for group in (gloo, fast):
        with _no_gloo(group) if group is fast else contextmanager(lambda: (yield))():
            inp = torch.arange(2.0 * n) + 10 * me  # two rows to each rank
            out = torch.zeros(2 * n)
            dist.all_to_all_single(out, inp, [2] * n, None, group=group)
            out2 = torch.zeros(2 * n)
            dist.all_to_all_single(out2, inp, None, [2] * n, group=group)
            nothing = torch.zeros(0)
            dist.all_to_all_single(nothing, torch.zeros(0), [0] * n, [0] * n, group=group)
        results.append(torch.cat([out, out2]))
    assert torch.equal(results[0], results[1]), results
    return "ok"


def check_every_dtype(dtype_name: str):
    """Every dtype through all_to_all_single, all_to_all and gather/scatter, against what the
    senders made (Gloo lacks some of these dtypes)."""
    fast, _ = _groups()
    me, n = env_rank(), env_world()
    dtype = getattr(torch, dtype_name)
    with _no_gloo(fast):
        out = _a2a_single(fast, dtype, 3, False, True)
        lists = _a2a_list(fast, dtype, True, False, True)
        both = _gather_scatter(fast, dtype, False, n - 1)
    assert torch.equal(out, torch.cat([_piece(q, me, _rows(q, me), dtype, 3) for q in range(n)]))
    assert torch.equal(lists, torch.cat([_piece(q, me, _rows(q, me) + 1, dtype, 2)
                                         for q in range(n)]))
    gathered = torch.cat([_piece(q, n - 1, 3, dtype, 2) for q in range(n)]).view(-1) \
        if me == n - 1 else torch.zeros(0, dtype=dtype)
    assert torch.equal(both, torch.cat([gathered, _piece(n - 1, me, 4, dtype).view(-1)]))
    return "ok"


def check_unequal_all_gather_and_reduce_scatter(async_op: bool):
    """What NCCL accepts and Gloo refuses: lists of unequal sizes."""
    fast, gloo = _groups()
    me, n = env_rank(), env_world()
    sizes = [q + 1 for q in range(n)]
    outs = [torch.zeros(sizes[q], dtype=torch.int64) for q in range(n)]
    with pytest.raises((RuntimeError, ValueError)):  # Gloo's refusal, as the issue says
        dist.all_gather([torch.zeros(s) for s in sizes], torch.ones(sizes[me]), group=gloo)
    with _no_gloo(fast):
        work = dist.all_gather(outs, torch.arange(sizes[me]) + 100 * me, group=fast,
                               async_op=async_op)
        if async_op:
            work.wait()
        out = torch.zeros(sizes[me])
        ins = [torch.arange(sizes[r], dtype=torch.float32) * (me + 1) for r in range(n)]
        work = dist.reduce_scatter(out, ins, group=fast, async_op=async_op)
        if async_op:
            work.wait()
    for q in range(n):
        assert outs[q].tolist() == [100 * q + i for i in range(sizes[q])]
    assert out.tolist() == [float(i * n * (n + 1) // 2) for i in range(sizes[me])]
    return "ok"


def check_object_collectives():
    fast, gloo = _groups()
    me, n = env_rank(), env_world()
    results = []
    for group in (gloo, fast):
        ctx = _no_gloo(group) if group is fast else contextmanager(lambda: (yield))()
        with ctx:
            everyone = [None] * n
            dist.all_gather_object(everyone, {"rank": me, "pad": "x" * (me * 50)}, group=group)
            gathered = [None] * n if me == 0 else None
            dist.gather_object(("g", me, list(range(me * 7))), gathered, dst=0, group=group)
            got = [None]
            dist.scatter_object_list(got, [f"to {r}" * (r + 1) for r in range(n)]
                                     if me == n - 1 else None, src=n - 1, group=group)
            objs = [me, "b" * (10 + me)] if me == 0 else [None, None]
            dist.broadcast_object_list(objs, src=0, group=group)
        results.append((everyone, gathered, got, objs))
    assert results[0] == results[1], results
    assert results[1][2] == [f"to {me}" * (me + 1)]
    return "ok"


def check_disagreement():
    """all_to_all_single split sizes that disagree: a ValueError on every rank naming both
    ranks' sizes; the group still works."""
    fast, _ = _groups()
    me = env_rank()
    with pytest.raises(ValueError) as info:
        dist.all_to_all_single(torch.empty(3), torch.ones(3), [1, 2] + [0] * (env_world() - 2),
                               [1, 2] + [0] * (env_world() - 2) if me == 0
                               else [2, 1] + [0] * (env_world() - 2), group=fast)
    t = torch.ones(2)
    dist.all_reduce(t, group=fast)
    assert t.tolist() == [float(env_world())] * 2
    return str(info.value).split(": ", 1)[1]


# ---------------------------------------------------------------------- MoE
def _moe(group, autograd_a2a, tokens_per_rank: int = 13, dim: int = 8):
    """A mixture-of-experts layer with one expert per rank: each rank's tokens are routed to
    experts by a fixed uneven rule, exchanged with all_to_all_single, transformed by the
    expert, exchanged back and combined; returns the loss and the gradients."""
    me, n = env_rank(), env_world()
    torch.manual_seed(1234 + me)
    tokens = torch.randn(tokens_per_rank + me, dim, requires_grad=True)
    torch.manual_seed(99 + me)
    expert = torch.randn(dim, dim, requires_grad=True)
    route = (torch.arange(len(tokens)) * (me + 2) // 3) % n  # uneven, differs by rank
    order = torch.argsort(route, stable=True)
    sends = torch.bincount(route, minlength=n)
    recvs = torch.empty_like(sends)
    dist.all_to_all_single(recvs, sends, group=group)
    sends, recvs = sends.tolist(), recvs.tolist()
    routed = tokens[order]
    arrived = autograd_a2a(torch.empty(sum(recvs), dim), routed, recvs, sends, group)
    done = torch.nn.functional.gelu(arrived @ expert)
    back = autograd_a2a(torch.empty(len(tokens), dim), done, sends, recvs, group)
    combined = torch.empty_like(back).index_copy(0, order, back)
    loss = (combined * torch.linspace(-1, 1, dim)).pow(2).sum()
    loss.backward()
    return loss.detach(), tokens.grad, expert.grad


def _a2a_nn(output, input, output_splits, input_splits, group):
    return dist_fn.all_to_all_single(output, input, output_splits, input_splits, group=group)


def _a2a_funcol(output, input, output_splits, input_splits, group):
    out = funcol.all_to_all_single_autograd(input, output_splits, input_splits, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def check_moe(form: str):
    fast, gloo = _groups()
    a2a = {"nn": _a2a_nn, "funcol": _a2a_funcol}[form]
    want = _moe(gloo, a2a)
    before = fast.communicator.stats.calls.get("all_to_all", 0)
    with _no_gloo(fast):
        got = _moe(fast, a2a)
    # the counts' exchange, two exchanges forward and two backward, all on the communicator
    assert fast.communicator.stats.calls["all_to_all"] - before == 5
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (a, b)
    return "ok"


pool = pool_fixture([2, 3], env={"OMP_NUM_THREADS": "1"}, timeout=180)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
def test_all_to_all_same_as_gloo(pool, async_op, contiguous):
    for dtype in ("float32", "int64"):
        pool.run(check_same_as_gloo, "a2a_single", dtype, 3, async_op, contiguous)
        pool.run(check_same_as_gloo, "a2a_list", dtype, async_op, contiguous)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_gather_scatter_same_as_gloo(pool, async_op):
    for root in range(pool.world_size):
        pool.run(check_same_as_gloo, "gather_scatter", "float32", async_op, root)


def test_split_forms_same_as_gloo(pool):
    pool.run(check_split_forms)


def test_all_gather_coalesced_same_as_gloo(pool):
    pool.run(check_same_as_gloo, "coalesced")


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype(pool, dtype):
    pool.run(check_every_dtype, dtype)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_unequal_all_gather_and_reduce_scatter(pool, async_op):
    pool.run(check_unequal_all_gather_and_reduce_scatter, async_op)


def test_object_collectives(pool):
    pool.run(check_object_collectives)


def test_disagreement_raises_on_every_rank(pool):
    messages = pool.run(check_disagreement)
    assert len(set(messages)) == 1, messages
    assert "rank 0 sends 2 elements to rank 1, which expects 1" in messages[0]


@pytest.mark.parametrize("form", ["nn", "funcol"])
def test_moe_forward_backward_same_as_gloo(pool, form):
    pool.run(check_moe, form)
