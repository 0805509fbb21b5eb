"""The hang report: every rank's flight record merged into lines whose first names the cause.

Pure Python over JSON (no torch): the launcher imports it; ``python -m fastcomm.trace FOLDER``
reads the dumps offline (``rank<r>.json`` from :mod:`fastcomm.comm.flight_watch`, ``beats.json``).
The first line is one of:

- ``ranks disagree at #S: ranks 0,2 all_reduce(...), rank 1 broadcast(...)``;
- ``rank 1 (host h) stopped answering at 12:00:01 (...); ranks 0,2 waiting in ...``;
- ``rank 1 never entered all_reduce #S of world (ranks 0,2 waiting since 12:00:03); rank 1 is
  at train.py:57 in next_batch``;
- ``all ranks are in all_reduce #S of world since ...``, ``no rank of world is inside ...``.

Sequence numbers count a communicator's calls from 1, alike on every rank (the contract).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence

__all__ = ["analyze", "first_line", "load", "load_latest", "main", "report_head", "stragglers"]

IN_FLIGHT = ("issued", "started")
_BOOTSTRAP = os.path.join("fastcomm", "launch", "_bootstrap.py")


def _clock(stamp: float | None) -> str:
    if not stamp:
        return "?"
    return time.strftime("%H:%M:%S", time.localtime(stamp))


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"


def _main_record(dump: dict) -> dict:
    records = dump.get("recorders") or [{}]
    return next((r for r in records if r.get("main")), records[0])


def _entries(dump: dict) -> dict[int, dict]:
    return {e["seq"]: e for e in _main_record(dump).get("entries", [])}


def _pending(dump: dict) -> dict | None:
    """The oldest call of the main communicator still in flight on this rank (or its last,
    where that one failed: the rank was in it when it gave up)."""
    entries = _main_record(dump).get("entries", [])
    found = next((e for e in entries if e["state"] in IN_FLIGHT), None)
    if found is None and entries and entries[-1]["state"] == "failed":
        return entries[-1]
    return found


def _last_seq(dump: dict) -> int:
    return int(_main_record(dump).get("seq", 0))


def _host(rank: int, dumps: dict, beats: dict) -> str:
    info = dumps.get(rank) or beats.get(rank) or {}
    return info.get("host", "?")


def _disagreement(dumps: dict[int, dict]) -> str | None:
    """The first sequence number where the ranks' calls differ, in words."""
    tables = {r: _entries(d) for r, d in dumps.items()}
    candidates = set()
    for table in tables.values():
        candidates.update(s for s, e in table.items() if e["state"] in (*IN_FLIGHT, "failed"))
    for seq in sorted(candidates):
        groups: dict[str, list[int]] = {}
        for rank, table in tables.items():
            entry = table.get(seq)
            if entry is not None:
                groups.setdefault(entry["desc"], []).append(rank)
        if len(groups) > 1:
            parts = [f"{_ranks(ranks)} {desc}" for desc, ranks in
                     sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1]))]
            return f"ranks disagree at #{seq}: {', '.join(parts)}"
    return None


def _silent(rank: int, dumps: dict, beats: dict) -> str:
    beat = beats.get(rank) or {}
    host = beat.get("host", "?")
    status = beat.get("status")
    when = _clock(beat.get("time"))
    if not beat:
        return f"rank {rank} never sent a heartbeat"
    fresh = time.time() - beat.get("time", 0) < 3 * beat.get("poll", 1.0) + 1.0
    if fresh and not status:
        return f"rank {rank} (host {host}) is alive (heartbeat at {when}) but sent no record"
    why = {"stopped": f" (pid {beat.get('pid')} is stopped)",
           "exited": f" (pid {beat.get('pid')} exited)",
           "lost": " (named lost by the launcher)"}.get(status, "")
    return f"rank {rank} (host {host}) stopped answering at {when}{why}"


def first_line(dumps: dict[int, dict], beats: dict[int, dict], size: int, name: str) -> str:
    """The cause, in one line (see the module docstring)."""
    return _cause(dumps, beats, size, name)[0]


