"""The suite's file order (``tests/schedule.py``): the longest files first, each file whole."""

from __future__ import annotations

from types import SimpleNamespace

from tests.schedule import longest_first, parse


def _items(*nodeids: str) -> list:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_files_go_longest_first_and_stay_whole():
    items = _items("a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "d.py::t1", "b.py::t2")
    seconds = {"a.py": 1.0, "b.py": 30.0, "c.py": 5.0}
    order = [i.nodeid for i in longest_first(items, seconds)]
    assert order == ["b.py::t1", "b.py::t2", "c.py::t1", "a.py::t1", "a.py::t2", "d.py::t1"]


def test_parse_sums_each_files_phases():
    log = """
============================= slowest durations ==============================
12.50s call     tests/launch/test_x.py::test_one[a]
0.50s setup    tests/launch/test_x.py::test_one[a]
3.00s call     bench/test_y.py::test_two
(20 durations < 0.005s hidden.  Use -vv to show these durations.)
"""
    assert parse(log) == {"tests/launch/test_x.py": 13.0, "bench/test_y.py": 3.0}
    assert parse("4 passed in 1.2s") == {}
