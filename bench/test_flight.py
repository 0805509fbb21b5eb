"""What the flight recorder costs a 4 KiB shm ``all_reduce`` (fp32, 1024 elements).

- ``test_all_reduce_4k_flight[on|off]``: pytest-benchmark at world size 1 (the host path
  alone, the recorder's share at its largest), recorder on and off (``comm.flight = None``).
- ``test_flight_ab``: 2 real ranks, interleaved A/B: blocks of ``CALLS`` calls alternate
  recorder on and off (the order flips every round, the same on both ranks), ``ROUNDS`` rounds;
  the median of the blocks' ns per call for each side, and their ratio. With
  ``FASTCOMM_FLIGHT_AB_OUT=path`` it writes them there as JSON (bench/results/
  flight_overhead.json). Quick mode (``--benchmark-disable``) runs a few blocks only.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

import pytest
import torch

from tests.harness import RankPool, fresh_comm

QUICK = bool(os.environ.get("FASTCOMM_BENCH_QUICK")) or "--benchmark-disable" in sys.argv
CALLS = 200 if QUICK else 2000
ROUNDS = 4 if QUICK else 40


@pytest.fixture(scope="module")
def solo_comm():
    from fastcomm.comm import new_communicator
    from fastcomm.comm.store import Store

    store = Store(is_server=True, timeout=30)
    comm = new_communicator("shm", store=store.prefixed("flight-bench", rank=0), rank=0,
                            size=1, timeout=30, watch=False)
    yield comm
    comm.close()


@pytest.mark.parametrize("recorder", ["on", "off"])
def test_all_reduce_4k_flight(benchmark, solo_comm, recorder):
    torch.set_num_threads(1)
    saved = solo_comm.flight
    solo_comm.flight = saved if recorder == "on" else None
    x = torch.ones(1024)
    try:
        benchmark.group = "all_reduce-4k-flight"
        benchmark(solo_comm.all_reduce, x)
    finally:
        solo_comm.flight = saved
    assert torch.equal(x, torch.ones(1024))
    assert (saved.seq > 0) == (recorder == "on") or recorder == "off"


def _ab(calls: int, rounds: int) -> dict:
    """Every rank: the interleaved A/B; returns its blocks' ns per call, on and off."""
    torch.set_num_threads(1)
    comm = fresh_comm("shm", "flight-ab", timeout=60)
    recorder = comm.flight
    x = torch.ones(1024)
    for _ in range(calls):  # warm up both paths
        comm.all_reduce(x)
    times = {"on": [], "off": [], "cpu_on": [], "cpu_off": []}
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    for r in range(rounds):
        for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
            comm.flight = recorder if side == "on" else None
            comm.barrier()
            start, start_cpu = clock(), cpu()
            for _ in range(calls):
                comm.all_reduce(x)
            times[side].append((clock() - start) / calls)
            times[f"cpu_{side}"].append((cpu() - start_cpu) / calls)
    comm.flight = recorder
    comm.close()
    return times


def test_flight_ab():
    with RankPool(2, timeout=600) as pool:
        per_rank = pool.run(_ab, CALLS, ROUNDS, timeout=600)
    on = statistics.median(per_rank[0]["on"])
    off = statistics.median(per_rank[0]["off"])
    result = {
        "what": "shm all_reduce of 4 KiB fp32, 2 ranks, synchronous, one torch thread",
        "method": f"interleaved A/B: {ROUNDS} rounds of a block of {CALLS} calls with the "
                  "recorder on and one with it off (comm.flight = None), order flipped every "
                  "round; median over the blocks of rank 0's ns per call",
        "median_ns_on": round(on, 1),
        "median_ns_off": round(off, 1),
        "overhead_ns": round(on - off, 1),
        "ratio": round(on / off, 4),
        "rank1_ratio": round(statistics.median(per_rank[1]["on"])
                             / statistics.median(per_rank[1]["off"]), 4),
        "cpu_ns_on": round(statistics.median(per_rank[0]["cpu_on"]), 1),
        "cpu_ns_off": round(statistics.median(per_rank[0]["cpu_off"]), 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                   f"{platform.python_version()}, torch {torch.__version__}",
    }
    out = os.environ.get("FASTCOMM_FLIGHT_AB_OUT")
    if out:
        with open(out, "w") as fh:
            json.dump(result, fh, indent=2)
    print(json.dumps(result, indent=2))
    assert on > 0 and off > 0
