"""What the ``fastcomm`` torch.distributed backend adds to a call, 2 CPU ranks, interleaved.

- The agreement before a call handed to Gloo (``agree``): the group's ``_agree`` (one ``SUM``
  all-reduce of a 18-``int64`` fingerprint) against the descriptor ``all_gather`` it replaced
  (``agree-gather``: every rank's descriptor gathered and compared in Python), the bare
  all-reduce of 18 ``int64`` (``round``), and the call it guards: a 4 KiB ``gather`` on the Gloo
  group beside the communicator (``gloo-gather``).
- A 4 KiB all-reduce: ``comm.all_reduce`` (``comm``), the group's own ``allreduce`` as torch
  calls it (``pg``: the adapter's part is ``pg - comm``), ``dist.all_reduce`` (``dist``: torch's
  own layer is ``dist - pg``).

Every round runs each way ``CALLS`` times in turn, a barrier before each; the figure is the
median over rounds of the slower rank (``extra_info["us_per_call"]``). ``test_table`` prints
them side by side. Quick mode (``--benchmark-disable``): a few calls, a smoke test.
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta

import pytest
import torch
from _ddp_common import quick

from tests.harness import STATE, RankPool, rank_store

WAYS = ("agree", "agree-gather", "round", "gloo-gather", "comm", "pg", "dist")
CALLS = 200
_ROWS: dict[str, float] = {}


# ---------------------------------------------------------------------- rank side
def _ways() -> dict:
    import torch.distributed as dist

    from fastcomm.comm.c10d.agree import FINGERPRINT, gloo_call
    from fastcomm.comm.calls import encode, first_difference

    if "c10d_overhead" not in STATE:
        import fastcomm  # noqa: F401 - registers the backend

        store = dist.PrefixStore("c10d-overhead", rank_store().torch_store)
        dist.init_process_group("fastcomm", store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=120))
        STATE["c10d_overhead"] = dist.group.WORLD
    group = STATE["c10d_overhead"]
    comm, size = group.communicator, group.size()
    t = torch.ones(1024)
    outputs = [[torch.empty(1024) for _ in range(size)]] if group.rank() == 0 else []
    gather_opts = dist.GatherOptions()
    gather_opts.rootRank = 0
    gather = (outputs, [t], gather_opts)
    reduce_opts = dist.AllreduceOptions()
    reduce_opts.asyncOp = False
    small = torch.zeros(FINGERPRINT, dtype=torch.int64)

    def agree_gather():
        mine = torch.tensor(encode(gloo_call("gather", size, gather)), dtype=torch.int64)
        rows = mine.new_empty((size, mine.numel()))
        comm.all_gather(rows, mine)
        assert first_difference(rows.tolist()) is None

    return {
        "agree": lambda: group._agree("gather", "gather", gather),
        "agree-gather": agree_gather,
        "round": lambda: comm.all_reduce(small),
        "gloo-gather": lambda: group.gloo.gather(*gather).wait(),
        "comm": lambda: comm.all_reduce(t),
        "pg": lambda: group.allreduce([t], reduce_opts),
        "dist": lambda: dist.all_reduce(t, group=group),
    }


def rounds(count: int, calls: int) -> dict[str, list[float]]:
    """Microseconds per call of every way, per round, the ways in turn."""
    import torch.distributed as dist

    ways = _ways()
    group = STATE["c10d_overhead"]
    per_call = {name: [] for name in ways}
    for i in range(count + 1):  # the first round warms up
        for name, call in ways.items():
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(calls):
                call()
            if i:
                per_call[name].append((time.perf_counter() - start) / calls * 1e6)
    return per_call


# ---------------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def measured(request):
    quick_mode = quick(request.config)
    with RankPool(2, env={"OMP_NUM_THREADS": "1"}, timeout=600) as pool:
        per_rank = pool.run(rounds, 2 if quick_mode else 15, 3 if quick_mode else CALLS)
    return {w: statistics.median(max(v) for v in zip(*(r[w] for r in per_rank), strict=True))
            for w in WAYS}


@pytest.mark.parametrize("way", WAYS)
def test_call(benchmark, measured, way):
    benchmark.extra_info.update(provider=way, us_per_call=round(measured[way], 2))
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    _ROWS[way] = measured[way]
    assert measured[way] > 0


def test_table(measured, capsys):
    m = measured
    with capsys.disabled():
        print(
            f"\nagreement {m['agree']:.1f} us (was {m['agree-gather']:.1f} us; its round "
            f"{m['round']:.1f} us; the Gloo gather it guards {m['gloo-gather']:.1f} us)\n"
            f"4 KiB all_reduce: comm {m['comm']:.1f} us, group.allreduce {m['pg']:.1f} us "
            f"(adapter {m['pg'] - m['comm']:+.1f} us), dist.all_reduce {m['dist']:.1f} us "
            f"(torch's layer {m['dist'] - m['pg']:+.1f} us; {m['dist'] - m['comm']:+.1f} us "
            "over comm)"
        )
    assert m["agree"] > 0
