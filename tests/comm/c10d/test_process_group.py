"""fastcomm as a ``torch.distributed`` backend, on 2 real CPU ranks.

Every public ``torch.distributed`` call is checked twice: its result against one computed
locally, and the path it took, by counting in the ranks which method of
:class:`~fastcomm.comm.c10d.FastcommProcessGroup` torch called and what moved the data (the
communicator's own counts, or a call handed to the Gloo group beside it), so an op cannot
silently run somewhere else. Also: the ways to initialize (``env://`` through the launchers,
``tcp://``, ``file://``, ``store=``, a device map), ``new_group`` and ``DeviceMesh``, the
works' semantics, errors (bad input raises on every rank, a missing rank is named within the
group's timeout), and ``fastcomm.ddp.DDP`` on a group of this backend (no second wrap).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import fastcomm  # noqa: F401 - registers the backend
from tests.harness import (
    STATE,
    env_rank,
    env_world,
    free_port,
    poll_barrier,
    poll_keys,
    pool_fixture,
    rank_store,
)

pytestmark = pytest.mark.timeout(240)


def _store(name: str) -> dist.Store:
    """A namespace of the pool's store that no other check uses."""
    STATE["c10d_inits"] = STATE.get("c10d_inits", 0) + 1
    return dist.PrefixStore(f"c10d/{name}/{STATE['c10d_inits']}", rank_store().torch_store)


