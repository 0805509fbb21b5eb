"""Which implementation runs: FASTCOMM_KERNELS, TRITON_INTERPRET and the tensor's device."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastcomm.kernels import _launch, kernel_backend, pack, pack_reference

from .helpers import needs_triton


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("FASTCOMM_KERNELS", raising=False)
    return monkeypatch


def test_cpu_uses_the_reference_by_default(env):
    # Even in interpreter mode: only FASTCOMM_KERNELS=triton interprets (slow) on CPU.
    assert kernel_backend(torch.zeros(1)) == "torch"
    assert kernel_backend("cpu") == "torch"
    assert kernel_backend(torch.device("meta")) == "torch"


def test_forced_torch(env):
    env.setenv("FASTCOMM_KERNELS", "torch")
    assert kernel_backend("cpu") == "torch"
    assert kernel_backend("cuda") == "torch"


def test_bad_setting_is_rejected(env):
    env.setenv("FASTCOMM_KERNELS", "cuda")
    with pytest.raises(ValueError, match="FASTCOMM_KERNELS='cuda'"):
        kernel_backend("cpu")
    with pytest.raises(ValueError, match="FASTCOMM_KERNELS"):
        pack([torch.zeros(3)])


@needs_triton
def test_forced_triton_where_it_cannot_run(env):
    env.setenv("FASTCOMM_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="FASTCOMM_KERNELS=triton but .* meta"):
        kernel_backend("meta")
    if _launch._interpreting():
        with pytest.raises(RuntimeError, match="interpreter mode"):
            kernel_backend("cuda")
        assert kernel_backend("cpu") == "triton"
    else:
        with pytest.raises(RuntimeError, match="CUDA tensors"):
            kernel_backend("cpu")


def test_reference_path_on_cpu(env):
    tensors = [torch.randn(3, 4), torch.randn(5)]
    assert torch.equal(pack(tensors, scale=0.5), pack_reference(tensors, scale=0.5))


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("TRITON_INTERPRET", "FASTCOMM_KERNELS")}
    full_env.update(env)
    root = str(Path(__file__).resolve().parents[2])
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=120)


@needs_triton
def test_interpreter_set_after_import_is_reported():
    run = _run("""
        import os, torch
        import fastcomm.kernels as K
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["FASTCOMM_KERNELS"] = "triton"
        try:
            K.pack([torch.ones(3)])
        except RuntimeError as e:
            print("ERROR", e)
    """)
    assert run.returncode == 0, run.stderr
    assert "ERROR" in run.stdout and "set after triton was imported" in run.stdout


@needs_triton
def test_interpreter_set_before_import_runs_kernels_on_cpu():
    run = _run("""
        import torch
        import fastcomm.kernels as K
        from fastcomm.kernels import _quantize
        assert K.kernel_backend("cpu") == "torch"  # auto keeps the reference on CPU
        import os; os.environ["FASTCOMM_KERNELS"] = "triton"
        x = torch.randn(1000)
        q, s = K.quantize(x, error=torch.zeros(1000))
        assert torch.equal(q, K.quantize_reference(x, error=torch.zeros(1000))[0])
        print("OK", type(_quantize._quantize_kernel).__name__)
    """, TRITON_INTERPRET="1")
    assert run.returncode == 0, run.stderr
    assert "OK InterpretedFunction" in run.stdout


def test_without_triton_everything_runs_the_references():
    run = _run("""
        import sys
        sys.modules["triton"] = None  # import triton -> ImportError
        import torch
        import fastcomm.kernels as K
        x = [torch.randn(5), torch.randn(3, 2)]
        assert K.kernel_backend("cpu") == "torch" and K.kernel_backend("cuda") == "torch"
        flat = K.pack(x, scale=0.5)
        q, s = K.quantize(flat)
        K.unpack(K.dequantize(q, s), x)
        import os; os.environ["FASTCOMM_KERNELS"] = "triton"
        try:
            K.pack(x)
        except RuntimeError as e:
            print("OK", e)
    """)
    assert run.returncode == 0, run.stderr
    assert "OK FASTCOMM_KERNELS=triton but triton is not installed" in run.stdout
