"""pack/unpack kernels against their torch references (interpreter on CPU, compiled on GPU)."""

import pytest
import torch

from fastcomm.kernels import _launch, pack, pack_reference, unpack, unpack_reference
from fastcomm.kernels._pack import BLOCK

from .helpers import assert_equal_or_1ulp

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64

# Shapes of one bucket: empty, zero-size, exact and non-multiples of the block, mixed ranks.
BUCKETS = {
    "empty-list": [],
    "zero-size": [(0,), (3, 0)],
    "one": [(1,)],
    "one-block": [(BLOCK,)],
    "block+1": [(BLOCK + 1,)],
    "mixed": [(3, 5), (0,), (BLOCK + 3,), (7, 1, 3), (128,), (2, 2, 2, 2)],
}
# (input dtype, packed dtype): same-dtype copies, up- and down-casts, fp64 both ways.
DTYPE_PAIRS = [(F32, F32), (BF16, BF16), (F16, F16), (F32, BF16), (BF16, F32), (F32, F16),
               (F16, BF16), (F64, F32), (F32, F64), (F64, BF16)]


def make(shapes, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 3).to(dtype).to(device) for s in shapes]


def rounds_to_bf16(src, dst, scale):
    """Whether a cast to bf16 happens that can round (the interpreter truncates those)."""
    return dst == BF16 and (src != BF16 or scale != 1.0)


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("src,dst", DTYPE_PAIRS, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("bucket", list(BUCKETS))
def test_pack_matches_reference(device, interpreted, bucket, src, dst, scale):
    tensors = make(BUCKETS[bucket], src, device)
    out = pack(tensors, scale=scale, dtype=dst)
    expected = pack_reference([t.cpu() for t in tensors], scale=scale, dtype=dst)
    # an empty list names no device: pack() allocates on CPU (test_empty_list_needs_no_device...)
    assert out.device.type == (device.type if tensors else "cpu")
    assert out.shape == (sum(t.numel() for t in tensors),)
    # Exact (atol=0) except fp32 -> bf16 rounding in the interpreter: 1 ulp (see helper).
    assert_equal_or_1ulp(out, expected, interpreted and rounds_to_bf16(src, dst, scale))


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
@pytest.mark.parametrize("flat_dtype,dst", DTYPE_PAIRS, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("bucket", ["zero-size", "block+1", "mixed"])
def test_unpack_matches_reference(device, interpreted, bucket, flat_dtype, dst, scale, accumulate):
    shapes = BUCKETS[bucket]
    targets = make(shapes, dst, device, seed=1)
    flat = torch.cat([t.reshape(-1) for t in make(shapes, F32, "cpu", seed=2)] or [torch.ones(0)])
    flat = flat.to(flat_dtype)
    expected = [t.cpu().clone() for t in targets]
    unpack(flat.to(device), targets, scale=scale, accumulate=accumulate)
    unpack_reference(flat, expected, scale=scale, accumulate=accumulate)
    rounds = dst == BF16 and (flat_dtype != BF16 or scale != 1.0 or accumulate)
    for got, want in zip(targets, expected, strict=True):
        assert_equal_or_1ulp(got, want, interpreted and rounds)


def test_pack_unpack_roundtrip_is_exact(device):
    tensors = make(BUCKETS["mixed"], F32, device)
    copies = [torch.full_like(t, float("nan")) for t in tensors]
    unpack(pack(tensors), copies)
    for a, b in zip(copies, tensors, strict=True):
        assert torch.equal(a, b)


def test_pack_is_bitwise_copy_without_scale_or_cast(device):
    # NaN payloads and -0.0 survive a same-dtype pack: no conversion happens.
    raw = torch.tensor([0x7FC1, 0x8000, 0x0001, 0xFFFF], dtype=torch.int32).to(torch.int16)
    t = raw.view(BF16).to(device)
    assert torch.equal(pack([t]).view(torch.int16).cpu(), raw)


def test_pack_into_view_of_larger_buffer(device):
    tensors = make([(5,), (BLOCK + 7,), (2, 3)], F32, device)
    total = sum(t.numel() for t in tensors)
    bucket = torch.full((total + 20,), -1.0, device=device)
    view = bucket[9 : 9 + total]  # deliberately not 16-byte aligned
    assert pack(tensors, out=view, scale=2.0) is view
    assert torch.equal(view.cpu(), pack_reference([t.cpu() for t in tensors], scale=2.0))
    assert bool((bucket[:9] == -1).all()) and bool((bucket[9 + total :] == -1).all())


def test_unaligned_tensors(device):
    # Tensors that are views at odd element offsets of one storage: no alignment hint.
    base = torch.randn(3 * BLOCK, device=device)
    tensors = [base[1 : 1 + BLOCK], base[BLOCK + 3 : BLOCK + 3 + 100]]
    assert torch.equal(pack(tensors).cpu(), torch.cat([t.cpu() for t in tensors]))
    targets = [torch.zeros(BLOCK + 5, device=device)[1:], torch.zeros(103, device=device)[3:]]
    flat = torch.randn(BLOCK + 4 + 100, device=device)
    unpack(flat, targets)
    assert torch.equal(torch.cat(targets).cpu(), flat.cpu())


def test_mixed_input_dtypes_need_dtype_and_cost_one_launch_each(device, launches):
    tensors = make([(10,)], F32, device) + make([(300,)], BF16, device) + make([(5,)], F32, device)
    tensors.append(torch.empty(0, dtype=F16, device=device))  # a group with nothing to copy
    with pytest.raises(TypeError, match="mix dtypes"):
        pack(tensors)
    assert launches.count == 0
    out = pack(tensors, dtype=F32, scale=0.5)
    assert launches.count == 2
    expected = pack_reference([t.cpu() for t in tensors], dtype=F32, scale=0.5)
    assert torch.equal(out.cpu(), expected)


def test_unpack_into_mixed_dtypes(device, interpreted, launches):
    targets = make([(10,)], F32, device) + make([(300,)], BF16, device) + make([(5,)], F16, device)
    flat = torch.randn(315)
    expected = [t.cpu().clone() for t in targets]
    unpack(flat.to(device), targets, scale=0.5, accumulate=True)
    unpack_reference(flat, expected, scale=0.5, accumulate=True)
    assert launches.count == 3
    for got, want in zip(targets, expected, strict=True):
        assert_equal_or_1ulp(got, want, interpreted)


def test_many_small_tensors_one_launch(device, launches):
    g = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 40, (500,), generator=g).tolist()
    tensors = [torch.randn(n, generator=g).to(device) for n in sizes]
    out = pack(tensors, scale=0.5)
    assert launches.count == 1
    assert torch.equal(out.cpu(), torch.cat([t.cpu() for t in tensors]) * 0.5)
    back = [torch.empty_like(t) for t in tensors]
    unpack(out, back, scale=2.0)
    assert launches.count == 2
    assert all(torch.equal(a, b) for a, b in zip(back, tensors, strict=True))


def test_empty_list(device, launches):
    assert pack([]).numel() == 0
    out = torch.empty(0, dtype=BF16, device=device)
    assert pack([], out=out) is out
    unpack(torch.empty(0, device=device), [])
    assert launches.count == 0


def test_empty_list_needs_no_device_where_triton_is_forced(monkeypatch):
    """On a CUDA machine ``pack([])`` makes a CPU buffer while ``FASTCOMM_KERNELS=triton``
    forces compiled kernels, which cannot take CPU tensors; with nothing to move, no kernel
    (hence no device check) is needed. Simulated here by making Triton refuse CPU tensors."""
    monkeypatch.setenv("FASTCOMM_KERNELS", "triton")
    monkeypatch.setattr(_launch, "_triton_unavailable_reason", lambda device: f"no {device}")
    assert pack([]).numel() == 0
    assert pack([torch.empty(0)], dtype=BF16).dtype == BF16
    unpack(torch.empty(0), [])
    with pytest.raises(RuntimeError, match="FASTCOMM_KERNELS=triton but no cpu"):
        pack([torch.ones(2)])


def test_block_table_is_cached_and_keyed_by_address(device):
    _launch.clear_table_cache()
    a = make([(100,), (BLOCK + 1,)], F32, device)
    out = pack(a)
    info = _launch._cached_table.cache_info()
    pack(a, out=out)
    assert _launch._cached_table.cache_info().hits == info.hits + 1
    b = make([(100,), (BLOCK + 1,)], F32, device, seed=5)  # same shapes, new addresses
    layouts = _launch._layout.cache_info()
    assert torch.equal(pack(b).cpu(), torch.cat([t.cpu() for t in b]))
    # a new table, on the layout (offsets, counts) the first one computed
    assert _launch._cached_table.cache_info().misses == info.misses + 1
    assert _launch._layout.cache_info().hits == layouts.hits + 1
    fresh, reused = (
        _launch.block_table([t.data_ptr() for t in b], [t.numel() for t in b],
                            [0, 100], 4, out, BLOCK).table.cpu()
        for _ in range(2)
    )
    _launch.clear_table_cache()
    rebuilt = _launch.block_table([t.data_ptr() for t in b], [t.numel() for t in b],
                                  [0, 100], 4, out, BLOCK).table.cpu()
    assert torch.equal(fresh, rebuilt) and torch.equal(reused, rebuilt)
    assert rebuilt[0].tolist() == [b[0].data_ptr(), b[1].data_ptr(), b[1].data_ptr() + BLOCK * 4]


def test_block_table_layout_and_alignment():
    base = torch.zeros(2 * BLOCK + 64)  # CPU storage: 64-byte aligned
    flat = torch.zeros(BLOCK + 300)
    aligned = [base[: BLOCK + 4], base[BLOCK + 32 : BLOCK + 64]]
    ptrs = [t.data_ptr() for t in aligned]
    bt = _launch.block_table(ptrs, [BLOCK + 4, 32], [0, BLOCK + 4], 4, flat, BLOCK)
    assert (bt.n_blocks, bt.tab_align, bt.flat_vec) == (3, 16, 4)
    addr0 = aligned[0].data_ptr()
    assert bt.table.tolist() == [
        [addr0, addr0 + 4 * BLOCK, aligned[1].data_ptr()],
        [0, BLOCK, BLOCK + 4],
        [BLOCK, 4, 32],
    ]
    odd = _launch.block_table([base[1:5].data_ptr()], [4], [3], 4, flat, BLOCK)
    assert (odd.tab_align, odd.flat_vec) == (1, 1)
    half = _launch.block_table([ptrs[0]], [4], [3], 4, flat, BLOCK)  # aligned source only
    assert (half.tab_align, half.flat_vec) == (16, 1)


# --------------------------------------------------------------------------- bad input

def _bad_pack_cases(dev):
    t = torch.randn(4, device=dev)
    return [
        (TypeError, "list or tuple", lambda: pack(t)),
        (TypeError, r"tensors\[1\] must be a torch.Tensor", lambda: pack([t, 3.0])),
        (TypeError, r"tensors\[0\] has dtype torch.int32", lambda: pack([t.int()])),
        (TypeError, "dtype=torch.int8", lambda: pack([t], dtype=torch.int8)),
        (TypeError, "out has dtype torch.float16",
         lambda: pack([t], out=t.new_empty(4, dtype=F16))),
        (ValueError, r"out has shape \(5,\)", lambda: pack([t], out=t.new_empty(5))),
        (ValueError, r"out has shape \(2, 2\)", lambda: pack([t], out=t.new_empty(2, 2))),
        (ValueError, "out is on meta", lambda: pack([t], out=torch.empty(4, device="meta"))),
        (ValueError, "not contiguous", lambda: pack([t.new_empty(4, 2).t()])),
        (ValueError, r"not contiguous", lambda: pack([t], out=t.new_empty(8)[::2])),
        (ValueError, r"tensors\[1\] is on meta", lambda: pack([t, torch.empty(2, device="meta")])),
        (TypeError, "scale must be a real number", lambda: pack([t], scale="2")),
        (TypeError, "scale must be a real number", lambda: pack([t], scale=torch.tensor(2.0))),
        (ValueError, "scale must be finite", lambda: pack([t], scale=float("inf"))),
        (ValueError, "scale must be finite", lambda: pack([t], scale=1e39)),  # inf in fp32
        (ValueError, r"flat has shape \(5,\)", lambda: unpack(t.new_empty(5), [t])),
        (ValueError, r"flat has shape \(2, 2\)", lambda: unpack(t.new_empty(2, 2), [t])),
        (TypeError, "flat must be a torch.Tensor", lambda: unpack([1.0], [t])),
        (ValueError, r"tensors\[0\] is on meta",
         lambda: unpack(t, [torch.empty(4, device="meta")])),
        (ValueError, "not contiguous", lambda: unpack(t, [t.new_empty(2, 2).t()])),
        (TypeError, "accumulate must be a bool", lambda: unpack(t, [t.clone()], accumulate=1)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_pack_cases("cpu"))))
def test_bad_input_raises_before_launch(device, launches, case):
    error, match, call = _bad_pack_cases(device)[case]
    with pytest.raises(error, match=match):
        call()
    assert launches.count == 0


def test_references_validate_the_same_way():
    t = torch.randn(4)
    with pytest.raises(ValueError, match="out has shape"):
        pack_reference([t], out=t.new_empty(5))
    with pytest.raises(TypeError, match="mix dtypes"):
        pack_reference([t, t.double()])
    with pytest.raises(ValueError, match="flat has shape"):
        unpack_reference(t.new_empty(3), [t])
