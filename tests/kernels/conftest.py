"""Fixtures for the kernel tests: where the Triton kernels run.

`device` is the device the kernels under test run on, with ``FASTCOMM_KERNELS=triton`` set
through monkeypatch (nothing leaks into other test packages):

- ``cpu``: the kernels run in Triton's interpreter. That needs ``TRITON_INTERPRET=1`` in the
  environment *before triton is first imported* (triton decorates its own standard library,
  e.g. ``tl.max``, at import), which the root ``tests/conftest.py`` does on machines without
  CUDA; otherwise these cases skip, saying why.
- ``cuda``: the kernels are compiled for the GPU (marked ``gpu``; skipped without CUDA or
  when triton was imported in interpreter mode).
"""

import pytest
import torch

from .helpers import HAS_TRITON, needs_cuda


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=needs_cuda)])
def device(request, monkeypatch):
    """The device the Triton kernels run on (interpreted on CPU, compiled on CUDA)."""
    if not HAS_TRITON:
        pytest.skip("needs triton")
    from fastcomm.kernels import _launch

    if (request.param == "cpu") != _launch._interpreting():
        mode = "interpreter" if _launch._interpreting() else "compiled"
        pytest.skip(f"triton was imported in {mode} mode (TRITON_INTERPRET is read at import)")
    monkeypatch.setenv("FASTCOMM_KERNELS", "triton")
    return torch.device(request.param)


@pytest.fixture
def interpreted(device) -> bool:
    """Whether the kernels run in the interpreter (fp32 -> bf16 casts truncate there)."""
    return device.type == "cpu"


@pytest.fixture
def launches(monkeypatch):
    """Counts kernel launches of pack/unpack/quantize/dequantize: ``launches.count``."""
    from fastcomm.kernels import _launch, _pack, _quantize

    class Counter:
        count = 0

    real = _launch.runnable

    class Launcher:
        def __init__(self, kernel):
            self.kernel = real(kernel)

        def __getitem__(self, grid):
            Counter.count += 1
            return self.kernel[grid]

    monkeypatch.setattr(_pack, "runnable", Launcher)
    monkeypatch.setattr(_quantize, "runnable", Launcher)
    return Counter
