"""The per-node agent: sequences the rounds of this node's share of the job.

    join round r -> start workers (``specs``) -> monitor until the round ends (``monitor``)
    -> stop the workers -> SUCCESS: exit 0; FAILURE with restarts left, or MEMBERSHIP: join r+1;
       FAILURE with restarts spent: print the root cause of all nodes' failures
       (``failures``, ``errors``), exit 1.

Handled signals (``--signals-to-handle``) are forwarded at once to every worker's process
group; the agent then waits ``--shutdown-timeout`` s, SIGKILLs what is left, removes the job's
temporary folder and exits with 128+signal. The stores' trust model: docs/launch.md.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from fastcomm import settings
from fastcomm.comm.errors import FastcommError, StoreTimeoutError
from fastcomm.comm.store import Store

from .config import LaunchConfig
from .errors import Failure, LaunchError, UsageError, format_report, headline
from .etcd_job import EtcdJob, etcd_loss, route_endpoint
from .events import EventLog
from .failures import (
    collect_job_failures,
    failures_after_stop,
    stopping_failure,
    worker_failure,
    write_local,
)
from .forkserver import ForkServer
from .heartbeat import Heartbeats
from .monitor import RoundMonitor
from .net import listen_address
from .recovery import announce_node
from .rendezvous import (
    Interrupted,
    JobEnded,
    NodeInfo,
    Rendezvous,
    RoundEnd,
    RoundInfo,
    default_host,
    new_agent_id,
    open_store,
)
from .specs import RunDirs, base_env, fork_server, set_gloo_interface, worker_specs
from .workers import WorkerGroup

__all__ = ["launch", "Agent"]

_VERBOSE = (os.environ.get("LOGLEVEL", "").upper() in ("INFO", "DEBUG")
            or settings.LAUNCH_VERBOSE.get())


def launch(config: LaunchConfig) -> int:
    """Runs this node's share of the job described by ``config``; returns the exit status."""
    agent = Agent(config)
    code = agent.run()
    if agent.store is not None and agent.store.guard is not None and agent.store.guard.lost:
        # A store call left unanswered still blocks a helper thread inside torch's client; if
        # its answer came while the interpreter finalizes, that thread would abort the process
        # (it cannot take the GIL back). Everything of this agent is cleaned up by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _with_hang(report: str, attempt: str) -> str:
    """``report`` with the flight recorder's verdict (``fastcomm.trace``) after its root
    cause line, where the workers wrote one under ``attempt``."""
    from fastcomm.trace import report_head

    head = report_head(os.path.join(attempt, "flight"))
    if head is None:
        return report
    lines = report.split("\n")
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("Root cause")), 1)
    return "\n".join([*lines[:at], f"Hang report: {head}", *lines[at:]])