def _reinit(backend: str = "fastcomm", name: str = "main", timeout: float = 60, **kwargs):
    """``init_process_group`` in this rank (after destroying a previous one)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if "init_method" not in kwargs:
        kwargs["store"] = _store(name)
    dist.init_process_group(
        backend, rank=env_rank(), world_size=env_world(), timeout=timedelta(seconds=timeout),
        **kwargs,
    )


def _main():
    """The default group of the fastcomm backend the checks share (made once per rank)."""
    from fastcomm.comm.c10d import FastcommProcessGroup

    if not isinstance(dist.distributed_c10d._world.default_pg, FastcommProcessGroup):
        _reinit()
    return dist.group.WORLD


# ---------------------------------------------------------------------- registration
def test_import_registers_the_backend():
    assert "fastcomm" in dist.Backend.backend_list
    assert dist.Backend("fastcomm") == "fastcomm"
    assert dist.Backend.backend_capability["fastcomm"] == ["cpu", "cuda"]
    assert dist.is_backend_available("fastcomm")


# ---------------------------------------------------------------------- initialization
_DEVICE_MAPS = {"device_map": "cpu:fastcomm,cuda:gloo", "device_map_nccl": "cpu:fastcomm,cuda:nccl"}


def check_init_form(form: str):
    from fastcomm.comm.c10d import FastcommProcessGroup

    rank, world = env_rank(), env_world()
    STATE["forms"] = STATE.get("forms", 0) + 1
    key = f"c10d/form/{form}/{STATE['forms']}"
    if form == "tcp":  # a port the system found free, handed to every rank; rank 0 serves it
        port = rank_store().broadcast_object(key, free_port(), is_source=rank == 0)
        agent = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE")  # else every rank is a client
        try:
            _reinit(init_method=f"tcp://127.0.0.1:{port}")
        finally:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent
    elif form == "file":
        path = os.path.join(tempfile.mkdtemp(), "rendezvous")
        path = rank_store().broadcast_object(key, path, is_source=rank == 0)
        _reinit(init_method=f"file://{path}")
    elif form == "store":
        _reinit(name=form)
    elif form in _DEVICE_MAPS:  # CPU tensors on fastcomm; CUDA ones would go to the other
        _reinit(_DEVICE_MAPS[form], name=form)
    group = dist.group.WORLD
    assert type(group) is FastcommProcessGroup
    assert dist.get_backend() == _DEVICE_MAPS.get(form, "fastcomm")
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [world * (world + 1) / 2] * 5
    assert group.communicator.stats.calls.get("all_reduce") == 1
    assert group._device_types == [torch.device("cpu")]
    dist.destroy_process_group()
    assert group.communicator.closed


# ---------------------------------------------------------------------- what runs where
# The methods of FastcommProcessGroup torch may call; each is counted in the ranks.
_METHODS = (
    "allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "all_gather_single",
    "_allgather_base", "all_gather_single_coalesced", "allgather_into_tensor_coalesced",
    "allgather_coalesced", "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "all_to_all_single",
    "alltoall_base", "alltoall", "barrier", "send", "recv", "recv_anysource", "gather",
    "scatter",
)


@contextmanager
def _counting(group):
    """Counts, while inside, the group's methods torch calls, the communicator's operations
    and the calls handed to Gloo: ``(methods, comm_ops, gloo_ops, agreed)``. A collective handed
    to Gloo is preceded by a comparison of its sizes across the ranks, an ``all_reduce`` of the
    communicator counted in ``agreed`` (by op), not in ``comm_ops``."""
    cls = type(group)
    saved = {name: getattr(cls, name) for name in _METHODS + ("_forward",)}
    own = {name for name in saved if name in cls.__dict__}  # the rest come from a mixin
    methods, gloo = Counter(), Counter()

    def counted(name, fn):
        def wrapper(self, *args, **kwargs):
            (gloo if name == "_forward" else methods)[args[0] if name == "_forward" else name] += 1
            return fn(self, *args, **kwargs)

        return wrapper

    for name, fn in saved.items():
        setattr(cls, name, counted(name, fn))
    before = Counter(group.communicator.stats.calls)
    agreed_before = Counter(group.agreed)
    comm_ops, agreed = Counter(), Counter()
    try:
        yield methods, comm_ops, gloo, agreed
    finally:
        for name, fn in saved.items():
            if name in own:
                setattr(cls, name, fn)
            else:
                delattr(cls, name)
        agreed.update(Counter(group.agreed) - agreed_before)
        comm_ops.update(Counter(group.communicator.stats.calls) - before)
        comm_ops.subtract({"all_reduce": agreed.total()})
        for op in [op for op, count in comm_ops.items() if count == 0]:
            del comm_ops[op]  # in place: the caller holds this object


def _val(rank: int, n: int = 4, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) + 10 * (rank + 1)).to(dtype)


def _all_ranks(fn) -> list:
    return [fn(r) for r in range(env_world())]


def case_all_reduce_sum(r, n):
    t = _val(r)
    dist.all_reduce(t)
    return t, sum(_all_ranks(_val))


def case_all_reduce_ops(r, n):
    got, want = [], []
    for op, fold in ((dist.ReduceOp.MAX, torch.maximum), (dist.ReduceOp.MIN, torch.minimum),
                     (dist.ReduceOp.PRODUCT, torch.mul)):
        t = _val(r)
        dist.all_reduce(t, op=op)
        ref = _val(0)
        for other in range(1, n):
            ref = fold(ref, _val(other))
        got.append(t)
        want.append(ref)
    t = _val(r, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    got.append(t)
    want.append(sum(_all_ranks(lambda q: _val(q, dtype=torch.int64))) // n)
    return torch.cat(got), torch.cat(want)


def case_all_reduce_premul(r, n):
    a, b = _val(r), _val(r)
    dist.all_reduce(a, op=dist._make_nccl_premul_sum(0.5 * (r + 1)))
    dist.all_reduce(b, op=dist._make_nccl_premul_sum(torch.tensor(2.0)))
    want_a = sum(_val(q) * (0.5 * (q + 1)) for q in range(n))
    return torch.cat([a, b]), torch.cat([want_a, sum(_val(q) * 2.0 for q in range(n))])


def case_all_reduce_complex(r, n):
    t = torch.complex(_val(r), -_val(r))
    dist.all_reduce(t)
    want = sum(torch.complex(_val(q), -_val(q)) for q in range(n))
    return torch.view_as_real(t), torch.view_as_real(want)


def case_all_reduce_sparse(r, n):
    t = torch.sparse_coo_tensor([[r, 3]], [float(r + 1), 1.0], (4,))
    dist.all_reduce(t)
    want = torch.zeros(4)
    for q in range(n):
        want += torch.sparse_coo_tensor([[q, 3]], [float(q + 1), 1.0], (4,)).to_dense()
    return t.to_dense(), want


def case_all_reduce_bool_band(r, n):  # extra dtype, bitwise op: on the communicator
    flags = torch.tensor([True, r == 0, False])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bits = torch.tensor([0b111, 0b101 if r == 0 else 0b110])
    dist.all_reduce(bits, op=dist.ReduceOp.BAND)
    return torch.cat([flags.long(), bits]), torch.tensor([1, 1, 0, 0b111, 0b100])


def case_non_contiguous(r, n):  # through a contiguous copy, written back
    grid = torch.stack([_val(r)] * 3, dim=1)  # columns are non-contiguous
    dist.all_reduce(grid[:, 0])
    dist.broadcast(grid[:, 1], src=n - 1)
    dist.reduce(grid[:, 2], dst=0)
    want = torch.stack([sum(_all_ranks(_val)), _val(n - 1),
                        sum(_all_ranks(_val)) if r == 0 else _val(r)], dim=1)
    return grid, want


def case_all_reduce_coalesced(r, n):
    a, b = _val(r), _val(r, 3)
    dist.all_reduce_coalesced([a, b])
    with dist._coalescing_manager(async_ops=True) as cm:
        c = _val(r)
        dist.all_reduce(c)
    cm.wait()
    want = [sum(_all_ranks(_val)), sum(_all_ranks(lambda q: _val(q, 3)))]
    return torch.cat([a, b, c]), torch.cat([want[0], want[1], want[0]])


def case_functional_all_reduce(r, n):
    out = funcol.all_reduce(_val(r), "sum", dist.group.WORLD).wait()
    return out, sum(_all_ranks(_val))


def case_broadcast(r, n):
    t, mask = _val(r), torch.tensor([r == 0, True, r == 1])
    dist.broadcast(t, src=n - 1)
    dist.broadcast(mask, src=0)  # bool: moved as bytes
    return torch.cat([t, mask.float()]), torch.cat([_val(n - 1), torch.tensor([1.0, 1.0, 0.0])])


def case_reduce(r, n):
    t, s = _val(r), _val(r)
    dist.reduce(t, dst=0)
    dist.reduce(s, dst=n - 1, op=dist._make_nccl_premul_sum(2.0))
    want_t = sum(_all_ranks(_val)) if r == 0 else _val(r)
    want_s = sum(_val(q) * 2.0 for q in range(n)) if r == n - 1 else _val(r)
    return torch.cat([t, s]), torch.cat([want_t, want_s])


def case_all_gather(r, n):
    outs = [torch.empty(2, 2) for _ in range(n)]
    dist.all_gather(outs, _val(r).view(2, 2))
    return torch.stack(outs), torch.stack([_val(q).view(2, 2) for q in range(n)])


def case_all_gather_into_tensor(r, n):
    out = torch.empty(n, 4)
    dist.all_gather_into_tensor(out, _val(r))
    inplace = torch.zeros(n * 4)
    inplace[r * 4:(r + 1) * 4] = _val(r)
    dist.all_gather_into_tensor(inplace, inplace[r * 4:(r + 1) * 4])  # FSDP2's in-place form
    want = torch.stack(_all_ranks(_val))
    return torch.cat([out.view(-1), inplace]), torch.cat([want.view(-1), want.view(-1)])


def case_all_gather_object(r, n):
    got = [None] * n
    dist.all_gather_object(got, {"rank": r})
    return torch.tensor([g["rank"] for g in got]), torch.arange(n)


def case_functional_all_gather(r, n):
    out = funcol.all_gather_tensor(_val(r), 0, dist.group.WORLD).wait()
    pair = funcol.all_gather_into_tensor_coalesced([_val(r), _val(r, 2)], dist.group.WORLD)
    pair = [p.wait() if hasattr(p, "wait") else p for p in pair]
    got = torch.cat([out, *pair])
    want = torch.cat([torch.cat(_all_ranks(_val)), torch.cat(_all_ranks(_val)),
                      torch.cat(_all_ranks(lambda q: _val(q, 2)))])
    return got, want


def case_reduce_scatter(r, n):
    out = torch.empty(4)
    dist.reduce_scatter(out, [_val(r) * (j + 1) for j in range(n)])
    return out, sum(_val(q) * (r + 1) for q in range(n))


def case_reduce_scatter_tensor(r, n):
    out, scaled = torch.empty(2), torch.empty(2)
    inp = torch.cat([_val(r, 2) * (j + 1) for j in range(n)])
    dist.reduce_scatter_tensor(out, inp)
    dist.reduce_scatter_tensor(scaled, inp, op=dist._make_nccl_premul_sum(0.5))
    want = sum(_val(q, 2) * (r + 1) for q in range(n))
    assert inp.equal(torch.cat([_val(r, 2) * (j + 1) for j in range(n)]))  # input untouched
    return torch.cat([out, scaled]), torch.cat([want, want * 0.5])


def case_functional_reduce_scatter(r, n):
    inp = torch.cat([_val(r, 2) * (j + 1) for j in range(n)])
    one = funcol.reduce_scatter_tensor(inp, "sum", 0, dist.group.WORLD).wait()
    pair = funcol.reduce_scatter_tensor_coalesced([inp, inp * 2], "sum", [0, 0], dist.group.WORLD)
    pair = [p.wait() if hasattr(p, "wait") else p for p in pair]
    want = sum(_val(q, 2) * (r + 1) for q in range(n))
    return torch.cat([one, *pair]), torch.cat([want, want, want * 2])


def case_all_to_all_single(r, n):
    out = torch.empty(n * 2)
    dist.all_to_all_single(out, torch.cat([_val(r, 2) + j for j in range(n)]))
    return out, torch.cat([_val(q, 2) + r for q in range(n)])


def case_all_to_all_uneven(r, n):  # explicit split sizes: one v-call
    sends = [j + 1 for j in range(n)]  # rank r sends j + 1 elements to rank j
    recvs = [r + 1] * n
    inp = torch.cat([torch.full((j + 1,), float(10 * r + j)) for j in range(n)])
    out = torch.empty(sum(recvs))
    dist.all_to_all_single(out, inp, recvs, sends)
    return out, torch.cat([torch.full((r + 1,), float(10 * q + r)) for q in range(n)])


def case_all_to_all_list(r, n):
    outs = [torch.empty(3) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((3,), float(10 * r + j)) for j in range(n)])
    return torch.cat(outs), torch.cat([torch.full((3,), float(10 * q + r)) for q in range(n)])


def case_barrier(r, n):
    dist.barrier()
    return torch.ones(1), torch.ones(1)


def case_send_recv(r, n):
    t = _val(r)
    if r == 0:
        dist.send(t, 1)
        dist.recv(t)  # from any source
    elif r == 1:
        dist.recv(t, 0)
        dist.send(t * 2, 0)
    ops = [dist.P2POp(dist.isend, _val(r), (r + 1) % n),
           dist.P2POp(dist.irecv, got := torch.empty(4), (r - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    want = {0: _val(0) * 2, 1: _val(0)}.get(r, _val(r))
    return torch.cat([t, got]), torch.cat([want, _val((r - 1) % n)])


def case_gather_scatter(r, n):
    got = [torch.empty(4) for _ in range(n)] if r == 0 else None
    dist.gather(_val(r), got, dst=0)
    out = torch.empty(4)
    dist.scatter(out, [_val(j) * 3 for j in range(n)] if r == n - 1 else None, src=n - 1)
    gathered = torch.stack(got) if r == 0 else torch.stack(_all_ranks(_val))
    return torch.cat([gathered.view(-1), out]), torch.cat([torch.stack(_all_ranks(_val)).view(-1),
                                                           _val(r) * 3])


# case -> ({method torch calls: count}, {communicator op or "gloo:<method>": count})
CASES = {
    case_all_reduce_sum: ({"allreduce": 1}, {"all_reduce": 1}),
    case_all_reduce_ops: ({"allreduce": 4}, {"all_reduce": 4}),
    case_all_reduce_premul: ({"allreduce": 2}, {"all_reduce": 2}),
    case_all_reduce_complex: ({"allreduce": 1}, {"all_reduce": 1}),
    case_all_reduce_sparse: ({"allreduce": 1}, {"all_reduce": 1}),
    case_all_reduce_bool_band: ({"allreduce": 2}, {"all_reduce": 2}),
    case_non_contiguous: (
        {"allreduce": 1, "broadcast": 1, "reduce": 1},
        {"all_reduce": 1, "broadcast": 1, "reduce": 1},
    ),
    case_all_reduce_coalesced: ({"allreduce_coalesced": 2}, {"all_reduce": 3}),
    case_functional_all_reduce: ({"allreduce": 1}, {"all_reduce": 1}),
    case_broadcast: ({"broadcast": 2}, {"broadcast": 2}),
    case_reduce: ({"reduce": 2}, {"reduce": 2}),
    case_all_gather: ({"allgather": 1}, {"all_gather": 1}),
    case_all_gather_into_tensor: ({"all_gather_single": 2}, {"all_gather": 2}),
    # the sizes, then the pickled objects (padded to the longest)
    case_all_gather_object: ({"allgather": 2}, {"all_gather": 2}),
    case_functional_all_gather: ({"all_gather_single_coalesced": 2}, {"all_gather": 3}),
    case_reduce_scatter: ({"reduce_scatter": 1}, {"reduce_scatter": 1}),
    case_reduce_scatter_tensor: ({"reduce_scatter_single": 2}, {"reduce_scatter": 2}),
    case_functional_reduce_scatter: (
        {"reduce_scatter_single_coalesced": 2}, {"reduce_scatter": 3}
    ),
    case_all_to_all_single: ({"all_to_all_single": 1}, {"all_to_all": 1}),
    case_all_to_all_uneven: ({"all_to_all_single": 1}, {"all_to_all": 1}),
    case_all_to_all_list: ({"alltoall": 1}, {"all_to_all": 1}),
    case_barrier: ({"barrier": 1}, {"barrier": 1}),
    case_gather_scatter: ({"gather": 1, "scatter": 1}, {"gather": 1, "scatter": 1}),
}
# rank 0 of 2: a send and an any-source receive, then one of each in the batch (on the shm
# communicator's tagged engine, counted as its send and recv)
P2P = ({"send": 2, "recv_anysource": 1, "recv": 1}, {"send": 2, "recv": 2})


def check_collectives(names: list[str]):
    group = _main()
    rank, world = env_rank(), env_world()
    report = {}
    for case in [c for c in (*CASES, case_send_recv) if c.__name__ in names]:
        want_methods, want_moves = P2P if case is case_send_recv else CASES[case]
        with _counting(group) as (methods, comm_ops, gloo, agreed):
            got, want = case(rank, world)
        moves = Counter(comm_ops) + Counter({f"gloo:{k}": v for k, v in gloo.items()})
        # every collective handed to Gloo, and nothing else, was compared across the ranks
        p2p = ("send", "recv", "recv_anysource")
        assert agreed == Counter({k: v for k, v in gloo.items() if k not in p2p}), (
            f"{case.__name__}: handed to Gloo {gloo}, compared first {agreed}"
        )
        if case is case_send_recv and rank != 0:
            want_methods = want_moves = None  # rank 0's counts are the ones written down
        torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0)
        if want_methods is not None:
            assert dict(methods) == want_methods, f"{case.__name__}: torch called {methods}"
            assert dict(moves) == want_moves, f"{case.__name__}: moved by {moves}"
        report[case.__name__] = "ok"
    return report


# ---------------------------------------------------------------------- works
def check_work_semantics():
    from fastcomm.comm.c10d import FastcommWork, FinishedWork
    from fastcomm.comm.errors import CommTimeoutError

    group = _main()
    rank, world = env_rank(), env_world()
    # a synchronous call finished before it returned; its work says so
    done = group.allreduce([torch.ones(2)], _sync_opts())
    assert isinstance(done, FinishedWork) and isinstance(done, dist._Work)
    assert done.wait() and done.is_completed() and done.get_future().value()[0].tolist() == [2, 2]
    # an asynchronous one: wait with a limit, is_completed, a future chained with then()
    t = torch.full((3,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    assert isinstance(work, FastcommWork)
    doubled = work.get_future().then(lambda f: f.value()[0] * 2)
    assert work.wait(timedelta(seconds=30)) is True and work.is_completed()
    assert work.is_success() and work.exception() is None
    assert doubled.wait().tolist() == [2.0 * world * (world + 1) / 2] * 3
    assert work.result()[0] is t
    # a peer that comes late: the work is pending, a short wait raises and leaves it running;
    # rank 1 comes once rank 0 has looked (not after a fixed sleep: a rank 0 slower than that
    # on a busy machine found the work completed)
    late = f"late/{STATE.setdefault('late', 0)}"
    STATE["late"] += 1
    rank_store().barrier(late, world, 30)
    if rank == 1:
        poll_keys(rank_store(), [f"{late}/looked"], timeout=60)
    pending = dist.all_reduce(torch.ones(2), async_op=True)
    if rank == 0:
        assert not pending.is_completed()
        with pytest.raises(CommTimeoutError, match="allreduce|all_reduce"):
            pending.wait(timedelta(milliseconds=100))
        rank_store().set(f"{late}/looked", "1")
    assert pending.wait() and pending.is_completed()
    # an asynchronous gather (a v-call): its future gives the outputs
    out = [torch.empty(2) for _ in range(world)] if rank == 0 else []
    outputs = [out] if rank == 0 else []
    gathered = group.gather(outputs, [torch.full((2,), float(rank))], _gather_opts())
    assert gathered.get_future().wait() == outputs
    if rank == 0:
        assert torch.stack(out)[:, 0].tolist() == list(map(float, range(world)))
    return "ok"


def _sync_opts():
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    return opts


def _gather_opts():
    opts = dist.GatherOptions()
    opts.rootRank = 0
    return opts


def check_ddp_comm_hook():
    """torch DDP with a Python comm hook over this backend's futures (``then`` chains)."""
    from torch.nn.parallel import DistributedDataParallel

    _main()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))

    def hook(state, bucket):
        fut = dist.group.WORLD.allreduce([bucket.buffer()]).get_future()
        return fut.then(lambda f: f.value()[0] / dist.get_world_size())

    model.register_comm_hook(None, hook)
    torch.manual_seed(1 + env_rank())
    x = torch.randn(3, 4)
    model(x).sum().backward()
    grads = torch.cat([p.grad.view(-1) for p in model.parameters()])
    everyone = [torch.empty_like(grads) for _ in range(env_world())]
    dist.all_gather(everyone, grads)
    assert all(g.equal(grads) for g in everyone)
    return "ok"


