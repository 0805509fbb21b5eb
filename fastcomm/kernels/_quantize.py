"""Block-wise symmetric quantization of flat buffers, with fused error feedback.

`quantize` gives each block of `block` elements one fp32 scale ``amax / QMAX`` (127 for int8,
448 for float8_e4m3fn) and codes rounded to nearest, ties to even; with an error buffer it
quantizes ``x + error`` and writes the new residual back in the same pass. `dequantize`
computes ``q * scale`` in fp32 and writes (or adds) it into `out`.

Invariants: the torch references give bit-identical results; a block of zeros gets scale 0 and
codes 0; a block whose ``QMAX / amax`` overflows fp32 (amax below about 4e-37 for int8: tiny
gradients and the residuals they leave) gets codes 0 too, its values kept whole in the error
buffer (the reciprocal was inf, and 0 * inf made the residual NaN); NaN and inf inputs are not
supported (their codes are unspecified).

The block size's cost and error bound, and why the references match: docs/kernels.md.
"""

from __future__ import annotations

import torch

from ._launch import (
    FLOAT_DTYPES,
    check_tensor,
    compute_dtype,
    kernel_backend,
    runnable,
    tl,
    tl_dtype,
    triton,
)

__all__ = ["quantize", "dequantize", "quantize_reference", "dequantize_reference"]

FLT_MAX = 3.4028234663852886e38  # a larger reciprocal overflowed: its block gets codes 0

#: Elements per quantization block (one fp32 scale each) unless told otherwise.
DEFAULT_BLOCK = 256
#: Allowed block sizes: powers of two in this range (a block is one row of a program's tile).
MIN_BLOCK, MAX_BLOCK = 16, 8192
#: Largest code magnitude of each quantized dtype.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
#: Elements per program: ROWS = TILE // block quantization blocks.
TILE = 4096
NUM_WARPS = 4


