"""``fastcomm.init()`` from torchrun's environment, and reuse of torch.distributed's store."""

from __future__ import annotations

import pytest
import torch

import fastcomm
from fastcomm.comm import world
from fastcomm.comm.nccl import decode_nccl_version
from tests.harness import pool_fixture


def check_init_from_env():
    try:
        fastcomm.get_world()
    except RuntimeError as exc:
        assert "before fastcomm.init()" in str(exc)
    else:
        raise AssertionError("get_world() before init() must raise")
    comm = fastcomm.init(timeout=30)
    # one host, CPU tensors: the shared-memory communicator (FASTCOMM_BACKEND=gloo forces Gloo)
    assert fastcomm.get_world() is comm and comm.backend == "shm"
    try:
        fastcomm.init()
    except RuntimeError as exc:
        assert "already called" in str(exc)
    else:
        raise AssertionError("a second init() must raise")
    t = torch.tensor([comm.rank + 1.0])
    comm.all_reduce(t)
    fastcomm.shutdown()
    assert comm.closed and not fastcomm.is_initialized()
    return (comm.rank, comm.size, t.item())


def check_init_reuses_torch_store():
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    try:
        comm = fastcomm.init(timeout=30)
        # same MASTER_PORT, no second bind: both groups work side by side
        a, b = torch.ones(2), torch.ones(2)
        comm.all_reduce(a)
        dist.all_reduce(b)
        assert torch.equal(a, b)
        assert comm.store.port == int(os.environ["MASTER_PORT"])
        fastcomm.shutdown()
    finally:
        dist.destroy_process_group()
    return True


def check_bad_backend():
    try:
        fastcomm.init(backend="mpi")
    except ValueError as exc:
        return str(exc)
    raise AssertionError("unknown backend accepted")


# The ranks' checks are about the CPU layout (one host -> shm); with GPUs hidden they mean
# the same on a GPU machine. GPU selection is tested below with a faked device count.
pool = pool_fixture(2, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=60)


def test_init_reads_torchrun_environment(pool):
    assert pool.run(check_init_from_env) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_init_reuses_initialized_torch_distributed(pool):
    assert pool.run(check_init_reuses_torch_store) == [True, True]


def test_unknown_backend(pool):
    for message in pool.run(check_bad_backend):
        assert "'mpi'" in message and "gloo" in message


def test_single_process_init_without_environment(monkeypatch):
    # the CPU path on any machine: no device, so no NCCL
    monkeypatch.setattr(world, "cuda_device_count", lambda: 0)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    comm = fastcomm.init(timeout=10)
    try:
        assert (comm.rank, comm.size) == (0, 1)
        t = torch.arange(4.0)
        comm.all_reduce(t, op="avg")
        assert torch.equal(t, torch.arange(4.0))
    finally:
        fastcomm.shutdown()


def test_missing_rank_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK is not set"):
        fastcomm.init()


# ------------------------------------------------------------------ NCCL or not (faked GPUs)
@pytest.mark.parametrize(
    "local_rank, local_world, devices, version, multi, ok, shared",
    [
        (0, 2, 0, (2, 30, 0), "1", False, False),  # CPU machine
        (1, 2, 2, (2, 28, 9), "", True, False),  # a GPU per rank
        (0, 8, 8, (2, 28, 9), "", True, False),
        (1, 2, 1, (2, 28, 9), "1", False, False),  # 1 GPU, 2 ranks: NCCL 2.28 refuses sharing
        (0, 2, 1, (2, 28, 9), "1", False, False),  # rank 0 agrees with rank 1: not NCCL
        (1, 2, 1, (2, 30, 0), "", False, False),  # 2.30 shares only when asked to
        (1, 2, 1, (2, 30, 0), "1", True, True),
        (0, 4, 2, (3, 0, 1), "1", True, True),
        (0, 2, 2, None, "", False, False),  # CuPy's NCCL does not load
    ],
)
def test_nccl_fit(local_rank, local_world, devices, version, multi, ok, shared):
    fit = world.nccl_fit(
        local_rank, local_world, device_count=devices, version=version,
        env={"NCCL_MULTI_RANK_GPU_ENABLE": multi},
    )
    assert (fit.ok, fit.shared, fit.device_count) == (ok, shared, devices), fit
    assert fit.reason


def test_nccl_version_is_decoded_from_the_library_integer():
    assert decode_nccl_version(22809) == (2, 28, 9)
    assert decode_nccl_version(23000) == (2, 30, 0)
    assert decode_nccl_version(2708) == (2, 7, 8)  # the encoding before 2.9