# ---------------------------------------------------------------------- errors
def check_bad_input_raises_everywhere():
    group = _main()
    rank, world = env_rank(), env_world()
    message = None
    try:  # every rank passes the same wrong size: every rank raises before sending
        dist.all_gather_into_tensor(torch.empty(world * 3 + 1), torch.ones(3))
    except ValueError as exc:
        message = str(exc)
    assert message and "all_gather" in message and str(world * 3 + 1) in message
    opts = dist.BroadcastOptions()
    opts.rootRank = world + 3
    with pytest.raises(ValueError, match=f"src={world + 3}"):
        group.broadcast([torch.ones(2)], opts)
    t = torch.full((2,), float(rank))  # still in step with the peers
    dist.all_reduce(t)
    assert t.tolist() == [world * (world - 1) / 2] * 2
    return "ok"


def _sized(r: int, dtype=torch.float32) -> torch.Tensor:
    return torch.ones(4 + r, dtype=dtype)


def _dtyped(r: int, n: int = 4) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float32 if r == 0 else torch.float64)


# name -> (the call rank r makes on group g; what both ranks' errors say). The fast path's are
# the communicator's own check; the rest are handed to Gloo after the ranks compared them.
DISAGREEMENTS = {
    "all_reduce_size": (lambda r, g: dist.all_reduce(_sized(r), group=g),
                        ["mismatch", "4 elements", "5 elements"]),
    "all_reduce_dtype": (lambda r, g: dist.all_reduce(_dtyped(r), group=g),
                         ["mismatch", "float32", "float64"]),
    "all_reduce_async_size": (lambda r, g: dist.all_reduce(_sized(r), group=g,
                                                           async_op=True).wait(),
                              ["mismatch", "4 elements", "5 elements"]),
    "all_gather_into_tensor_size": (
        lambda r, g: dist.all_gather_into_tensor(torch.empty(2 * (4 + r)), _sized(r), group=g),
        ["mismatch", "4 elements", "5 elements"]),
    "reduce_scatter_tensor_dtype": (
        lambda r, g: dist.reduce_scatter_tensor(_dtyped(r, 2), _dtyped(r, 4), group=g),
        ["mismatch", "float32", "float64"]),
    "broadcast_size": (lambda r, g: dist.broadcast(_sized(r), 0, group=g),
                       ["mismatch", "4 elements", "5 elements"]),
    "all_reduce_bool_size": (
        lambda r, g: dist.all_reduce(_sized(r, torch.bool), group=g),
        ["mismatch", "all_reduce(bool, 4 elements", "all_reduce(bool, 5 elements"]),
    "all_reduce_band_dtype": (
        lambda r, g: dist.all_reduce(torch.ones(3, dtype=torch.int32 if r else torch.int64),
                                     op=dist.ReduceOp.BAND, group=g),
        ["mismatch", "all_reduce(int64, 3 elements, op band",
         "all_reduce(int32, 3 elements, op band"]),
    "v_gather_size": (
        lambda r, g: dist.gather(_sized(r), [torch.empty(4)] * 2 if r == 0 else None, 0,
                                 group=g),
        ["gather: collective mismatch",
         "rank 1 sends 5 elements to rank 0, which expects 4"]),
    "v_gather_root": (
        lambda r, g: dist.gather(torch.ones(2), [torch.empty(2)] * 2, r, group=g),
        ["rank 0 called gather(float32, root 0", "rank 1 called gather(float32, root 1"]),
    "v_scatter_size": (
        lambda r, g: dist.scatter(_sized(r), [torch.ones(4)] * 2 if r == 0 else None, 0,
                                  group=g),
        ["scatter: collective mismatch",
         "rank 0 sends 4 elements to rank 1, which expects 5"]),
    "v_all_to_all_single_splits": (
        lambda r, g: dist.all_to_all_single(torch.empty(3), torch.ones(3), [1, 2],
                                            [1, 2] if r == 0 else [2, 1], group=g),
        ["all_to_all: collective mismatch",
         "rank 0 sends 2 elements to rank 1, which expects 1"]),
    "v_all_to_all_list": (
        lambda r, g: dist.all_to_all([torch.empty(2)] * 2, [torch.ones(2), torch.ones(2 + r)],
                                     group=g),
        ["all_to_all: collective mismatch",
         "rank 1 sends 3 elements to rank 1, which expects 2"]),
}


