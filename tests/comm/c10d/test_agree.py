"""The agreement's fingerprint (``fastcomm.comm.c10d.agree``), without ranks: the summed
fingerprints of calls that agree always say so; a difference in any head field or any
sent/expected count is always caught (the checksums' weights are fixed, so the cases here are
deterministic; one count that differs by less than 2^61 is never missed)."""

from __future__ import annotations

import random

import pytest

from fastcomm.comm.c10d.agree import _weights, agrees, fingerprint
from fastcomm.comm.calls import HEAD


def _summed(rows: list[list[int]]) -> list[int]:
    size = len(rows)
    terms = [fingerprint(r, size, row) for r, row in enumerate(rows)]
    return [sum(column) for column in zip(*terms, strict=True)]


def _consistent(size: int, seed: int) -> list[list[int]]:
    """Rows of ranks that agree: one head, and a flow matrix read by rows (sent) and by
    columns (expected)."""
    rng = random.Random(seed)
    # calls.encode's head: op, dtype, numel, reduce op, root, two-step, layout
    head = [rng.randrange(1, 23), rng.randrange(40), -1, rng.randrange(10),
            rng.randrange(-1, size), 0, rng.randrange(1 << 20)]
    flows = [[rng.choice([-1, 0, 1, 7, 1 << 40]) for _ in range(size)] for _ in range(size)]
    return [head + flows[r] + [flows[i][r] for i in range(size)] for r in range(size)]


@pytest.mark.parametrize("size", [1, 2, 3, 8, 33])
def test_agreeing_calls_agree(size):
    for seed in range(20):
        assert agrees(_summed(_consistent(size, seed)), size)


@pytest.mark.parametrize("size", [2, 3, 8])
def test_every_single_difference_is_caught(size):
    for seed in range(5):
        rows = _consistent(size, seed)
        for r in range(size):
            for field in range(len(rows[r])):
                for delta in (1, -2, 1 << 31, (1 << 31) - 1, 1 << 50):
                    changed = [list(row) for row in rows]
                    changed[r][field] += delta
                    head = field < HEAD
                    if not head and size == 1:
                        continue
                    assert not agrees(_summed(changed), size), (seed, r, field, delta)


def test_weights_are_fixed_and_in_range():
    first, second = _weights(4)
    assert first != second
    assert all(1 <= w < (1 << 61) - 1 for table in (first, second) for row in table for w in row)
    assert _weights(4) is _weights(4)
