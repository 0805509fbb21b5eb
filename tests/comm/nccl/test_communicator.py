"""NCCL communicator: the dtype/op tables on any machine; real collectives on a GPU only.

GPU tests run at world size 1 and with 2 ranks: on a GPU each where there are two, else sharing
GPU 0 (NCCL >= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``, ``NCCL_NVLS_ENABLE=0``); where NCCL
refuses that, the 2-rank test skips and says why (``tests/comm/gpu_layout.py``).
"""

from __future__ import annotations

import pytest
import torch

from fastcomm import ReduceOp
from fastcomm.comm import SUPPORTED_DTYPES
from fastcomm.comm.nccl import (
    NCCL_DTYPE_NAMES,
    NCCL_OP_NAMES,
    cupy_nccl,
    dtype_code,
    nccl_dtype,
    nccl_op,
    nccl_tables,
)

nccl = cupy_nccl()
needs_cupy_nccl = pytest.mark.skipif(nccl is None, reason="CuPy NCCL bindings not loadable")


@needs_cupy_nccl
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_every_supported_dtype_maps_to_a_distinct_nccl_type(dtype):
    codes = {nccl_dtype(nccl, d) for d in SUPPORTED_DTYPES}
    assert len(codes) == len(SUPPORTED_DTYPES)
    assert nccl_dtype(nccl, dtype) in codes


@needs_cupy_nccl
@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.int16])
def test_unsupported_dtype_is_a_type_error(dtype):
    with pytest.raises(TypeError, match=str(dtype)):
        nccl_dtype(nccl, dtype)


@needs_cupy_nccl
def test_every_reduce_op_maps():
    assert len({nccl_op(nccl, op) for op in ReduceOp}) == len(ReduceOp)


def test_name_tables_cover_every_supported_dtype_and_op_once():
    assert set(NCCL_DTYPE_NAMES) == set(SUPPORTED_DTYPES)
    assert len(set(NCCL_DTYPE_NAMES.values())) == len(NCCL_DTYPE_NAMES)
    assert set(NCCL_OP_NAMES) == set(ReduceOp)
    assert len(set(NCCL_OP_NAMES.values())) == len(NCCL_OP_NAMES)


def test_dtype_code_looks_up_and_refuses_naming_what_is_allowed():
    table = {torch.float32: 7, torch.int8: 0}  # ncclFloat32, ncclInt8 in nccl.h
    assert dtype_code(table, torch.int8) == 0
    with pytest.raises(TypeError, match=r"complex64; allowed: torch.float32, torch.int8"):
        dtype_code(table, torch.complex64)


@needs_cupy_nccl
def test_cached_tables_agree_with_the_per_call_lookups():
    dtypes, ops = nccl_tables(nccl)
    assert dtypes == {d: nccl_dtype(nccl, d) for d in SUPPORTED_DTYPES}
    assert ops == {op: nccl_op(nccl, op) for op in ReduceOp}


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the error on a machine without CUDA; this one has it"
)
def test_nccl_without_cuda_is_a_clear_error():
    from fastcomm.comm import NcclCommunicator, Store

    store = Store(is_server=True, timeout=5)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        NcclCommunicator(store, 0, 1)


# ------------------------------------------------------------------ GPU
def check_nccl_collectives():
    from fastcomm.comm import ReduceOp
    from tests.harness import rank_comm

    comm = rank_comm("nccl")
    dev = comm.device
    n = comm.size
    for dtype in SUPPORTED_DTYPES:
        t = torch.full((1031,), comm.rank + 1, dtype=dtype, device=dev)
        comm.all_reduce(t, op=ReduceOp.SUM)
        torch.cuda.synchronize()
        assert torch.all(t == n * (n + 1) // 2).item()
    out = torch.empty(n, 4, device=dev)
    comm.all_gather(out, torch.full((4,), float(comm.rank), device=dev))
    torch.cuda.synchronize()
    assert torch.equal(out[:, 0].cpu(), torch.arange(float(n)))
    x = torch.ones(1 << 20, device=dev)
    fut = comm.all_reduce(x, op="avg", async_op=True).get_future()
    y = fut.wait() * 2  # stream-ordered: no host sync needed for correctness
    assert torch.allclose(y, torch.full_like(y, 2.0))
    # Temporaries held only by their works and the communicator (no record_stream), futures
    # made after later collectives were enqueued.
    works = [comm.all_reduce(torch.full((4096,), 1.0, device=dev), async_op=True)
             for _ in range(8)]
    values = [w.get_future().wait() for w in works]
    assert all(bool(torch.all(v == n)) for v in values)
    sub = comm.split(0)
    s = torch.ones(3, device=dev)
    sub.all_reduce(s)
    torch.cuda.synchronize()
    assert s[0].item() == n
    return torch.cuda.get_device_name(dev)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_nccl_collectives_on_gpu(world):
    from tests.comm.gpu_layout import nccl_ranks_env_or_skip
    from tests.harness import RankPool

    env = nccl_ranks_env_or_skip(world)
    with RankPool(world, env=env, timeout=120) as pool:
        names = pool.run(check_nccl_collectives)
    assert len(names) == world
