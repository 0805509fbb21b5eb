"""Collective latency and bus bandwidth: fastcomm-shm/ipc/gloo and torch-gloo side by side.

Ops ``all_reduce``, ``all_gather``, ``reduce_scatter`` and ``broadcast`` on fp32 CPU tensors,
4 KiB to 64 MiB. ``nbytes`` is the whole buffer, as nccl-tests counts it (the all-gather output,
the reduce-scatter input). Bandwidths as nccl-tests defines them, from the median round:
``algbw = nbytes / time``; ``busbw = algbw * 2(n-1)/n`` (all-reduce), ``* (n-1)/n``
(all-gather, reduce-scatter), ``* 1`` (broadcast). Providers:

- ``fastcomm-shm``: :class:`fastcomm.comm.ShmCommunicator` (shared memory);
- ``fastcomm-shm-python``: the same with ``ShmOptions(compiled=False)``: small all-reduces
  (up to 256 KiB, all-reduce only) through the pure-Python path instead of the compiled core;
- ``fastcomm-ipc``: :class:`fastcomm.comm.IpcCommunicator` (the same segment and schedules,
  reductions by the ``peer_reduce`` kernel: on CPU its torch reference, or Triton's interpreter
  under ``FASTCOMM_KERNELS=triton``, far too slow to time);
- ``fastcomm-gloo``: :class:`fastcomm.comm.GlooCommunicator`;
- ``torch-gloo``: ``torch.distributed`` with its Gloo process group (``dist.all_reduce``...);
- ``mpich`` (outside reference, when ``mpi4py`` is installed: ``pip install fastcomm[mpi]``):
  ``bench/mpi_collectives.py`` run under ``mpiexec`` with the same sizes, by
  ``test_mpich_reference`` (last, so nothing else competes for the cores).

Timing, as nccl-tests and the OSU benchmarks do it: a round is a block of ``k`` back-to-back
collectives (``benchmark.pedantic(iterations=k)``) and its time divided by ``k`` is one sample;
the tables report the median sample. Timing one collective per round would add to every sample
the skew with which the ranks enter the round (one rank's timer starts while the other is still
finishing the last round) and pytest-benchmark's own per-round overhead: for a 4 KiB all-reduce
on shared memory both are larger than the collective itself. ``k`` depends on the size alone
(``iterations_for``: about 1 ms of work per round, 1 from 1 MiB up), so every provider is timed
alike, and rounds are counted rather than timed, so every rank knows how many collectives to
issue (``expected_calls``). Two ways to run:

- ``fastcomm-run --nproc-per-node N -m pytest bench/test_collectives.py``: every rank is a
  pytest process; only rank 0 writes ``--benchmark-json`` (``bench/conftest.py``).
- ``pytest bench/test_collectives.py``: this process is rank 0 and starts ``N - 1`` helper
  ranks (``FASTCOMM_BENCH_WORLD``, default 2) that mirror each timed test.

CUDA (``test_all_reduce_cuda``, skipped without CUDA): ``all_reduce`` of fp32 CUDA tensors,
4 KiB to 64 MiB, ``fastcomm-ipc`` (its CUDA IPC transport) beside ``torch-gloo`` (the only
thing that runs where ranks share a GPU and NCCL refuses them) and ``fastcomm-nccl`` where
NCCL can run the job (``nccl_fit``; skipped otherwise); rank ``r`` uses device
``r % device_count``, and each timed call ends with ``torch.cuda.synchronize()``. Rows carry
the provider as ``<provider>@cuda``.

Each rank uses ``cores // N`` torch threads (1 on this 2-core machine), for every provider.
Quick mode (``--benchmark-disable`` or ``FASTCOMM_BENCH_QUICK=1``): 4 KiB and 256 KiB only, 3
rounds of at most 10 collectives, for CI. Results: the pytest-benchmark table (grouped by op and
size), a busbw table at the end, and the rows under ``"collectives"`` in the JSON (``python
bench/plot.py`` charts them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fastcomm.comm import GlooCommunicator, ShmCommunicator, ShmOptions, Store, new_communicator

QUICK = bool(os.environ.get("FASTCOMM_BENCH_QUICK")) or "--benchmark-disable" in sys.argv
KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 256 * KIB] if QUICK else [
    4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 25 * MIB, 64 * MIB
]
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
PROVIDERS = ["fastcomm-shm", "fastcomm-shm-python", "fastcomm-ipc", "fastcomm-gloo", "torch-gloo"]
CUDA_PROVIDERS = ["fastcomm-ipc", "torch-gloo", "fastcomm-nccl"]
HAS_CUDA = torch.cuda.is_available()
TIMEOUT = 300.0
LAUNCHED = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
WORLD = int(os.environ["WORLD_SIZE"]) if LAUNCHED else int(
    os.environ.get("FASTCOMM_BENCH_WORLD", "2")
)


def bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


def size_id(nbytes: int) -> str:
    return f"{nbytes // MIB}MiB" if nbytes >= MIB else f"{nbytes // KIB}KiB"


def iterations_for(nbytes: int) -> int:
    """Collectives per timed round: about 1 ms of work at the fastest providers' speed (10 us +
    1 GB/s), by size only, so every provider and every rank uses the same count."""
    k = max(1, min(100, int(1e-3 / (10e-6 + nbytes / 1e9))))
    return min(k, 10) if QUICK else k


def rounds_for(provider: str, nbytes: int) -> tuple[int, int]:
    """(rounds, warmup) for ~0.3 s per test, the same on every rank (no timing-based choice)."""
    if QUICK:
        return 3, 1
    fast = provider.startswith(("fastcomm-shm", "fastcomm-ipc"))
    latency, bandwidth = (30e-6, 4e9) if fast else (1e-3, 1e9)
    estimate = (latency + nbytes / bandwidth) * iterations_for(nbytes)
    return max(5, min(300, int(0.3 / estimate))), 3


# ---------------------------------------------------------------------- one rank's side
class Rank:
    """This process's communicators, one per provider, built on first use."""

    def __init__(self, store: Store, rank: int, size: int) -> None:
        self.store, self.rank, self.size = store, rank, size
        self.comms: dict[str, object] = {}
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))

    def comm(self, provider: str):
        if provider not in self.comms:
            ns = self.store.prefixed(f"bench/{provider}", rank=self.rank)
            if provider == "fastcomm-shm":
                self.comms[provider] = ShmCommunicator(ns, self.rank, self.size, TIMEOUT)
            elif provider == "fastcomm-shm-python":
                self.comms[provider] = ShmCommunicator(
                    ns, self.rank, self.size, TIMEOUT, options=ShmOptions(compiled=False)
                )
            elif provider == "fastcomm-ipc":
                self.comms[provider] = new_communicator(
                    "ipc", store=ns, rank=self.rank, size=self.size, timeout=TIMEOUT,
                    fallback=False,
                )
            elif provider == "fastcomm-nccl":
                from fastcomm.comm.nccl import NcclCommunicator

                device = self.rank % torch.cuda.device_count()
                self.comms[provider] = NcclCommunicator(
                    ns, self.rank, self.size, TIMEOUT, device=device
                )
            elif provider == "fastcomm-gloo":
                self.comms[provider] = GlooCommunicator(ns, self.rank, self.size, TIMEOUT)
            else:
                dist.init_process_group(
                    "gloo", store=ns.torch_store, rank=self.rank, world_size=self.size
                )
                self.comms[provider] = dist
        return self.comms[provider]

    def step(self, provider: str, op: str, nbytes: int, device: str = "cpu"):
        """The timed call of one test (tensors allocated here, outside it)."""
        comm, n = self.comm(provider), self.size
        numel = nbytes // 4 // n * n
        if device == "cuda":
            cuda = torch.device("cuda", self.rank % torch.cuda.device_count())
            torch.cuda.set_device(cuda)
            big = torch.full((numel,), float(self.rank + 1), device=cuda)

            def all_reduce_cuda() -> None:  # timed to completion on the device
                (dist if comm is dist else comm).all_reduce(big)
                torch.cuda.synchronize(cuda)

            return all_reduce_cuda
        big = torch.full((numel,), float(self.rank + 1))
        part = torch.full((numel // n,), float(self.rank + 1))
        if comm is dist:  # torch 2.13 names (older: all_gather_into_tensor, ..._tensor)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return {
                "all_reduce": lambda: dist.all_reduce(big),
                "all_gather": lambda: gather(big, part),
                "reduce_scatter": lambda: scatter(part, big),
                "broadcast": lambda: dist.broadcast(big, 0),
            }[op]
        return {
            "all_reduce": lambda: comm.all_reduce(big),
            "all_gather": lambda: comm.all_gather(big, part),
            "reduce_scatter": lambda: comm.reduce_scatter(part, big),
            "broadcast": lambda: comm.broadcast(big, 0),
        }[op]

    def close(self) -> None:
        for comm in self.comms.values():
            if comm is dist:
                dist.destroy_process_group()
            else:
                comm.close()
        self.comms.clear()


def helper_run(
    size: int, provider: str, op: str, nbytes: int, calls: int, device: str = "cpu"
) -> int:
    """A helper rank's mirror of one timed test (plain-pytest mode): ``calls`` collectives."""
    from tests.harness import STATE

    rank = STATE.get("bench-rank")
    if rank is None:
        global_rank = int(os.environ["RANK"]) + 1
        store = Store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                      timeout=TIMEOUT, rank=global_rank)
        rank = STATE["bench-rank"] = Rank(store, global_rank, size)
    rank.comm(provider)
    fn = rank.step(provider, op, nbytes, device) if calls else None
    for _ in range(calls):
        fn()
    return calls


