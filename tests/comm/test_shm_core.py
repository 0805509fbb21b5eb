"""The shm communicator's compiled core on its own: reductions against torch, bit for bit, and
its argument checks. The protocol (waits, resumes, mismatches) runs on real ranks in
``test_shm.py``; here one process calls the module's functions on tensors' memory."""

from __future__ import annotations

import pytest
import torch

from fastcomm.comm.shm import schedules

core = schedules._core
pytestmark = pytest.mark.skipif(core is None, reason="the compiled core was not built")

KINDS = {} if core is None else {
    torch.float32: core.KIND_F32,
    torch.float64: core.KIND_F64,
    torch.int8: core.KIND_I8,
    torch.uint8: core.KIND_U8,
    torch.int32: core.KIND_I32,
    torch.int64: core.KIND_I64,
}


def terms_of(dtype: torch.dtype, count: int, numel: int) -> list[torch.Tensor]:
    """Random terms whose sums and products round (floats) or wrap around (integers)."""
    gen = torch.Generator().manual_seed(numel * 31 + count)
    if dtype.is_floating_point:
        return [torch.randn(numel, generator=gen, dtype=dtype) * 3 for _ in range(count)]
    info = torch.iinfo(dtype)
    return [torch.randint(info.min, info.max, (numel,), generator=gen, dtype=dtype)
            for _ in range(count)]


def torch_fold(terms: list[torch.Tensor], op: str, scale: float = 1.0) -> torch.Tensor:
    """What torch gives: each term scaled (``mul``), then folded in order; AVG divided."""
    if scale != 1.0:
        terms = [t * scale for t in terms]
    out = terms[0].clone()
    for t in terms[1:]:
        out = out * t if op == "PRODUCT" else out + t
    if op == "AVG":
        if out.is_floating_point():
            out.div_(len(terms))
        else:
            out.div_(len(terms), rounding_mode="trunc")
    return out


@pytest.mark.parametrize("dtype", list(KINDS), ids=str)
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "AVG"])
@pytest.mark.parametrize("count", [1, 2, 3, 5])
@pytest.mark.parametrize("numel", [1, 13, 4099, 300_007])  # past the GIL-release threshold
def test_reduce_gives_torch_bits(dtype, op, count, numel):
    terms = terms_of(dtype, count, numel)
    out = torch.empty_like(terms[0])
    core.reduce(out.data_ptr(), [t.data_ptr() for t in terms], numel, KINDS[dtype],
                getattr(core, f"OP_{op}"))
    expected = torch_fold(terms, op)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), (out[:4], expected[:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("scale", [0.5, 1 / 3, 0.1, 7.0])
def test_scaled_sum_gives_the_bits_of_mul_then_add(dtype, count, scale):
    terms = terms_of(dtype, count, 70_001)
    out = torch.empty_like(terms[0])
    fp_scale = torch.tensor(scale, dtype=dtype).item()  # as torch rounds a Python float scalar
    core.reduce(out.data_ptr(), [t.data_ptr() for t in terms], out.numel(), KINDS[dtype],
                core.OP_SUM, fp_scale)
    expected = torch_fold(terms, "SUM", scale)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


def test_reduce_in_place_into_the_first_or_second_term():
    a, b = terms_of(torch.float32, 2, 999)
    expected = a + b
    for out in (a.clone(), b.clone()):
        pair = [out, b] if out.equal(a) else [a, out]
        core.reduce(out.data_ptr(), [t.data_ptr() for t in pair], 999, core.KIND_F32, core.OP_SUM)
        assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, [0, 0], 4, 99, 0), "kind must be in"),
        ((0, [0, 0], 4, 0, 9), "op must be in"),
        ((0, [0, 0], 4, 2, 0, 0.5), "needs op SUM on float32/float64"),  # int8 with a scale
        ((0, [0, 0], 4, 0, 1, 0.5), "needs op SUM on float32/float64"),  # PRODUCT with a scale
        ((0, [0, 0], -1, 0, 0), "numel must be >= 0"),
        ((0, [], 4, 0, 0), "1 to 4096 addresses"),
    ],
)
def test_reduce_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        core.reduce(*args)


def test_reduce_rejects_addresses_that_are_not_integers():
    with pytest.raises(TypeError):
        core.reduce(0, ["x", 0], 4, 0, 0)


def test_small_core_rejects_a_bad_layout():
    with pytest.raises(ValueError, match="8-byte aligned"):
        core.SmallCore(3, 0, [0], [1], [2, 3], [64, 128])
    with pytest.raises(ValueError, match="rank must be in"):
        core.SmallCore(4096, 2, [0, 1], [2, 3], [4, 5, 6, 7], [64, 128, 192, 256])
    with pytest.raises(ValueError, match="desc_idx: expected 4 entries"):
        core.SmallCore(4096, 0, [0, 1], [2, 3], [4, 5], [64, 128, 192, 256])
    with pytest.raises(ValueError, match="negative entry"):
        core.SmallCore(4096, 0, [0, -1], [2, 3], [4, 5, 6, 7], [64, 128, 192, 256])


def test_one_rank_all_reduce_runs_the_whole_protocol_in_one_call():
    """World size 1 over a real buffer: enter, descriptor, copy in, publish, copy out."""
    words = torch.zeros(64, dtype=torch.int64)  # seq, waiting_on, desc h0, desc h1, slots
    base = words.data_ptr()
    small = core.SmallCore(base, 0, [0], [1], [2, 3], [base + 64, base + 256])
    user = torch.arange(10, dtype=torch.float32)
    status = small.all_reduce(user.data_ptr(), 10, core.KIND_F32, core.OP_AVG, 0xABC, 1, 0, 1,
                              0, 0)
    assert status == core.DONE
    assert words[0].item() == 1  # published
    assert words[3].item() == 0xABC  # half 1's descriptor
    assert torch.equal(words[32:37].view(torch.float32), user)  # half 1's slot, at base + 256
    assert torch.equal(user, torch.arange(10, dtype=torch.float32))  # the average of one rank
    with pytest.raises(ValueError, match="bad all_reduce call"):
        small.all_reduce(user.data_ptr(), 10, core.KIND_F32, core.OP_SUM, 0, 2, 0, 1, 0, 0)
    with pytest.raises(TypeError, match="takes 10 arguments"):
        small.all_reduce(user.data_ptr(), 10)
