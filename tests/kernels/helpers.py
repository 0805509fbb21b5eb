"""Shared markers and comparison helpers for the kernel tests."""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is a Linux dependency
    HAS_TRITON = False

#: Marks for tests that need a GPU: the `gpu` marker, and a clean skip without CUDA.
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _interpreting() -> bool:
    if not HAS_TRITON:
        return False
    from fastcomm.kernels import _launch

    return _launch._interpreting()


#: Whether this process's triton was imported in interpreter mode (``TRITON_INTERPRET=1``
#: before its first import: what the root ``tests/conftest.py`` sets on machines without CUDA).
INTERPRETING = _interpreting()

#: Mark for in-process checks that run a Triton kernel on CPU memory (CPU tensors, or address
#: tables of CPU mappings): only the interpreter follows those, and it cannot be turned on once
#: triton is imported compiled (pytest's process on a CUDA machine), so they skip there, saying
#: why. Multi-process checks run them anyway: their ranks get `tests.harness.INTERPRETED_KERNELS`.
needs_interpreter = pytest.mark.skipif(
    not INTERPRETING,
    reason="Triton kernels on CPU memory need the interpreter, and triton was imported in "
    "compiled mode in this process (TRITON_INTERPRET is read at import)",
)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a 16-bit float tensor as int32 (adjacent floats differ by 1)."""
    return t.view(torch.int16).to(torch.int32)


def assert_equal_or_1ulp(actual: torch.Tensor, expected: torch.Tensor, one_ulp: bool) -> None:
    """Exact equality, or within 1 ulp of bf16 where the interpreter truncates fp32 -> bf16.

    Triton's interpreter converts fp32 to bf16 by dropping mantissa bits (round toward
    zero) instead of rounding to nearest even as GPUs and torch do, so a value that needed
    rounding lands on the neighbouring bf16 (toward zero) at most: 1 ulp.
    """
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    actual, expected = actual.cpu(), expected.cpu()
    if one_ulp and actual.dtype == torch.bfloat16:
        if actual.numel():
            assert int((bits(actual) - bits(expected)).abs().max()) <= 1
        # Toward zero: never larger in magnitude than the correctly rounded value.
        assert bool((actual.float().abs() <= expected.float().abs()).all())
    else:
        torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)