def helper_close() -> None:
    from tests.harness import STATE

    if "bench-rank" in STATE:
        STATE.pop("bench-rank").close()


class Mirror:
    """The helper ranks' side of one test, run on a thread; ``join`` re-raises their error.
    Without helpers (``fastcomm-run`` mode) it does nothing."""

    def __init__(self, pool, *args) -> None:
        self.error: BaseException | None = None
        self.thread = None
        if pool is not None:
            self.thread = threading.Thread(target=self._run, args=(pool, args), daemon=True)
            self.thread.start()

    def _run(self, pool, args) -> None:
        try:
            pool.run(helper_run, WORLD, *args)
        except BaseException as exc:  # re-raised by join() in the test
            self.error = exc

    def join(self, timeout: float = TIMEOUT) -> None:
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise TimeoutError(f"helper ranks still busy after {timeout:.0f} s")
        if self.error is not None:
            raise self.error


class World:
    """Rank 0's view: its own :class:`Rank`, plus helper ranks when pytest started alone."""

    def __init__(self) -> None:
        self.pool = None
        if LAUNCHED:
            rank = int(os.environ["RANK"])
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            store = Store(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          int(os.environ["MASTER_PORT"]), is_server=rank == 0 and not agent,
                          timeout=TIMEOUT, rank=rank)
        else:
            from tests.harness import RankPool

            self.pool = RankPool(WORLD - 1, timeout=TIMEOUT * 2, grace=30)
            self.pool.start()
            store, rank = self.pool.store, 0
        self.me = Rank(store, rank, WORLD)

    def mirror(
        self, provider: str, op: str, nbytes: int, calls: int, device: str = "cpu"
    ) -> Mirror:
        """Has the helper ranks issue the same ``calls`` collectives, in the background."""
        return Mirror(self.pool, provider, op, nbytes, calls, device)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.run(helper_close)
        self.me.close()
        if self.pool is not None:
            self.pool.close()