def check_disagreement(name: str):
    """Both ranks call ``name``'s collective with sizes or dtypes that disagree: each raises
    within a second and says what each rank called; a group whose call was handed to Gloo is
    still usable afterwards (Gloo never saw it)."""
    _main()
    # the fast path's communicator refuses every later call once the ranks disagreed: a group
    # of its own
    group = dist.new_group(timeout=timedelta(seconds=30))
    call, _ = DISAGREEMENTS[name]
    start = time.monotonic()
    with pytest.raises((ValueError, RuntimeError)) as info:
        call(env_rank(), group)
    elapsed = time.monotonic() - start
    assert elapsed < 5, f"{name} raised after {elapsed:.1f} s"
    if name.startswith("v_"):  # agreed inside the v-call: every rank took part
        assert isinstance(info.value, ValueError), info.value
    if name.startswith(("gloo_", "v_")):
        assert name.startswith("v_") or type(info.value) is ValueError, info.value
        t = torch.ones(2)
        dist.all_reduce(t, group=group)
        assert t.tolist() == [float(env_world())] * 2
    dist.destroy_process_group(group)
    return str(info.value)


def check_missing_rank(timeout_s: float):
    """Rank 1 never calls: rank 0 raises within the group's timeout naming it and the op."""
    _main()
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))
    gloo_path = dist.new_group(timeout=timedelta(seconds=timeout_s))
    p2p = dist.new_group(timeout=timedelta(seconds=timeout_s))  # a timeout closes Gloo's pairs
    future = dist.new_group(timeout=timedelta(seconds=timeout_s))  # a timeout aborts the group
    messages = {}
    if env_rank() == 0:
        for name, call in (
            ("allreduce", lambda: dist.all_reduce(torch.ones(4), group=group)),
            ("gather", lambda: dist.gather(torch.ones(2), [torch.empty(2)] * env_world(), 0,
                                           group=gloo_path)),
            ("recv", lambda: dist.recv(torch.ones(2), src=1, group=p2p)),
            ("future", lambda: dist.all_reduce(torch.ones(4), group=future, async_op=True)
             .get_future().then(lambda f: f.value()[0] + 1).wait()),
        ):
            start = time.monotonic()
            with pytest.raises(RuntimeError) as info:
                call()
            elapsed = time.monotonic() - start
            assert elapsed < timeout_s + 5, f"{name} raised after {elapsed:.1f} s"
            messages[name] = str(info.value)
    poll_barrier(f"missing/{STATE.setdefault('missing', 0)}")
    STATE["missing"] += 1
    for g in (group, gloo_path, p2p, future):
        dist.destroy_process_group(g)
    return messages


