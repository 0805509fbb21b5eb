"""Interleaved A/B of two commits on this machine: ``bench/ab_probe.py``'s figures, alternating.

    python bench/ab.py BEFORE AFTER [--rounds 5] [--out bench/results/ab-....json]

Each commit is checked out into a temporary worktree (the shm core built in place there); the
probe (this checkout's copy, so both sides run the same code) then runs A, B, A, B ... ``rounds``
times, and the JSON holds every round, the medians per side and AFTER / BEFORE for each figure
(below 1: AFTER is faster). The worktrees are removed on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).resolve().parent / "ab_probe.py"


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, text=True,
                          capture_output=True).stdout.strip()


def _checkout(rev: str, where: Path) -> None:
    _git("worktree", "add", "--detach", str(where), rev)
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=where,
                   check=True, capture_output=True)


def _probe(tree: Path, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, str(PROBE), str(out)], cwd=tree, env=env, check=True,
                   timeout=900)
    return json.loads(out.read_text())


def _medians(rounds: list[dict]) -> dict:
    return {unit: {name: statistics.median(r[unit][name] for r in rounds)
                   for name in rounds[0][unit]} for unit in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sides = {"before": _git("rev-parse", args.before), "after": _git("rev-parse", args.after)}
    runs: dict = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="fastcomm-ab-") as tmp:
        trees = {side: Path(tmp) / side for side in sides}
        try:
            for side, rev in sides.items():
                _checkout(rev, trees[side])
            for i in range(args.rounds):
                for side in sides:
                    runs[side].append(_probe(trees[side], Path(tmp) / f"{side}-{i}.json"))
                    print(f"round {i} {side}: {runs[side][-1]}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(tree)], capture_output=True)
    med = {side: _medians(r) for side, r in runs.items()}
    ratio = {unit: {k: med["after"][unit][k] / med["before"][unit][k] for k in med["after"][unit]}
             for unit in med["after"]}
    result = {"commits": sides, "rounds": args.rounds, "machine": platform.processor() or
              platform.machine(), "cpus": os.cpu_count(), "runs": runs, "median": med,
              "after_over_before": ratio}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    for unit, figures in ratio.items():
        for name, r in figures.items():
            print(f"{name:22s} before {med['before'][unit][name]:8.2f} {unit}  "
                  f"after {med['after'][unit][name]:8.2f} {unit}  after/before {r:.3f}")


if __name__ == "__main__":
    main()
