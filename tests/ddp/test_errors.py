"""Error cases: clear messages on every rank instead of hangs or silent divergence.

Multi-rank checks catch the expected error on each rank and return its message, so the pool
survives (a raising check would restart it).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastcomm.ddp import DDP, DDPConfig
from tests.ddp.common import batches, build, init_torch_dist, loss_of, rank, step
from tests.harness import pool_fixture, rank_comm


def _expect(exc_type, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return str(exc)
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


# ---------------------------------------------------------------------- checks (every rank)
def check_parameter_mismatch(kind: str):
    comm = rank_comm("gloo")
    sizes = (16, 32, 24, 4) if kind == "shape" and rank() == 1 else (16, 32, 32, 4)
    model = build("mlp", sizes=sizes)
    if kind == "count" and rank() == 1:
        model.extra = nn.Linear(2, 3)
    return _expect(RuntimeError, DDP, model, comm=comm)  # torch's type (also a ValueError)


def check_unused_without_find_unused():
    init_torch_dist()
    model = DDP(build("branchy", dynamic=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), (x2, y2) = batches("mlp", 2)
    step(model, opt, "mlp", x, y)  # `never` gets no gradient: its bucket cannot launch
    return _expect(RuntimeError, model, x2)


def check_hook_errors():
    from fastcomm.ddp import hooks

    model = DDP(build("mlp"), comm=rank_comm("gloo"))
    model.register_comm_hook(None, lambda state, bucket: "not a future")
    second = _expect(RuntimeError, model.register_comm_hook, None, hooks.allreduce_hook)
    (x, y), = batches("mlp", 1)
    bad_future = _expect(TypeError, lambda: loss_of("mlp", model(x), y).backward())
    q = DDP(build("mlp"), comm=rank_comm("gloo"))
    q.register_comm_hook(None, hooks.int8_compress_hook)
    no_state = _expect(TypeError, lambda: loss_of("mlp", q(x), y).backward())
    return second, bad_future, no_state


# ---------------------------------------------------------------------- pytest side
pool = pool_fixture(2, timeout=90)


@pytest.mark.parametrize("kind", ["shape", "count"])
def test_parameter_mismatch_raises_on_every_rank(pool, kind):
    messages = pool.run(check_parameter_mismatch, kind)
    assert messages[0] == messages[1], "every rank raises the same error"
    if kind == "shape":
        assert "layers.2.weight" in messages[0] and "(32, 32)" in messages[0]
        assert "(24, 32)" in messages[0] and "rank 1" in messages[0]
    else:
        assert "rank 0 has 6 parameters but rank 1 has 8" in messages[0]
        assert "#6 'extra.weight'" in messages[0]


def test_unused_parameter_named_on_next_iteration(pool):
    for message in pool.run(check_unused_without_find_unused):
        assert "never.weight" in message and "never.bias" in message
        assert "find_unused_parameters=True" in message
        assert "skip.weight" not in message


def test_hook_misuse(pool):
    for second, bad_future, no_state in pool.run(check_hook_errors):
        assert "only be called once" in second
        assert "str" in bad_future and "Future" in bad_future
        assert "QuantizeState" in no_state


# ---------------------------------------------------------------------- single process
def test_no_communicator_is_a_clear_error():
    import torch.distributed as dist

    import fastcomm

    assert not dist.is_initialized() and not fastcomm.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DDP(nn.Linear(2, 2))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"bucket_cap_mb": 0}, ValueError, r"bucket_cap_mb must be a finite number of MiB in \(0,"),
        ({"bucket_cap_mb": float("inf")}, ValueError, "bucket_cap_mb must be a finite.*got inf"),
        ({"bucket_cap_mb": float("nan")}, ValueError, "bucket_cap_mb must be a finite.*got nan"),
        ({"bucket_cap_mb": 1e300}, ValueError, "bucket_cap_mb must be a finite.*got 1e"),
        ({"bucket_cap_mb": 10**400}, ValueError, "bucket_cap_mb must be a finite"),
        ({"first_bucket_mb": float("inf")}, ValueError, "first_bucket_mb must be a finite"),
        ({"bucket_cap_mb_list": [1, float("inf")]}, ValueError, r"bucket_cap_mb_list\[1\]"),
        ({"bucket_cap_mb_list": 5}, TypeError, "bucket_cap_mb_list must be a list"),
        ({"bucket_cap_mb_list": "12"}, TypeError, "bucket_cap_mb_list must be a list"),
        ({"bucket_cap_mb": "25"}, TypeError, "bucket_cap_mb must be a number"),
        ({"bucket_cap_mb_list": []}, ValueError, "at least one cap"),
        ({"bucket_cap_mb_list": [1, -2]}, ValueError, r"bucket_cap_mb_list\[1\]"),
        ({"static_graph": 1}, TypeError, "static_graph must be a bool"),
    ],
)
def test_config_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DDPConfig(**kwargs)


def test_bad_arguments_before_any_communication():
    from fastcomm.comm import GlooCommunicator, Store

    comm = GlooCommunicator(Store(is_server=True, timeout=10), 0, 1, timeout=10)
    try:
        with pytest.raises(RuntimeError, match="doesn't have any parameter"):
            DDP(nn.Linear(2, 2).requires_grad_(False), comm=comm)
        with pytest.raises(TypeError, match="callable"):
            DDP(nn.Linear(2, 2), comm=comm).register_comm_hook(None, 5)
        with pytest.raises(ValueError, match="delay_all_reduce"):
            DDP(nn.Linear(2, 2), comm=comm, delay_all_reduce_named_params=[])
        with pytest.raises(TypeError, match="Communicator"):
            DDP(nn.Linear(2, 2), comm="gloo")
    finally:
        comm.close()


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"bucket_cap_mb": float("inf")}, ValueError, "bucket_cap_mb must be a finite"),
        ({"bucket_cap_mb_list": [float("inf")]}, ValueError, r"bucket_cap_mb_list\[0\]"),
        ({"dim": "0"}, TypeError, "dim must be an int"),
        ({"broadcast_buffers": 2}, TypeError, "broadcast_buffers must be a bool or None"),
        ({"forward_sync_buffers": "yes"}, TypeError, "forward_sync_buffers must be a bool"),
        ({"process_group": "gloo"}, TypeError, "process_group must be a torch.distributed"),
        ({"check_finite": 1}, TypeError, "check_finite must be a bool"),
    ],
)
def test_bad_options_raise_one_error_before_anything_is_built(kwargs, exc, match):
    from fastcomm.comm import GlooCommunicator, Store

    comm = GlooCommunicator(Store(is_server=True, timeout=10), 0, 1, timeout=10)
    try:
        with pytest.raises(exc, match=match):
            DDP(nn.Linear(2, 2), comm=comm, **kwargs)
        with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
            DDP("not a module", comm=comm)
    finally:
        comm.close()


def test_infinite_bucket_cap_is_one_line_without_del_noise(tmp_path):
    """The issue's row, as a user runs it: one ValueError, nothing printed by a half-built
    object's ``__del__`` at exit."""
    import subprocess
    import sys

    script = tmp_path / "inf_cap.py"
    script.write_text(
        "import gc\n"
        "from torch import nn\n"
        "from fastcomm.comm import GlooCommunicator, Store\n"
        "from fastcomm.ddp import DDP\n"
        "comm = GlooCommunicator(Store(is_server=True, timeout=10), 0, 1, timeout=10)\n"
        "try:\n"
        "    DDP(nn.Linear(2, 2), comm=comm, bucket_cap_mb=float('inf'))\n"
        "except ValueError as exc:\n"
        "    print('ValueError:', exc)\n"
        "gc.collect()\n"
        "comm.close()\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ValueError: bucket_cap_mb must be a finite number of MiB")
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr
