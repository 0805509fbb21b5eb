"""The rank layout from torchrun's, srun's, MPICH's and Open MPI's variables, and the layouts
refused on every rank (real ranks over a real TCPStore on 127.0.0.1)."""

from __future__ import annotations

import os

import pytest
import torch

from fastcomm.comm.launch_env import (
    LaunchEnvError,
    detect,
    expand_hostlist,
    expand_tasks_per_node,
    export_torchrun_env,
    missing_master,
    slurm_port,
)
from tests.harness import pool_fixture

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")


# ------------------------------------------------------------------ SLURM's compressed lists
@pytest.mark.parametrize(
    "text, hosts",
    [
        # the examples of SLURM's documentation (sbatch/srun "Node list" and hostlist forms)
        ("tux[0-3]", ["tux0", "tux1", "tux2", "tux3"]),
        ("lx[15,18,32-33]", ["lx15", "lx18", "lx32", "lx33"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("linux[00-02]", ["linux00", "linux01", "linux02"]),
        ("rack[1-2]-node[01-02]",
         ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("a[1-2],b3,c[08-10]-ib", ["a1", "a2", "b3", "c08-ib", "c09-ib", "c10-ib"]),
        ("gpu-node7", ["gpu-node7"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
    ],
)
def test_hostlist_expands_like_slurm(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-04", "node01]", "node[a-b]", "node[4-1]", ""])
def test_malformed_hostlist_names_the_list(text):
    with pytest.raises(LaunchEnvError, match="host list"):
        expand_hostlist(text)


@pytest.mark.parametrize(
    "text, counts",
    [
        ("2(x3),1", [2, 2, 2, 1]),  # SLURM_TASKS_PER_NODE's documented example
        ("4", [4]),
        ("1(x2)", [1, 1]),
        ("8,8,4", [8, 8, 4]),
    ],
)
def test_tasks_per_node_expands_like_slurm(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["2(3),1", "x", "2(x)", ""])
def test_malformed_tasks_per_node_is_refused(text):
    with pytest.raises(LaunchEnvError, match="neither N nor N\\(xM\\)"):
        expand_tasks_per_node(text)


# ------------------------------------------------------------------ detection
def _srun(procid, ntasks, localid, nodeid, per_node, **extra):
    env = {
        "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks), "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid), "SLURM_TASKS_PER_NODE": per_node, "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456",
    }
    env.update(extra)
    return env


def test_srun_layout_two_nodes_of_two():
    launch = detect(_srun(3, 4, 1, 1, "2(x2)"))
    assert launch.launcher == "srun"
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (
        3, 4, 1, 2)
    assert launch.master_addr == "gpu07"  # the first node of the step
    assert launch.master_port == slurm_port(123456, 0)
    assert launch.problem() is None
    assert "SLURM_PROCID=3" in launch.describe()


def test_srun_uneven_nodes_and_step_variables_win():
    env = _srun(4, 99, 0, 2, "9", SLURM_STEP_NUM_TASKS="5", SLURM_STEP_TASKS_PER_NODE="2(x2),1",
                SLURM_STEP_NODELIST="n[3-5]")
    launch = detect(env)
    assert (launch.world_size, launch.local_world_size, launch.master_addr) == (5, 1, "n3")


def test_slurm_port_is_shared_by_a_step_and_differs_between_steps():
    assert slurm_port(123456, 0) == slurm_port(123456, 0)
    ports = {slurm_port(123456, step) for step in range(8)}
    assert len(ports) == 8 and all(20000 <= p < 60000 for p in ports)


def test_master_variables_win_over_what_srun_derives():
    launch = detect(_srun(0, 2, 0, 0, "2", MASTER_ADDR="10.1.2.3", MASTER_PORT="4242"))
    assert (launch.master_addr, launch.master_port) == ("10.1.2.3", 4242)


def test_torchrun_variables_win_over_srun():
    env = _srun(3, 4, 1, 1, "2(x2)", RANK="0", WORLD_SIZE="8", LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="8", MASTER_ADDR="h", MASTER_PORT="1")
    launch = detect(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_world_size) == (
        "torchrun", 0, 8, 8)


def test_mpich_and_open_mpi_layouts():
    mpich = detect({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                    "MPI_LOCALNRANKS": "2", "MASTER_PORT": "5000"})
    assert (mpich.launcher, mpich.rank, mpich.world_size, mpich.local_rank,
            mpich.local_world_size) == ("mpiexec (MPICH)", 1, 2, 1, 2)
    assert mpich.master_addr == "127.0.0.1"  # every rank on this host
    ompi = detect({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                   "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                   "PMI_RANK": "0", "PMI_SIZE": "1"})
    assert (ompi.launcher, ompi.rank, ompi.world_size, ompi.local_rank,
            ompi.local_world_size, ompi.master_addr) == ("mpiexec (Open MPI)", 5, 8, 1, 4, None)
    why = missing_master(ompi)
    assert "MASTER_ADDR and MASTER_PORT not set" in why and "OMPI_COMM_WORLD_RANK=5" in why


def test_no_launcher_is_one_rank():
    launch = detect({})
    assert (launch.launcher, launch.rank, launch.world_size) == ("none", 0, 1)
    assert missing_master(launch) is None


@pytest.mark.parametrize(
    "env, match",
    [
        ({"WORLD_SIZE": "2"}, "RANK is not set"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)"},
         "SLURM_NODEID is not set"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)",
          "SLURM_NODEID": "2"}, "SLURM_NODEID=2 is outside"),
    ],
)
def test_malformed_variables_are_named(env, match):
    with pytest.raises(LaunchEnvError, match=match):
        detect(env)


@pytest.mark.parametrize(
    "env, why",
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
         "local rank 2 is outside its host's 2 local rank(s)"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"},
         "4 local rank(s) on one host but a world of 2"),
        ({"PMI_RANK": "2", "PMI_SIZE": "2"}, "rank 2 is outside a world of 2"),
    ],
)
def test_layouts_that_cannot_be_right(env, why):
    launch = detect(env)
    assert launch.problem() == why
    with pytest.raises(LaunchEnvError, match="layout cannot be right"):
        launch.check()


def test_export_fills_torchrun_variables_and_keeps_those_set():
    env = _srun(1, 2, 1, 0, "2", MASTER_PORT="7000")
    launch = export_torchrun_env(env)
    assert launch is not None and launch.launcher == "srun"
    assert {k: env[k] for k in TORCHRUN} == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07", "MASTER_PORT": "7000",
    }
    torchrun = {"RANK": "0", "WORLD_SIZE": "1"}
    assert export_torchrun_env(torchrun) is None and torchrun == {"RANK": "0", "WORLD_SIZE": "1"}
    broken = {"PMI_RANK": "x", "PMI_SIZE": "2"}
    assert export_torchrun_env(broken) is None and "RANK" not in broken