def _cause(dumps: dict[int, dict], beats: dict[int, dict], size: int, name: str
           ) -> tuple[str, list[int]]:
    """The first line and the ranks it blames."""
    waiting = {r: p for r, d in dumps.items() if (p := _pending(d)) is not None}
    since = min((p["issued"] for p in waiting.values() if p["issued"]), default=None)
    seq = min((p["seq"] for p in waiting.values()), default=0)  # the oldest call waited in
    op = next((p["op"] for p in waiting.values() if p["seq"] == seq), "")
    behind = sorted(r for r, d in dumps.items() if _last_seq(d) < seq)  # never entered it
    where = ", ".join(f"rank {r} is at {dumps[r].get('where') or '?'}" for r in behind)
    never_entered = (f"{_ranks(behind)} never entered {op} #{seq} of {name} "
                     f"({_ranks(sorted(set(waiting) - set(behind)))} waiting since "
                     f"{_clock(since)}); {where}") if behind else ""
    silent = [r for r in range(size) if r not in dumps]
    if silent:
        lines = "; ".join(_silent(r, dumps, beats) for r in silent)
        if behind and since and all((beats.get(r) or {}).get("time", 0) > since for r in silent):
            # the silent ranks answered after the others began to wait (a rank that gave up on
            # the wait and exited, say): the ranks that never entered the call came first
            return f"{never_entered}; {lines}", behind
        if not waiting:
            return lines, silent
        return (f"{lines}; {_ranks(list(waiting))} waiting in {op} #{seq} of {name} since "
                f"{_clock(since)}"), silent
    problem = _disagreement(dumps)
    if problem is not None:
        return problem, []
    if not waiting:
        top = max((_last_seq(d) for d in dumps.values()), default=0)
        return f"no rank of {name} is inside a collective (last call #{top})", []
    if behind:
        return never_entered, behind
    stuck = sorted(r for r, p in waiting.items() if p["seq"] == seq)
    if len(stuck) == size:
        return (f"all ranks are in {op} #{seq} of {name} since {_clock(since)}, none missing "
                "(the backend itself is stuck or slow)"), []
    ahead = sorted(set(dumps) - set(stuck))
    return (f"{_ranks(stuck)} waiting in {op} #{seq} of {name} since {_clock(since)}; "
            f"{_ranks(ahead)} went past it"), ahead


