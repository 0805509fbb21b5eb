"""Runs after the shm suites (file order): ``/dev/shm`` holds nothing of fastcomm's.

Segments are unlinked as soon as every rank mapped them, so after the shm tests -- including
ranks that raised, timed out or were SIGKILLed, and communicators never closed -- no
``/dev/shm/fastcomm-*`` may remain. A segment whose creator still runs may belong to another
test session setting one up right now: it must be gone within seconds.
"""

from __future__ import annotations

import os
import time

from fastcomm.comm.shm.segment import PREFIX, SHM_DIR, process_alive


def _creator(name: str) -> int:
    return int(name[len(PREFIX) :].split("-", 1)[0])


def test_no_fastcomm_segment_left_in_dev_shm():
    deadline = time.monotonic() + 10.0
    while True:
        left = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
        orphans = [n for n in left if not process_alive(_creator(n))]
        assert not orphans, f"segments of exited processes left in {SHM_DIR}: {orphans}"
        if not left:
            return
        assert time.monotonic() < deadline, f"segments still in {SHM_DIR} after 10 s: {left}"
        time.sleep(0.1)
