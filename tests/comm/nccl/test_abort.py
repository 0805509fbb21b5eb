"""A lost rank on the CUDA stream transports (NCCL, ``ipc``'s CUDA transport): the bookkeeping
of ``StreamWatchdog.abort`` on any machine; on GPUs, a NCCL all-reduce that a lost rank never
joins (its kernels would spin forever) released by ``NcclCommunicator.abort``, and in-place
recovery shrinking NCCL when a rank is SIGKILLed mid-backward.

Multi-rank NCCL needs one GPU per rank: the GPU tests skip unless 3 are visible.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from fastcomm.comm.errors import CommAbortedError
from fastcomm.comm.stream import StreamWatchdog


def test_the_watchdog_aborts_once_then_refuses():
    stopped: list[int] = []
    watchdog = StreamWatchdog("test-abort", 60.0, 0.01, lambda work: RuntimeError("stuck"))
    error = CommAbortedError("member 2 (launcher rank 2, pid 1, this host) exited")
    try:
        assert watchdog.abort(error, lambda: stopped.append(1)) is True
        assert watchdog.error is error and stopped == [1] and not watchdog.pending
        assert watchdog.abort(CommAbortedError("again"), lambda: stopped.append(2)) is False
        assert watchdog.error is error and stopped == [1]
        watchdog._thread.join(timeout=10)
        assert not watchdog._thread.is_alive()  # the thread ends with the abort
    finally:
        watchdog.close()


def test_a_failing_native_abort_still_leaves_the_transport_aborted():
    watchdog = StreamWatchdog("test-abort-broken", 60.0, 0.01, lambda work: RuntimeError("x"))

    def broken() -> None:
        raise RuntimeError("ncclCommAbort: the communicator is already gone")

    try:
        assert watchdog.abort(CommAbortedError("lost"), broken) is True
        assert str(watchdog.error) == "lost"
    finally:
        watchdog.close()


# ------------------------------------------------------------------ GPU
three_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 3, reason="multi-rank NCCL needs one GPU per rank (3 here)"
)
LOSS = "member 2 (launcher rank 2, pid 1, this host) exited"


def check_nccl_abort() -> str | None:
    from fastcomm.comm import new_communicator
    from tests.harness import env_rank, rank_store

    rank, store = env_rank(), rank_store()
    comm = new_communicator("nccl", store=store.prefixed("nccl-abort", rank=rank), rank=rank,
                            size=3, timeout=60, device=rank)
    x = torch.ones(4, device=comm.device)
    comm.all_reduce(x)
    torch.cuda.synchronize()
    if rank == 2:  # lost: never joins the next all-reduce
        store.wait([f"nccl-abort/done{r}" for r in (0, 1)])
        comm.abort(CommAbortedError("done"))
        comm.close()
        return None
    work = comm.all_reduce(torch.ones(1 << 20, device=comm.device), async_op=True)
    timer = threading.Timer(1.0, comm.abort, [CommAbortedError(LOSS)])
    timer.start()
    try:
        work.wait(timeout=60)  # the host waits: the kernel spins until the abort
        outcome = "returned"
    except CommAbortedError as exc:
        outcome = str(exc)
    timer.join()
    try:
        comm.all_reduce(x)
        later = "returned"
    except CommAbortedError as exc:
        later = str(exc)
    comm.close()  # does not wait on the aborted communicator
    store.set(f"nccl-abort/done{rank}", "1")
    return outcome + " | " + later


@pytest.mark.gpu
@pytest.mark.timeout(300)
@three_gpus
def test_nccl_abort_releases_a_wait_on_a_lost_rank():
    from tests.harness import RankPool

    with RankPool(3, timeout=200) as pool:
        results = pool.run(check_nccl_abort)
    assert results[2] is None
    for rank in (0, 1):
        outcome, later = results[rank].split(" | ")
        assert outcome.endswith(f"NCCL communicator aborted: {LOSS}"), outcome
        assert later.startswith(f"rank {rank}: all_reduce refused: "), later


NCCL_JOB = """
import json, os, signal, sys
import torch
from torch import nn
import fastcomm
from fastcomm.ddp import DDP

out, STEPS, KILL = sys.argv[1], 6, 3
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
comm = fastcomm.init(backend="nccl", timeout=60)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 4)).cuda()
state = {"step": -1}
if rank == 1:
    def hook(param):
        if state["step"] == KILL:
            os.kill(os.getpid(), signal.SIGKILL)
    model[0].weight.register_post_accumulate_grad_hook(hook)
ddp = DDP(model, bucket_cap_mb=0.25)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
sizes = []
for step in range(STEPS):
    state["step"] = step
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * rank + step)).cuda()
    opt.zero_grad(set_to_none=True)
    ddp(x).square().mean().backward()
    opt.step()
    sizes.append(ddp.world_size)
torch.save([p.detach().cpu() for p in model.parameters()], os.path.join(out, f"p{rank}.pt"))
with open(os.path.join(out, f"r{rank}.json"), "w") as fh:
    json.dump({"sizes": sizes, "backend": ddp.comm.backend}, fh)
fastcomm.shutdown()
"""


@pytest.mark.gpu
@pytest.mark.timeout(300)
@three_gpus
def test_nccl_recovers_in_place_from_a_killed_rank(tmp_path):
    from tests.launch._util import run, script

    path = script(tmp_path, "nccl_job.py", NCCL_JOB)
    result = run(["--nproc-per-node", "3", "--recover", "in-process", path, tmp_path],
                 tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = {r: json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 2)}
    params = {r: torch.load(tmp_path / f"p{r}.pt") for r in (0, 2)}
    assert not os.path.exists(tmp_path / "r1.json")
    for r in (0, 2):
        assert reports[r] == {"sizes": [3, 3, 3, 2, 2, 2], "backend": "nccl"}
    for a, b in zip(params[0], params[2], strict=True):
        assert torch.equal(a, b)
