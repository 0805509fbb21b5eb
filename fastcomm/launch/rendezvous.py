"""Store-based rendezvous: the agents of a job agree, round by round, on the node set.

One agent serves the rendezvous ``Store`` (the one on the endpoint host; with the static
backend, node rank 0); the others connect to it, retrying within the join timeout. All keys of
a job live under ``fastcomm.launch/<run_id>/`` and every round ``r`` has its own namespace
``r<r>/`` -- a round's keys are never read by another round, so nothing stale from a failed
round can leak into the next one:

``join``            counter; an agent's join index is the value its ``add`` returned, minus 1
``node/<i>``        the ``NodeInfo`` of the agent with join index ``i``
``returning``       counter of joined agents that were members of the previous round
``closed``          ``N``, the number of admitted nodes (join indices ``0..N-1``), set once
                    (``compare_set``) by whichever agent sees the round complete: ``MAX`` nodes
                    joined, or ``MIN`` joined and the last-call window passed (or every member
                    of the previous round that was not declared lost is back). A round closes
                    only after the previous one has ended; later joiners wait for the next.
``restarts``        TORCHELASTIC_RESTART_COUNT of the round (failure restarts so far)
``master``          ``addr:port`` of the round's worker store (a fresh ``TCPStore`` on a free
                    port served by the agent of GROUP_RANK 0; workers connect as clients with
                    ``TORCHELASTIC_USE_AGENT_STORE=True``)
``end``             how the round ended, set once: ``("success", None)``,
                    ``("failure", [Failure, ...])`` or ``("membership", None)`` (a node waits to
                    be admitted: restart, not counted as a failure)
``failures/<g>``    the failures node ``g`` observed (for the final report)
``done``/``exited`` counters of agents whose workers succeeded / that left after the end
``hb/<g>``          heartbeat counter of node ``g``

A node that joins while a round runs joins the next round; the running agents see it waiting
(``join`` of round ``r+1`` > 0) and end their round with ``membership`` when there is room.
"""

from __future__ import annotations

import enum
import os
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from fastcomm.comm.errors import StoreTimeoutError
from fastcomm.comm.store import Store

from .config import LaunchConfig
from .errors import LaunchError

__all__ = [
    "JobEnded",
    "NodeInfo",
    "RoundEnd",
    "RoundInfo",
    "Rendezvous",
    "open_store",
    "is_local_address",
]


class RoundEnd(enum.Enum):
    """How a round ended. The store holds the value (a plain string) in the round's ``end``."""

    SUCCESS = "success"
    """Every agent's workers exited 0."""
    FAILURE = "failure"
    """A worker failed or an agent was lost; the payload lists the failures."""
    MEMBERSHIP = "membership"
    """A node waits to be admitted: restart, not counted as a failure."""


class JobEnded(enum.Enum):
    """What ``Rendezvous.next_round`` returns when the job ended while this agent waited."""

    OK = "ok"
    FAILED = "failed"


@dataclass(slots=True)
class NodeInfo:
    """What an agent tells the others about itself when it joins a round."""

    agent_id: str
    host: str
    addr: str
    nproc: int
    role: str
    pid: int
    node_rank: int | None = None
    """Fixed GROUP_RANK (static backend)."""
    prev_group_rank: int | None = None
    """GROUP_RANK in the previous round (keeps ranks stable across restarts)."""


@dataclass(slots=True)
class RoundInfo:
    """The outcome of a completed rendezvous round, as seen by one agent."""

    round: int
    group_rank: int
    nodes: list[NodeInfo]
    """Admitted nodes in GROUP_RANK order."""
    restart_count: int
    master_addr: str
    master_port: int
    store: Store = field(repr=False)
    """The round's namespace in the rendezvous store."""

    @property
    def group_world_size(self) -> int:
        """Number of nodes admitted to the round (GROUP_WORLD_SIZE)."""
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        """Number of workers of all nodes (WORLD_SIZE)."""
        return sum(n.nproc for n in self.nodes)

    @property
    def rank_offset(self) -> int:
        """RANK of this node's local rank 0."""
        return sum(n.nproc for n in self.nodes[: self.group_rank])

    def role_ranks(self, role: str) -> tuple[int, int]:
        """(ROLE_RANK of this node's local rank 0, ROLE_WORLD_SIZE)."""
        before = sum(n.nproc for n in self.nodes[: self.group_rank] if n.role == role)
        total = sum(n.nproc for n in self.nodes if n.role == role)
        return before, total