class Agent:
    """The launcher's agent on one node: one per ``fastcomm-run`` process.

    It joins the job's rendezvous, starts this node's workers with torchrun's environment,
    watches them and the other agents, and restarts the workers in a new round after a failure
    (up to ``max_restarts``) or to admit a waiting node. ``run`` returns the exit status.

    Args:
        config: the parsed command line.
    """

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.host = default_host()
        self.group: WorkerGroup | None = None
        self._server: ForkServer | None = None
        """The fork server the workers of every round start from (``forkserver.py``)."""
        self.rdzv: Rendezvous | None = None
        self.store: Store | None = None
        """The rendezvous store (a client's answers bounded by the heartbeat limit)."""
        self.etcd: EtcdJob | None = None
        """The job in etcd (``--rdzv-backend etcd``: no agent serves a store)."""
        self._etcd_gone = False  # the etcd cluster could not serve a call
        self.is_host = False
        self.group_rank: int | None = None
        self.dirs = RunDirs(config, self.log)
        self._signum: int | None = None
        self._old_handlers: dict[int, object] = {}
        self._round: RoundInfo | None = None
        self._beats: Heartbeats | None = None
        """The heartbeats of the last round monitored (the report's wait goes on with them)."""
        self._env: dict[str, str] = {}
        self._last_workers: list = []
        """The workers of the last round that ran (their end states, for the events)."""
        self._outcome: tuple[RoundInfo, list[Failure] | None] | None = None
        """The last round and, if the job failed, this node's failures (for the events)."""
        self.events = EventLog(
            config.event_log_handler,
            run_id=config.run_id,
            role=config.role,
            backend=config.rdzv_backend,
            host=self.host,
            max_restarts=config.max_restarts,
            entry_point=config.entrypoint if config.no_python else config.python,
        )

    # ------------------------------------------------------------------ logging
    def log(self, message: str, *, always: bool = True) -> None:
        """Prints ``message`` to stderr, prefixed with the node (only verbose if not ``always``)."""
        if not always and not _VERBOSE:
            return
        node = f" node {self.group_rank}" if self.group_rank is not None else ""
        try:
            print(f"[fastcomm-run{node}] {message}", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass  # stderr is closed: there is nowhere left to report to

    def info(self, message: str) -> None:
        """Prints ``message`` only when verbose (``LOGLEVEL=INFO``/``DEBUG``)."""
        self.log(message, always=False)

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum, frame) -> None:
        first = self._signum is None
        self._signum = signum
        if self.group is not None:
            # Forward at once; a second signal escalates to SIGKILL.
            self.group.signal_all(signum if first else signal.SIGKILL)

    def check_stop(self) -> None:
        """Raises ``Interrupted`` once a handled signal was received."""
        if self._signum is not None:
            raise Interrupted(self._signum)

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.config.signals_to_handle:
            signum = getattr(signal, name)
            try:
                self._old_handlers[signum] = signal.signal(signum, self._on_signal)
            except (OSError, ValueError) as exc:
                self.info(f"cannot handle {name}: {exc}")

    def _restore_signals(self) -> None:
        for signum, handler in self._old_handlers.items():
            try:
                signal.signal(signum, handler)
            except (OSError, ValueError, TypeError) as exc:
                self.info(f"cannot restore the handler of signal {signum}: {exc}")
        self._old_handlers.clear()

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        """Runs the job on this node until it ends; returns the launcher's exit status."""
        self._install_signals()
        started = time.monotonic()
        code = None
        try:
            code = self._run()
            return code
        except Interrupted as exc:
            name = signal.Signals(exc.signum).name
            self.log(f"received {name}; stopping the workers")
            self._stop_workers(exc.signum, again=False)
            self._tell_peers(
                f"the agent of node {self.group_rank} ({self.host}) was stopped by {name}"
            )
            return 128 + exc.signum
        except UsageError as exc:
            print(f"fastcomm-run: error: {exc}", file=sys.stderr, flush=True)
            return 2
        except LaunchError as exc:
            self.log(f"error: {exc}")
            self._stop_workers()
            if self.etcd is None or not self.etcd.lease_lost:  # else the peers know it lost
                self._tell_peers(
                    f"the agent of node {self.group_rank} ({self.host}) failed: {exc}")
            return 1
        except StoreTimeoutError as exc:  # the rendezvous host stopped answering, or is gone
            cfg = self.config
            if self._etcd_lost(exc):
                return 1
            self.log(
                f"error: lost the rendezvous store at {cfg.rdzv_host}:{cfg.rdzv_port} (the "
                f"rendezvous host, {cfg.rdzv_host}): {exc}"
            )
            self._stop_workers()
            return 1
        except FastcommError as exc:  # a refused store value
            if self._etcd_lost(exc):
                return 1
            self.log(f"error: {exc}")
            self._stop_workers()
            return 1
        except RuntimeError as exc:  # torch's own error from the store (e.g. its host died)
            self.log(f"error: lost the rendezvous store ({type(exc).__name__}: {exc})")
            self._stop_workers()
            return 1
        finally:
            self._stop_workers()
            if self._server is not None:
                self._server.close()
            if self._outcome is not None:
                self.events.job_end(*self._outcome, self._last_workers)
            self.events.agent_end(started, ok=code is not None, group_rank=self.group_rank)
            self._restore_signals()
            self.dirs.cleanup()
            if self.etcd is not None:
                self.etcd.close(reachable=not self._etcd_gone)

    def _etcd_lost(self, exc: BaseException) -> bool:
        """With the etcd backend: when ``exc`` says the cluster could not serve a call (its
        majority lost, or unreachable), says so in one line and stops the workers."""
        loss = etcd_loss(exc) if self.etcd is not None else None
        if loss is None:
            return False
        self._etcd_gone = True
        self.log(f"error: lost the etcd cluster, stopping this node's workers: {loss}")
        self._stop_workers()
        return True

    def _stop_workers(self, sig: int = signal.SIGTERM, *, again: bool = True) -> None:
        if self.group is not None:
            self.group.stop(sig, self.config.shutdown_timeout, again=again)
            self.group = None
        if self.rdzv is not None:
            self.rdzv.release_worker_store()

    def _tell_peers(self, message: str) -> None:
        """Ends the running round as a failure of this node, so the other agents restart
        without it (or give up) instead of waiting for its heartbeat to time out."""
        info = self._round
        if info is None or self.rdzv is None or info.group_world_size < 2:
            return
        lost = stopping_failure(info, self.host, message)
        try:
            write_local(info, [])
            self.rdzv.end_round(info.round, RoundEnd.FAILURE, [lost])
            if self.is_host and self.etcd is None:
                # give the others a moment to read it before the store goes
                self.rdzv.exit_barrier(info, True, timeout=min(5.0, self.config.close_timeout))
        except Exception as exc:  # best effort: the peers' heartbeat check covers it
            self.log(
                f"could not tell the other nodes that this one stops ({type(exc).__name__}: {exc})"
            )

    def _run(self) -> int:
        self._open_rendezvous()
        info = self._next_round()
        while True:
            if info is JobEnded.OK:
                self.log("the job finished before this node was admitted")
                return 0
            if info is JobEnded.FAILED:
                self.log("the job failed before this node was admitted")
                return 1
            self.group_rank = info.group_rank
            self._round = info
            kind, payload, local = self._run_round(info)
            self._round = None
            if kind is RoundEnd.SUCCESS:
                self._outcome = (info, None)
                self.rdzv.exit_barrier(info, self.is_host)
                return 0
            if kind is RoundEnd.FAILURE:
                # under --recover in-process the restarts went to replacements: no new round
                if (info.restart_count >= self.config.max_restarts
                        or self.config.recover == "in-process"):
                    self._outcome = (info, local)
                    return self._give_up(info, local)
                self._announce_restart(info, payload, info.restart_count + 1)
            else:
                self.log(
                    f"a new node is waiting; restarting the workers to admit it "
                    f"(round {info.round + 1}, not counted as a restart)"
                )
            info = self._next_round(from_round=info.round + 1, prev_group_rank=info.group_rank)

    def _open_rendezvous(self) -> None:
        """Builds the workers' base environment, opens the rendezvous store (serving it on the
        host; on etcd, the job's namespace there) and joins the job's rendezvous as this node."""
        cfg = self.config
        self._env, secret = base_env(cfg, self.log, self.info)
        self._server = fork_server(cfg, self._env)
        if self._server is not None and not self._server.wait_ready():  # before any heartbeat
            self.log("the fork server did not start; the workers start as new interpreters")
            self._server.close()
            self._server = None
        host, port = cfg.rdzv_host, cfg.rdzv_port
        if cfg.rdzv_backend == "etcd":  # the address that routes to a member elsewhere
            host, port = route_endpoint(cfg.rdzv_endpoints)
            if cfg.max_nodes == 1:  # every worker is here, wherever etcd runs
                host = "127.0.0.1"
        try:
            listen = listen_address(
                host,
                port,
                single_node=cfg.max_nodes == 1,
                local_addr=cfg.local_addr,
            )
        except OSError as exc:
            raise UsageError(
                f"no route to the rendezvous host {host!r} ({exc}); give --local-addr"
            ) from None
        set_gloo_interface(self._env, cfg, listen, self.log, self.info)
        node = NodeInfo(
            agent_id=new_agent_id(),
            host=self.host,
            addr=listen,
            nproc=cfg.nproc_per_node,
            role=cfg.role,
            pid=os.getpid(),
            node_rank=cfg.node_rank if cfg.rdzv_backend == "static" else None,
        )
        if cfg.rdzv_backend == "etcd":
            self.etcd = EtcdJob(cfg, secret, self.check_stop, self.log)
            store, self.is_host = self.etcd.open(node.agent_id), False
        else:
            store, self.is_host = open_store(cfg, self.check_stop, listen=listen, secret=secret)
        self.store = store
        if not self.is_host and self.etcd is None:
            # a silent rendezvous host (powered off) never answers: every call is bounded by
            # the heartbeat limit, and a stop signal is seen while one waits
            store.bound_answers(cfg.keep_alive_interval * cfg.keep_alive_max_attempt,
                                self.check_stop)
        role = "served here" if self.is_host else "client"
        self.info(f"rendezvous store {store.address} ({role}); this node listens on {listen}")
        self.rdzv = Rendezvous(store, cfg, node, self.check_stop, self.info, listen=listen,
                               etcd=self.etcd)

    def _next_round(self, **kwargs):
        """``Rendezvous.next_round``, timed as torch's ``RENDEZVOUS`` event."""
        start = time.perf_counter()
        info = self.rdzv.next_round(**kwargs)
        self.events.agent(
            "RENDEZVOUS",
            restarts=getattr(info, "restart_count", 0),
            duration_ms=(time.perf_counter() - start) * 1000,
        )
        return info

    # ------------------------------------------------------------------ one round
    def _failure(self, info: RoundInfo, worker) -> Failure:
        return worker_failure(
            info, worker, host=self.host, role=self.config.role,
            keep_error_file=not self.dirs.temporary,
        )

    def _run_round(self, info: RoundInfo) -> tuple[RoundEnd, object, list[Failure]]:
        """Runs the workers of one round; returns ``(end kind, end payload, local failures)``."""
        self._start_workers(info)
        monitor = RoundMonitor(
            self.config, self.rdzv, info, self.group,
            lambda worker: self._failure(info, worker), self.check_stop,
        )
        self._beats = monitor.beats
        kind, payload = monitor.run()
        self._finish_round(info, kind, monitor.failures)
        return kind, payload, monitor.failures

    def _start_workers(self, info: RoundInfo) -> None:
        start = time.perf_counter()
        env = self._env
        if info.joined:  # --recover in-process: the workers join the running ranks (regrow)
            node = f"node{info.group_rank}"
            env = {**env, settings.RECOVER_JOIN.name: node}
            announce_node(info, node, self.log)
            self.log(f"joined the running round {info.round}; its workers join the running "
                     "ranks at a step boundary")
        specs = worker_specs(self.config, info, env, self.dirs.attempt(info.round))
        self.events.agent(
            "ASSIGN_WORKER_RANKS",
            restarts=info.restart_count,
            duration_ms=(time.perf_counter() - start) * 1000,
        )
        self.group = WorkerGroup(
            specs,
            duplicate_filters={
                "stdout": self.config.duplicate_stdout_filters,
                "stderr": self.config.duplicate_stderr_filters,
            },
            # replacements (--recover in-process) start warm: forked, or from a spare
            spares=self.config.max_restarts
            if self.config.recover == "in-process" and self.config.spare else 0,
            server=self._server,
        )
        self._last_workers = self.group.workers
        self.check_stop()
        self.group.start()
        for worker in self.group.workers:
            self.events.worker("START", info, worker)
        self.info(
            f"round {info.round}: started local ranks "
            f"{info.rank_offset}..{info.rank_offset + self.config.nproc_per_node - 1} "
            f"(pids {self.group.pids})"
        )

    def _finish_round(self, info: RoundInfo, kind: RoundEnd, failures: list[Failure]) -> None:
        """Stops the workers; after a failure, records every local failure for the report."""
        stop_time = time.time()
        if kind is not RoundEnd.SUCCESS:  # published before the (maybe slow) stop, for joiners
            self.rdzv.set_next_restarts(info.round, info.restart_count + (kind is RoundEnd.FAILURE))
        workers = self.group.workers
        self._stop_workers()
        if kind is not RoundEnd.FAILURE:
            return
        failures_after_stop(workers, failures, stop_time, lambda w: self._failure(info, w))
        write_local(info, failures)

    # ------------------------------------------------------------------ outcome
    def _announce_restart(self, info: RoundInfo, payload, next_restart: int) -> None:
        what = headline(list(payload or []))
        self.log(
            f"round {info.round}: {what}; restarting the workers "
            f"(restart {next_restart} of {self.config.max_restarts})"
        )

    def _give_up(self, info: RoundInfo, local: list[Failure]) -> int:
        """Restarts are spent: gathers every node's failures, prints the report, exits 1."""
        cfg = self.config
        beats = self._beats or self.rdzv.heartbeats(info)
        failures, lost = collect_job_failures(
            self.rdzv, info, beats,
            wait_s=min(30.0, cfg.shutdown_timeout + 5.0),
            log=self.log, check_stop=self.check_stop,
        )
        report = format_report(
            cfg.entrypoint, failures or local, restarts=info.restart_count,
            max_restarts=cfg.max_restarts,
        )
        print(_with_hang(report, self.dirs.attempt(info.round)), file=sys.stderr, flush=True)
        self.rdzv.exit_barrier(info, self.is_host, lost=lost)
        return 1
