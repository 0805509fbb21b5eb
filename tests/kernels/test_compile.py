"""Compile the kernels for an sm_90 GPU without one (Triton bundles ptxas).

The interpreter accepts code the compiler may reject and cannot tell whether alignment
hints work. `_compile_probe.py` compiles representative variants to PTX in a subprocess
(compiling is impossible in a process whose triton was imported in interpreter mode, as the
root conftest does on CPU machines); these tests check the PTX: 128-bit accesses for aligned
full blocks, correctly rounded divisions, no FMA contraction, and the round-to-grid
additions kept as two rounded operations (not folded away).
"""

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from .helpers import needs_triton

pytestmark = needs_triton

PROBE = Path(__file__).with_name("_compile_probe.py")


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    out = tmp_path_factory.mktemp("ptx")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, str(PROBE), str(out)], env=env, capture_output=True,
                         text=True, timeout=300)
    if run.returncode and "ptxas" in run.stderr:  # pragma: no cover - no CUDA backend
        pytest.skip(f"cannot compile for CUDA here: {run.stderr[-500:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    return {p.stem: p.read_text() for p in out.glob("*.ptx")}


def accesses(text: str, op: str) -> Counter:
    return Counter(re.findall(rf"{op}\.global[\.\w]*", text))


def is_wide(kind: str) -> bool:
    return ".v4" in kind or ".v2.b64" in kind or ".v2.f64" in kind


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "fp64"])
@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_pack_unpack_vectorize_when_aligned(ptx, op, dtype, aligned):
    text = ptx[f"{op}-{dtype}-{aligned}"]
    kinds = accesses(text, "ld") | accesses(text, "st")
    assert any(is_wide(k) for k in kinds) == aligned, kinds
    assert not re.search(r"\bfma\.", text)


@pytest.mark.parametrize("block", [16, 256, 8192])
@pytest.mark.parametrize("qdtype", ["i8", "fp8e4nv"])
def test_quantize_vectorized_with_exact_rounding(ptx, qdtype, block):
    text = ptx[f"quantize-{qdtype}-{block}"]
    assert any(is_wide(k) for k in accesses(text, "ld")), accesses(text, "ld")
    assert "div.rn.f32" in text and not re.search(r"div\.(full|approx)", text)
    assert not re.search(r"\bfma\.", text)  # the reference rounds products and sums apart
    magic = "0f49C00000" if qdtype == "fp8e4nv" else "0f4B400000"  # 1.5*2**20, 1.5*2**23
    assert magic in text
    assert re.search(r"add\.rn\.f32", text) and re.search(r"sub\.rn\.f32", text)


@pytest.mark.parametrize("out", ["fp32", "bf16", "fp64"])
def test_dequantize_vectorized(ptx, out):
    text = ptx[f"dequantize-{out}"]
    assert any(is_wide(k) for k in accesses(text, "st")), accesses(text, "st")
