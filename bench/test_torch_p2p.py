"""Point-to-point through ``torch.distributed``: backend fastcomm beside a Gloo group and MPICH.

Pairs of ranks (0, 1), (2, 3)... at once, fp32 CPU tensors of 4 KiB to 64 MiB, 2 and 4 ranks:

- ``torch_send_recv``: ``dist.send`` + ``dist.recv`` ping-pong (the even rank sends then
  receives, the odd one the reverse); ``us`` is half a round trip, the one-way time, as the OSU
  latency test (and ``send_recv`` of ``bench/test_collectives.py``) reports it;
- ``torch_exchange``: ``dist.batch_isend_irecv`` of one send to and one receive from the peer,
  both works waited on: both directions at once; ``us`` is one exchange.

Providers, in the same rank processes (the default group of backend fastcomm, a Gloo group
beside it): ``fastcomm`` (the calls on the fastcomm group), ``gloo`` (the same calls on the
Gloo group), ``pg`` and ``comm`` (``torch_send_recv`` only: the fastcomm group's own
``send``/``recv`` methods called as torch calls them, ``.wait()`` included, without torch's
``dist`` layer; and the group's shm communicator called directly, ``comm.send``/``comm.recv``,
the untagged lane with neither the adapter nor torch's layer), and ``mpich``
(one ``mpiexec -n N`` run of ``bench/mpi_p2p.py`` per op and size: ``Send``/``Recv``,
``Isend``/``Irecv`` + ``Waitall``, the same block length and rounds).

A round times one block of ``k`` back-to-back calls of every in-process provider in turn
(a Gloo barrier before each block), ``k`` by size alone (about 1 ms of work at 1 GB/s); a
provider's figure is the median over rounds of rank 0's per-call time, so fastcomm and Gloo are
interleaved within seconds of each other. Rows go to the ``"collectives"`` list of
``--benchmark-json`` (ops ``torch_send_recv`` and ``torch_exchange``), so the table at the end
and ``python bench/plot.py`` (``collectives_torch_*.png``) show them.

Filters: ``FASTCOMM_BENCH_WORLDS`` (default ``2,4``), ``FASTCOMM_BENCH_SIZES`` (``4KiB``,
``64MiB``...), ``FASTCOMM_BENCH_P2P_OPS`` (default both). Quick mode (``--benchmark-disable``
or ``FASTCOMM_BENCH_QUICK=1``): 4 KiB and 256 KiB, 2 ranks, one checked call per provider, no
MPICH. Run: ``flock /tmp/fastcomm-bench.lock python -m pytest bench/test_torch_p2p.py
--benchmark-json bench/results/torch_p2p.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from _torch_groups import init_groups

from tests.harness import STATE, RankPool

QUICK = bool(os.environ.get("FASTCOMM_BENCH_QUICK")) or "--benchmark-disable" in sys.argv
KIB, MIB = 1 << 10, 1 << 20
OPS = [op for op in os.environ.get("FASTCOMM_BENCH_P2P_OPS", "torch_send_recv,torch_exchange")
       .split(",") if op]
ALL_SIZES = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB"
PROVIDERS = {"torch_send_recv": ("fastcomm", "gloo", "pg", "comm"),
             "torch_exchange": ("fastcomm", "gloo")}
TIMEOUT = 300.0
MPI_MAX_SECONDS = 2.0


def _size(text: str) -> int:
    for unit, mult in (("KiB", KIB), ("MiB", MIB)):
        if text.endswith(unit):
            return int(text[: -len(unit)]) * mult
    return int(text)


SIZES = [_size(s) for s in (os.environ.get("FASTCOMM_BENCH_SIZES") or
                            ("4KiB,256KiB" if QUICK else ALL_SIZES)).split(",")]
WORLDS = [int(w) for w in (os.environ.get("FASTCOMM_BENCH_WORLDS") or
                           ("2" if QUICK else "2,4")).split(",")]
for _op in OPS:
    if _op not in PROVIDERS:
        raise ValueError(f"FASTCOMM_BENCH_P2P_OPS: unknown op {_op!r}; allowed: "
                         f"{', '.join(PROVIDERS)}")


def size_id(nbytes: int) -> str:
    return f"{nbytes // MIB}MiB" if nbytes >= MIB else f"{nbytes // KIB}KiB"


def iterations_for(nbytes: int) -> int:
    """Calls per timed block: about 1 ms of work at 10 us + 1 GB/s, by size only."""
    return max(1, min(100, int(1e-3 / (10e-6 + nbytes / 1e9))))


# ---------------------------------------------------------------------- rank side
def setup_ranks() -> None:
    STATE["p2p_bench"] = init_groups("bench-torch-p2p", TIMEOUT)


def teardown_ranks() -> None:
    import torch.distributed as dist

    STATE.pop("p2p_bench", None)
    dist.destroy_process_group()


def _call(provider: str, op: str, nbytes: int):
    """The timed call, and the tensors whose values :func:`check_once` reads."""
    import torch.distributed as dist

    groups = STATE["p2p_bench"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    peer = rank ^ 1
    message = torch.full((nbytes // 4,), float(rank + 1))
    into = torch.empty_like(message)
    if peer >= world:
        return (lambda: None), message, into
    if provider == "comm":
        comm = groups["fastcomm"].communicator
        send = lambda t, p: comm.send(t, p)  # noqa: E731
        recv = lambda t, p: comm.recv(t, p)  # noqa: E731
    elif provider == "pg":  # the group's methods as torch calls them, without torch's layer
        pg = groups["fastcomm"]
        send = lambda t, p: pg.send([t], p, 0).wait()  # noqa: E731
        recv = lambda t, p: pg.recv([t], p, 0).wait()  # noqa: E731
    else:
        group = groups[provider]
        send = lambda t, p: dist.send(t, p, group=group)  # noqa: E731
        recv = lambda t, p: dist.recv(t, p, group=group)  # noqa: E731
    if op == "torch_send_recv":
        if rank % 2 == 0:
            return (lambda: (send(message, peer), recv(message, peer))), message, into
        return (lambda: (recv(message, peer), send(message, peer))), message, into
    group = groups[provider]

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, message, peer, group=group),
               dist.P2POp(dist.irecv, into, peer, group=group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return exchange, message, into


def check_once(op: str, nbytes: int) -> str:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank ^ 1 >= world:
        return "idle"
    for provider in PROVIDERS[op]:
        fn, message, into = _call(provider, op, nbytes)
        fn()
        got, want = ((message, rank + 1 - rank % 2) if op == "torch_send_recv"
                     else (into, (rank ^ 1) + 1))
        assert torch.equal(got, torch.full_like(got, float(want))), (provider, op, got[:4])
    return "ok"


def time_round(op: str, nbytes: int, iterations: int) -> dict[str, float]:
    """Microseconds per call of every provider, one block of ``iterations`` calls each."""
    import torch.distributed as dist

    per_call = {}
    for provider in PROVIDERS[op]:
        fn, _, _ = _call(provider, op, nbytes)
        fn()  # warm: the tensors' first touch, the engine's first use
        dist.barrier(group=STATE["p2p_bench"]["gloo"])
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        seconds = (time.perf_counter() - start) / iterations
        per_call[provider] = seconds / (2 if op == "torch_send_recv" else 1) * 1e6
    return per_call


# ---------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"{n}ranks")
def world(request):
    with RankPool(request.param, env={"OMP_NUM_THREADS": "1"}, timeout=TIMEOUT) as pool:
        pool.run(setup_ranks)
        yield pool
        pool.run(teardown_ranks)


def _mpich(op: str, nbytes: int, world: int, rounds: int, iterations: int) -> dict | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if not mpiexec.exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "mpi.json"
        cmd = [str(mpiexec), "-n", str(world), sys.executable,
               str(Path(__file__).with_name("mpi_p2p.py")), "--out", str(out), "--ops", op,
               "--sizes", str(nbytes), "--rounds", str(rounds), "--iterations", str(iterations),
               "--max-seconds", str(MPI_MAX_SECONDS)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}"
        (row,) = json.loads(out.read_text())
    return row


@pytest.mark.parametrize("nbytes", SIZES, ids=size_id)
@pytest.mark.parametrize("op", OPS)
def test_torch_p2p(benchmark, world, collectives_report, op, nbytes):
    if QUICK or benchmark.disabled:  # one checked call of every provider
        results = []
        benchmark.pedantic(lambda: results.extend(world.run(check_once, op, nbytes)),
                           rounds=1, iterations=1)
        assert results and set(results) <= {"ok", "idle"}, results
        return
    n = world.world_size
    iterations = iterations_for(nbytes)
    rounds = 15
    samples: list[dict[str, float]] = []

    def one_round() -> None:
        samples.append(world.run(time_round, op, nbytes, iterations)[0])

    benchmark.group = f"{op} {size_id(nbytes)} {n} ranks"
    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=1)
    rows = {}
    for provider in PROVIDERS[op]:
        us = statistics.median(s[provider] for s in samples[1:])
        rows[provider] = dict(op=op, provider=f"{provider}", bytes=nbytes, world=n,
                              us=round(us, 2), algbw=nbytes / us / 1e3, busbw=nbytes / us / 1e3)
    mpich = _mpich(op, nbytes, n, rounds, iterations)
    if mpich is not None:
        rows["mpich"] = mpich
    collectives_report.extend(rows.values())
    benchmark.extra_info.update({f"{p}_us": r["us"] for p, r in rows.items()})
    benchmark.extra_info["fastcomm_over_gloo"] = rows["fastcomm"]["us"] / rows["gloo"]["us"]
    if mpich is not None:
        benchmark.extra_info["fastcomm_over_mpich"] = rows["fastcomm"]["us"] / mpich["us"]
