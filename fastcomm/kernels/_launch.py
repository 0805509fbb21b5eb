"""Shared launch helpers for the fused bucket kernels: dispatch, validation, block tables.

`kernel_backend`: CUDA tensors run the compiled Triton kernels, CPU tensors the torch
references; ``FASTCOMM_KERNELS=triton|torch`` forces one. Triton's interpreter mode is fixed
when triton is imported (``TRITON_INTERPRET``); `runnable` re-wraps the kernels to match it.

`block_table`: per ``BLOCK``-element block of a multi-tensor launch, an int64 ``[3, n_blocks]``
tensor on the device (the block's address in its tensor, in bytes; its element offset in the
flat buffer; its element count), so a bucket of many tensors is one launch.

Invariants: tables are cached by (addresses, sizes, offsets), the layout apart from the
addresses; a miss queues its upload on the current stream and never waits for it; in
interpreter mode CUDA tensors fall back to torch (it cannot follow their device addresses).

Interpreter mode and the table's layout in detail: docs/kernels.md.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import operator
import os
import struct
import threading
import types
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    HAS_TRITON = True
except ImportError:  # e.g. macOS wheels of torch come without triton: torch references only
    HAS_TRITON = False
    InterpretedFunction = JITFunction = type(None)
    # Enough for the kernel modules to define (never run) their @triton.jit functions.
    triton = types.SimpleNamespace(jit=lambda fn=None, **_: fn if fn else (lambda f: f))
    tl = types.SimpleNamespace(constexpr=None)

__all__ = ["kernel_backend"]

ENV_BACKEND = "FASTCOMM_KERNELS"
_BACKENDS = ("triton", "torch")

#: Floating dtypes the pack/unpack/quantize inputs may have.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# Bytes of alignment the kernels try to prove for vectorized (128-bit) memory access.
VEC_BYTES = 16


_TL_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.float8_e4m3fn: "float8e4nv",
}


def tl_dtype(dtype: torch.dtype):
    """The Triton element type of a torch dtype the kernels handle."""
    return getattr(tl, _TL_DTYPES[dtype])


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """fp64 if any operand is fp64, else fp32: kernels load, compute in this, cast on store."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def fp32_scale(scale) -> float:
    """`scale` rounded to fp32, as the kernels receive it (Triton passes Python floats as fp32).

    Raises:
        TypeError: `scale` is not a real number (tensors are refused: reading one would sync).
        ValueError: `scale` is not finite in fp32.
    """
    exact_float = type(scale) is float
    if exact_float:  # the hot case, the same 1/world on every bucket of every step
        rounded = _ROUNDED.get(scale)
        if rounded is not None:
            return rounded
    if isinstance(scale, (bool, torch.Tensor)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__} {scale!r}")
    try:
        value = _F32.unpack(_F32.pack(float(scale)))[0]
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite in fp32, got {scale!r}")
    if exact_float and scale and len(_ROUNDED) < 256:  # not 0.0: it would also answer -0.0
        _ROUNDED[scale] = value
    return value


_F32 = struct.Struct("f")
# float -> its fp32 rounding: checking and rounding cost host time (docs/kernels.md), and a
# training loop passes the same few scales again and again (only exact floats: a bool or int
# must not hit a float's entry)
_ROUNDED: dict[float, float] = {}


# --------------------------------------------------------------------------- dispatch


def _interpreting() -> bool:
    """Whether triton was imported in interpreter mode (see module docstring)."""
    if not HAS_TRITON:
        return False
    probe = getattr(tl, "max", None)  # a @triton.jit function of triton's standard library
    if isinstance(probe, (InterpretedFunction, JITFunction)):
        return isinstance(probe, InterpretedFunction)
    return _env_interpret()  # pragma: no cover - other triton versions


def _env_interpret() -> bool:
    """Whether ``TRITON_INTERPRET`` is on in the environment now."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device` now (None when they can)."""
    if not HAS_TRITON:
        return "triton is not installed"
    if _interpreting():
        if device.type != "cpu":
            return (
                f"triton runs in interpreter mode (TRITON_INTERPRET=1), which takes CPU "
                f"tensors only, got {device} (it cannot follow device addresses in a block table)"
            )
        return None
    if device.type == "cuda":
        return None
    if device.type == "cpu" and _env_interpret():
        return (
            "TRITON_INTERPRET=1 was set after triton was imported, too late to take effect; "
            "set it before the first import of triton (or of anything importing it)"
        )
    return f"Triton kernels need CUDA tensors (or CPU ones with TRITON_INTERPRET=1), got {device}"