class Interrupted(Exception):
    """The agent received a signal while waiting."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


def is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (one can bind a socket to it)."""
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::"):
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def open_store(config: LaunchConfig, check_stop: Callable[[], None]) -> tuple[Store, bool]:
    """Serves or joins the rendezvous store; returns ``(store, is_host)``."""
    host, port = config.rdzv_host, config.rdzv_port
    if config.is_host is not None:
        serve = config.is_host
    elif config.rdzv_backend == "static":
        serve = config.node_rank == 0
    else:
        serve = port == 0 or is_local_address(host)
    if serve:
        try:
            return Store(host, port, is_server=True, timeout=config.read_timeout), True
        except StoreTimeoutError as exc:
            # c10d on the endpoint host: another agent of this machine may serve it already.
            if port == 0 or config.rdzv_backend == "static" or config.is_host:
                raise LaunchError(
                    f"cannot serve the rendezvous store at {host}:{port}: {exc}"
                ) from None
    deadline = time.monotonic() + config.join_timeout
    while True:
        check_stop()
        left = deadline - time.monotonic()
        try:
            store = Store(host, port, timeout=max(1.0, min(5.0, left)))
            store.timeout = timedelta(seconds=config.read_timeout)
            return store, False
        except StoreTimeoutError as exc:
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"could not reach the rendezvous store at {host}:{port} within the join "
                    f"timeout ({config.join_timeout:g} s): {exc}"
                ) from None
            time.sleep(0.2)


def _dumps(obj) -> bytes:
    return pickle.dumps(obj)


def _loads(data: bytes):
    return pickle.loads(data)


def _load_end(data: bytes) -> tuple[RoundEnd, object]:
    kind, payload = _loads(data)
    return RoundEnd(kind), payload


