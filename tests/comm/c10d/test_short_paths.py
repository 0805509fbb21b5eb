"""The short paths of the ``fastcomm`` process group against its general paths, on 2 and 3 CPU
ranks: ``gather``, ``scatter``, ``all_to_all_single`` with split sizes and ``send``/``recv`` of
contiguous CPU tensors, waited for, are done by a lane of their own (counted here); each must
give what the communicator's own call gives (values, version counters, flight record), raise
the same disagreement naming the difference with the group still usable, and leave anything
unusual (a non-contiguous tensor, a receive left pending, a bad tag) to the general path,
correct; a communicator with no inline lane (Gloo's) still gets the calls. The group's
``rank()``/``size()`` answer as torch's C++ getters do.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fastcomm  # noqa: F401 - registers the backend
from tests.harness import STATE, env_rank, env_world, pool_fixture, rank_store

pytestmark = pytest.mark.timeout(240)


def _group():
    """The fastcomm default group of this rank, made once per pool."""
    if "short_group" not in STATE:
        store = dist.PrefixStore("c10d-short", rank_store().torch_store)
        dist.init_process_group("fastcomm", store=store, rank=env_rank(), world_size=env_world(),
                                timeout=timedelta(seconds=60))
        STATE["short_group"] = dist.group.WORLD
    return STATE["short_group"]


@contextmanager
def _lanes(comm, counts: dict):
    """Counts the calls that reach the backend's ops of the short lanes (the caller's tensors,
    no list of pieces) and the communicator's public calls (the general path's)."""
    names = ("_impl_gather", "_impl_scatter", "_impl_all_to_all_split", "gather", "scatter",
             "all_to_all_split")
    for name in names:
        method = getattr(comm, name)

        def counted(*args, _name=name, _method=method):
            counts[_name] = counts.get(_name, 0) + 1
            return _method(*args)

        setattr(comm, name, counted)
    try:
        yield counts
    finally:
        for name in names:
            delattr(comm, name)


def _values(q: int, n: int, dtype, salt: int = 0) -> torch.Tensor:
    return ((torch.arange(n) * 7 + 100 * q + salt) % 97).to(dtype)


def _last_two(comm) -> list:
    return [(row["op"], row["desc"], row["state"]) for row in comm.flight.entries(last=2)]


def check_rooted_same_as_communicator(dtype_name: str, root: int):
    """gather and scatter of uneven sizes, sizes changing from call to call, a scatter sending
    one tensor to several ranks: dist.* (the short lane) and comm.gather/comm.scatter (the
    general path) give the same values, version counters and flight records."""
    pg = _group()
    comm = pg.communicator
    me, n = env_rank(), env_world()
    dtype = getattr(torch, dtype_name)
    counts: dict = {}
    for sizes in ([3] * n, [2, 5, 1][:n], [3] * n):
        mine = _values(me, sizes[me], dtype)
        got = {}
        for how in ("short", "general"):
            outs = [torch.zeros(sizes[q], dtype=dtype) for q in range(n)]
            before = [t._version for t in outs]
            with _lanes(comm, counts):
                if how == "short":
                    dist.gather(mine, outs if me == root else None, dst=root)
                else:
                    comm.gather(outs if me == root else None, mine, root)
            got[how] = (outs, [t._version - v for t, v in zip(outs, before, strict=True)])
        assert all(torch.equal(a, b) for a, b in zip(got["short"][0], got["general"][0],
                                                     strict=True)), got
        assert got["short"][1] == got["general"][1], got
        if me == root:
            assert all(torch.equal(got["short"][0][q], _values(q, sizes[q], dtype))
                       for q in range(n)), got
        one, two = _last_two(comm)
        assert one == two and one[0] == "gather" and one[2] == "completed", (one, two)
        shared = _values(root, sizes[root], dtype, salt=n)  # one tensor for each rank of size
        every = [_values(root, sizes[r], dtype, salt=r) if sizes[r] != sizes[root] else shared
                 for r in range(n)]
        ins = every if me == root else None
        for how in ("short", "general"):
            out = torch.zeros(sizes[me], dtype=dtype)
            before = out._version
            with _lanes(comm, counts):
                if how == "short":
                    dist.scatter(out, ins, src=root)
                else:
                    comm.scatter(out, ins, root)
            got[how] = (out, out._version - before)
        assert torch.equal(got["short"][0], got["general"][0]), got
        assert torch.equal(got["short"][0], every[me]), (got, every[me])
        assert got["short"][1] == got["general"][1] == 1, got
        one, two = _last_two(comm)
        assert one == two and one[0] == "scatter" and one[2] == "completed", (one, two)
    # the dist.* calls took the short lane, the communicator's own calls the general path
    assert counts == {"_impl_gather": 3, "_impl_scatter": 3, "gather": 3, "scatter": 3}, counts
    return "ok"


def check_rooted_general_way(root: int):
    """A non-contiguous input or output goes the general way (no short lane), correct."""
    pg = _group()
    comm = pg.communicator
    me, n = env_rank(), env_world()
    counts: dict = {}
    mine = _values(me, 6, torch.float32).view(3, 2).t()  # non-contiguous
    outs = [torch.zeros(2, 3) for _ in range(n)] if me == root else None
    out = torch.zeros(4, 2).t()[:, ::2]  # non-contiguous, 2 x 2
    ins = [_values(root, 4, torch.float32, salt=r).view(2, 2) for r in range(n)]
    with _lanes(comm, counts):
        dist.gather(mine, outs, dst=root)
        dist.scatter(out, ins if me == root else None, src=root)
    assert counts == {"gather": 1, "scatter": 1}, counts  # the general path's calls
    if me == root:
        for q in range(n):
            assert torch.equal(outs[q], _values(q, 6, torch.float32).view(3, 2).t()), outs
    assert torch.equal(out, ins[me]), (out, ins[me])
    return "ok"


def check_rooted_disagreement(how: str, kind: str):
    """Ranks that disagree (sizes, or a rank sending another dtype): a ValueError on every
    rank naming the difference, the same text on the short and the general path; the group
    still usable."""
    pg = _group()
    comm = pg.communicator
    me, n = env_rank(), env_world()
    dtype = torch.int64 if kind == "dtype" and me == 1 else torch.float32
    mine = torch.ones(3 if kind == "sizes" and me == 1 else 2, dtype=dtype)
    outs = [torch.zeros(2) for _ in range(n)] if me == 0 else None
    with pytest.raises(ValueError) as info:
        if how == "short":
            pg.gather([outs] if me == 0 else [], [mine], _gather_opts(0))
        else:
            comm.gather(outs, mine, 0)
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [float(n)] * 2
    return str(info.value)


def _gather_opts(root: int) -> dist.GatherOptions:
    opts = dist.GatherOptions()
    opts.rootRank = root
    opts.asyncOp = False
    return opts


def check_split_same_as_communicator():
    """all_to_all_single with split sizes: the short lane, the communicator's own
    all_to_all_split and a non-contiguous input (the general way) give the same values."""
    pg = _group()
    comm = pg.communicator
    me, n = env_rank(), env_world()
    sends = [(me + 2 * r) % 3 for r in range(n)]
    recvs = [(q + 2 * me) % 3 for q in range(n)]
    inp = torch.cat([_values(me, 2 * s, torch.float32, salt=r).view(s, 2)
                     for r, s in enumerate(sends)])
    want = torch.cat([_values(q, 2 * s, torch.float32, salt=me).view(s, 2)
                      for q, s in enumerate(recvs)])
    counts: dict = {}
    results = []
    for how in ("short", "general", "strided"):
        out = torch.zeros(sum(recvs), 2)
        source = inp
        if how == "strided":  # every other element of a wider tensor: never contiguous
            source = torch.zeros(inp.shape[0], 4)[:, ::2]
            source.copy_(inp)
        before = out._version
        with _lanes(comm, counts):
            if how == "general":
                comm.all_to_all_split(out, source, recvs, sends)
            else:
                dist.all_to_all_single(out, source, recvs, sends)
        results.append((out, out._version - before))
        assert torch.equal(out, want), (how, out, want)
    assert results[0][1] == results[1][1] == 1, results
    one, two = _last_two(comm)[:2]
    assert one[0] == two[0] == "all_to_all_v", (one, two)
    # the strided input is staged by the general path (comm.all_to_all_split), which takes
    # the backend's op of the offsets, as the short path does
    assert counts == {"_impl_all_to_all_split": 3, "all_to_all_split": 2}, counts
    return "ok"


def check_rank_and_size():
    pg = _group()
    assert pg.rank() == dist.ProcessGroup.rank(pg) == env_rank() == dist.get_rank()
    assert pg.size() == dist.ProcessGroup.size(pg) == env_world() == dist.get_world_size()
    return "ok"


def check_p2p_short_and_general():
    """send/recv between ranks 0 and 1: contiguous (short) and non-contiguous (general)
    tensors arrive intact; a receive posted before its message is recorded ``issued`` until
    it completes, whatever completes meanwhile; bad arguments raise naming them."""
    pg = _group()
    comm = pg.communicator
    me = env_rank()
    store = rank_store()
    x = _values(me, 8, torch.float32)
    strided = _values(me, 16, torch.float32).view(8, 2).t()
    if me == 0:
        store.wait(["short/posted"], timedelta(seconds=60))
        dist.send(x, 1)
        dist.send(strided, 1)
        got = torch.zeros(8)
        dist.recv(got, 1)
        assert torch.equal(got, _values(1, 8, torch.float32)), got
    elif me == 1:
        got = torch.zeros(8)
        work = dist.irecv(got, 0)  # rank 0 sends once this is posted: left pending
        row = comm.flight.entries(last=1)[0]
        pending = comm.flight.in_flight()
        for _ in range(9):  # completes at once, whichever call's record ends by one store
            comm.flight.returned(comm.flight.issue("barrier", None, None))
        assert (row["op"], row["state"]) == ("recv", "issued"), row
        assert pending is not None and pending[0] == row["seq"], (pending, row)
        assert comm.flight.in_flight()[0] == pending[0]
        store.set("short/posted", "1")
        work.wait()
        row = next(r for r in comm.flight.entries() if r["seq"] == pending[0])
        assert row["state"] == "completed", row
        assert torch.equal(got, _values(0, 8, torch.float32)), got
        into = torch.zeros(8, 2).t()  # non-contiguous
        dist.recv(into, 0)
        assert torch.equal(into, _values(0, 16, torch.float32).view(8, 2).t()), into
        dist.send(x, 0)
    for bad, why in ((lambda: pg.send([x], me, 0), f"peer rank {me} must be another rank"),
                     (lambda: pg.recv([x], 1 - me if me < 2 else 0, "t"), "tag 't' must be")):
        with pytest.raises(ValueError, match=why):
            bad()
    dist.barrier()
    return "ok"


def check_other_communicator():
    """A group whose communicator has no inline v-call lane (Gloo's): gather, scatter and
    all_to_all_single with split sizes still take the communicator (not the Gloo group beside
    it), through the default lane and its task, with the same values as on shm."""
    pg = _group()
    me, n = env_rank(), env_world()
    saved = os.environ.get("FASTCOMM_BACKEND")
    os.environ["FASTCOMM_BACKEND"] = "gloo"
    try:
        other = dist.new_group(backend="fastcomm")
    finally:
        if saved is None:
            del os.environ["FASTCOMM_BACKEND"]
        else:
            os.environ["FASTCOMM_BACKEND"] = saved
    assert other.communicator.backend != pg.communicator.backend, other.communicator
    handed: list = []
    forward = other._forward
    other._forward = lambda op, *args, **kwargs: handed.append(op) or forward(op, *args,
                                                                              **kwargs)
    results = []
    for group in (pg, other):
        outs = [torch.zeros(q + 1) for q in range(n)] if me == 0 else None
        dist.gather(_values(me, me + 1, torch.float32), outs, dst=0, group=group)
        out = torch.zeros(2)
        dist.scatter(out, [_values(0, 2, torch.float32, salt=r) for r in range(n)]
                     if me == 0 else None, src=0, group=group)
        moved = torch.zeros(n)
        dist.all_to_all_single(moved, _values(me, n, torch.float32), [1] * n, [1] * n,
                               group=group)
        results.append((outs, out, moved))
    del other._forward
    assert not handed, handed
    dist.destroy_process_group(other)
    (outs, out, moved), (outs2, out2, moved2) = results
    assert torch.equal(out, out2) and torch.equal(moved, moved2), results
    assert me != 0 or all(torch.equal(a, b) for a, b in zip(outs, outs2, strict=True)), results
    return "ok"


pool = pool_fixture([2, 3], env={"OMP_NUM_THREADS": "1"}, timeout=180)


@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16"])
def test_gather_scatter_same_as_general_path(pool, dtype):
    for root in range(pool.world_size):
        pool.run(check_rooted_same_as_communicator, dtype, root)


def test_unusual_gather_scatter_go_the_general_way(pool):
    for root in (0, pool.world_size - 1):
        pool.run(check_rooted_general_way, root)


@pytest.mark.parametrize("kind", ["sizes", "dtype"])
def test_disagreement_same_on_both_paths(pool, kind):
    short = pool.run(check_rooted_disagreement, "short", kind)
    general = pool.run(check_rooted_disagreement, "general", kind)
    assert short == general, (short, general)
    assert all("rank 1" in message for message in short), short
    what = "int64" if kind == "dtype" else "3 elements"
    assert any(what in message for message in short), short


def test_split_all_to_all_same_as_general_path(pool):
    pool.run(check_split_same_as_communicator)


def test_rank_and_size_are_torch_s(pool):
    pool.run(check_rank_and_size)


def test_send_recv_short_and_general(pool):
    pool.run(check_p2p_short_and_general)


def test_communicator_without_inline_lane(pool):
    pool.run(check_other_communicator)
