"""The shm communicator's compiled core on its own: reductions against torch, bit for bit, and
its argument checks. The protocol (waits, resumes, mismatches) runs on real ranks in
``shm/test_communicator.py``; here one process calls the module's functions on tensors' memory."""

from __future__ import annotations

import pytest
import torch

from fastcomm.comm.shm.core import BUILT
from fastcomm.comm.types import divide_

if BUILT:  # the extension itself, driven directly
    from fastcomm.comm.shm import _core as core
else:
    core = None
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
        ((0, [0, 0], -1, 0, 0), "numel must be in"),
        ((0, [], 4, 0, 0), "1 to 4096 addresses"),
    ],
)
def test_reduce_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        core.reduce(*args)


def test_reduce_rejects_addresses_that_are_not_integers():
    with pytest.raises(TypeError):
        core.reduce(0, ["x", 0], 4, 0, 0)


def one_rank_core(words: torch.Tensor, slot_bytes: int = 128):
    """A one-rank SmallCore over ``words`` (int64): seq 0, waiting_on 1, descriptors 2-5, the
    slot of half 0 at byte 64 and of half 1 at byte 256."""
    return core.SmallCore(words.numpy(), 0, [0], [1], [2, 3, 4, 5], [64, 256], slot_bytes)


def test_small_core_rejects_a_bad_layout():
    seg = torch.zeros(64, dtype=torch.int64).numpy()  # 512 bytes
    with pytest.raises(ValueError, match="rank must be in"):
        core.SmallCore(seg, 2, [0, 1], [2, 3], list(range(4, 12)), [64, 128, 192, 256], 64)
    with pytest.raises(ValueError, match="desc_idx: expected 8 entries"):
        core.SmallCore(seg, 0, [0, 1], [2, 3], [4, 5], [64, 128, 192, 256], 64)
    with pytest.raises(ValueError, match="seq_idx must be in"):
        core.SmallCore(seg, 0, [0, -1], [2, 3], list(range(4, 12)), [64, 128, 192, 256], 64)
    with pytest.raises(ValueError, match="wait_idx must be in"):  # past the segment's 64 words
        core.SmallCore(seg, 0, [0, 1], [2, 64], list(range(4, 12)), [64, 128, 192, 256], 64)
    with pytest.raises(ValueError, match="slots must be in"):  # a slot past the segment's end
        core.SmallCore(seg, 0, [0, 1], [2, 3], list(range(4, 12)), [64, 128, 192, 480], 64)
    with pytest.raises(ValueError, match="not 8-byte aligned"):
        core.SmallCore(seg, 0, [0, 1], [2, 3], list(range(4, 12)), [64, 128, 192, 3], 64)
    with pytest.raises(ValueError, match="slot_bytes .* exceeds"):
        core.SmallCore(seg, 0, [0, 1], [2, 3], list(range(4, 12)), [0, 0, 0, 0], 4096)
    with pytest.raises(TypeError):  # not a writable buffer
        core.SmallCore(b"x" * 512, 0, [0], [1], [2, 3, 4, 5], [64, 256], 64)


def test_an_uninitialised_or_reinitialised_core_raises():
    bare = core.SmallCore.__new__(core.SmallCore)
    with pytest.raises(ValueError, match="not initialised"):
        bare.all_reduce(0, 0, 0, 0, -1, 0, 0, 0, 1, 0, 0)
    with pytest.raises(ValueError, match="not initialised"):
        bare.barrier(0, 0, 0, 1, 0, 0)
    with pytest.raises(ValueError, match="not initialised"):
        _ = bare.slot_bytes
    words = torch.zeros(64, dtype=torch.int64)
    small = one_rank_core(words)
    with pytest.raises(ValueError, match="already initialised"):
        small.__init__(words.numpy(), 0, [0], [1], [2, 3, 4, 5], [64, 256], 128)
    failed = core.SmallCore.__new__(core.SmallCore)
    with pytest.raises(ValueError):
        failed.__init__(words.numpy(), 5, [0], [1], [2, 3, 4, 5], [64, 256], 128)
    with pytest.raises(ValueError, match="not initialised"):  # a failed __init__ leaves it bare
        failed.barrier(0, 0, 0, 1, 0, 0)


