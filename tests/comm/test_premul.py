"""``PremulSum``: the sum of every rank's tensor times its factor, on 2 and 3 real ranks.

Its contract is the bits of ``tensor.mul_(factor)`` then a ``SUM`` all-reduce on the same
communicator, each rank's factor scaling its own term. The ``shm`` communicator folds the
multiply into its reduction (the compiled core, float32/float64; one-shot and two-step, several
chunks through 4 KiB slots; factors that differ between ranks take a path of their own); other
dtypes and every other backend (Gloo here) take the default path, which multiplies first.
Inputs are random floats and the factors round (1/3), so a product rounded differently, an
extra rounding or a term summed out of rank order shows up as different bits: comparisons are
exact. The 2-rank communicators are split from the
pool's three ranks (one pool for the module).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import STATE, pool_fixture, rank_comm, rank_store

FACTOR = 1.0 / 3.0
# a 4 KiB slot holds 1024 float32s: sizes of one element, a prime, several chunks (not a
# multiple of the slot, the rank count or the 64-byte slice alignment), and beyond 1 MiB
SIZES = [1, 7, 1000, 5003, 300_007]
SHM_LAYOUTS = {
    # one shot at every size (the default limit, 512 KiB / size), in pieces of one slot
    "one-shot": dict(slot_bytes=4096),
    # two steps at every size: reduce-scatter + all-gather, a chunk per slot
    "two-step": dict(slot_bytes=4096, one_shot_max=0),
    # the default layout: one shot up to 256 KiB (2 ranks), then two steps in 1 MiB chunks
    "default": dict(),
}


# ---------------------------------------------------------------------- checks (every rank)
def group_comm(backend: str, world: int, layout: str = "default"):
    """A cached communicator of ``backend`` over ranks ``0 .. world - 1`` of the pool (``None``
    on the others); ``layout`` picks the shm options."""
    import os

    from fastcomm.comm import ShmCommunicator, ShmOptions

    torch.set_num_threads(1)  # 3 ranks on 2 cores: no intra-op threads spinning besides
    if backend != "shm":
        parent = rank_comm(backend)
    else:
        parent = STATE.get(f"premul/shm/{layout}")
        if parent is None:
            rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            parent = STATE[f"premul/shm/{layout}"] = ShmCommunicator(
                rank_store().prefixed(f"premul-{layout}", rank=rank),
                rank,
                size,
                30.0,
                options=ShmOptions(**SHM_LAYOUTS[layout]),
            )
    if world == parent.size:
        return parent
    key = f"premul/{backend}/{layout}/{world}"
    if key not in STATE:
        STATE[key] = parent.split(0 if parent.rank < world else None)
    return STATE[key]


def inputs(world: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input, built from the same seeds on every rank."""
    gen = torch.Generator().manual_seed(1000 * world + numel)
    return [torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype) for _ in range(world)]


def count_default_multiplies():
    """Counts the tasks the default path wraps with a ``mul_`` (``adapt.premultiplied``)."""
    from fastcomm.comm import adapt

    real = STATE.setdefault("premul/real", adapt.premultiplied)
    calls = STATE.setdefault("premul/calls", [0])

    def counting(task, tensor, factor):
        calls[0] += 1
        return real(task, tensor, factor)

    adapt.premultiplied = counting
    return calls


def check_matches_mul_then_sum(backend, world, layout, dtype, factors):
    """Every size: ``PremulSum`` gives the bits of ``mul_`` + ``SUM`` (and, where the order
    is known, of the rank-order sum computed here); returns the results, how many times the
    default path multiplied and whether the communicator fuses the dtype."""
    from fastcomm.comm import PremulSum, ReduceOp

    comm = group_comm(backend, world, layout)
    if comm is None:
        return None
    calls = count_default_multiplies()
    before = calls[0]
    factor = factors[comm.rank]
    results = []
    for numel in SIZES:
        xs = inputs(world, numel, dtype)
        fused = xs[comm.rank].clone()
        version = fused._version
        comm.all_reduce(fused, PremulSum(factor))
        if backend == "shm":  # torch's own collectives leave the counter alone
            assert fused._version > version, "an in-place write, as torch's ops count it"
        plain = xs[comm.rank].clone()
        plain.mul_(factor)
        comm.all_reduce(plain, ReduceOp.SUM)
        assert torch.equal(fused, plain), (numel, (fused != plain).nonzero()[:5].flatten())
        if backend == "shm" or world == 2:  # shm sums in rank order; two terms commute
            expected = xs[0] * factors[0]
            for r in range(1, world):
                expected = expected + xs[r] * factors[r]
            assert torch.equal(fused, expected), numel
        async_copy = xs[comm.rank].clone()
        work = comm.all_reduce(async_copy, PremulSum(factor), async_op=True)
        work.wait()
        assert torch.equal(async_copy, plain), numel
        results.append(fused)
    return results, calls[0] - before, dtype in comm.capabilities.premul_dtypes


def check_rejected_before_anything_is_sent(backend):
    """Integer tensors, ``reduce_scatter`` and ``reduce`` refuse a ``PremulSum`` at once; the
    communicator is still in step with its peers afterwards."""
    from fastcomm.comm import PremulSum

    comm = group_comm(backend, 3)
    messages = []
    for dtype in (torch.int32, torch.int64, torch.uint8):
        t = torch.ones(5, dtype=dtype)
        with pytest.raises(TypeError, match="floating-point") as info:
            comm.all_reduce(t, PremulSum(2.0))
        assert torch.equal(t, torch.ones(5, dtype=dtype)), "untouched"
        messages.append(str(info.value))
    with pytest.raises(TypeError, match="all_reduce only") as info:
        comm.reduce_scatter(torch.zeros(2), torch.ones(2 * comm.size), PremulSum(2.0))
    messages.append(str(info.value))
    if backend == "shm":
        with pytest.raises(TypeError, match="all_reduce only") as info:
            comm.reduce(torch.ones(3), 0, PremulSum(2.0))
        messages.append(str(info.value))
    t = torch.ones(3)
    comm.all_reduce(t, PremulSum(0.5))  # still in step with the peers
    assert torch.equal(t, torch.full((3,), 0.5 * comm.size))
    empty = torch.empty(0)
    comm.all_reduce(empty, PremulSum(0.5))
    return messages