def _fake_gpus(monkeypatch, devices, version, *, local_rank, local_world, multi=""):
    monkeypatch.setattr(world, "cuda_device_count", lambda: devices)
    monkeypatch.setattr(world, "detected_nccl_version", lambda: version)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", multi)
    monkeypatch.delenv("FASTCOMM_BACKEND", raising=False)


def test_two_ranks_on_one_gpu_pick_ipc_and_say_why(monkeypatch, caplog):
    _fake_gpus(monkeypatch, 1, (2, 28, 9), local_rank=1, local_world=2)
    assert world.default_backend(2) in ("ipc", "gloo")  # gloo: no /dev/shm
    # through init(): rank 0 of this host, whose peer on LOCAL_RANK 1 would have no GPU
    monkeypatch.setenv("LOCAL_RANK", "0")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level("WARNING", logger="fastcomm"):
        comm = fastcomm.init(timeout=10)
    try:
        lines = [r.getMessage() for r in caplog.records if r.name == "fastcomm"]
        assert len(lines) == 1, lines
        assert comm.backend in ("ipc", "gloo") and f"backend {comm.backend}" in lines[0], lines
        assert "not nccl" in lines[0], lines
        assert "2 local rank(s) on 1 CUDA device(s)" in lines[0] and "2.28.9" in lines[0]
    finally:
        fastcomm.shutdown()


def test_a_gpu_per_rank_picks_nccl(monkeypatch):
    _fake_gpus(monkeypatch, 2, (2, 28, 9), local_rank=1, local_world=2)
    assert world.default_backend(2) == "nccl"


def test_cpu_tensors_keep_auto_selection_off_nccl(monkeypatch):
    _fake_gpus(monkeypatch, 2, (2, 28, 9), local_rank=1, local_world=2)
    assert world.default_backend(2, cpu_tensors=True) in ("shm", "gloo")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="rank 1: backend='nccl' moves CUDA tensors"):
        fastcomm.init(backend="nccl", device="cpu")


def test_shared_gpu_picks_nccl_only_where_nccl_allows_it(monkeypatch):
    _fake_gpus(monkeypatch, 1, (2, 30, 0), local_rank=1, local_world=2, multi="1")
    assert world.default_backend(2) == "nccl"
    assert world._check_nccl_device(1, 2, None) == 0  # LOCAL_RANK % devices


def test_no_gpu_picks_a_cpu_backend_quietly(monkeypatch, caplog):
    _fake_gpus(monkeypatch, 0, None, local_rank=0, local_world=1)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level("INFO", logger="fastcomm"):
        comm = fastcomm.init(timeout=10)
    fastcomm.shutdown()
    assert comm.backend in ("shm", "gloo")
    assert not [r for r in caplog.records if r.name == "fastcomm"]


def test_explicit_nccl_without_a_gpu_for_this_rank_is_a_clear_error(monkeypatch):
    _fake_gpus(monkeypatch, 1, (2, 28, 9), local_rank=1, local_world=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    # raised before any store or collective: no MASTER_PORT is needed to get there
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError) as info:
        fastcomm.init(backend="nccl")
    message = str(info.value)
    for needle in ("rank 1", "CUDA device 1", "sees 1 CUDA device(s)", "2.28.9"):
        assert needle in message, message
    # rank 0 of the same job would own device 0, but its peer cannot: it fails as well
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="rank 0 .*CUDA device 0"):
        fastcomm.init(backend="nccl")
    assert not fastcomm.is_initialized()


@pytest.mark.parametrize(
    "devices, version, expected",
    [
        (2, (2, 28, 9), {}),  # a GPU per rank
        (1, (2, 30, 0), "shared"),  # both on GPU 0, as NCCL 2.30 allows
        (1, (2, 28, 9), None),  # NCCL 2.28 refuses: the test skips, naming why
        (0, None, None),
    ],
)
def test_gpu_tests_decide_how_many_nccl_ranks_fit(monkeypatch, devices, version, expected):
    from tests.comm.gpu_layout import SHARED_GPU_ENV, nccl_ranks_env

    monkeypatch.setattr(world, "cuda_device_count", lambda: devices)
    monkeypatch.setattr(world, "detected_nccl_version", lambda: version)
    env, reason = nccl_ranks_env(2)
    assert env == (SHARED_GPU_ENV if expected == "shared" else expected), (env, reason)
    if env is None:
        assert "2 NCCL ranks cannot run here" in reason, reason
