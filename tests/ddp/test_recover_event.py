"""How the survivors learn of a loss on one host: 3 ranks on shm under ``fastcomm-run --recover
in-process``, rank 1 SIGKILLed at a step boundary or inside its backward. Each survivor's
change records how it saw the loss: ``pidfd`` (the exit as an event, within a wait's sleep
slice) or ``flag`` (the other survivor's abort mark, itself set on a pidfd), never ``poll``;
with ``FASTCOMM_PIDFD=0`` (as where the kernel has no pidfd_open) the waits read ``/proc``
every 50 ms and the job recovers the same. Either way every step is done once and the
survivors' parameters agree bitwise and match the replay (``test_recover._check``)."""

from __future__ import annotations

import os

import pytest

from tests.ddp.test_recover import KILL_STEP, STEPS, _check, _launch

needs_pidfd = pytest.mark.skipif(not hasattr(os, "pidfd_open"),
                                 reason="no os.pidfd_open in this Python")


@needs_pidfd
@pytest.mark.timeout(200)
@pytest.mark.parametrize("point", ["between", "backward"])
def test_a_kill_is_seen_through_the_pidfd(tmp_path, point):
    """With pidfds, the waits see the kill by the victim's exit flag in ``/proc`` (within ms of
    the kill) or its pidfd (readable once the kernel has torn it down), never by a timeout."""
    result = _launch(tmp_path, f"1:{point}", shared=True)
    reports, sizes = _check(tmp_path, result, {1})
    assert [s[0] for s in sizes] == [3] * KILL_STEP + [2] * (STEPS - KILL_STEP)
    seen_by = [how for r in (0, 2) for how in reports[r]["seen_by"]]
    assert len(seen_by) == 2 and {"pidfd", "exiting"} & set(seen_by), seen_by
    assert set(seen_by) <= {"pidfd", "exiting", "flag"}, seen_by


@pytest.mark.timeout(200)
@pytest.mark.parametrize("point", ["between", "backward"])
def test_without_a_pidfd_the_waits_read_proc(tmp_path, point):
    result = _launch(tmp_path, f"1:{point}", shared=True, FASTCOMM_PIDFD="0")
    reports, sizes = _check(tmp_path, result, {1})
    assert [s[0] for s in sizes] == [3] * KILL_STEP + [2] * (STEPS - KILL_STEP)
    seen_by = [how for r in (0, 2) for how in reports[r]["seen_by"]]
    assert len(seen_by) == 2 and "poll" in seen_by, seen_by
    assert set(seen_by) <= {"poll", "flag"}, seen_by