def check_mismatch_detected(name, numel):
    """Rank 0 passes ``PremulSum``, the others ``SUM``: every rank raises."""
    from fastcomm.comm import PremulSum, ReduceOp
    from tests.harness import fresh_comm

    comm = fresh_comm("shm", name, timeout=20.0)
    t = torch.ones(numel)
    try:
        comm.all_reduce(t, PremulSum(0.5) if comm.rank == 0 else ReduceOp.SUM)
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        message = str(exc)
    else:
        raise AssertionError("a PremulSum/SUM mismatch was not detected")
    comm.close()
    return message


# ---------------------------------------------------------------------- tests (parent)
pool = pool_fixture(3, timeout=120)


def core_built() -> bool:
    from fastcomm.comm.shm import core

    return core.BUILT


def assert_same_on_every_rank(results, world: int) -> None:
    ranks = [tensors for tensors, _, _ in results[:world]]
    for other in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0], other, strict=True))
    assert all(result is None for result in results[world:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", list(SHM_LAYOUTS))
def test_shm_fused_gives_mul_then_sum_bits(pool, layout, world, dtype):
    results = pool.run(check_matches_mul_then_sum, "shm", world, layout, dtype, [FACTOR] * 3)
    fused = core_built()
    for _, multiplies, fuses in results[:world]:
        assert fuses == fused and multiplies == (0 if fused else 2 * len(SIZES)), results
    assert_same_on_every_rank(results, world)


@pytest.mark.skipif(not core_built(), reason="the compiled core of shm was not built")
def test_shm_core_is_built():
    """Where the extension is built (an install with a C compiler), shm fuses float32 and
    float64: the other shm tests then cover the fused path, not the default one."""
    from fastcomm.comm.shm import core

    assert core.PREMUL_KINDS.keys() == {torch.float32, torch.float64}


@pytest.mark.parametrize("layout", ["one-shot", "two-step"])
def test_shm_other_dtypes_take_the_default_path(pool, layout):
    results = pool.run(check_matches_mul_then_sum, "shm", 3, layout, torch.float16, [FACTOR] * 3)
    for _, multiplies, fuses in results:
        assert not fuses and multiplies == 2 * len(SIZES), results
    assert_same_on_every_rank(results, 3)


@pytest.mark.parametrize("backend, layout", [("shm", "one-shot"), ("shm", "two-step"),
                                             ("gloo", "default")])
def test_factors_may_differ_between_ranks(pool, backend, layout):
    """Each rank's factor scales its own term (as NCCL's pre-multiplied sum does)."""
    results = pool.run(
        check_matches_mul_then_sum, backend, 3, layout, torch.float32, [0.5, FACTOR, 1.0]
    )
    assert_same_on_every_rank(results, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_default_path_gives_mul_then_sum_bits(pool, world, dtype):
    results = pool.run(check_matches_mul_then_sum, "gloo", world, "default", dtype, [FACTOR] * 3)
    # two all-reduces per size multiply first: the synchronous and the asynchronous one
    for _, multiplies, fuses in results[:world]:
        assert not fuses and multiplies == 2 * len(SIZES), results
    assert_same_on_every_rank(results, world)


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_integer_tensors_and_other_ops_rejected(pool, backend):
    for messages in pool.run(check_rejected_before_anything_is_sent, backend):
        assert "int32" in messages[0] and "PremulSum(factor=2.0)" in messages[0], messages
        assert "reduce_scatter" in messages[3], messages


@pytest.mark.parametrize("numel", [10, 100_000], ids=["one-shot", "two-step"])
def test_premul_against_sum_is_a_mismatch(pool, unique_name, numel):
    for message in pool.run(check_mismatch_detected, unique_name, numel):
        assert "collective mismatch" in message, message
        assert "premul_sum" in message and "sum" in message, message


@pytest.mark.parametrize(
    "factor, error",
    [(float("nan"), ValueError), (float("inf"), ValueError), (-float("inf"), ValueError),
     (True, TypeError), ("0.5", TypeError), (None, TypeError), (1j, TypeError),
     (torch.tensor(0.5), TypeError)],
    ids=repr,
)
def test_bad_factors_rejected(factor, error):
    from fastcomm.comm import PremulSum

    with pytest.raises(error, match="factor") as info:
        PremulSum(factor)
    assert repr(factor) in str(info.value) or type(factor).__name__ in str(info.value)


def test_factor_normalized_and_op_coerced():
    import numpy as np

    from fastcomm.comm import PremulSum, ReduceOp

    op = PremulSum(np.float32(0.25))
    assert type(op.factor) is float and op.factor == 0.25 and op == PremulSum(0.25)
    assert PremulSum(2).factor == 2.0 and ReduceOp.coerce(op) is op
    with pytest.raises(AttributeError):
        op.factor = 1.0  # frozen: one op object may be shared by many calls
    with pytest.raises(ValueError, match="PremulSum"):
        ReduceOp.coerce("premul_sum")  # needs a factor: named in the list of allowed ops
