"""Failure collection: this node's failures in a round, and every node's once the job fails.

A worker's failure is read from its error file (the traceback its bootstrap recorded) and its
exit code; a node lost mid-round is named by its peers' heartbeat watch (``heartbeat``). Each
agent writes its round's failures to ``failures/<group rank>`` in the round's store; when
restarts are spent every agent gathers all of them for the root-cause report (``errors``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from .errors import Failure, read_error_file
from .heartbeat import Heartbeats
from .rendezvous import Rendezvous, RoundEnd, RoundInfo, read_failures, write_failures

__all__ = [
    "collect_job_failures",
    "failures_after_stop",
    "stopping_failure",
    "worker_failure",
    "write_local",
]


def write_local(info: RoundInfo, failures: list[Failure]) -> None:
    """Publishes this node's ``failures`` of round ``info`` for the other agents' reports."""
    write_failures(info.store, f"failures/{info.group_rank}", failures)


def _precise_time(path: str) -> float | None:
    try:
        with open(path) as fh:
            return float(json.load(fh)["message"]["extraInfo"]["fastcomm_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def worker_failure(info: RoundInfo, worker, *, host: str, role: str, keep_error_file: bool
                   ) -> Failure:
    """The failure of ``worker`` in round ``info``, from its error file and exit code.

    ``keep_error_file``: whether the error file outlives the agent (a report may name it).
    """
    message, trace, stamp = read_error_file(worker.spec.error_file)
    precise = _precise_time(worker.spec.error_file)
    return Failure(
        rank=worker.spec.rank,
        local_rank=worker.spec.local_rank,
        group_rank=info.group_rank,
        host=host,
        pid=worker.proc.pid,
        exitcode=1 if worker.exitcode is None else worker.exitcode,  # None: exiting
        timestamp=precise or stamp or worker.exited_at or time.time(),
        round=info.round,
        role=role,
        error_file=worker.spec.error_file if message and keep_error_file else None,
        message=message,
        traceback=trace,
    )


def stopping_failure(info: RoundInfo, host: str, message: str) -> Failure:
    """This node's own failure when its agent stops mid-round (a signal, an error)."""
    return Failure(
        rank=-1,
        local_rank=-1,
        group_rank=info.group_rank,
        host=host,
        pid=os.getpid(),
        exitcode=1,
        timestamp=time.time(),
        round=info.round,
        role=info.nodes[info.group_rank].role,
        message=message,
    )


def failures_after_stop(workers, failures: list[Failure], stop_time: float,
                        describe: Callable[[object], Failure]) -> None:
    """Adds to ``failures`` the stopped ``workers`` that died on their own before the stop
    (at ``stop_time``), or recorded an exception; ``describe`` makes a worker's failure."""
    for worker in workers:
        if worker.exitcode in (None, 0) or any(
            f.local_rank == worker.spec.local_rank for f in failures
        ):
            continue
        failure = describe(worker)
        if failure.message or (worker.exited_at or stop_time) < stop_time:
            failures.append(failure)


def collect_job_failures(
    rdzv: Rendezvous,
    info: RoundInfo,
    beats: Heartbeats,
    *,
    wait_s: float,
    log: Callable[[str], None],
    check_stop: Callable[[], None],
) -> tuple[list[Failure], int]:
    """Every node's failures of the failed round ``info``, and how many nodes were lost.

    A peer's record is waited for (at most ``wait_s``) only while its agent heartbeats: a node
    whose heartbeat stops for the limit (counted from the last beat ``beats`` saw in the round)
    is named as lost -- the root cause of the peer-loss errors of this node's workers -- and
    neither its record nor its exit is waited for any longer.
    """
    round_store = info.store
    end = rdzv.end_of(info.round)
    lost = []
    if end is not None and end[0] is RoundEnd.FAILURE:
        lost = [f for f in (end[1] or []) if f.rank < 0]
    deadline = time.monotonic() + wait_s
    while True:
        gone = {f.group_rank for f in lost}
        waiting = [g for g in range(info.group_world_size) if g not in gone]
        if round_store.check([f"failures/{g}" for g in waiting]) or time.monotonic() >= deadline:
            break
        now = time.monotonic()
        beats.beat(now)  # still alive to the peers while it waits for them
        silent = [
            g for g in waiting
            if g != info.group_rank and not round_store.check([f"failures/{g}"])
        ]
        found = beats.lost_peer(silent, now)
        if found is not None:
            log(f"node {found.group_rank} ({found.host}) was lost: {found.message}")
            lost.append(found)
            continue
        check_stop()
        time.sleep(0.05)
    gone = {f.group_rank for f in lost}
    failures: list[Failure] = list(lost)
    for key in (f"failures/{g}" for g in range(info.group_world_size) if g not in gone):
        if round_store.check([key]):
            failures.extend(read_failures(round_store, key))
    return failures, len(gone)
