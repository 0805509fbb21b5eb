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
