"""Naming a hang: which ranks never launched a bucket, and which gradients they lacked.

Buckets launch in index order once all their parameters have gradients, so when one rank's
backward produces no gradient for some parameter (a data-dependent branch, a layer frozen
on that rank only) it never launches that parameter's bucket, while the other ranks wait in
that bucket's collective until the communicator's timeout.

Nothing is exchanged on the fast path. Only when a bucket's wait times out, or a rank ends
its backward with a bucket unlaunched, does a rank publish its readiness -- how many buckets
it launched and which parameters got no gradient -- under a store key of this DDP and step,
and read the others'. Both sides then raise the same explanation: the timed-out ranks at
once (a ``CommTimeoutError`` chained to the collective's), the lagging ranks at their next
forward (the reducer's unused-parameter error, extended).
"""

from __future__ import annotations

import json
import time
from typing import NoReturn

from fastcomm.comm.errors import CommTimeoutError

__all__ = ["Readiness"]

_MAX_NAMES = 10
#: Seconds a timed-out rank waits for the others' readiness (they publish at their own
#: timeout, about when it fires here, or published long ago at the end of their backward).
GRACE_S = 10.0


def _is_timeout(exc: BaseException) -> bool:
    if isinstance(exc, TimeoutError):
        return True
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _shown(names: list[str]) -> str:
    text = ", ".join(names[:_MAX_NAMES])
    if len(names) > _MAX_NAMES:
        text += f", ... ({len(names) - _MAX_NAMES} more)"
    return text


class Readiness:
    """Publishes and compares the ranks' readiness of one DDP when a bucket hangs.

    Args:
        reducer: the DDP's reducer; constructed on every rank in the same order (DDP
            construction is collective), so the store prefix drawn here matches.
    """

    def __init__(self, reducer) -> None:
        self.reducer = reducer
        comm = reducer.comm
        self.store = getattr(comm, "store", None)
        self.prefix = comm.next_key("ddp-readiness") if self.store is not None else ""
        self._published_step = -1

    # ------------------------------------------------------------------ exchange
    def _key(self, step: int, rank: int) -> str:
        return f"{self.prefix}/step{step}/rank{rank}"

    def publish(self) -> None:
        """Writes this rank's readiness for the current step (idempotent per step)."""
        reducer = self.reducer
        step = reducer.synced_iterations
        if self.store is None or self._published_step == step:
            return
        record = {
            "launched": reducer.step.next_bucket,
            "buckets": len(reducer.buckets),
            "missing": reducer.step.missing(),
        }
        self.store.set(self._key(step, reducer.comm.rank), json.dumps(record))
        self._published_step = step

    def gather(self, timeout_s: float) -> dict[int, dict | None]:
        """Every rank's record of this step (None: not published within `timeout_s`)."""
        comm = self.reducer.comm
        step = self.reducer.synced_iterations
        deadline = time.monotonic() + timeout_s
        records: dict[int, dict | None] = {}
        for rank in range(comm.size):
            try:
                left = max(0.05, deadline - time.monotonic())
                records[rank] = json.loads(self.store.get(self._key(step, rank), timeout=left))
            except Exception:  # noqa: BLE001 - a silent rank is reported, not raised
                records[rank] = None
        return records

    # ------------------------------------------------------------------ explanations
    def describe(self, records: dict[int, dict | None], waited_s: float) -> str | None:
        """The mismatch the records show, or None when every reporting rank launched all."""
        reducer = self.reducer
        comm = reducer.comm
        reported = {r: rec for r, rec in records.items() if rec is not None}
        silent = sorted(r for r, rec in records.items() if rec is None)
        if not reported:
            return None
        first = min(rec["launched"] for rec in reported.values())
        if first >= len(reducer.buckets):
            return None
        lagging = sorted(r for r, rec in reported.items() if rec["launched"] <= first)
        launched = sorted(r for r, rec in reported.items() if rec["launched"] > first)
        bucket = reducer.buckets[first]
        lines = [
            f"fastcomm DDP (rank {comm.rank} of {comm.size}): ranks disagree on which "
            f"gradients they produced in synchronized step {reducer.synced_iterations + 1}: "
            f"bucket {first} ({len(bucket.params)} parameter(s)) was never launched on "
            f"rank(s) {', '.join(map(str, lagging))}"
            + (f"; rank(s) {', '.join(map(str, launched))} launched it" if launched else "")
        ]
        for r in lagging:
            missing = [reducer.names[i] for i in reported[r]["missing"]]
            lines.append(
                f"  rank {r} launched {reported[r]['launched']} of {reported[r]['buckets']} "
                f"buckets; it produced no gradient for {len(missing)} parameter(s): "
                f"{_shown(missing)}"
            )
        if silent:
            lines.append(
                f"  rank(s) {', '.join(map(str, silent))} did not report within "
                f"{waited_s:.1f} s (hung elsewhere, or gone)"
            )
        lines.append(
            "  A data-dependent branch or a layer frozen on some ranks only: pass "
            "find_unused_parameters=True to DDP (unused parameters are then reduced as zeros) "
            "or make every rank use the same parameters."
        )
        return "\n".join(lines)

    def wait(self, bucket):
        """``reducer.wait_bucket(bucket)``; a timeout is re-raised with the ranks' readiness."""
        try:
            return self.reducer.wait_bucket(bucket)
        except Exception as exc:
            self.failed(bucket, exc)

    def failed(self, bucket, exc: Exception) -> NoReturn:
        """Raises `exc`, the failure of `bucket`'s wait; a timeout as a ``CommTimeoutError``
        naming the ranks' readiness where they disagree (chained to `exc`)."""
        if self.store is None or not _is_timeout(exc):
            raise exc
        self.publish()
        grace = min(GRACE_S, self.reducer.comm.timeout.total_seconds())
        message = self.describe(self.gather(grace), grace)
        if message is None:
            raise exc
        raise CommTimeoutError(f"{message}\n  (bucket {bucket.index}'s wait: {exc})") from exc

    def explain_incomplete(self) -> str:
        """For a rank that ended its backward with a bucket unlaunched: the ranks' readiness.

        Waits up to the communicator's timeout (plus a grace) for the ranks that launched the
        bucket: they publish when their own wait for it times out.
        """
        if self.store is None:
            return ""
        self.publish()
        limit = self.reducer.comm.timeout.total_seconds() + GRACE_S
        message = self.describe(self.gather(limit), limit)
        return "" if message is None else "\n" + message
