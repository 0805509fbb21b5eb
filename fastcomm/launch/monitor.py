"""The monitor loop of one round, and what ends the round.

Every ``--monitor-interval`` the agent polls its workers and the round, and proposes an end
(the first end proposed wins, on every node alike):

* a local worker fails             -> ``FAILURE`` (after a short grace for its peers' failures;
                                      the workers still running are asked for their flight
                                      records first, SIGUSR1 where they handle it)
* every agent's workers succeeded  -> ``SUCCESS``
* a node waits and there is room   -> ``MEMBERSHIP`` (not a failure restart; under
                                      ``--recover in-process`` it joins the running round)
* a peer agent stops heartbeating  -> ``FAILURE`` (node lost; on etcd: its liveness key
                                      expired)

Under ``--recover in-process`` a failing worker, or a node whose agent stopped heartbeating, is
reported and the round goes on (``recovery``) until fewer than the minimum of ranks are left.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from .config import LaunchConfig
from .errors import Failure
from .failures import write_local
from .heartbeat import Heartbeats
from .recovery import RoundLosses
from .rendezvous import Rendezvous, RoundEnd, RoundInfo
from .workers import WorkerGroup

__all__ = ["FAILURE_GRACE_S", "End", "RoundMonitor"]

#: Seconds a failed round keeps collecting local failures after the first one (peers of a
#: dead worker fail within a few hundred ms of it) before it ends, unless all have exited.
FAILURE_GRACE_S = 1.0

#: The grace instead when running workers were asked for their flight records (SIGUSR1).
DUMP_GRACE_S = 3.0


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` handles ``signum`` (Linux: ``SigCgt`` in its status)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def ask_for_dumps(workers) -> bool:
    """Sends SIGUSR1 to each of ``workers`` that handles it (fastcomm's flight recorder does:
    every rank then writes its record and the report); returns whether any was asked."""
    asked = False
    for worker in workers:
        pid = worker.proc.pid
        if _catches(pid, signal.SIGUSR1):
            try:
                os.kill(pid, signal.SIGUSR1)
                asked = True
            except OSError:
                pass
    return asked


#: How a round ended and the payload that came with it (the failures, for ``FAILURE``).
End = tuple[RoundEnd, object]


class RoundMonitor:
    """Watches the workers of round ``info`` and the other agents until the round ends.

    Args:
        cfg: the launch configuration (intervals, ``max_nodes``).
        rdzv: the rendezvous, where the round's end is proposed and read.
        info: the running round.
        group: this node's workers in the round.
        describe: makes a worker's ``Failure`` (from its error file).
        check_stop: raises once the agent was told to stop.
    """

    def __init__(
        self,
        cfg: LaunchConfig,
        rdzv: Rendezvous,
        info: RoundInfo,
        group: WorkerGroup,
        describe: Callable[[object], Failure],
        check_stop: Callable[[], None],
    ) -> None:
        self.cfg = cfg
        self.rdzv = rdzv
        self.info = info
        self.group = group
        self.describe = describe
        self.check_stop = check_stop
        self.peers = [g for g in range(info.group_world_size) if g != info.group_rank and not (
            cfg.recover == "in-process" and info.store.check([f"lost-node/{g}"]))]
        """GROUP_RANKs of the other agents, whose heartbeats are watched (with those the
        running round admits later; not those already lost)."""
        self.beats: Heartbeats = rdzv.heartbeats(info)
        self.failures: list[Failure] = []
        """This node's failures in the round, in the order they were seen."""
        self._grace_until: float | None = None
        self._reported_done = False
        self.recovery = RoundLosses(cfg, info) if cfg.recover == "in-process" else None
        """The losses absorbed under ``--recover in-process`` (``None``: restart)."""

    def run(self) -> End:
        """Polls the workers and the round until it ends; returns the end that won."""
        while True:
            self.check_stop()
            self._collect_failures()
            end = (
                self._end_on_failure()
                or self._end_on_success()
                or self.rdzv.end_of(self.info.round)
                or self._end_to_admit()
                or self._beat_and_check_peers()
            )
            if end is not None:
                return end
            time.sleep(self.cfg.monitor_interval)

    def _collect_failures(self) -> None:
        for worker in self.group.poll():
            # A worker that recorded an uncaught exception is failing even while its
            # interpreter is still tearing down (which can take long, or hang, with a
            # process group still alive): no need to wait for its exit.
            failing = worker.exitcode not in (None, 0) or (
                worker.exitcode is None and os.path.exists(worker.spec.error_file)
            )
            if not failing or any(f.local_rank == worker.spec.local_rank for f in self.failures):
                continue
            watch = self.recovery
            if watch is not None and watch.is_lost(worker):
                continue
            failure = self.describe(worker)
            if watch is not None:
                if watch.take(failure):  # reported; the others go on
                    spec = watch.replacement(worker, self.cfg.max_restarts)
                    if spec is not None:
                        self.group.add(spec)
                    continue
                self.failures.extend(f for f in watch.lost if f is not failure)
            self.failures.append(failure)

    def _end_on_failure(self) -> End | None:
        if not self.failures:
            return None
        # The first failure is often a consequence (a peer-loss error recorded before the
        # dead worker's exit is seen): collect what follows within a short grace, so the
        # round's failures name the root cause.
        if self._grace_until is None:
            # the workers still running write their flight records (fastcomm.trace)
            asked = ask_for_dumps([w for w in self.group.workers if w.exitcode is None])
            self._grace_until = time.monotonic() + (DUMP_GRACE_S if asked else FAILURE_GRACE_S)
        if time.monotonic() < self._grace_until and any(
            w.exitcode is None for w in self.group.workers
        ):
            return None
        write_local(self.info, self.failures)
        return self.rdzv.end_round(self.info.round, RoundEnd.FAILURE, self.failures)

    def _end_on_success(self) -> End | None:
        watch = self.recovery
        if not self._reported_done:
            if any(w.exitcode != 0 for w in self.group.workers
                   if watch is None or not watch.is_lost(w)):
                return None
            self._reported_done = True  # this node's workers are counted in the round's "done"
            done = self.info.store.add("done", 1)
        elif watch is None:
            return None
        else:  # under recovery a node lost later is no longer waited for: look again
            done = self.info.store.add("done", 0)
        if done < self._nodes_to_succeed():
            return None
        return self.rdzv.end_round(self.info.round, RoundEnd.SUCCESS)

    def _nodes_to_succeed(self) -> int:
        """The nodes whose workers must all succeed: the round's, less (under recovery) the
        nodes lost whole (``recovery.RoundLosses.take_node``)."""
        total = self.rdzv.members(self.info.round)  # with the nodes that joined it
        return total if self.recovery is None else total - self.info.store.add("lost-nodes", 0)

    def _end_to_admit(self) -> End | None:
        """Ends the round to admit a waiting node, if there is room and no worker finished.
        Under ``--recover in-process`` the lowest group rank not lost admits it into the
        running round instead (its workers join the running ranks at a step boundary)."""
        info = self.info
        if self.recovery is not None:
            if (self.cfg.max_nodes > 1 and info.store.add("done", 0) == 0
                    and self.rdzv.admitter(info)):
                for group_rank in self.rdzv.admit_waiting(info):
                    self.recovery.log(f"node {group_rank} joins the running round "
                                      f"{info.round} (--recover in-process)")
            return None
        if (
            info.group_world_size < self.cfg.max_nodes
            and self.rdzv.waiting(info.round) > 0
            and info.store.add("done", 0) == 0
        ):
            return self.rdzv.end_round(info.round, RoundEnd.MEMBERSHIP)
        return None

    def _beat_and_check_peers(self) -> End | None:
        now = time.monotonic()
        if not self.beats.beat(now):
            return None
        if self.recovery is not None and self.cfg.max_nodes > 1:  # nodes admitted meanwhile
            first = len(self.info.nodes)
            grown = self.rdzv.grown_nodes(self.info)
            self.peers += [g for g in range(first, first + len(grown)) if g != self.info.group_rank]
        lost = self.beats.lost_peer(self.peers, now)
        if lost is None:
            return None
        if self.recovery is not None:
            self.peers.remove(lost.group_rank)  # watched no more
            if self.recovery.take_node(lost):
                return None
        return self.rdzv.end_round(self.info.round, RoundEnd.FAILURE, [lost])