# ------------------------------------------------------------------ real ranks
def _as_launched(env: dict[str, str]) -> dict[str, str | None]:
    """Replaces the pool's torchrun variables by ``env`` (returns what to restore)."""
    saved = {k: os.environ.get(k) for k in (*TORCHRUN, *env)}
    for k in TORCHRUN:
        os.environ.pop(k, None)
    os.environ.update(env)
    return saved


def _restore(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        del os.environ[k]


def _srun_env(rank: int, size: int, port: int) -> dict[str, str]:
    """srun's variables for one node of ``size`` tasks whose derived port is ``port``: the
    job and step ids are chosen so :func:`slurm_port` lands on the pool's store."""
    offset = port - 20000
    return _srun(rank, size, rank, 0, str(size), SLURM_JOB_ID=str(offset // 16),
                 SLURM_STEP_ID=str(offset % 16), SLURM_JOB_NODELIST="127.0.0.1")


def check_srun_init_and_ddp():
    """``fastcomm.init()``, an all_reduce and a few DDP steps with srun's variables only."""
    import fastcomm
    from fastcomm.ddp import DDP

    rank = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])  # the pool's store, reached through the job id
    saved = _as_launched(_srun_env(rank, size, port))
    try:
        comm = fastcomm.init(timeout=30)
        t = torch.tensor([rank + 1.0])
        comm.all_reduce(t)
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            model(torch.full((4, 8), float(rank + step))).sum().backward()
            opt.step()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        out = (comm.backend, comm.rank, comm.size, t.item(), flat.tolist())
        fastcomm.shutdown()
        return out
    finally:
        _restore(saved)