@triton.jit
def _quantize_kernel(
    x,  # *IN input, flat
    error,  # *ERR error-feedback buffer, flat (unused unless HAS_ERROR)
    q,  # *Q codes, flat
    scales,  # *fp32 one scale per quantization block
    n,  # elements
    n_blocks,  # quantization blocks: ceil(n / QBLOCK)
    QMAX: tl.constexpr,  # largest code magnitude
    IS_FP8: tl.constexpr,  # codes are float8_e4m3fn (else int8)
    HAS_ERROR: tl.constexpr,  # add `error` before quantizing and write the residual back
    QBLOCK: tl.constexpr,  # elements per quantization block
    ROWS: tl.constexpr,  # quantization blocks per program
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    # Programs wholly inside the buffer go unmasked so their accesses can be vectorized.
    full = (pid + 1) * (ROWS * QBLOCK) <= n
    if full:
        v = tl.load(x + offs).to(tl.float32)
        if HAS_ERROR:
            v += tl.load(error + offs).to(tl.float32)
    else:
        v = tl.load(x + offs, mask=offs < n, other=0.0).to(tl.float32)
        if HAS_ERROR:
            v += tl.load(error + offs, mask=offs < n, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=1)
    qmax = tl.full([ROWS], QMAX, tl.float32)
    # Correctly rounded divisions (plain `/` may be approximate on GPUs) keep the torch
    # reference bit-exact.
    scale = tl.math.div_rn(amax, qmax)
    inv = tl.where(amax > 0, tl.math.div_rn(qmax, tl.where(amax > 0, amax, 1.0)), 0.0)
    inv = tl.where(inv <= 3.4028234663852886e38, inv, 0.0)  # FLT_MAX: overflowed, codes 0
    y = v * inv[:, None]
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_FP8:
        # Round |y| to e4m3's grid (3 mantissa bits, step 2**-9 below 2**-6) by adding and
        # subtracting 1.5 * 2**20 * max(2**floor(log2|y|), 2**-6): the sum's ulp is the grid
        # step, so the fp32 add rounds half to even onto it; the cast to fp8 is then exact.
        a = tl.abs(y)
        pow2 = (a.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        magic = tl.maximum(pow2, 0.015625) * 1572864.0
        r = (a + magic) - magic
        code = tl.where(y < 0, -r, r)
    else:
        # |y| <= 127: adding 1.5 * 2**23 leaves an ulp of 1, so the fp32 add rounds half to
        # even onto the integers (exactly torch.round).
        code = (y + 12582912.0) - 12582912.0
    if full:
        tl.store(q + offs, code.to(q.dtype.element_ty))
        tl.store(scales + rows, scale)
    else:
        tl.store(q + offs, code.to(q.dtype.element_ty), mask=offs < n)
        tl.store(scales + rows, scale, mask=rows < n_blocks)
    if HAS_ERROR:
        residual = (v - code * scale[:, None]).to(error.dtype.element_ty)
        if full:
            tl.store(error + offs, residual)
        else:
            tl.store(error + offs, residual, mask=offs < n)


@triton.jit
def _dequantize_kernel(
    q,  # *Q codes, flat
    scales,  # *fp32 one scale per quantization block
    out,  # *OUT result, flat
    n,  # elements
    n_blocks,  # quantization blocks: ceil(n / QBLOCK)
    COMPUTE: tl.constexpr,  # dtype of the accumulation: fp32, or fp64 for an fp64 `out`
    MID: tl.constexpr,  # type the result passes through before the final cast
    ACCUMULATE: tl.constexpr,  # add into `out` instead of overwriting it
    QBLOCK: tl.constexpr,  # elements per quantization block
    ROWS: tl.constexpr,  # quantization blocks per program
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    full = (pid + 1) * (ROWS * QBLOCK) <= n
    if full:
        s = tl.load(scales + rows)
        code = tl.load(q + offs).to(tl.float32)
    else:
        s = tl.load(scales + rows, mask=rows < n_blocks, other=0.0)
        code = tl.load(q + offs, mask=offs < n, other=0.0).to(tl.float32)
    y = code * s[:, None]
    if ACCUMULATE:
        if full:
            acc = tl.load(out + offs)
        else:
            acc = tl.load(out + offs, mask=offs < n, other=0.0)
        y = acc.to(COMPUTE) + y.to(COMPUTE)
    y = y.to(MID).to(out.dtype.element_ty)
    if full:
        tl.store(out + offs, y)
    else:
        tl.store(out + offs, y, mask=offs < n)


# --------------------------------------------------------------------------- host side


def _n_blocks(n: int, block: int) -> int:
    return -(-n // block)


def _check_block(block) -> int:
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"block must be an int, got {type(block).__name__}")
    if not (MIN_BLOCK <= block <= MAX_BLOCK) or block & (block - 1):
        raise ValueError(f"block={block}; expected a power of two in [{MIN_BLOCK}, {MAX_BLOCK}]")
    return block


def _check_qdtype(name: str, dtype) -> None:
    if dtype not in QMAX:
        raise TypeError(f"{name}={dtype}; allowed: {', '.join(str(d) for d in QMAX)}")


def _prepare_quantize(x, dtype, block, error, out):
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    _check_qdtype("dtype", dtype)
    block = _check_block(block)
    n = x.numel()
    if error is not None:
        check_tensor("error", error, dtypes=FLOAT_DTYPES, device=x.device)
        if error.numel() != n:
            raise ValueError(f"error has {error.numel()} elements; expected {n} like x")
    nb = _n_blocks(n, block)
    if out is None:
        q = torch.empty(x.shape, dtype=dtype, device=x.device)
        scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("out must be a (q, scales) pair of tensors")
        q, scales = out
        check_tensor("out[0]", q, dtypes=(dtype,), device=x.device)
        check_tensor("out[1]", scales, dtypes=(torch.float32,), device=x.device)
        if q.numel() != n:
            raise ValueError(f"out[0] has {q.numel()} elements; expected {n} like x")
        if scales.dim() != 1 or scales.numel() != nb:
            raise ValueError(f"out[1] has shape {tuple(scales.shape)}; expected ({nb},)")
    return q, scales


def quantize(
    x: torch.Tensor,
    *,
    dtype: torch.dtype = torch.int8,
    block: int = DEFAULT_BLOCK,
    error: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` block-wise (one fp32 scale per `block` elements of its flat view).

    Args:
        x: contiguous floating tensor, read as a flat buffer.
        dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.
        block: elements per scale, a power of two in [16, 8192]; default 256.
        error: optional contiguous floating error-feedback buffer with ``x.numel()``
            elements (fp32 recommended): added to `x` before quantizing and overwritten
            with the new residual ``x + error - dequantize(q, scales)``.
        out: optional ``(q, scales)`` to write into (e.g. views of a send buffer).

    Returns:
        ``(q, scales)``: codes of `dtype` shaped like `x`, and fp32 scales of shape
        ``(ceil(x.numel() / block),)``.

    Raises:
        TypeError: a non-tensor or non-floating `x`/`error`, `dtype` not int8/float8_e4m3fn,
            a non-int `block`, or `out` of the wrong dtypes.
        ValueError: `block` not a power of two in range, `error`/`out` of the wrong size,
            on another device, or non-contiguous.
    """
    q, scales = _prepare_quantize(x, dtype, block, error, out)
    n = x.numel()
    if n == 0:
        return q, scales
    if kernel_backend(x) == "torch":
        _quantize_torch(x, dtype, block, error, q, scales)
        return q, scales
    rows = max(1, TILE // block)
    runnable(_quantize_kernel)[(_n_blocks(scales.numel(), rows),)](
        x,
        error if error is not None else x,
        q,
        scales,
        n,
        scales.numel(),
        QMAX=QMAX[dtype],
        IS_FP8=dtype == torch.float8_e4m3fn,
        HAS_ERROR=error is not None,
        QBLOCK=block,
        ROWS=rows,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )
    return q, scales


def _prepare_dequantize(q, scales, out, accumulate, block):
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    _check_qdtype("q.dtype", q.dtype)
    check_tensor("q", q)
    check_tensor("scales", scales, dtypes=(torch.float32,), device=q.device)
    if scales.dim() != 1:
        raise ValueError(f"scales has shape {tuple(scales.shape)}; expected 1-D")
    n, nb = q.numel(), scales.numel()
    if block is None:
        block = _infer_block(n, nb)
    elif _n_blocks(n, _check_block(block)) != nb:
        raise ValueError(f"scales has {nb} entries; {n} elements in blocks of {block} need "
                         f"{_n_blocks(n, block)}")
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs an out= tensor to add into")
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    else:
        check_tensor("out", out, dtypes=FLOAT_DTYPES, device=q.device)
        if out.numel() != n:
            raise ValueError(f"out has {out.numel()} elements; expected {n} like q")
    return out, block


def _infer_block(n: int, nb: int) -> int:
    """The block size that gives `nb` scales for `n` elements (unique when nb >= 2)."""
    if n == 0 and nb == 0:
        return DEFAULT_BLOCK
    block = MIN_BLOCK
    while block <= MAX_BLOCK:
        if _n_blocks(n, block) == nb:
            return block
        block *= 2
    raise ValueError(
        f"scales has {nb} entries, which no block size in [{MIN_BLOCK}, {MAX_BLOCK}] gives "
        f"for {n} elements"
    )


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    block: int | None = None,
) -> torch.Tensor:
    """``q * scale`` of its block, computed in fp32, written or added into `out`.

    Args:
        q: contiguous int8 or float8_e4m3fn codes from `quantize`.
        scales: their fp32 scales, 1-D.
        out: floating tensor with ``q.numel()`` elements; default a new fp32 tensor shaped
            like `q`.
        accumulate: add into `out` (in fp32, fp64 for an fp64 `out`; rounded once), e.g.
            to sum peers' chunks.
        block: the block size `quantize` used; default inferred from the sizes (a power of
            two is determined by ``len(scales)`` unless there is a single block).

    Returns:
        `out`, or the new tensor.

    Raises:
        TypeError: a non-tensor operand, codes not int8/float8_e4m3fn, scales not fp32,
            `out` not floating.
        ValueError: sizes that do not match, operands on different devices or
            non-contiguous, or `accumulate` without `out`.
    """
    out, block = _prepare_dequantize(q, scales, out, accumulate, block)
    n = q.numel()
    if n == 0:
        return out
    if kernel_backend(q) == "torch":
        _dequantize_torch(q, scales, out, accumulate, block)
        return out
    rows = max(1, TILE // block)
    runnable(_dequantize_kernel)[(_n_blocks(scales.numel(), rows),)](
        q,
        scales,
        out,
        n,
        scales.numel(),
        COMPUTE=tl_dtype(compute_dtype(out.dtype)),
        MID=tl_dtype(_mid_dtype(out.dtype)),
        ACCUMULATE=accumulate,
        QBLOCK=block,
        ROWS=rows,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )
    return out


def _mid_dtype(target: torch.dtype) -> torch.dtype:
    return torch.float32 if target in (torch.float16, torch.bfloat16) else target


# --------------------------------------------------------------------------- references


def quantize_reference(
    x: torch.Tensor,
    *,
    dtype: torch.dtype = torch.int8,
    block: int = DEFAULT_BLOCK,
    error: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch `quantize` (what CPU tensors run, and the test oracle); same arguments."""
    q, scales = _prepare_quantize(x, dtype, block, error, out)
    if x.numel():
        _quantize_torch(x, dtype, block, error, q, scales)
    return q, scales


def dequantize_reference(
    q: torch.Tensor,
    scales: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    block: int | None = None,
) -> torch.Tensor:
    """Pure-torch `dequantize` (what CPU tensors run, and the test oracle); same arguments."""
    out, block = _prepare_dequantize(q, scales, out, accumulate, block)
    if q.numel():
        _dequantize_torch(q, scales, out, accumulate, block)
    return out


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """`flat` zero-padded to whole blocks, as a [n_blocks, block] matrix."""
    pad = _n_blocks(flat.numel(), block) * block - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block)


def _quantize_torch(x, dtype, block, error, q, scales) -> None:
    n = x.numel()
    v = x.reshape(-1).float()
    if error is not None:
        v = v + error.reshape(-1).float()
    vb = _blocks(v, block)
    qmax = QMAX[dtype]
    amax = vb.abs().amax(dim=1)
    qmax_t = torch.full_like(amax, qmax)
    # Tensor / tensor: `scalar / t` and `t / scalar` may use a rounded reciprocal in torch.
    scale = amax / qmax_t
    inv = torch.where(amax > 0, qmax_t / amax, torch.zeros_like(amax))
    inv = torch.where(inv <= FLT_MAX, inv, torch.zeros_like(inv))  # overflowed: codes 0
    y = (vb * inv[:, None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        code = torch.round(y)
    else:
        code = y.to(dtype).float()
    q.view(-1).copy_(code.view(-1)[:n])
    scales.copy_(scale)
    if error is not None:
        residual = vb - code * scale[:, None]
        error.view(-1).copy_(residual.view(-1)[:n])


def _dequantize_torch(q, scales, out, accumulate, block) -> None:
    n = q.numel()
    y = (_blocks(q.reshape(-1).float(), block) * scales[:, None]).view(-1)[:n]
    if accumulate:
        compute = compute_dtype(out.dtype)
        y = out.reshape(-1).to(compute) + y.to(compute)
    out.view(-1).copy_(y.to(_mid_dtype(out.dtype)))
