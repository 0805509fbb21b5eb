"""``--recover in-process`` on the launcher's side: a lost worker is reported, not restarted.

With it, a worker that dies (a signal, an exception, an exit code) is reported at once -- its
rank, host, exit code or signal and traceback, as the failure report shows them -- and the
round goes on with the others (``FASTCOMM_RECOVER=in-process`` in their environment tells
fastcomm DDP to shrink in place). The job's live ranks are counted in the round's store
(``lost`` less ``replaced``: with ``--max-restarts N`` a lost worker gets a replacement, N in
all, which fastcomm DDP admits at a step boundary); once fewer than the minimum are left
(``--min-ranks``, and ``--nnodes MIN`` nodes' worth of ranks) the job stops with today's
report, naming the first loss as the root cause (no restart). A round whose live workers all
succeed ends in success. A node lost whole (no heartbeat from its agent) is absorbed alike,
counted out of the round; every absorbed rank is named in the workers' store
(``lost_rank_key``; in etcd with the etcd backend), where the survivors on other hosts learn of
it: whichever node is lost, group rank 0's included, when the store is in etcd. A node
arriving in an elastic ``--nnodes MIN:MAX`` job joins the running round (``rendezvous``): its
workers start with ``FASTCOMM_RECOVER_JOIN`` and join the running ranks as a replacement does.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable

from fastcomm import settings
from fastcomm.comm.store import Store, joining_node_key, lost_rank_key

from .config import LaunchConfig
from .errors import Failure, exit_description
from .rendezvous import RoundInfo

__all__ = ["RoundLosses", "announce_node", "loss_report"]


def announce_node(info: RoundInfo, node: str, log: Callable[[str], None]) -> None:
    """Puts how many ranks joining `node` (this agent's, admitted into the running round
    `info`) brings under ``joining_node_key(node)`` in the workers' store, before its workers
    start. Best effort: unreached, the running ranks admit each worker as it asks."""
    try:
        store = info.workers_store(timeout=10.0)
        store.set(joining_node_key(node), str(info.nodes[info.group_rank].nproc))
    except RuntimeError as exc:
        log(f"could not tell the running ranks how many ranks {node} brings: {exc}")


def loss_report(failure: Failure, live: int, world: int) -> str:
    """The lines printed when `failure` is absorbed: who was lost, how, its traceback."""
    how = (
        f"killed by {exit_description(failure.exitcode)}" if failure.exitcode < 0
        else f"failed with {exit_description(failure.exitcode)}"
    )
    lines = [
        f"rank {failure.rank} (local_rank {failure.local_rank}, host {failure.host}, pid "
        f"{failure.pid}) was lost: {how}; the job goes on with {live} of {world} ranks "
        "(--recover in-process)",
    ]
    if failure.traceback:
        lines.append("  traceback :")
        lines.extend("    " + line for line in failure.traceback.rstrip("\n").splitlines())
    elif failure.message:
        lines.append(f"  error     : {failure.message}")
    return "\n".join(lines)


class RoundLosses:
    """The losses of one round under ``--recover in-process``.

    Args:
        cfg: the launch configuration (``min_ranks``, ``min_nodes``, ``nproc_per_node``).
        info: the running round (its store counts the job's losses).
        log: prints a line prefixed with the node.
    """

    def __init__(self, cfg: LaunchConfig, info: RoundInfo, log: Callable[[str], None] | None
                 = None) -> None:
        self.info = info
        self.minimum = max(cfg.min_ranks, cfg.min_nodes * cfg.nproc_per_node
                           if cfg.min_nodes > 1 else 1)
        self.lost: list[Failure] = []
        """This node's absorbed losses, in the order they were seen."""
        self.lost_pids: set[int] = set()
        self.replaced = 0
        self.log = log or _stderr
        """Prints a line of the launcher's (prefixed)."""
        self._workers_store: Store | None = None
        self.lost_nodes: set[int] = set()
        """The GROUP_RANKs of the nodes this agent found lost."""

    def take(self, failure: Failure) -> bool:
        """Absorbs `failure` (reported, the job goes on): ``True``; ``False`` when the job
        would fall below the minimum (the round must fail, with :attr:`lost` in its report)."""
        if failure.pid in self.lost_pids:
            return True
        store = self.info.store
        total = store.add("lost", 1)
        world = self.info.world_size_now()  # with the nodes that joined the running round
        live = world - total + store.add("replaced", 0)  # replacements live
        self.lost.append(failure)
        if live < self.minimum:  # a failure of the round, not a loss it goes on without
            self.log(
                f"rank {failure.rank} was lost ({exit_description(failure.exitcode)}); "
                f"{live} live rank(s) are fewer than the minimum {self.minimum}: stopping"
            )
            return False
        self.lost_pids.add(failure.pid)
        report = loss_report(failure, live, world)
        self.name_lost([failure.rank], report)
        self.log(report)
        return True

    def take_node(self, failure: Failure) -> bool:
        """Absorbs the loss of node ``failure.group_rank`` (its agent stopped heartbeating):
        ``True`` when the job goes on (its ranks named lost in the workers' store, the node
        counted out of the round); ``False`` when it would fall below the minimum."""
        info, store = self.info, self.info.store
        g = failure.group_rank
        if g in self.lost_nodes:
            return True
        self.lost_nodes.add(g)
        first = sum(n.nproc for n in info.nodes[:g])
        ranks = list(range(first, first + info.nodes[g].nproc))
        tag = str(info.group_rank)
        mine = store.compare_set(f"lost-node/{g}", "", tag) == tag.encode()
        total = store.add("lost", len(ranks) if mine else 0)  # one agent counts each node
        live = info.world_size_now() - total + store.add("replaced", 0)
        self.lost.append(failure)
        node = f"node {g} ({failure.host})"
        if live < self.minimum:
            self.log(f"{node} was lost ({failure.message}); {live} live rank(s) are fewer "
                      f"than the minimum {self.minimum}: stopping")
            return False
        why = f"{node} was lost: {failure.message}"
        self.name_lost(ranks, why)
        if mine:  # its workers' success is not waited for, nor its exit
            store.add("lost-nodes", 1)
            store.add("exited", 1)
        self.log(f"{why}; its ranks {', '.join(map(str, ranks))} are lost; the job goes on "
                  f"with {live} of {info.world_size_now()} ranks (--recover in-process)")
        return True

    def name_lost(self, ranks: list[int], why: str) -> None:
        """Sets ``lost_rank_key`` of each of ``ranks`` in the workers' store (best effort: a
        store that cannot be reached leaves the survivors to their own liveness checks)."""
        try:
            if self._workers_store is None:
                self._workers_store = self.info.workers_store(timeout=10.0)
            for rank in ranks:
                self._workers_store.set(lost_rank_key(rank), why.splitlines()[0])
        except RuntimeError as exc:
            self.log(f"could not name rank(s) {ranks} lost in the workers' store: {exc}")

    def is_lost(self, worker) -> bool:
        """Whether `worker` is one of this node's absorbed losses."""
        return worker.proc.pid in self.lost_pids

    def replacement(self, worker, max_restarts: int):
        """The spec of a replacement for the lost `worker` while the job's replacements
        (``--max-restarts``, counted in the round's store) last, else ``None``. The
        replacement joins the running ranks (``FASTCOMM_RECOVER_JOIN``)."""
        if max_restarts <= 0 or self.info.store.add("replaced", 1) > max_restarts:
            return None
        self.replaced += 1
        spec = worker.spec
        log_dir = f"{spec.log_dir}_replacement{self.replaced}"
        error_file = os.path.join(log_dir, "error.json")
        env = {**spec.env, settings.RECOVER_JOIN.name: str(self.replaced),
               "TORCHELASTIC_ERROR_FILE": error_file}
        self.log(f"starting a replacement for rank {spec.rank} (replacement "
                 f"{self.replaced}; it joins at the running ranks' next step)")
        return dataclasses.replace(spec, env=env, log_dir=log_dir, error_file=error_file)


def _stderr(message: str) -> None:
    print(f"[fastcomm-run] {message}", file=sys.stderr, flush=True)