# ---------------------------------------------------------------------- groups
def check_new_group_and_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    from fastcomm.comm.c10d import FastcommProcessGroup

    _main()
    rank, world = env_rank(), env_world()
    sub = dist.new_group(backend="fastcomm")
    assert type(sub) is FastcommProcessGroup
    assert sub.communicator is not dist.group.WORLD.communicator
    t = torch.ones(2)
    dist.all_reduce(t, group=sub)
    assert t.tolist() == [float(world)] * 2
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_group(), mesh["tp"].get_group()
    assert type(dp) is FastcommProcessGroup and type(tp) is FastcommProcessGroup
    assert (dp.size(), tp.size()) == (world, 1)
    assert dist.get_backend(dp) == "fastcomm"
    u = torch.full((2,), float(rank))
    dist.all_reduce(u, group=dp)
    dist.all_reduce(u, group=tp)
    assert u.tolist() == [world * (world - 1) / 2] * 2
    # a fastcomm group beside a Gloo default group
    _reinit("gloo", name="gloo-default")
    beside = dist.new_group(backend="fastcomm")
    assert type(beside) is FastcommProcessGroup
    v = torch.ones(3)
    dist.all_reduce(v, group=beside)
    assert v.tolist() == [float(world)] * 3
    _reinit()
    return "ok"


