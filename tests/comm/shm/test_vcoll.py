"""Collectives of unequal sizes on the communicators (``all_to_all_v``, ``gather``, ``scatter``,
``all_gather_v``, ``reduce_scatter_v``), on 2 and 3 real ranks.

Every rank builds the pieces every rank sends from one rule (:func:`_piece`: sizes that differ
by pair, zero included), so each output is checked exactly against what its sender made. shm
runs its own schedule (the sizes agreed inside the call); gloo and hier the shared default (the
sizes gathered, then a padded all-to-all). A slot of 4 KiB makes larger pieces take several
rounds.
"""

from __future__ import annotations

import os

import pytest
import torch

from fastcomm.comm.shm import ShmCommunicator, ShmOptions
from fastcomm.comm.vcoll import SizesDisagreement
from tests.harness import STATE, env_rank, pool_fixture, rank_comm, rank_store

pytestmark = pytest.mark.timeout(180)

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32",
          "int64", "bool", "complex64", "uint16"]
SMALL = dict(slot_bytes=4096, one_shot_max=1024, mbox_bytes=4096)


def _comm(backend: str):
    """``backend``'s communicator; ``shm_small``: 4 KiB slots (several rounds), ``shm_mixed``:
    the compiled core on even ranks only (the two paths interoperate)."""
    if backend not in ("shm_small", "shm_mixed"):
        return rank_comm(backend)
    comm = STATE.get(backend)
    if comm is None or comm.closed:
        rank = env_rank()
        STATE["gen"] = STATE.get("gen", 0) + 1
        options = ShmOptions(**SMALL) if backend == "shm_small" else ShmOptions(
            compiled=rank % 2 == 0)
        comm = STATE[backend] = ShmCommunicator(
            rank_store().prefixed(f"{backend}-{STATE['gen']}", rank=rank), rank,
            int(os.environ["WORLD_SIZE"]), 30.0, options=options,
        )
    return comm


def _numel(q: int, r: int, scale: int) -> int:
    """Elements rank ``q`` sends rank ``r``: differ by pair, zero for some."""
    return ((3 * q + 5 * r + 1) % 4) * scale


def _piece(q: int, r: int, scale: int, dtype: torch.dtype) -> torch.Tensor:
    n = _numel(q, r, scale)
    values = torch.arange(n, dtype=torch.int64) * 7 + 100 * q + 10 * r
    if dtype is torch.bool:
        return values % 3 == 0
    return (values % 120).to(dtype)


def check_all_to_all_v(backend: str, dtype_name: str, scale: int, async_op: bool):
    comm, me = _comm(backend), env_rank()
    n = comm.size
    dtype = getattr(torch, dtype_name)
    inputs = [_piece(me, r, scale, dtype) for r in range(n)]
    outputs = [torch.full((_numel(q, me, scale),), 1, dtype=dtype) for q in range(n)]
    work = comm.all_to_all_v(outputs, inputs, async_op=async_op)
    if async_op:
        work.wait()
    for q in range(n):
        assert torch.equal(outputs[q], _piece(q, me, scale, dtype)), (q, outputs[q])
    return "ok"


def check_all_to_all_split(backend: str, scale: int, in_place: bool):
    """Row blocks of one tensor each side (torch's all_to_all_single with split sizes), rows of
    width 3; in place: one tensor as both (equal splits both ways)."""
    comm, me = _comm(backend), env_rank()
    n = comm.size
    sends = [_numel(me, r, scale) for r in range(n)]
    recvs = [_numel(q, me, scale) for q in range(n)]
    if in_place:
        sends = recvs = [scale] * n
    def block(q: int, r: int, count: int) -> torch.Tensor:  # rows rank q sends rank r
        return (torch.arange(count * 3, dtype=torch.float32) + 1000 * q + 100 * r).view(-1, 3)

    rows = torch.cat([block(me, r, sends[r]) for r in range(n)])
    out = rows if in_place else torch.full((sum(recvs), 3), -1.0)
    comm.all_to_all_split(out, rows, recvs, sends)
    want = torch.cat([block(q, me, count) for q, count in enumerate(recvs)])
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="input_splits"):
        comm.all_to_all_split(out, rows, recvs, [count + 1 for count in sends])
    return "ok"


def check_gather_scatter(backend: str, dtype_name: str, scale: int, root: int):
    comm, me = _comm(backend), env_rank()
    n = comm.size
    dtype = getattr(torch, dtype_name)
    mine = _piece(me, root, scale, dtype)
    got = [torch.zeros(_numel(q, root, scale), dtype=dtype) for q in range(n)]
    comm.gather(got if me == root else None, mine, root)
    if me == root:
        for q in range(n):
            assert torch.equal(got[q], _piece(q, root, scale, dtype))
    out = torch.zeros(_numel(root, me, scale), dtype=dtype)
    sent = [_piece(root, r, scale, dtype) for r in range(n)] if me == root else None
    comm.scatter(out, sent, root, async_op=True).wait()
    assert torch.equal(out, _piece(root, me, scale, dtype))
    return "ok"


def check_all_gather_and_reduce_scatter_v(backend: str, scale: int):
    comm, me = _comm(backend), env_rank()
    n = comm.size
    sizes = [_numel(q, 0, scale) + q for q in range(n)]
    outs = [torch.empty(sizes[q], dtype=torch.int32) for q in range(n)]
    comm.all_gather_v(outs, torch.arange(sizes[me], dtype=torch.int32) + 1000 * me)
    for q in range(n):
        assert outs[q].tolist() == [1000 * q + i for i in range(sizes[q])]
    # rank r's output: sum over q of rank q's inputs[r] (integers in float: exact)
    inputs = [torch.arange(sizes[r], dtype=torch.float32) * (me + 1) for r in range(n)]
    out = torch.empty(sizes[me])
    comm.reduce_scatter_v(out, inputs, "sum")
    want = torch.arange(sizes[me], dtype=torch.float32) * sum(q + 1 for q in range(n))
    assert torch.equal(out, want)
    out2 = torch.empty(sizes[me])
    comm.reduce_scatter_v(out2, inputs, "max", async_op=True).wait()
    assert torch.equal(out2, torch.arange(sizes[me], dtype=torch.float32) * n)
    return "ok"