def check_srun_init_process_group():
    """``init_process_group("fastcomm")`` (torch's env:// rendezvous) under srun's variables,
    as after ``import fastcomm`` exported torchrun's."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])  # the pool's store, reached through the job id
    saved = _as_launched(_srun_env(rank, size, port))
    try:
        assert export_torchrun_env() is not None
        dist.init_process_group("fastcomm")
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        out = (dist.get_rank(), dist.get_world_size(), t.item())
        dist.destroy_process_group()
        return out
    finally:
        _restore(saved)


def check_refused(layouts: dict[int, dict[str, str]], via_torch: bool = False):
    """Starts with this rank's ``layouts`` entry; returns the error every rank must raise."""
    from datetime import timedelta

    import torch.distributed as dist

    import fastcomm

    rank = int(os.environ["RANK"])
    saved = _as_launched({**{k: os.environ[k] for k in TORCHRUN}, **layouts[rank]})
    try:
        try:
            if via_torch:
                # a namespace of its own: torch names every default group "0", and an earlier
                # check's rows under it would still be in the pool's store
                client = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]),
                                       is_master=False, timeout=timedelta(seconds=30))
                dist.init_process_group(
                    "fastcomm", store=dist.PrefixStore("refused", client), rank=rank,
                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=30),
                )
            else:
                fastcomm.init(timeout=30)
        except LaunchEnvError as exc:
            return str(exc)
        raise AssertionError(f"rank {rank}: the layout {layouts[rank]} was accepted")
    finally:
        _restore(saved)


pool = pool_fixture(2, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=90)


def test_srun_variables_start_fastcomm_and_ddp(pool):
    results = pool.run(check_srun_init_and_ddp)
    assert [r[:4] for r in results] == [("shm", 0, 2, 3.0), ("shm", 1, 2, 3.0)]
    assert results[0][4] == results[1][4]  # DDP kept the replicas equal


def test_srun_variables_start_init_process_group(pool):
    assert pool.run(check_srun_init_process_group) == [(0, 2, 3.0),
                                                                        (1, 2, 3.0)]


@pytest.mark.parametrize(
    "layouts, expected",
    [
        # LOCAL_RANK=2 of LOCAL_WORLD_SIZE=2 on rank 1: named at once, not after the timeout
        ({0: {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
          1: {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}},
         "rank 1: local rank 2 is outside its host's 2 local rank(s)"),
        ({0: {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"},
          1: {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3"}},
         "rank 0: 3 local rank(s) on one host but a world of 2"),
        # the ranks of one host disagree about it
        ({0: {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
          1: {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}},
         "runs 2 rank(s) [0, 1] but they say (rank 0: local rank 0 of 2, rank 1: local rank 0 "
         "of 1)"),
        ({0: {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
          1: {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}},
         "local ranks are not 0..1"),
    ],
)
def test_a_layout_that_cannot_be_right_raises_on_every_rank(pool, layouts, expected):
    errors = pool.run(check_refused, layouts)
    assert all(expected in e for e in errors), errors
    assert errors[0].split(": ", 1)[1] == errors[1].split(": ", 1)[1]  # one error, every rank


def test_torch_backend_refuses_the_same_layouts(pool):
    layouts = {0: {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
               1: {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}}
    errors = pool.run(check_refused, layouts, True)
    assert all("rank 1: local rank 2 is outside" in e for e in errors), errors


@pytest.mark.parametrize(
    "env",
    [
        _srun(13, 16, 5, 1, "8(x2)"),
        {"OMPI_COMM_WORLD_RANK": "13", "OMPI_COMM_WORLD_SIZE": "16",
         "OMPI_COMM_WORLD_LOCAL_RANK": "5", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"},
        {"PMI_RANK": "13", "PMI_SIZE": "16", "MPI_LOCALRANKID": "5", "MPI_LOCALNRANKS": "8"},
    ],
)
def test_two_nodes_of_eight_gpus_pick_nccl_under_each_launcher(monkeypatch, env):
    """16 ranks on 2 nodes of 8 GPUs: each local rank owns a GPU, so NCCL (before, a missing
    LOCAL_WORLD_SIZE counted 16 local ranks for 8 GPUs and fell back to another backend)."""
    from fastcomm.comm import world

    for key in [*TORCHRUN, "FASTCOMM_BACKEND", "NCCL_MULTI_RANK_GPU_ENABLE"]:
        monkeypatch.delenv(key, raising=False)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "PMI_", "OMPI_", "MPI_"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(world, "cuda_device_count", lambda: 8)
    monkeypatch.setattr(world, "detected_nccl_version", lambda: (2, 28, 9))
    assert world.default_backend(16) == "nccl"