def check_split_group_refused():
    """torch 2.13's ``split_group`` needs a default group bound to an accelerator and a C++
    backend that splits (NCCL) before it reaches any group: on CPU it refuses Gloo and
    fastcomm alike (this pins that, so a torch that changes it is noticed)."""
    for backend in ("gloo", "fastcomm"):
        _reinit(backend, name=f"split-{backend}")
        with pytest.raises(RuntimeError, match="split"):
            dist.split_group(split_ranks=[list(range(env_world()))])
    return "ok"


def check_ddp_uses_group_communicator():
    from fastcomm.ddp import DDP

    group = _main()
    sub = dist.new_group(backend="fastcomm")
    assert group.device_communicator("cpu") is group.communicator
    for pg, expected in ((None, group.communicator), (group, group.communicator),
                         (sub, sub.communicator)):
        model = DDP(torch.nn.Linear(4, 4), process_group=pg)
        assert model.comm is expected, (model.comm, expected)
        model(torch.ones(2, 4)).sum().backward()
    return "ok"


# ---------------------------------------------------------------------- the checks
pool = pool_fixture(2, env={"OMP_NUM_THREADS": "1"}, timeout=120)


@pytest.mark.parametrize("form", ["tcp", "file", "store", "device_map", "device_map_nccl"])
def test_init_forms(pool, form):
    pool.run(check_init_form, form)