def kernel_backend(tensor: torch.Tensor | torch.device | str) -> str:
    """Which implementation the fused ops use for tensors on this device.

    ``"triton"`` for CUDA tensors (when triton is installed and not in interpreter mode),
    ``"torch"`` otherwise; ``FASTCOMM_KERNELS=torch`` forces the references everywhere and
    ``FASTCOMM_KERNELS=triton`` forces the kernels (interpreted for CPU tensors, which needs
    ``TRITON_INTERPRET=1`` set before triton is imported).

    Args:
        tensor: a tensor, or the device its operands live on.

    Returns:
        ``"triton"`` or ``"torch"``.

    Raises:
        ValueError: ``FASTCOMM_KERNELS`` holds something other than ``triton`` or ``torch``.
        RuntimeError: ``FASTCOMM_KERNELS=triton`` but Triton cannot run on this device.
    """
    device = tensor.device if isinstance(tensor, torch.Tensor) else torch.device(tensor)
    forced = os.environ.get(ENV_BACKEND, "").strip().lower()
    if forced not in ("", "auto", *_BACKENDS):
        raise ValueError(f"{ENV_BACKEND}={forced!r}; expected one of {_BACKENDS} (or unset)")
    if forced == "torch" or (forced != "triton" and device.type != "cuda"):
        return "torch"  # auto on a CPU tensor: the references (no Triton probing per call)
    reason = _triton_unavailable_reason(device)
    if forced == "triton":
        if reason is not None:
            raise RuntimeError(f"{ENV_BACKEND}=triton but {reason}")
        return "triton"
    # Auto on CUDA: the compiled kernels unless triton is missing or interpreting.
    return "triton" if reason is None else "torch"


_runnable_lock = threading.Lock()
_runnable_cache: dict = {}


def runnable(kernel):
    """`kernel` wrapped for the mode triton was imported in (see module docstring)."""
    interpret = _interpreting()
    if isinstance(kernel, InterpretedFunction) == interpret:
        return kernel
    key = (kernel.fn, interpret)
    with _runnable_lock:
        if key not in _runnable_cache:
            wrap = InterpretedFunction if interpret else JITFunction
            _runnable_cache[key] = wrap(kernel.fn)
        return _runnable_cache[key]


# --------------------------------------------------------------------------- validation


def check_tensor(name: str, t, *, dtypes=None, device: torch.device | None = None) -> None:
    """Raise TypeError/ValueError unless `t` is a contiguous tensor of `dtypes` on `device`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; allowed: {allowed}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}; expected {device} like the other operands")
    if not t.is_contiguous():
        raise ValueError(f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) is not contiguous")


def check_out(name: str, out, *, numel: int, dtype: torch.dtype, device: torch.device) -> None:
    """Raise TypeError/ValueError unless `out` is a contiguous 1-D `dtype` buffer of `numel`."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"{name} has dtype {out.dtype}; expected {dtype}")
    if out.device != device:
        raise ValueError(f"{name} is on {out.device}; expected {device} like the inputs")
    if out.dim() != 1 or out.numel() != numel:
        raise ValueError(f"{name} has shape {tuple(out.shape)}; expected ({numel},)")
    if not out.is_contiguous():
        raise ValueError(f"{name} (stride {out.stride()}) is not contiguous")


class TensorList(NamedTuple):
    """A validated list of tensors and what the launch needs of each."""

    tensors: list[torch.Tensor]
    device: torch.device | None  # None for an empty list
    dtypes: list[torch.dtype]
    ptrs: list[int]
    numels: list[int]
    offsets: list[int]  # running sum of numels: where each tensor sits in the flat buffer
    total: int


FLOAT_SET = frozenset(FLOAT_DTYPES)


_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")