def expected_calls(benchmark, rounds: int, warmup: int, iterations: int) -> int:
    """How often ``benchmark.pedantic`` calls its target (pytest-benchmark 5): ``iterations``
    per round, warmup included, one more call for the result when ``iterations > 1``, and the
    profiled calls (``iterations`` of them unless ``--benchmark-cprofile-loops`` says)."""
    if benchmark.disabled:
        return 1
    profiled = (benchmark.cprofile_loops or iterations) if benchmark.cprofile else 0
    return (warmup + rounds) * iterations + (iterations > 1) + profiled


@pytest.fixture(scope="module")
def world():
    w = World()
    yield w
    w.close()


def run_timed(benchmark, world, report, provider: str, op: str, nbytes: int, device: str):
    """Times one (provider, op, size, device) with the helper ranks mirroring every call, and
    reports its row."""
    rounds, warmup = rounds_for(provider, nbytes)
    iterations = iterations_for(nbytes)
    if world.pool is not None and provider not in world.me.comms:
        setup = world.mirror(provider, op, nbytes, 0)  # helpers build theirs alongside
        world.me.comm(provider)
        setup.join()
    fn = world.me.step(provider, op, nbytes, device)
    calls = expected_calls(benchmark, rounds, warmup, iterations)
    helpers = world.mirror(provider, op, nbytes, calls, device)
    benchmark.pedantic(fn, rounds=rounds, warmup_rounds=warmup, iterations=iterations)
    helpers.join()
    if benchmark.stats is None:  # quick mode: nothing timed
        return
    seconds = benchmark.stats.stats.median  # per collective: pedantic divides by iterations
    algbw = nbytes / seconds / 1e9
    name = provider if device == "cpu" else f"{provider}@{device}"
    row = dict(op=op, provider=name, bytes=nbytes, world=WORLD, us=round(seconds * 1e6, 1),
               algbw=algbw, busbw=algbw * bus_factor(op, WORLD))
    benchmark.extra_info.update(row)
    report.append(row)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("nbytes", SIZES, ids=size_id)
