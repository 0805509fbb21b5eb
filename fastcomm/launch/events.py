"""``--event-log-handler``: torchelastic's events, as torchrun 2.13 records them.

An event is one JSON object (torch's ``Event.serialize()``: ``name``, ``source``, ``timestamp``
0, ``metadata``) logged at INFO through the handler torch registers under the name:
``console`` writes each on its own line to stderr (shown unless ``LOGLEVEL`` is above INFO);
``null`` and ``dynamic_rendezvous`` drop them. The agent records, as torchrun's does:

* per round, ``RENDEZVOUS`` and ``ASSIGN_WORKER_RANKS`` (agent events with ``duration_ms``),
  then ``START`` for each worker (``worker_id``: its pid);
* at the end, the last round's workers' ``SUCCEEDED``, ``FAILED`` (with ``exit_code``,
  ``worker_pid`` and the error file as ``raw_error``) or ``TERMINATED`` (stopped by the
  agent); then the agent's ``SUCCEEDED`` (it ran to the end, whatever the workers did) or
  ``FAILED`` (stopped by a signal or an error).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

__all__ = ["EventLog"]


class EventLog:
    """Records one agent's events through ``handler`` (see the module docstring).

    Args:
        handler: ``console``, ``null`` or ``dynamic_rendezvous``.
        run_id, role, backend, host, max_restarts: the job's, as in every event.
        entry_point: the program workers run (its basename is recorded).
    """

    def __init__(self, handler: str, *, run_id: str, role: str, backend: str, host: str,
                 max_restarts: int, entry_point: str) -> None:
        self._logger: logging.Logger | None = None
        if handler == "console":
            logger = logging.getLogger("fastcomm-run-events-console")
            try:
                logger.setLevel(os.environ.get("LOGLEVEL", "INFO").upper())
            except ValueError:  # not a level name: torch's default
                logger.setLevel(logging.INFO)
            logger.propagate = False
            if not logger.handlers:
                logger.addHandler(logging.StreamHandler(sys.stderr))
            self._logger = logger
        self._common = {"run_id": run_id, "role": role, "hostname": host, "rdzv_backend": backend}
        self._max_restarts = max_restarts
        self._entry_point = os.path.basename(entry_point)
        self.total_run_time = 0
        """Whole seconds the agent has run (set at the end, as torch's)."""
        self._end = None

    @property
    def enabled(self) -> bool:
        return self._logger is not None

    def agent(self, state: str, *, restarts: int, group_rank: int | None = None,
              group_world_size: int | None = None, duration_ms: float | None = None,
              raw_error: str | None = None) -> None:
        """Records an agent event (``source`` AGENT)."""
        if self._logger is None:
            return
        md = {"group_world_size": group_world_size, "entry_point": self._entry_point}
        self._record(state, "AGENT", md, restarts=restarts, global_rank=None,
                     group_rank=group_rank, worker_id=None, raw_error=raw_error,
                     duration_ms=duration_ms)

    def worker(self, state: str, info, worker, failure=None) -> None:
        """Records a worker event (``source`` WORKER) of round ``info`` (a ``RoundInfo``);
        ``failure``: the worker's ``Failure`` (its exit code and error file are recorded)."""
        if self._logger is None:
            return
        spec = worker.spec
        raw_error = None
        if failure is not None:
            try:
                with open(spec.error_file) as fh:
                    raw_error = json.dumps(json.load(fh))
            except (OSError, ValueError):
                raw_error = json.dumps({})
        md = {
            "group_world_size": info.group_world_size,
            "entry_point": self._entry_point,
            "local_rank": [spec.local_rank],
            "role_rank": [int(spec.env["ROLE_RANK"])],
            "role_world_size": [int(spec.env["ROLE_WORLD_SIZE"])],
            "exit_code": [None if failure is None else failure.exitcode],
            "worker_pid": [None if failure is None else worker.proc.pid],
        }
        self._record(state, "WORKER", md, restarts=info.restart_count, global_rank=spec.rank,
                     group_rank=info.group_rank, worker_id=str(worker.proc.pid),
                     raw_error=raw_error, duration_ms=None)

    def job_end(self, info, failures, workers) -> None:
        """Records the end state of each of ``workers`` (the last round's) after the job ran to
        its end: ``SUCCEEDED`` (``failures`` is ``None``), else ``FAILED`` for those with a
        ``Failure`` in ``failures`` and ``TERMINATED`` for the others."""
        self._end = info
        if self._logger is None:
            return
        for worker in workers:
            failure = next(
                (f for f in failures or [] if f.local_rank == worker.spec.local_rank), None
            )
            state = "SUCCEEDED" if failures is None else "FAILED" if failure else "TERMINATED"
            self.worker(state, info, worker, failure)

    def agent_end(self, started: float, *, ok: bool, group_rank: int | None) -> None:
        """Records the agent's end: ``SUCCEEDED`` if it ran to the end (``ok``), else ``FAILED``;
        ``started``: its ``time.monotonic()`` at the start."""
        self.total_run_time = int(time.monotonic() - started)
        info = self._end
        self.agent(
            "SUCCEEDED" if ok else "FAILED",
            restarts=info.restart_count if info is not None else 0,
            group_rank=group_rank,
            group_world_size=info.group_world_size if info is not None else None,
        )

    def _record(self, state, source, md, *, restarts, global_rank, group_rank, worker_id,
                raw_error, duration_ms) -> None:
        metadata = {
            "run_id": self._common["run_id"],
            "global_rank": global_rank,
            "group_rank": group_rank,
            "worker_id": worker_id,
            "role": self._common["role"],
            "hostname": self._common["hostname"],
            "state": state,
            "total_run_time": self.total_run_time,
            "rdzv_backend": self._common["rdzv_backend"],
            "raw_error": raw_error,
            "metadata": json.dumps(md),
            "agent_restarts": restarts,
            "duration_ms": duration_ms,
        }
        event = {
            "name": f"torchelastic.worker.status.{state}",
            "source": source,
            "timestamp": 0,
            "metadata": metadata,
        }
        try:
            self._logger.info(json.dumps(event))
        except (OSError, ValueError):
            pass  # stderr is closed: events are best effort, as torch's logging
