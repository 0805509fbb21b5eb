"""Compile kernel variants for sm_90 and write their PTX: ``python _compile_probe.py OUT_DIR``.

Run in a subprocess by test_compile.py, with ``TRITON_INTERPRET`` unset: a process whose
triton was imported in interpreter mode cannot compile. Needs no GPU (Triton bundles ptxas).
"""

import inspect
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fastcomm.kernels import _pack, _quantize  # noqa: E402

TL = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16, "fp64": tl.float64}
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}


def compile_ptx(kernel, types: dict, constexprs: dict, aligned=()) -> str:
    names = list(inspect.signature(kernel.fn).parameters)
    src = ASTSource(
        fn=kernel,
        signature={n: "constexpr" if n in constexprs else types[n] for n in names},
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in aligned},
    )
    options = {"num_warps": 4, "enable_fp_fusion": False}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def variants():
    for dtype in TL:
        for aligned in (True, False):
            align, vec = (16, 16 // ITEMSIZE[dtype]) if aligned else (1, 1)
            types = {"table": "*i64", "flat": f"*{dtype}", "scale": "fp32", "n_blocks": "i32"}
            common = dict(COMPUTE=tl.float64 if dtype == "fp64" else tl.float32, MID=TL[dtype],
                          CAST=True, APPLY_SCALE=True, FLAT_VEC=vec, BLOCK=_pack.BLOCK)
            yield (f"pack-{dtype}-{aligned}", _pack._pack_kernel, types,
                   dict(common, SRC=TL[dtype], SRC_ALIGN=align), ["table", "flat"])
            yield (f"unpack-{dtype}-{aligned}", _pack._unpack_kernel,
                   dict(types, partials="*fp32"),
                   dict(common, DST=TL[dtype], ACCUMULATE=True, STATS=False, DST_ALIGN=align),
                   ["table", "flat"])
    for qdtype in ("i8", "fp8e4nv"):
        for block in (16, 256, 8192):
            is_fp8 = qdtype == "fp8e4nv"
            types = {"x": "*bf16", "error": "*fp32", "q": f"*{qdtype}", "scales": "*fp32",
                     "n": "i32", "n_blocks": "i32"}
            yield (f"quantize-{qdtype}-{block}", _quantize._quantize_kernel, types,
                   dict(QMAX=448.0 if is_fp8 else 127.0, IS_FP8=is_fp8, HAS_ERROR=True,
                        QBLOCK=block, ROWS=max(1, _quantize.TILE // block)),
                   ["x", "error", "q", "scales"])
    for out in ("fp32", "bf16", "fp64"):
        types = {"q": "*i8", "scales": "*fp32", "out": f"*{out}", "n": "i32", "n_blocks": "i32"}
        yield (f"dequantize-{out}", _quantize._dequantize_kernel, types,
               dict(COMPUTE=tl.float64 if out == "fp64" else tl.float32,
                    MID=tl.float32 if out == "bf16" else TL[out], ACCUMULATE=True, QBLOCK=256,
                    ROWS=16),
               ["q", "scales", "out"])


if __name__ == "__main__":
    out_dir = sys.argv[1]
    for name, kernel, types, constexprs, aligned in variants():
        with open(os.path.join(out_dir, f"{name}.ptx"), "w") as f:
            f.write(compile_ptx(kernel, types, constexprs, aligned))
