"""``monitored_barrier`` for groups of the ``fastcomm`` backend.

torch's ``dist.monitored_barrier`` refuses every backend but one by name (``ValueError:
monitored_barrier is only implemented for GLOO backend``) before it reaches the group, so a
fastcomm group offers the same call itself: ``fastcomm.monitored_barrier`` (``group.py``,
which hands any other group to torch's) and the group's own
``group.monitored_barrier(timeout, wait_all_ranks)``, the method torch would call.

Protocol (Gloo's, over the group's store instead of its pairs): every rank but 0 writes its
arrival key for the barrier's sequence number and waits for rank 0's verdict; rank 0 waits for
the arrivals within ``timeout`` -- stopping at the first rank missing, or with ``wait_all_ranks``
collecting every one -- and writes the verdict. A rank that did not arrive is named in the
``CommTimeoutError`` rank 0 raises and, through the verdict, in the one every other rank that
did arrive raises; a rank waiting on a rank 0 that never comes raises naming rank 0.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from ..errors import CommTimeoutError

__all__ = ["run"]

_PREFIX = "fastcomm/monitored_barrier"
_GRACE = 5.0  # seconds a waiting rank allows rank 0 beyond the timeout to write its verdict


def run(store: dist.Store, rank: int, size: int, seq: int, timeout: timedelta,
        wait_all_ranks: bool, where: str) -> None:
    """One monitored barrier of a group (its ``seq``-th) over the group's ``store``.

    Args:
        store: the group's c10d store.
        rank: this rank in the group.
        size: the group's size.
        seq: the call's number in the group (the same on every rank that calls).
        timeout: how long rank 0 waits.
        wait_all_ranks: as in :func:`monitored_barrier`.
        where: the group, for messages.
    """
    seconds = timeout.total_seconds()  # positive: the group checked it (store.as_timedelta)
    key = f"{_PREFIX}/{seq}"
    start = time.monotonic()
    if rank != 0:
        store.set(f"{key}/arrived/{rank}", "1")
        try:
            store.wait([f"{key}/verdict"], timedelta(seconds=seconds + _GRACE))
        except (RuntimeError, dist.DistStoreError) as exc:
            raise CommTimeoutError(
                f"rank {rank}: monitored_barrier of {where}: rank 0 gave no verdict within "
                f"{time.monotonic() - start:.1f} s (timeout {seconds:g} s): rank 0 did not "
                "reach the barrier"
            ) from exc
        verdict = store.get(f"{key}/verdict").decode()
        if verdict != "ok":
            raise CommTimeoutError(
                f"rank {rank}: monitored_barrier of {where}: {verdict}"
            )
        return
    missing = []
    for peer in range(1, size):
        left = seconds - (time.monotonic() - start)
        arrived = f"{key}/arrived/{peer}"
        try:
            if left <= 0:
                if not store.check([arrived]):
                    raise TimeoutError
            else:
                store.wait([arrived], timedelta(seconds=left))
        except (RuntimeError, TimeoutError, dist.DistStoreError):
            missing.append(peer)
            if not wait_all_ranks:
                break
    elapsed = time.monotonic() - start
    if missing:
        who = f"rank {missing[0]}" if len(missing) == 1 else \
            f"ranks {', '.join(map(str, missing))}"
        verdict = (f"{who} did not reach the monitored barrier within {seconds:g} s "
                   f"(rank 0 waited {elapsed:.1f} s)")
        store.set(f"{key}/verdict", verdict)
        raise CommTimeoutError(f"rank 0: monitored_barrier of {where}: {verdict}")
    store.set(f"{key}/verdict", "ok")
    for peer in range(1, size):  # the arrivals are read; the verdict stays for late readers
        store.delete_key(f"{key}/arrived/{peer}")