def test_collectives_results_and_paths(pool):
    names = [c.__name__ for c in (*CASES, case_send_recv)]
    assert pool.run(check_collectives, names) == [dict.fromkeys(names, "ok")] * 2


def test_work_semantics(pool):
    pool.run(check_work_semantics)


def test_torch_ddp_comm_hook_futures(pool):
    pool.run(check_ddp_comm_hook)


def test_bad_input_raises_on_every_rank(pool):
    pool.run(check_bad_input_raises_everywhere)


@pytest.mark.parametrize("name", DISAGREEMENTS)
def test_disagreement_raises_on_every_rank(pool, name):
    messages = pool.run(check_disagreement, name)
    for rank, text in enumerate(messages):
        assert text.startswith(f"rank {rank}: "), text
        for part in DISAGREEMENTS[name][1]:
            assert part in text, (part, text)


def test_missing_rank_named_within_timeout(pool):
    messages = pool.run(check_missing_rank, 1.0)[0]
    assert "all_reduce" in messages["allreduce"] and "[1] never arrived" in messages["allreduce"]
    assert "gather" in messages["gather"] and "[1] never arrived" in messages["gather"]
    assert "rank 0: recv from rank 1" in messages["recv"]
    assert "peer rank 1" in messages["recv"]
    assert "all_reduce" in messages["future"] and "[1] never arrived" in messages["future"]
    assert all("timed out" in text.lower() for text in messages.values()), messages


def test_new_group_and_device_mesh(pool):
    pool.run(check_new_group_and_mesh)


def test_split_group_refused_on_cpu(pool):
    pool.run(check_split_group_refused)


def test_fastcomm_ddp_uses_the_groups_communicator(pool):
    pool.run(check_ddp_uses_group_communicator)


# ---------------------------------------------------------------------- launchers (env://)
_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    import fastcomm
    dist.init_process_group("fastcomm")
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    comm = dist.group.WORLD.communicator
    print(f"rank {dist.get_rank()}: {t.tolist()} {type(comm).__name__}", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("launcher", ["fastcomm.launch", "torch.distributed.run"])
def test_env_init_under_launchers(tmp_path, launcher):
    from tests.launch._util import clean_env

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", "2", str(script)],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        assert f"rank {rank}: [3.0, 3.0, 3.0] ShmCommunicator" in proc.stdout, proc.stdout