@pytest.mark.parametrize("op", OPS)
def test_collective(benchmark, world, collectives_report, op, nbytes, provider):
    if provider == "fastcomm-shm-python" and (op != "all_reduce" or nbytes > 256 * KIB):
        pytest.skip("the Python path differs from fastcomm-shm only in small all-reduces")
    benchmark.group = f"{op} {size_id(nbytes)}"
    run_timed(benchmark, world, collectives_report, provider, op, nbytes, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("provider", CUDA_PROVIDERS)
@pytest.mark.parametrize("nbytes", SIZES, ids=size_id)
def test_all_reduce_cuda(benchmark, world, collectives_report, nbytes, provider):
    if provider == "fastcomm-nccl":
        from fastcomm.comm.world import nccl_fit

        fit = nccl_fit(0, WORLD)  # every rank skips alike: the helpers only mirror what runs
        if not fit.ok:
            pytest.skip(f"NCCL cannot run this job: {fit.reason}")
    benchmark.group = f"all_reduce cuda {size_id(nbytes)}"
    run_timed(benchmark, world, collectives_report, provider, "all_reduce", nbytes, "cuda")


def _mpiexec() -> str | None:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def test_mpich_reference(collectives_report):
    """The same sizes under MPICH (``bench/mpi_collectives.py``), as reference rows."""
    if LAUNCHED and int(os.environ["RANK"]) != 0:
        pytest.skip("rank 0 runs the MPI reference")
    pytest.importorskip("mpi4py", reason="install the MPI extra: pip install 'fastcomm[mpi]'")
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("mpiexec not found")
    script = Path(__file__).with_name("mpi_collectives.py")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "mpi.json"
        cmd = [mpiexec, "-n", str(WORLD), sys.executable, str(script), "--out", str(out),
               "--sizes", ",".join(map(str, SIZES)), "--ops", ",".join(OPS)]
        if QUICK:
            cmd.append("--quick")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = json.loads(out.read_text())
    assert {(r["op"], r["bytes"]) for r in rows} == {(o, s) for o in OPS for s in SIZES}
    for row in rows:
        assert row["us"] > 0 and row["busbw"] > 0, row
    collectives_report.extend(rows)