def scan_tensors(name: str, tensors) -> TensorList:
    """Validate a list of contiguous floating tensors on one device.

    A DDP calls this every step on buckets of hundreds of tensors, so the checks are C-level
    loops over the list (``map`` over tensor methods, no Python frame per tensor) and the
    messages are formatted only on failure, by a second, per-tensor pass.

    Raises:
        TypeError: `tensors` is not a list/tuple, or holds a non-tensor or non-floating one.
        ValueError: tensors on different devices, or a non-contiguous one.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    try:
        dtypes = list(map(_DTYPE, tensors))
        devices = set(map(_DEVICE, tensors))
        ok = (
            FLOAT_SET.issuperset(dtypes)
            and len(devices) <= 1
            and all(map(torch.Tensor.is_contiguous, tensors))
        )
    except (AttributeError, TypeError):  # a non-tensor in the list
        ok = False
    if not ok:
        _explain_scan(name, tensors)
    numels = list(map(torch.Tensor.numel, tensors))
    ptrs = list(map(torch.Tensor.data_ptr, tensors))
    device = devices.pop() if devices else None
    offsets = [0, *itertools.accumulate(numels)]
    return TensorList(tensors, device, dtypes, ptrs, numels, offsets[:-1], offsets[-1])


def _explain_scan(name: str, tensors: list) -> None:
    """Raises the error of the first tensor `scan_tensors` refuses, naming it."""
    device = None
    for i, t in enumerate(tensors):
        check_tensor(f"{name}[{i}]", t, dtypes=FLOAT_DTYPES, device=device)
        device = t.device
    raise AssertionError("unreachable")  # pragma: no cover


# --------------------------------------------------------------------------- block tables


class BlockTable(NamedTuple):
    """A block table on the device and the alignment its entries share (module docstring)."""

    table: torch.Tensor  # int64 [3, n_blocks]: address (bytes), flat offset, element count
    n_blocks: int
    tab_align: int  # bytes every address is a multiple of (16 or 1)
    flat_vec: int  # elements every flat offset is a multiple of (16 bytes' worth, or 1)


_TABLE_CACHE_SIZE = 256


def block_table(
    ptrs: list[int],
    numels: list[int],
    flat_offsets: list[int],
    itemsize: int,
    flat: torch.Tensor,
    block: int,
) -> BlockTable:
    """The (cached) block table of tensors at `ptrs` placed at `flat_offsets` in `flat`.

    The table is marked in use by the current stream (`keep_for_launch`): call this right
    before the launch that reads it; a caller holding a table across launches marks it again
    before each.

    Args:
        ptrs, numels: addresses and sizes of the (same-dtype) tensors.
        flat_offsets: where each tensor sits in `flat`, in elements.
        itemsize: bytes per element of the tensors.
        flat: the flat buffer (its device and element size matter).
        block: elements per program.
    """
    key = (flat.device, block, itemsize, flat.element_size(), tuple(ptrs), tuple(numels),
           tuple(flat_offsets))
    bt = _cached_table(key)
    keep_for_launch(bt)
    return bt


def keep_for_launch(bt: BlockTable) -> None:
    """Keeps a CUDA table's memory from reuse until the current stream's next kernel is done.

    A table is cached (allocated on whichever stream was current when it was built) and a
    cache may drop it while a kernel on another stream still reads it.
    """
    if bt.table.is_cuda:
        bt.table.record_stream(torch.cuda.current_stream(bt.table.device))


@functools.lru_cache(maxsize=_TABLE_CACHE_SIZE)
def _cached_table(key) -> BlockTable:
    device, block, itemsize, flat_itemsize, ptrs, numels, offsets = key
    layout = _layout(device, block, itemsize, numels, offsets)
    # Blocks start at multiples of `block` inside a tensor, so a 16-byte aligned tensor
    # start and a 16-byte aligned flat offset make every block aligned.
    aligned = all(p % VEC_BYTES == 0 for p, n in zip(ptrs, numels, strict=True) if n)
    tab_align = VEC_BYTES if aligned else 1
    flat_vec = max(1, VEC_BYTES // flat_itemsize)
    if not all(o % flat_vec == 0 for o, n in zip(offsets, numels, strict=True) if n):
        flat_vec = 1
    assert (block * itemsize) % VEC_BYTES == 0 and block % flat_vec == 0, block
    blk_addr = torch.tensor(ptrs, dtype=torch.int64)[layout.tensor_of] + layout.start_bytes
    if device.type != "cuda":
        return BlockTable(torch.cat([blk_addr[None], layout.rows]), layout.n_blocks,
                          tab_align, flat_vec)
    # a pageable host-to-device copy would wait for the stream (the backward in flight): the
    # addresses go through pinned memory, the cached rows device to device, both queued
    table = torch.empty(3, layout.n_blocks, dtype=torch.int64, device=device)
    table[0].copy_(blk_addr.pin_memory(), non_blocking=True)
    table[1:].copy_(layout.rows)
    layout.rows.record_stream(torch.cuda.current_stream(device))  # kept past an eviction
    return BlockTable(table, layout.n_blocks, tab_align, flat_vec)


class _Layout(NamedTuple):
    """What a block table holds apart from the addresses: fixed by the tensors' sizes."""

    tensor_of: torch.Tensor  # int64 [n_blocks], CPU: the tensor each block reads
    start_bytes: torch.Tensor  # int64 [n_blocks], CPU: the block's byte offset in its tensor
    rows: torch.Tensor  # int64 [2, n_blocks] on the device: flat offset, element count
    n_blocks: int


@functools.lru_cache(maxsize=_TABLE_CACHE_SIZE)
def _layout(device, block: int, itemsize: int, numels: tuple, offsets: tuple) -> _Layout:
    numel = torch.tensor(numels, dtype=torch.int64)
    offset = torch.tensor(offsets, dtype=torch.int64)
    n_blk = (numel + block - 1) // block
    tensor_of = torch.repeat_interleave(torch.arange(len(numels)), n_blk)
    first = torch.cumsum(n_blk, 0) - n_blk
    start = (torch.arange(tensor_of.numel()) - first[tensor_of]) * block
    blk_off = offset[tensor_of] + start
    blk_count = torch.clamp(numel[tensor_of] - start, max=block)
    rows = torch.stack([blk_off, blk_count]).to(device)  # once per layout
    return _Layout(tensor_of, start * itemsize, rows, int(tensor_of.numel()))


def clear_table_cache() -> None:
    """Drop cached block tables (and their device memory)."""
    _cached_table.cache_clear()
    _layout.cache_clear()