class Rendezvous:
    """Round-based rendezvous of the agents of one job, over the rendezvous store."""

    POLL_S = 0.05

    def __init__(
        self,
        store: Store,
        config: LaunchConfig,
        node: NodeInfo,
        check_stop: Callable[[], None],
        log: Callable[[str], None] = lambda msg: None,
    ) -> None:
        self.config = config
        self.node = node
        self.base = store.prefixed(f"fastcomm.launch/{config.run_id}")
        self._check_stop = check_stop
        self._log = log
        self._worker_store: Store | None = None

    # ------------------------------------------------------------------ helpers
    def round_store(self, r: int) -> Store:
        """The key namespace of round ``r`` in the rendezvous store."""
        return self.base.prefixed(f"r{r}")

    def _sleep(self) -> None:
        self._check_stop()
        time.sleep(self.POLL_S)

    def _get(self, store: Store, key: str, what: str) -> bytes:
        deadline = time.monotonic() + self.config.read_timeout
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"timed out after {self.config.read_timeout:g} s waiting for "
                    f"{what} (key {store.prefix}/{key})"
                )
            self._sleep()
        return store.get(key)

    def end_of(self, r: int) -> tuple[RoundEnd, object] | None:
        """How round ``r`` ended, or ``None`` while it runs."""
        round_store = self.round_store(r)
        if not round_store.check(["end"]):
            return None
        return _load_end(round_store.get("end"))

    def end_round(self, r: int, kind: RoundEnd, payload=None) -> tuple[RoundEnd, object]:
        """Proposes the end of round ``r``; returns the end that won (the first one proposed)."""
        round_store = self.round_store(r)
        round_store.compare_set("end", b"", _dumps((kind.value, payload)))
        return _load_end(round_store.get("end"))

    def restarts_of(self, r: int) -> int:
        """TORCHELASTIC_RESTART_COUNT of round ``r`` (waits up to ``read_timeout`` for it)."""
        return int(self._get(self.round_store(r), "restarts", f"the restart count of round {r}"))

    def set_next_restarts(self, r: int, restarts: int) -> None:
        """Publishes TORCHELASTIC_RESTART_COUNT of round ``r + 1`` (all members agree on it)."""
        self.round_store(r + 1).compare_set("restarts", b"", str(restarts))

    def waiting(self, r: int) -> int:
        """Number of agents waiting to join round ``r + 1``."""
        return self.round_store(r + 1).add("join", 0)

    def _first_open_round(self) -> int:
        r = 0
        while self.round_store(r).check(["closed"]):
            r += 1
        return r

    # ------------------------------------------------------------------ joining
    def next_round(
        self, from_round: int | None = None, prev_group_rank: int | None = None
    ) -> RoundInfo | JobEnded:
        """Joins the next round and waits for it to close.

        ``from_round``: the round to join when this agent was a member of ``from_round - 1``
        (``None`` for a new agent: the first round that is still open). Returns the
        ``RoundInfo``, or a ``JobEnded`` when the job ended while this
        agent waited to be admitted.
        """
        returning = from_round is not None
        r = self._first_open_round() if from_round is None else from_round
        if r == 0:
            self.round_store(0).compare_set("restarts", b"", b"0")
        info = NodeInfo(**{k: getattr(self.node, k) for k in NodeInfo.__slots__})
        info.prev_group_rank = prev_group_rank if returning else None
        while True:
            round_store = self.round_store(r)
            index = round_store.add("join", 1) - 1
            round_store.set(f"node/{index}", _dumps(info))
            if returning:
                round_store.add("returning", 1)
            outcome = self._wait_closed(r)
            if isinstance(outcome, JobEnded):
                round_store.add("left", 1)
                return outcome
            if index < outcome:
                return self._complete(r, outcome, index)
            # Over MAX: wait in the next round (admitted when a round has room).
            self._log(f"round {r} is full ({outcome} nodes); waiting for the next round")
            r += 1
            returning = False
            info.prev_group_rank = None

    def _wait_closed(self, r: int) -> int | JobEnded:
        cfg = self.config
        round_store = self.round_store(r)
        deadline = time.monotonic() + cfg.join_timeout
        prev_ended = r == 0
        prev_members = None
        last_call_from = None
        while True:
            if round_store.check(["closed"]):
                return int(round_store.get("closed"))
            if not prev_ended:
                end = self.end_of(r - 1)
                if end is not None:
                    if end[0] is RoundEnd.SUCCESS:
                        return JobEnded.OK
                    if end[0] is RoundEnd.FAILURE and self.restarts_of(r - 1) >= cfg.max_restarts:
                        return JobEnded.FAILED
                    prev_ended = True
                    prev_members = int(self.round_store(r - 1).get("closed"))
                    if end[0] is RoundEnd.FAILURE:  # nodes declared lost will not be back
                        prev_members -= len({f.group_rank for f in end[1] or [] if f.rank < 0})
                    deadline = time.monotonic() + cfg.join_timeout
            if prev_ended:
                # "returning" before "join": every agent counted returning is in ``count``
                returning = round_store.add("returning", 0) if prev_members is not None else 0
                count = round_store.add("join", 0)
                now = time.monotonic()
                target = None
                if count >= cfg.max_nodes:
                    target = cfg.max_nodes
                elif count >= cfg.min_nodes:
                    if last_call_from is None:
                        last_call_from = now
                    everyone_back = prev_members is not None and returning >= prev_members
                    if everyone_back or now - last_call_from >= cfg.last_call_timeout:
                        target = count
                elif now > deadline:
                    raise LaunchError(
                        f"rendezvous round {r} timed out after {cfg.join_timeout:g} s "
                        f"(join_timeout): {count} of at least {cfg.min_nodes} nodes joined"
                    )
                if target is not None:
                    round_store.compare_set("closed", b"", str(target))
                    continue
            self._sleep()

    def _complete(self, r: int, count: int, index: int) -> RoundInfo:
        cfg = self.config
        round_store = self.round_store(r)
        nodes = [
            _loads(self._get(round_store, f"node/{i}", f"node {i} of round {r}"))
            for i in range(count)
        ]
        order = list(range(count))
        if cfg.rdzv_backend == "static":
            ranks = [n.node_rank for n in nodes]
            if sorted(ranks) != list(range(count)):
                raise LaunchError(
                    f"static rendezvous: the nodes' --node-rank values are {sorted(ranks)}; "
                    f"each of 0..{count - 1} must be given exactly once"
                )
            order.sort(key=lambda i: nodes[i].node_rank)
        else:
            order.sort(
                key=lambda i: (nodes[i].prev_group_rank is None, nodes[i].prev_group_rank or 0, i)
            )
        ordered = [nodes[i] for i in order]
        group_rank = order.index(index)
        restarts = self.restarts_of(r)
        if group_rank == 0:
            # A fresh worker store per round is what makes restarts work: torchrun reuses one
            # store for every round, so restarted workers read the failed round's keys (e.g.
            # Gloo's peer addresses) and fail with ``connectFullMesh ... Connection refused``
            # or hang. Hence MASTER_PORT changes every round.
            addr = cfg.master_addr or ordered[0].addr
            self._worker_store = Store(addr, 0, is_server=True, timeout=cfg.read_timeout)
            round_store.set("master", f"{addr}:{self._worker_store.port}")
        master = self._get(round_store, "master", f"the worker store address of round {r}").decode()
        addr, _, port = master.rpartition(":")
        self._log(
            f"round {r}: {count} node(s), group rank {group_rank}, world size "
            f"{sum(n.nproc for n in ordered)}, restart count {restarts}, master {master}"
        )
        return RoundInfo(
            round=r,
            group_rank=group_rank,
            nodes=ordered,
            restart_count=restarts,
            master_addr=addr,
            master_port=int(port),
            store=round_store,
        )

    def release_worker_store(self) -> None:
        """Stops serving the finished round's worker store (its workers are gone)."""
        self._worker_store = None

    # ------------------------------------------------------------------ leaving
    def exit_barrier(self, info: RoundInfo, is_host: bool, timeout: float | None = None) -> None:
        """Counts this agent out; the store host waits (``close_timeout``) for the others and
        for agents that waited to be admitted, so none loses the store before it read the
        outcome."""
        round_store = info.store
        round_store.add("exited", 1)
        if not is_host:
            return
        nxt = self.round_store(info.round + 1)
        deadline = time.monotonic() + (self.config.close_timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            if round_store.add("exited", 0) >= info.group_world_size and (
                nxt.add("join", 0) <= nxt.add("left", 0)
            ):
                return
            time.sleep(self.POLL_S)


def default_host() -> str:
    """This machine's fully qualified host name (how agents name their node)."""
    return socket.getfqdn()


def new_agent_id() -> str:
    """A job-unique id for an agent: host, pid and random bytes."""
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