def test_arguments_are_checked_as_the_c_types_they_become():
    """No truncating cast before a range check: 2**32 is not kind 0, nor 2**64 + 1 a half."""
    words = torch.zeros(64, dtype=torch.int64)
    small = one_rank_core(words)
    user = torch.zeros(4)
    for bad, message in [
        (dict(kind=2**32), "kind must be in"),
        (dict(kind=-(2**63)), "kind must be in"),
        (dict(op=2**31), "op must be in"),
        (dict(half=2**64 + 1), "half must be in"),
        (dict(stage=2**32 + 1), "stage must be in"),
        (dict(numel=33), "numel must be in"),  # past the 128-byte slot
        (dict(root=1), "root must be in"),
        (dict(spin=-1), "spin_ns must be in"),
        (dict(user=-1), "user must be in"),
        (dict(user=0), "null address"),
    ]:
        args = dict(user=user.data_ptr(), numel=4, kind=core.KIND_F32, op=core.OP_SUM, root=-1,
                    code=1, half=0, enter=0, target=1, stage=0, spin=0) | bad
        with pytest.raises(ValueError, match=message):
            small.all_reduce(*args.values())
    with pytest.raises(TypeError, match="kind must be an int"):
        small.all_reduce(user.data_ptr(), 4, 0.0, 0, -1, 1, 0, 0, 1, 0, 0)
    with pytest.raises(ValueError, match="kind must be in"):
        core.reduce(user.data_ptr(), [user.data_ptr()], 4, 2**32, 0)
    assert words[0].item() == 0, "a rejected call published"


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("count", [127, 128, 255, 256, 300, 4096])
def test_integer_average_divides_by_the_true_count(dtype, count):
    """An int8 AVG over 256 terms divided by 256 cast to int8 (0): SIGFPE. The count is exact
    in 64 bits: torch's trunc division wherever torch's divisor is exact (count <= max)."""
    info = torch.iinfo(dtype)
    gen = torch.Generator().manual_seed(count)
    terms = [torch.randint(info.min, info.max, (33,), generator=gen, dtype=dtype)
             for _ in range(count)]
    out = torch.empty_like(terms[0])
    core.reduce(out.data_ptr(), [t.data_ptr() for t in terms], 33, KINDS[dtype], core.OP_AVG)
    total = terms[0].clone()
    for t in terms[1:]:
        total += t  # wraps in the dtype, as the core's sum
    expected = (total.to(torch.int64) // 1).div(count, rounding_mode="trunc").to(dtype)
    assert torch.equal(out, expected)
    if count <= info.max:
        assert torch.equal(out, total.div(count, rounding_mode="trunc"))
    divide_(total, count)  # the Python path's division, too
    assert torch.equal(total, expected)


def test_one_rank_all_reduce_runs_the_whole_protocol_in_one_call():
    """World size 1 over a real buffer: enter, descriptors, copy in, publish, copy out."""
    words = torch.zeros(64, dtype=torch.int64)
    small = one_rank_core(words)
    user = torch.arange(10, dtype=torch.float32)
    status = small.all_reduce(user.data_ptr(), 10, core.KIND_F32, core.OP_AVG, -1, 0xABC, 1, 0,
                              1, 0, 0)
    assert status == core.DONE
    assert words[0].item() == 1  # published
    assert words[3].item() == 0xABC and words[5].item() == 0  # half 1's descriptors A and B
    assert torch.equal(words[32:37].view(torch.float32), user)  # half 1's slot, at byte 256
    assert torch.equal(user, torch.arange(10, dtype=torch.float32))  # the average of one rank
    status = small.all_reduce(user.data_ptr(), 10, core.KIND_F32, core.OP_SUM, 0, 0xABD, 0, 0,
                              2, 0, 0)
    assert status == core.DONE and words[2].item() == 0xABD and words[4].item() == 1  # root + 1
    status = small.broadcast(user.data_ptr(), 40, 0, 0xABE, 1, 1, 3, 0, 0)
    assert status == core.DONE and words[5].item() == 1  # src + 1
    with pytest.raises(ValueError, match="half must be in"):
        small.all_reduce(user.data_ptr(), 10, core.KIND_F32, core.OP_SUM, -1, 0, 2, 0, 1, 0, 0)
    with pytest.raises(TypeError, match="takes 11 arguments"):
        small.all_reduce(user.data_ptr(), 10)
    assert small.slot_bytes == 128
