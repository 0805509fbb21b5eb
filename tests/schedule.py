"""The order the suite's files are handed to pytest-xdist's workers: the longest first.

With ``-n 2 --dist loadfile`` a worker takes a whole file at a time. pytest-xdist's own order
(the files with the most tests first) leaves the launcher and recovery files, a few tests of
10 to 60 s each, to the end, where one worker runs them while the other has nothing left.
Handing the files out longest first (the longest-processing-time rule) ends both workers at
about the same time. ``tests/file_seconds.json`` holds each file's seconds from a full run;
a file missing from it goes after the known ones, in collection order.

Refresh the figures after a full run with ``--durations=0`` saved to a log:
``python -m tests.schedule LOG`` (rewrites ``tests/file_seconds.json``).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

SECONDS = Path(__file__).with_name("file_seconds.json")
_LINE = re.compile(r"^\s*([0-9.]+)s (?:setup|call|teardown)\s+(\S+?)::")


def file_seconds() -> dict[str, float]:
    """Seconds per test file (its node id's path), from ``file_seconds.json``."""
    try:
        return json.loads(SECONDS.read_text())
    except FileNotFoundError:
        return {}


def longest_first(items: list, seconds: dict[str, float]) -> list:
    """`items` grouped by file, the files in decreasing `seconds` (unknown ones last, in the
    order met), each file's items in their own order."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    known = sorted((f for f in files if f in seconds), key=lambda f: -seconds[f])
    unknown = [f for f in files if f not in seconds]
    return [item for f in known + unknown for item in files[f]]


def parse(log: str) -> dict[str, float]:
    """Seconds per file from pytest's ``--durations=0`` lines."""
    totals: dict[str, float] = {}
    for line in log.splitlines():
        match = _LINE.match(line)
        if match:
            path = match.group(2)
            totals[path] = totals.get(path, 0.0) + float(match.group(1))
    return {path: round(s, 1) for path, s in sorted(totals.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.schedule PYTEST_LOG_WITH_DURATIONS", file=sys.stderr)
        return 2
    totals = parse(Path(argv[0]).read_text())
    if not totals:
        print(f"no --durations lines in {argv[0]}", file=sys.stderr)
        return 1
    SECONDS.write_text(json.dumps(totals, indent=1) + "\n")
    print(f"{len(totals)} files, {sum(totals.values()):.0f} s in all -> {SECONDS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
