"""Shared benchmark helpers: throughput reporting on top of pytest-benchmark.

`throughput(benchmark, nbytes, ops_per_call=1, **info)` is called after ``benchmark(fn)``:
it stores ``bytes``, ``gbps`` (bytes read + written per second, from the median round)
and `info` in ``benchmark.extra_info`` (saved with ``--benchmark-json``/``--benchmark-save``)
and adds a row to a GB/s table printed at the end of the session. With
``--benchmark-disable`` (quick mode) the functions run once and no rate is reported.
"""

import pytest

_ROWS: list[dict] = []


@pytest.fixture
def throughput(request):
    def report(benchmark, nbytes: int, ops_per_call: int = 1, **info) -> float | None:
        stats = getattr(benchmark, "stats", None)
        seconds = stats.stats.median / ops_per_call if stats is not None else None
        gbps = nbytes / seconds / 1e9 if seconds else None
        benchmark.extra_info.update(info, bytes=nbytes, ops_per_call=ops_per_call)
        if gbps is not None:
            benchmark.extra_info["gbps"] = round(gbps, 2)
            benchmark.extra_info["us_per_op"] = round(seconds * 1e6, 2)
        _ROWS.append(dict(info, test=request.node.name, gbps=gbps, seconds=seconds))
        return gbps

    return report


def pytest_terminal_summary(terminalreporter):
    rows = [r for r in _ROWS if r["gbps"] is not None]
    if not rows:
        return
    terminalreporter.section("throughput (bytes read + written per second)")
    width = max(len(r["test"]) for r in rows)
    for r in rows:
        extra = "  ".join(f"{k}={v}" for k, v in r.items()
                          if k in ("fraction_of_copy", "backend") and v is not None)
        terminalreporter.write_line(
            f"{r['test']:<{width}}  {r['gbps']:9.2f} GB/s  {r['seconds'] * 1e6:10.1f} us  {extra}"
        )


# ---------------------------------------------------------------------- collectives
# (bench/test_collectives.py) rows {op, provider, bytes, world, us, algbw, busbw}: a table per world
# at the end and a "collectives" list in --benchmark-json (charted by bench/plot.py).
_COLLECTIVES: list[dict] = []


@pytest.fixture(scope="session")
def collectives_report():
    return _COLLECTIVES


def pytest_configure(config):
    import os

    # quick mode for the modules that read it at import: an xdist worker's argv has no
    # --benchmark-disable, its options do
    if getattr(config.option, "benchmark_disable", False):
        os.environ["FASTCOMM_BENCH_QUICK"] = "1"

    # under fastcomm-run every rank runs pytest; only rank 0 writes results
    if int(os.environ.get("RANK", "0") or 0) != 0:
        for name in ("benchmark_json", "benchmark_save", "benchmark_autosave"):
            value = getattr(config.option, name, None)
            if hasattr(value, "close"):
                value.close()
            if hasattr(config.option, name):
                setattr(config.option, name, None)
    config.pluginmanager.register(_CollectivesTable(), "fastcomm-collectives-table")


def pytest_benchmark_update_json(config, benchmarks, output_json):
    if _COLLECTIVES:
        output_json["collectives"] = list(_COLLECTIVES)
    # Every round's raw time (hundreds of thousands for the fast kernels) would make a results
    # file of tens of MB; the summary statistics are what the tables and charts read.
    for bench in output_json.get("benchmarks", []):
        bench.get("stats", {}).pop("data", None)


_OP_ORDER = ["copy", "all_reduce", "all_reduce_async", "all_gather", "all_gather_list",
             "reduce_scatter", "reduce_scatter_list", "broadcast", "all_to_all", "send_recv"]


class _CollectivesTable:
    def pytest_terminal_summary(self, terminalreporter):
        if not _COLLECTIVES:
            return
        providers = list(dict.fromkeys(r["provider"] for r in _COLLECTIVES if r["op"] != "copy"))
        cells = {(r["op"], r["bytes"], r["world"], r["provider"]): r for r in _COLLECTIVES}
        order = {op: i for i, op in enumerate(_OP_ORDER)}
        for world in sorted({r["world"] for r in _COLLECTIVES}):
            rows = [r for r in _COLLECTIVES if r["world"] == world]
            keys = sorted({(r["op"], r["bytes"]) for r in rows},
                          key=lambda k: (order.get(k[0], len(order)), k[0], k[1]))
            names = sorted({r["provider"] for r in rows}) if world == 1 else providers
            what = "copy reference (one process)" if world == 1 else f"collectives, {world} ranks"
            terminalreporter.section(f"{what}: median us / busbw GB/s")
            terminalreporter.write_line(f"{'op':<20}{'size':>7}" + "".join(
                f"{p:>24}" for p in names))
            for op, nbytes in keys:
                size = f"{nbytes >> 20}MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10}KiB"
                line = f"{op:<20}{size:>7}"
                for p in names:
                    r = cells.get((op, nbytes, world, p))
                    line += f"{r['us']:>13.1f} /{r['busbw']:>7.2f}  " if r else f"{'-':>24}"
                terminalreporter.write_line(line)