def stragglers(dumps: dict[int, dict]) -> str | None:
    """Which rank issued the completed calls last most often, and by how much (median)."""
    tables = {r: _entries(d) for r, d in dumps.items()}
    if len(tables) < 2:
        return None
    common = set.intersection(*(set(t) for t in tables.values()))
    last: Counter[int] = Counter()
    lags: dict[int, list[float]] = {}
    for seq in common:
        times = {r: t[seq]["issued"] for r, t in tables.items() if t[seq]["issued"]}
        if len(times) < 2:
            continue
        late = max(times, key=times.get)
        last[late] += 1
        lags.setdefault(late, []).append(times[late] - min(times.values()))
    if not last:
        return None
    rank, count = last.most_common(1)[0]
    lag = sorted(lags[rank])[len(lags[rank]) // 2]
    return (f"stragglers: rank {rank} issued last in {count} of {sum(last.values())} calls, "
            f"by {lag * 1e3:.2f} ms (median)")


def _rank_line(rank: int, dump: dict) -> str:
    pending = _pending(dump)
    record = _main_record(dump)
    entries = record.get("entries", [])
    last = entries[-1] if entries else None
    now = (f"in {pending['desc']} #{pending['seq']} since {_clock(pending['issued'])}"
           if pending else "outside any collective")
    done = f"last call #{last['seq']} {last['desc']} ({last['state']})" if last else "no call"
    return (f"  rank {rank} (host {dump.get('host', '?')}, pid {dump.get('pid', '?')}): {now}; "
            f"{done}; at {dump.get('where') or '?'}")


def analyze(dumps: dict[int, dict], beats: dict[int, dict], size: int, name: str = "world"
            ) -> list[str]:
    """The report's lines: the cause first, then one line per rank, the stragglers, and the
    main-thread stack of each rank the first line names."""
    head, named = _cause(dumps, beats, size, name)
    lines = [head]
    for rank in range(size):
        if rank in dumps:
            lines.append(_rank_line(rank, dumps[rank]))
        else:
            lines.append(f"  rank {rank}: no record ({_silent(rank, dumps, beats)})")
    late = stragglers(dumps)
    if late:
        lines.append(late)
    for rank in sorted(set(named) & set(dumps)):
        main = next((t for t in dumps[rank].get("threads", []) if t.get("main")), None)
        if main:
            frames = main["frames"]
            # the user's frames only: what runs the script (the launcher's bootstrap, runpy) cut
            start = max((k + 1 for k, f in enumerate(frames) if f[0].startswith("<frozen runpy")
                         or f[0].endswith(_BOOTSTRAP)), default=0)
            lines.append(f"  rank {rank} main thread (innermost last):")
            lines.extend(f"    {f}:{n} in {fn}: {text}" for f, n, fn, text in frames[start:][-8:])
    return lines


def load(folder: str) -> tuple[dict[int, dict], dict[int, dict], int, str]:
    """The dumps (``rank<r>.json``) and heartbeats (``beats.json``) of a folder: ``(dumps,
    beats, size, communicator name)``."""
    dumps: dict[int, dict] = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as fh:
                dump = json.load(fh)
            dumps[int(dump["rank"])] = dump
    beats: dict[int, dict] = {}
    path = os.path.join(folder, "beats.json")
    if os.path.exists(path):
        with open(path) as fh:
            beats = {int(k): v for k, v in json.load(fh).items()}
    any_dump = next(iter(dumps.values()), {})
    size = int(any_dump.get("size") or (max(beats, default=-1) + 1))
    return dumps, beats, size, any_dump.get("comm", "world")


def _requests(folder: str) -> list[str]:
    """The request folders (``<comm>/<n>``) of the newest communicator under ``folder``,
    newest first."""
    found = []
    for comm in os.listdir(folder):
        path = os.path.join(folder, comm)
        if os.path.isdir(path):
            found += [(int(n), os.path.join(path, n)) for n in os.listdir(path) if n.isdigit()]
    return [p for _, p in sorted(found, reverse=True)]


def load_latest(folder: str) -> tuple[dict[int, dict], dict[int, dict], int, str]:
    """:func:`load` of the newest dump of each rank among the last few requests under
    ``folder`` (ranks that ask at once post several requests; each rank answers one)."""
    dumps: dict[int, dict] = {}
    beats: dict[int, dict] = {}
    size, name = 0, "world"
    for path in _requests(folder)[:4]:
        more, more_beats, more_size, more_name = load(path)
        for rank, dump in more.items():
            dumps.setdefault(rank, dump)
        for rank, beat in more_beats.items():
            beats.setdefault(rank, beat)
        if more_size and not size:
            size, name = more_size, more_name
    return dumps, beats, size, name


def report_head(folder: str) -> str | None:
    """The first line of the hang report the ranks wrote under ``folder`` (``report.txt``),
    else of the newest dumps there, else ``None``."""
    if not os.path.isdir(folder):
        return None
    path = os.path.join(folder, "report.txt")
    try:
        if os.path.exists(path):
            with open(path) as fh:
                return fh.readline().strip() or None
        dumps, beats, size, name = load_latest(folder)
        return first_line(dumps, beats, size, name) if size else None
    except (OSError, ValueError, KeyError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fastcomm.trace FOLDER``: prints the report of a folder of dumps."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python -m fastcomm.trace FOLDER  (a folder of rank<r>.json dumps)",
              file=sys.stderr)
        return 2
    folder = argv[0]
    if any(n.startswith("rank") for n in os.listdir(folder)):
        dumps, beats, size, name = load(folder)
    else:
        dumps, beats, size, name = load_latest(folder)
    if not size:
        print(f"no flight dumps in {argv[0]}", file=sys.stderr)
        return 1
    print("\n".join(analyze(dumps, beats, size, name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