def check_disagreement(backend: str, what: str):
    """Both ranks raise ``SizesDisagreement`` with the same text; the communicator still
    works."""
    comm, me = _comm(backend), env_rank()
    n = comm.size
    with pytest.raises(SizesDisagreement) as info:
        if what == "size":
            outs = [torch.empty(2) for _ in range(n)]
            ins = [torch.ones(2 + (me == 1 and r == 0)) for r in range(n)]
            comm.all_to_all_v(outs, ins)
        elif what == "root":
            comm.gather([torch.empty(2) for _ in range(n)], torch.ones(2), root=me % 2)
        else:  # dtype
            dtype = torch.float32 if me else torch.int32
            comm.all_gather_v([torch.empty(2, dtype=dtype)] * n, torch.ones(2, dtype=dtype))
    assert isinstance(info.value, ValueError)
    t = torch.ones(3)
    comm.all_reduce(t)
    assert t.tolist() == [float(n)] * 3
    return str(info.value).split(": ", 1)[1]


def check_bad_input():
    comm = _comm("shm")
    n = comm.size
    with pytest.raises(ValueError, match="one per rank"):
        comm.all_to_all_v([torch.empty(1)], [torch.empty(1)] * n)
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_to_all_v([torch.empty(1)] * n, [torch.ones(4, 2).t()] * n)
    with pytest.raises(TypeError, match="dtype"):
        comm.all_to_all_v([torch.empty(1, dtype=torch.int8)] * n, [torch.empty(1)] * n)
    with pytest.raises(ValueError, match="root"):
        comm.gather(None, torch.ones(1), root=n)
    return "ok"


def check_overlap():
    """An all_to_all_v whose outputs alias its inputs (one buffer, in place)."""
    comm, me = _comm("shm"), env_rank()
    n = comm.size
    buf = torch.arange(n * 3, dtype=torch.float32) + 100 * me
    pieces = list(buf.split(3))
    comm.all_to_all_v(pieces, pieces)
    want = torch.cat([torch.arange(3, dtype=torch.float32) + 3 * me + 100 * q for q in range(n)])
    assert torch.equal(buf, want)
    return "ok"


def check_compiled_core_taken():
    """A v-call whose pieces from this rank fit one round starts in the compiled core where it
    was built (the core says when a peer's pieces need more rounds); on 4 KiB slots at scale
    1500 some ranks' pieces do not fit, and those ranks run round 0 in Python."""
    from fastcomm.comm.shm import core

    if not core.BUILT:
        pytest.skip("the compiled core was not built")
    taken = []
    me, n = env_rank(), int(os.environ["WORLD_SIZE"])
    for backend, scale in (("shm", 1), ("shm_small", 1500)):
        v = _comm(backend)._v
        pieces = [_numel(me, r, scale) * 4 for r in range(n) if r != me and _numel(me, r, scale)]
        rounds = int(all(b <= v.rooms[len(pieces)] for b in pieces))
        inner = v.compiled.v_call
        v.compiled.v_call = lambda *a, inner=inner: taken.append(a) or inner(*a)
        try:
            check_all_to_all_v(backend, "float32", scale, False)
        finally:
            del v.compiled.v_call
        assert len(taken) == rounds, (backend, taken)
        taken.clear()
    return "ok"


pool = pool_fixture([2, 3], env={"OMP_NUM_THREADS": "1"}, timeout=120)


BACKENDS = ["shm", "shm_small", "shm_mixed", "gloo", "hier"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1, 1500], ids=["small", "rounds"])
def test_all_to_all_v_values(pool, backend, scale):
    for async_op in (False, True):
        assert pool.run(check_all_to_all_v, backend, "float32", scale, async_op) == ["ok"] * \
            pool.world_size


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_to_all_split(pool, backend):
    for scale in (1, 500):
        for in_place in (False, True):
            pool.run(check_all_to_all_split, backend, scale, in_place)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all_v_every_dtype(pool, dtype):
    for backend in ("shm", "shm_small", "shm_mixed"):
        for scale in (1, 700):
            pool.run(check_all_to_all_v, backend, dtype, scale, False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_scatter(pool, backend):
    for root in range(pool.world_size):
        for scale in (1, 1100):
            pool.run(check_gather_scatter, backend, "float64", scale, root)
    pool.run(check_gather_scatter, backend, "bool", 3, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_gather_v_and_reduce_scatter_v(pool, backend):
    for scale in (1, 900):
        pool.run(check_all_gather_and_reduce_scatter_v, backend, scale)


@pytest.mark.parametrize("backend", ["shm", "shm_small", "shm_mixed", "gloo"])
@pytest.mark.parametrize("what", ["size", "root", "dtype"])
def test_disagreement_raises_on_every_rank(pool, backend, what):
    messages = pool.run(check_disagreement, backend, what)
    assert len(set(messages)) == 1, messages  # the same text on every rank
    text = messages[0]
    if what == "size":
        assert "rank 1 sends 3 elements to rank 0, which expects 2" in text
    elif what == "root":
        assert "root 0" in text and "root 1" in text
    else:
        assert "float32" in text and "int32" in text


def test_compiled_core_taken(pool):
    pool.run(check_compiled_core_taken)


def test_bad_input_and_overlap(pool):
    pool.run(check_bad_input)
    pool.run(check_overlap)

