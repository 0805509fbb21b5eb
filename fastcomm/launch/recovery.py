"""``--recover in-process`` on the launcher's side: a lost worker is reported, not restarted.

With it, a worker that dies (a signal, an exception, an exit code) is reported at once -- its
rank, host, exit code or signal and traceback, as the failure report shows them -- and the
round goes on with the others (``FASTCOMM_RECOVER=in-process`` in their environment tells
fastcomm DDP to shrink in place). The job's live ranks are counted in the round's store
(``lost`` less ``replaced``: with ``--max-restarts N`` a lost worker gets a replacement, N in
all, which fastcomm DDP admits at a step boundary); once fewer than the minimum are left
(``--min-ranks``, and ``--nnodes MIN`` nodes' worth of ranks) the job stops with today's
report, naming the first loss as the root cause (no restart). A round whose live workers all
succeed ends in success. A node arriving in an elastic ``--nnodes MIN:MAX`` job joins the running
round (``rendezvous``): its workers start with ``FASTCOMM_RECOVER_JOIN`` and join the running
ranks as a replacement does.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable

from .config import LaunchConfig
from .errors import Failure, exit_description
from .rendezvous import RoundInfo

__all__ = ["JOIN_ENV", "RECOVER_ENV", "LossWatch", "loss_report"]

#: The workers' variable: ``in-process`` turns on fastcomm DDP's in-place shrink.
RECOVER_ENV = "FASTCOMM_RECOVER"
#: Set in a replacement's environment: it joins the running ranks instead of starting a job.
JOIN_ENV = "FASTCOMM_RECOVER_JOIN"


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


class LossWatch:
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
        self.log(loss_report(failure, live, world))
        return True

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
        env = {**spec.env, JOIN_ENV: str(self.replaced), "TORCHELASTIC_ERROR_FILE": error_file}
        self.log(f"starting a replacement for rank {spec.rank} (replacement "
                 f"{self.replaced}; it joins at the running ranks' next step)")
        return dataclasses.replace(spec, env=env, log_dir=log_dir, error_file=error_file)


def _stderr(message: str) -> None:
    print(f"[fastcomm-run] {message}", file=sys.stderr, flush=True)
