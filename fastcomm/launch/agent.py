"""The per-node agent: rendezvous, start the local workers, monitor them, restart, report.

Round loop of one agent::

    join round r -> start workers (env as torchrun's) -> monitor until the round ends:
      * a local worker exits non-zero   -> end r with FAILURE (the first end proposed wins)
      * every agent's workers succeeded -> end r with SUCCESS
      * a node waits and there is room  -> end r with MEMBERSHIP (not a failure restart)
      * a peer agent stops heartbeating -> end r with FAILURE (node lost)
    -> stop the workers -> SUCCESS: exit 0; FAILURE with restarts left, or MEMBERSHIP: join r+1;
       FAILURE with restarts spent: print the root cause (all nodes' failures), exit 1.

Each round's workers meet in the round's own worker store (see ``Rendezvous._complete``).

SIGINT/SIGTERM/... (``--signals-to-handle``) are forwarded at once to every worker's process
group; the agent then waits ``--shutdown-timeout`` s, SIGKILLs what is left, removes the job's
temporary folder and exits with 128+signal. Workers watch the agent and kill themselves (and
their children) if it dies.

Trust: the stores listen on one address (``net.listen_address``: loopback for a single node);
every value read back from them is JSON, signed with the job secret when there is one (a
single-node job makes one with ``secrets`` and hands it to its workers as
``FASTCOMM_JOB_SECRET``; a job of several nodes takes it from ``--job-secret-file`` or the
environment). A value that fails the check stops the agent with an error naming its key.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from fastcomm.comm.errors import FastcommError, StoreTimeoutError
from fastcomm.comm.store import Store

from .config import SECRET_ENV, SECRET_FILE_ENV, LaunchConfig, read_job_secret, std_for
from .errors import Failure, LaunchError, UsageError, format_report, headline, read_error_file
from .events import EventLog
from .net import interface_of, listen_address
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
    read_failures,
    write_failures,
)
from .workers import BOOTSTRAP, WorkerGroup, WorkerSpec, line_prefix

__all__ = ["launch", "Agent"]

#: Seconds a failed round keeps collecting local failures after the first one (peers of a
#: dead worker fail within a few hundred ms of it) before it ends, unless all have exited.
FAILURE_GRACE_S = 1.0

#: How a round ended and the payload that came with it (the failures, for ``FAILURE``).
_End = tuple[RoundEnd, object]

_VERBOSE = os.environ.get("LOGLEVEL", "").upper() in ("INFO", "DEBUG") or bool(
    os.environ.get("FASTCOMM_LAUNCH_VERBOSE")
)


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


@dataclass(slots=True)
class _RoundWatch:
    """What the monitor loop of one round remembers between polls."""

    peers: list[int]
    """GROUP_RANKs of the other agents, whose heartbeats are watched."""
    failures: list[Failure] = field(default_factory=list)
    grace_until: float | None = None
    """Monotonic time the failure grace ends (set at the first local failure)."""
    reported_done: bool = False
    """Whether this agent counted its workers' success in the round's ``done``."""
    next_beat: float = 0.0
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Per peer: the last heartbeat count read and the monotonic time it changed."""


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
        self.rdzv: Rendezvous | None = None
        self.store: Store | None = None
        """The rendezvous store (a client's answers bounded by the heartbeat limit)."""
        self.is_host = False
        self.group_rank: int | None = None
        self._signum: int | None = None
        self._old_handlers: dict[int, object] = {}
        self._base_dir: str | None = None
        self._run_dir: str | None = None
        self._round: RoundInfo | None = None
        self._watch: _RoundWatch | None = None
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
            self._tell_peers(f"the agent of node {self.group_rank} ({self.host}) failed: {exc}")
            return 1
        except StoreTimeoutError as exc:  # the rendezvous host stopped answering, or is gone
            cfg = self.config
            self.log(
                f"error: lost the rendezvous store at {cfg.rdzv_host}:{cfg.rdzv_port} (the "
                f"rendezvous host, {cfg.rdzv_host}): {exc}"
            )
            self._stop_workers()
            return 1
        except FastcommError as exc:  # a refused store value
            self.log(f"error: {exc}")
            self._stop_workers()
            return 1
        except RuntimeError as exc:  # torch's own error from the store (e.g. its host died)
            self.log(f"error: lost the rendezvous store ({type(exc).__name__}: {exc})")
            self._stop_workers()
            return 1
        finally:
            self._stop_workers()
            if self._outcome is not None:
                self.events.job_end(*self._outcome, self._last_workers)
            self.events.agent_end(started, ok=code is not None, group_rank=self.group_rank)
            self._restore_signals()
            self._cleanup_dirs()

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
        node = info.nodes[info.group_rank]
        lost = Failure(
            rank=-1,
            local_rank=-1,
            group_rank=info.group_rank,
            host=self.host,
            pid=os.getpid(),
            exitcode=1,
            timestamp=time.time(),
            round=info.round,
            role=node.role,
            message=message,
        )
        try:
            write_failures(info.store, f"failures/{info.group_rank}", [])
            self.rdzv.end_round(info.round, RoundEnd.FAILURE, [lost])
            if self.is_host:  # give the others a moment to read it before the store goes
                self.rdzv.exit_barrier(info, True, timeout=min(5.0, self.config.close_timeout))
        except Exception as exc:  # best effort: the peers' heartbeat check covers it
            self.log(
                f"could not tell the other nodes that this one stops ({type(exc).__name__}: {exc})"
            )

    def _run(self) -> int:
        cfg = self.config
        # The workers' base environment: ours, plus what torchrun adds to its own.
        self._env = dict(os.environ)
        if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            self.info("setting OMP_NUM_THREADS=1 for each worker (set it to override)")
            self._env["OMP_NUM_THREADS"] = "1"
        self._env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(cfg.signals_to_handle)
        secret = self._job_secret()
        self._env.pop(SECRET_FILE_ENV, None)
        if secret is None:
            self._env.pop(SECRET_ENV, None)
        else:
            self._env[SECRET_ENV] = secret.hex()
        try:
            listen = listen_address(
                cfg.rdzv_host,
                cfg.rdzv_port,
                single_node=cfg.max_nodes == 1,
                local_addr=cfg.local_addr,
            )
        except OSError as exc:
            raise UsageError(
                f"no route to the rendezvous host {cfg.rdzv_host!r} ({exc}); give --local-addr"
            ) from None
        self._gloo_interface(listen)
        store, self.is_host = open_store(cfg, self.check_stop, listen=listen, secret=secret)
        self.store = store
        if not self.is_host:
            # a silent rendezvous host (powered off) never answers: every call is bounded by
            # the heartbeat limit, and a stop signal is seen while one waits
            store.bound_answers(cfg.keep_alive_interval * cfg.keep_alive_max_attempt,
                                self.check_stop)
        role = "served here" if self.is_host else "client"
        self.info(f"rendezvous store {store.address} ({role}); this node listens on {listen}")
        node = NodeInfo(
            agent_id=new_agent_id(),
            host=self.host,
            addr=listen,
            nproc=cfg.nproc_per_node,
            role=cfg.role,
            pid=os.getpid(),
            node_rank=cfg.node_rank if cfg.rdzv_backend == "static" else None,
        )
        self.rdzv = rdzv = Rendezvous(store, cfg, node, self.check_stop, self.info, listen=listen)
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
                rdzv.exit_barrier(info, self.is_host)
                return 0
            if kind is RoundEnd.FAILURE:
                if info.restart_count >= cfg.max_restarts:
                    self._outcome = (info, local)
                    return self._give_up(info, local)
                self._announce_restart(info, payload, info.restart_count + 1)
            else:
                self.log(
                    f"a new node is waiting; restarting the workers to admit it "
                    f"(round {info.round + 1}, not counted as a restart)"
                )
            info = self._next_round(from_round=info.round + 1, prev_group_rank=info.group_rank)

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

    def _gloo_interface(self, listen: str) -> None:
        """Has the workers' Gloo (fastcomm's and torch's) use the interface of ``listen``
        (``--local-addr``, or the address that routes to the rendezvous host) in a job of
        several nodes, unless ``GLOO_SOCKET_IFNAME`` is set already: by default Gloo binds
        the address the hostname resolves to, loopback under a Debian ``/etc/hosts``."""
        if self.config.max_nodes == 1 or self._env.get("GLOO_SOCKET_IFNAME"):
            return
        name = interface_of(listen)
        if name is None:
            self.log(f"no interface holds {listen}; Gloo picks its own (set GLOO_SOCKET_IFNAME)")
            return
        self._env["GLOO_SOCKET_IFNAME"] = name
        self.info(f"workers' Gloo uses interface {name} ({listen})")

    def _job_secret(self) -> bytes | None:
        """The secret signing the stores' values (see the module docstring)."""
        cfg = self.config
        secret = cfg.job_secret
        if secret is None:
            try:
                secret, _ = read_job_secret(cfg.job_secret_file, os.environ)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        if secret is None and cfg.max_nodes == 1:
            secret = secrets.token_bytes(32)
        elif secret is None:
            self.log(
                "no job secret (--job-secret-file, $FASTCOMM_JOB_SECRET or "
                "$FASTCOMM_JOB_SECRET_FILE): store values are checked JSON but unsigned, so "
                "any process that reaches the stores' ports can forge them"
            )
        return secret

    # ------------------------------------------------------------------ one round
    def _worker_specs(self, info: RoundInfo) -> list[WorkerSpec]:
        cfg = self.config
        attempt = os.path.join(self._attempt_root(), f"attempt_{info.round}")
        role_base, role_world = info.role_ranks(cfg.role)
        if cfg.no_python:
            base_cmd, mode = [cfg.python, BOOTSTRAP], ["--exec"]
        else:
            base_cmd, mode = [cfg.python, "-u", BOOTSTRAP], ["--module"] if cfg.module else []

        def cpus(local_rank: int) -> list[str]:  # --numa-binding
            return [] if cfg.worker_cpus is None else ["--cpus", cfg.worker_cpus[local_rank]]

        specs = []
        for local_rank in range(cfg.nproc_per_node):
            rank = info.rank_offset + local_rank
            log_dir = os.path.join(attempt, str(local_rank))
            error_file = os.path.join(log_dir, "error.json")
            env = dict(self._env)
            env.update(
                RANK=str(rank),
                GROUP_RANK=str(info.group_rank),
                ROLE_RANK=str(role_base + local_rank),
                ROLE_NAME=cfg.role,
                LOCAL_WORLD_SIZE=str(cfg.nproc_per_node),
                WORLD_SIZE=str(info.world_size),
                GROUP_WORLD_SIZE=str(info.group_world_size),
                ROLE_WORLD_SIZE=str(role_world),
                MASTER_ADDR=info.master_addr,
                MASTER_PORT=str(info.master_port),
                TORCHELASTIC_RESTART_COUNT=str(info.restart_count),
                TORCHELASTIC_MAX_RESTARTS=str(cfg.max_restarts),
                TORCHELASTIC_RUN_ID=cfg.run_id,
                TORCHELASTIC_USE_AGENT_STORE="True",
                TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get(
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
                ),
                TORCHELASTIC_ERROR_FILE=error_file,
                LOCAL_RANK=str(local_rank),
            )
            if cfg.virtual_local_rank:
                env["LOCAL_RANK"] = "0"
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                devices = visible.split(",") if visible else None
                if devices is not None and local_rank >= len(devices):
                    raise LaunchError(
                        f"local rank {local_rank} exceeds CUDA_VISIBLE_DEVICES={visible}"
                    )
                env["CUDA_VISIBLE_DEVICES"] = (
                    devices[local_rank].strip() if devices else str(local_rank)
                )
            shown = cfg.local_ranks_filter is None or local_rank in cfg.local_ranks_filter
            specs.append(
                WorkerSpec(
                    local_rank=local_rank,
                    rank=rank,
                    cmd=[*base_cmd, *mode, *cpus(local_rank), "--", cfg.entrypoint, *cfg.args],
                    env=env,
                    log_dir=log_dir,
                    error_file=error_file,
                    console_prefix=(
                        line_prefix(cfg.line_prefix_template, rank, local_rank, cfg.role)
                        if shown
                        else None
                    ),
                    redirect=std_for(cfg.redirects, local_rank),
                    tee=std_for(cfg.tee, local_rank),
                )
            )
        return specs

    def _failure(self, info: RoundInfo, worker) -> Failure:
        message, trace, stamp = read_error_file(worker.spec.error_file)
        precise = _precise_time(worker.spec.error_file)
        return Failure(
            rank=worker.spec.rank,
            local_rank=worker.spec.local_rank,
            group_rank=info.group_rank,
            host=self.host,
            pid=worker.proc.pid,
            exitcode=1 if worker.exitcode is None else worker.exitcode,  # None: exiting
            timestamp=precise or stamp or worker.exited_at or time.time(),
            round=info.round,
            role=self.config.role,
            # a temporary folder is removed at exit: the report must not point into it
            error_file=worker.spec.error_file if message and self._base_dir is None else None,
            message=message,
            traceback=trace,
        )

    def _run_round(self, info: RoundInfo) -> tuple[RoundEnd, object, list[Failure]]:
        """Runs the workers of one round; returns ``(end kind, end payload, local failures)``."""
        self._start_workers(info)
        peers = [g for g in range(info.group_world_size) if g != info.group_rank]
        watch = _RoundWatch(peers=peers)
        self._watch = watch
        kind, payload = self._monitor(info, watch)
        self._finish_round(info, kind, watch.failures)
        return kind, payload, watch.failures

    def _start_workers(self, info: RoundInfo) -> None:
        start = time.perf_counter()
        specs = self._worker_specs(info)
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

    def _monitor(self, info: RoundInfo, watch: _RoundWatch) -> _End:
        """Polls the workers and the round until it ends; returns the end that won."""
        while True:
            self.check_stop()
            self._collect_failures(info, watch)
            end = (
                self._end_on_failure(info, watch)
                or self._end_on_success(info, watch)
                or self.rdzv.end_of(info.round)
                or self._end_to_admit(info)
                or self._beat_and_check_peers(info, watch)
            )
            if end is not None:
                return end
            time.sleep(self.config.monitor_interval)

    def _collect_failures(self, info: RoundInfo, watch: _RoundWatch) -> None:
        for worker in self.group.poll():
            # A worker that recorded an uncaught exception is failing even while its
            # interpreter is still tearing down (which can take long, or hang, with a
            # process group still alive): no need to wait for its exit.
            failing = worker.exitcode not in (None, 0) or (
                worker.exitcode is None and os.path.exists(worker.spec.error_file)
            )
            if failing and all(f.local_rank != worker.spec.local_rank for f in watch.failures):
                watch.failures.append(self._failure(info, worker))

    def _end_on_failure(self, info: RoundInfo, watch: _RoundWatch) -> _End | None:
        if not watch.failures:
            return None
        # The first failure is often a consequence (a peer-loss error recorded before the
        # dead worker's exit is seen): collect what follows within a short grace, so the
        # round's failures name the root cause.
        if watch.grace_until is None:
            watch.grace_until = time.monotonic() + FAILURE_GRACE_S
        if time.monotonic() < watch.grace_until and any(
            w.exitcode is None for w in self.group.workers
        ):
            return None
        write_failures(info.store, f"failures/{info.group_rank}", watch.failures)
        return self.rdzv.end_round(info.round, RoundEnd.FAILURE, watch.failures)

    def _end_on_success(self, info: RoundInfo, watch: _RoundWatch) -> _End | None:
        if watch.reported_done or any(w.exitcode != 0 for w in self.group.workers):
            return None
        watch.reported_done = True
        if info.store.add("done", 1) < info.group_world_size:
            return None
        return self.rdzv.end_round(info.round, RoundEnd.SUCCESS)

    def _end_to_admit(self, info: RoundInfo) -> _End | None:
        """Ends the round to admit a waiting node, if there is room and no worker finished."""
        if (
            info.group_world_size < self.config.max_nodes
            and self.rdzv.waiting(info.round) > 0
            and info.store.add("done", 0) == 0
        ):
            return self.rdzv.end_round(info.round, RoundEnd.MEMBERSHIP)
        return None

    def _beat_and_check_peers(self, info: RoundInfo, watch: _RoundWatch) -> _End | None:
        now = time.monotonic()
        if now < watch.next_beat:
            return None
        watch.next_beat = now + self.config.keep_alive_interval
        info.store.add(f"hb/{info.group_rank}", 1)
        lost = self._check_peers(info, watch.peers, watch.seen, now)
        if lost is None:
            return None
        return self.rdzv.end_round(info.round, RoundEnd.FAILURE, [lost])

    def _finish_round(self, info: RoundInfo, kind: RoundEnd, failures: list[Failure]) -> None:
        """Stops the workers; after a failure, records every local failure for the report."""
        stop_time = time.time()
        if kind is not RoundEnd.SUCCESS:  # published before the (maybe slow) stop, for joiners
            self.rdzv.set_next_restarts(info.round, info.restart_count + (kind is RoundEnd.FAILURE))
        workers = self.group.workers
        self._stop_workers()
        if kind is not RoundEnd.FAILURE:
            return
        # Workers that died on their own before the stop, or recorded an exception.
        for worker in workers:
            if worker.exitcode in (None, 0) or any(
                f.local_rank == worker.spec.local_rank for f in failures
            ):
                continue
            failure = self._failure(info, worker)
            if failure.message or (worker.exited_at or stop_time) < stop_time:
                failures.append(failure)
        write_failures(info.store, f"failures/{info.group_rank}", failures)

    def _check_peers(self, info, peers, seen, now) -> Failure | None:
        """The first of ``peers`` whose heartbeat count has not changed for the limit, as a
        lost-node failure dated at its last beat seen (so it precedes, as the root cause, the
        peer-loss errors it caused), or ``None``."""
        limit = self.config.keep_alive_interval * self.config.keep_alive_max_attempt
        for g in peers:
            count = info.store.add(f"hb/{g}", 0)
            last = seen.get(g)
            if last is None or last[0] != count:
                seen[g] = (count, now)
            elif now - last[1] > limit:
                node = info.nodes[g]
                return Failure(
                    rank=-1,
                    local_rank=-1,
                    group_rank=g,
                    host=node.host,
                    pid=node.pid,
                    exitcode=1,
                    timestamp=time.time() - (now - last[1]),
                    round=info.round,
                    role=node.role,
                    message=f"no heartbeat from the agent of node {g} for {now - last[1]:.0f} s",
                )
        return None

    # ------------------------------------------------------------------ outcome
    def _announce_restart(self, info: RoundInfo, payload, next_restart: int) -> None:
        what = headline(list(payload or []))
        self.log(
            f"round {info.round}: {what}; restarting the workers "
            f"(restart {next_restart} of {self.config.max_restarts})"
        )

    def _give_up(self, info: RoundInfo, local: list[Failure]) -> int:
        """Restarts are spent: gathers every node's failures, prints the report, exits 1.

        A peer's failure record is waited for only while its agent heartbeats: a node whose
        heartbeat stops for the limit (``keep_alive_interval * keep_alive_max_attempt``,
        counted from the last beat this agent saw in the round) is named as lost -- the root
        cause of the peer-loss errors of this node's workers -- and neither its record nor its
        exit is waited for any longer.
        """
        round_store = info.store
        end = self.rdzv.end_of(info.round)
        lost = []
        if end is not None and end[0] is RoundEnd.FAILURE:
            lost = [f for f in (end[1] or []) if f.rank < 0]
        watch = self._watch if self._watch is not None else _RoundWatch(peers=[])
        deadline = time.monotonic() + min(30.0, self.config.shutdown_timeout + 5.0)
        while True:
            gone = {f.group_rank for f in lost}
            waiting = [g for g in range(info.group_world_size) if g not in gone]
            keys = [f"failures/{g}" for g in waiting]
            if round_store.check(keys) or time.monotonic() >= deadline:
                break
            now = time.monotonic()
            if now >= watch.next_beat:  # still alive to the peers while it waits for them
                watch.next_beat = now + self.config.keep_alive_interval
                round_store.add(f"hb/{info.group_rank}", 1)
            silent = [
                g for g in waiting
                if g != info.group_rank and not round_store.check([f"failures/{g}"])
            ]
            found = self._check_peers(info, silent, watch.seen, now)
            if found is not None:
                self.log(f"node {found.group_rank} ({found.host}) was lost: {found.message}")
                lost.append(found)
                continue
            self.check_stop()
            time.sleep(0.05)
        gone = {f.group_rank for f in lost}
        failures: list[Failure] = list(lost)
        for key in (f"failures/{g}" for g in range(info.group_world_size) if g not in gone):
            if round_store.check([key]):
                failures.extend(read_failures(round_store, key))
        if not failures:
            failures = local
        print(
            format_report(
                self.config.entrypoint,
                failures,
                restarts=info.restart_count,
                max_restarts=self.config.max_restarts,
            ),
            file=sys.stderr,
            flush=True,
        )
        self.rdzv.exit_barrier(info, self.is_host, lost=len(gone))
        return 1

    # ------------------------------------------------------------------ dirs
    def _attempt_root(self) -> str:
        """The folder of this run's attempts, made when the first workers start (so a launch
        that fails before leaves nothing behind)."""
        if self._run_dir is None:
            cfg = self.config
            try:
                if cfg.log_dir:
                    os.makedirs(cfg.log_dir, exist_ok=True)
                    prefix = cfg.run_id.replace(os.sep, "_") + "_"
                    self._run_dir = tempfile.mkdtemp(prefix=prefix, dir=cfg.log_dir)
                    self.log(f"logs and error files under {self._run_dir}", always=False)
                else:
                    self._base_dir = tempfile.mkdtemp(prefix="fastcomm_launch_")
                    self._run_dir = self._base_dir
                    if _any_std(cfg.redirects) or _any_std(cfg.tee):
                        self.log(f"worker logs under {self._run_dir} (no --log-dir given)")
                        self._base_dir = None  # keep the logs the user asked for
            except OSError as exc:
                where = f"--log-dir {cfg.log_dir!r}" if cfg.log_dir else "the temporary folder"
                raise UsageError(f"cannot create a folder in {where}: {exc.strerror}") from None
        return self._run_dir

    def _cleanup_dirs(self) -> None:
        """Removes the temporary folder of error files, whatever the outcome (the failure
        report carries their contents)."""
        if self._base_dir is not None:
            shutil.rmtree(self._base_dir, ignore_errors=True)
        self._base_dir = None


def _any_std(spec) -> bool:
    return any(spec.values()) if isinstance(spec, dict) else bool(spec)


def _precise_time(path: str) -> float | None:
    try:
        with open(path) as fh:
            return float(json.load(fh)["message"]["extraInfo"]["fastcomm_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
