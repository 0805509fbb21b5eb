"""Store-based rendezvous: the agents of a job agree, round by round, on the node set.

One agent serves the rendezvous ``Store`` (the one on the endpoint host; with the static
backend, node rank 0); the others connect to it, retrying within the join timeout. With the
etcd backend no agent serves anything: the same keys live in an etcd cluster (``etcd_job``),
and so do the workers' stores. All keys of
a job live under ``fastcomm.launch/<run_id>/`` and every round ``r`` has its own namespace
``r<r>/``: nothing stale from a failed round can leak into the next one. A round closes once
``MAX`` nodes joined, or ``MIN`` joined and the last-call window passed; a node that joins
while a round runs joins the next one, and the running agents end theirs with ``membership``
when there is room. Every value except the counters is JSON (``Store.encode``, signed with the
job secret when there is one) and type-checked on reading. The keys: docs/launch.md.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import socket
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from fastcomm.comm.errors import FastcommError, StoreTimeoutError
from fastcomm.comm.store import Store

from .config import LaunchConfig
from .errors import Failure, LaunchError, UsageError
from .net import is_local_address

__all__ = [
    "JobEnded",
    "NodeInfo",
    "RoundEnd",
    "RoundInfo",
    "Rendezvous",
    "open_store",
    "is_local_address",
    "read_failures",
    "write_failures",
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
    joined: bool = False
    """This node joined the round while it ran (``--recover in-process``): its workers join
    the running ranks at a step boundary instead of starting with them."""
    grown_ranks: int = 0
    """The ranks of ``nodes`` that joined the round while it ran."""
    store_url: str | None = None
    """The workers' store in etcd (``etcd://.../<prefix>``, their ``FASTCOMM_STORE``), with the
    etcd backend; ``None``: the ``TCPStore`` at ``master_addr:master_port``."""

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

    def world_size_now(self) -> int:
        """WORLD_SIZE with every node the round admitted while it ran, so far."""
        return self.world_size - self.grown_ranks + self.store.add("grow/ranks", 0)

    def workers_store(self, timeout: float = 10.0) -> Store:
        """A client of the round's workers' store (raw keys: values unsigned).

        Raises:
            RuntimeError: the ``TCPStore`` could not be reached within ``timeout``.
        """
        if self.store_url is not None:
            from fastcomm.comm.store import parse_store_url

            _, endpoints, prefix = parse_store_url(self.store_url)
            return Store.on_etcd(endpoints, prefix, timeout=timeout,
                                 request_timeout=min(5.0, timeout / 2), _secret=None)
        return Store(self.master_addr, self.master_port, timeout=timeout, _secret=None)

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


def open_store(
    config: LaunchConfig,
    check_stop: Callable[[], None],
    *,
    listen: str,
    secret: bytes | None,
) -> tuple[Store, bool]:
    """Serves or joins the rendezvous store; returns ``(store, is_host)``.

    Args:
        config: the launch configuration (endpoint, backend, timeouts).
        check_stop: raises once the agent got a stop signal (checked while retrying).
        listen: the address a served store listens on (see ``net.listen_address``).
        secret: the job secret the store's values are signed with (``None``: unsigned).

    Raises:
        UsageError: the port is in use (and this agent must serve it), or ``listen`` is not
            an address of this machine.
        LaunchError: the store could not be reached within the join timeout.
    """
    host, port = config.rdzv_host, config.rdzv_port
    if config.is_host is not None:
        serve = config.is_host
    elif config.rdzv_backend == "static":
        serve = config.node_rank == 0
    else:
        serve = port == 0 or is_local_address(host)
    serve_error = None
    if serve:
        try:
            store = Store(listen, port, is_server=True, timeout=config.read_timeout, _secret=secret)
            return store, True
        except FastcommError as exc:
            # c10d on the endpoint host: another agent of this machine may serve it already.
            if port == 0 or config.rdzv_backend == "static" or config.is_host:
                raise UsageError(f"cannot serve the rendezvous store: {exc}") from None
            serve_error = exc
        except StoreTimeoutError as exc:
            raise LaunchError(
                f"cannot serve the rendezvous store at {listen}:{port}: {exc}"
            ) from None
    deadline = time.monotonic() + config.join_timeout
    while True:
        check_stop()
        left = deadline - time.monotonic()
        try:
            store = Store(host, port, timeout=max(1.0, min(5.0, left)), _secret=secret)
            store.timeout = timedelta(seconds=config.read_timeout)
            return store, False
        except StoreTimeoutError as exc:
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"could not reach the rendezvous store at {host}:{port} within the join "
                    f"timeout ({config.join_timeout:g} s): {exc}"
                ) from None
            time.sleep(0.2)
        except FastcommError as exc:  # what listens there is not a store: retrying cannot help
            if serve_error is not None:  # ... and it holds the port this agent was to serve
                raise UsageError(f"cannot serve the rendezvous store: {serve_error}") from None
            raise LaunchError(f"cannot use the rendezvous store at {host}:{port}: {exc}") from None


# ---------------------------------------------------------------------- records
def _field_types(cls) -> dict[str, tuple[type, ...]]:
    """Per field of the dataclass ``cls``: the exact types its value may have in a record."""
    hints = typing.get_type_hints(cls)
    types = {}
    for f in dataclasses.fields(cls):
        allowed = typing.get_args(hints[f.name]) or (hints[f.name],)
        types[f.name] = (*allowed, int) if float in allowed else allowed
    return types


_RECORD_TYPES: dict[type, dict[str, tuple[type, ...]]] = {}


def to_record(obj) -> dict[str, Any]:
    """A ``NodeInfo`` or ``Failure`` as the dict of its fields (what the store holds)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def from_record(cls, value: Any, where: str):
    """The ``cls`` instance of a record read from the store, every field type-checked.

    Raises:
        LaunchError: naming ``where`` (the key), when ``value`` is not such a record.
    """
    types = _RECORD_TYPES.get(cls)
    if types is None:
        types = _RECORD_TYPES[cls] = _field_types(cls)
    if type(value) is not dict or set(value) != set(types):
        raise LaunchError(f"{where}: expected a {cls.__name__} record, got {_brief(value)}")
    for name, item in value.items():
        if type(item) not in types[name]:
            raise LaunchError(
                f"{where}: field {name!r} of a {cls.__name__} record is a "
                f"{type(item).__name__}, expected {' or '.join(t.__name__ for t in types[name])}"
            )
    return cls(**value)


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _where(store: Store, key: str) -> str:
    full = f"{store.prefix}/{key}" if store.prefix else key
    return f"store key {full!r} at {store.address}"


def read_value(store: Store, key: str, data: bytes, kind: type | tuple[type, ...]) -> Any:
    """Decodes ``data`` read from ``key`` (signature first) and checks its type."""
    value = store.decode(key, data)
    if not isinstance(kind, tuple):
        kind = (kind,)
    if type(value) not in kind:
        raise LaunchError(
            f"{_where(store, key)}: expected a {' or '.join(t.__name__ for t in kind)}, "
            f"got {_brief(value)}"
        )
    return value


def write_failures(store: Store, key: str, failures: list[Failure]) -> None:
    """Publishes a node's failures under ``key`` (records, for the final report)."""
    store.set(key, store.encode(key, [to_record(f) for f in failures]))


def read_failures(store: Store, key: str, data: bytes | None = None) -> list[Failure]:
    """The failures under ``key`` (``data``: the value already read), checked record by record.

    Raises:
        FastcommError: the value fails the signature check or is not this encoding.
        LaunchError: it is not a list of failure records.
    """
    value = read_value(store, key, store.get(key) if data is None else data, list)
    return [from_record(Failure, item, _where(store, key)) for item in value]


def _encode_end(store: Store, kind: RoundEnd, payload) -> bytes:
    failures = None if payload is None else [to_record(f) for f in payload]
    return store.encode("end", (kind.value, failures))


def _decode_end(store: Store, data: bytes) -> tuple[RoundEnd, object]:
    value = read_value(store, "end", data, tuple)
    kinds = {k.value: k for k in RoundEnd}
    if (
        len(value) != 2
        or type(value[0]) is not str
        or value[0] not in kinds
        or type(value[1]) not in (list, type(None))
    ):
        raise LaunchError(f"{_where(store, 'end')}: expected (kind, failures), got {_brief(value)}")
    kind, payload = kinds[value[0]], value[1]
    if payload is not None:
        payload = [from_record(Failure, item, _where(store, "end")) for item in payload]
    return kind, payload


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
        *,
        listen: str = "127.0.0.1",
        etcd=None,
    ) -> None:
        self.config = config
        self.node = node
        self.etcd = etcd
        """The job in etcd (``etcd_job.EtcdJob``) with the etcd backend, else ``None``."""
        self.base = store.prefixed(f"fastcomm.launch/{config.run_id}")
        self._check_stop = check_stop
        self._log = log
        self._listen = listen
        self._worker_store: Store | None = None

    # ------------------------------------------------------------------ helpers
    def round_store(self, r: int) -> Store:
        """The key namespace of round ``r`` in the rendezvous store."""
        return self.base.prefixed(f"r{r}")

    def heartbeats(self, info: RoundInfo):
        """The watch on the other agents of round ``info``: their heartbeat counters, or on
        etcd their liveness keys (``etcd_job.LeaseBeats``)."""
        cfg = self.config
        if self.etcd is not None:
            return self.etcd.heartbeats(info)
        from .heartbeat import Heartbeats

        return Heartbeats(info, cfg.keep_alive_interval, cfg.keep_alive_max_attempt)

    def _sleep(self) -> None:
        self._check_stop()
        time.sleep(self.POLL_S)

    def _get(self, store: Store, key: str, what: str, kind: type) -> Any:
        """The checked value of ``key`` (see ``read_value``), waiting ``read_timeout`` for it."""
        deadline = time.monotonic() + self.config.read_timeout
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"timed out after {self.config.read_timeout:g} s waiting for "
                    f"{what} (key {store.prefix}/{key})"
                )
            self._sleep()
        return read_value(store, key, store.get(key), kind)

    def end_of(self, r: int) -> tuple[RoundEnd, object] | None:
        """How round ``r`` ended, or ``None`` while it runs."""
        round_store = self.round_store(r)
        if not round_store.check(["end"]):
            return None
        return _decode_end(round_store, round_store.get("end"))

    def end_round(self, r: int, kind: RoundEnd, payload=None) -> tuple[RoundEnd, object]:
        """Proposes the end of round ``r``; returns the end that won (the first one proposed)."""
        round_store = self.round_store(r)
        round_store.compare_set("end", b"", _encode_end(round_store, kind, payload))
        return _decode_end(round_store, round_store.get("end"))

    def restarts_of(self, r: int) -> int:
        """TORCHELASTIC_RESTART_COUNT of round ``r`` (waits up to ``read_timeout`` for it)."""
        store = self.round_store(r)
        count = self._get(store, "restarts", f"the restart count of round {r}", int)
        if count < 0:
            raise LaunchError(f"{_where(store, 'restarts')}: negative restart count {count}")
        return count

    def set_next_restarts(self, r: int, restarts: int) -> None:
        """Publishes TORCHELASTIC_RESTART_COUNT of round ``r + 1`` (all members agree on it)."""
        store = self.round_store(r + 1)
        store.compare_set("restarts", b"", store.encode("restarts", restarts))

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
            first = self.round_store(0)
            first.compare_set("restarts", b"", first.encode("restarts", 0))
        info = NodeInfo(**{k: getattr(self.node, k) for k in NodeInfo.__slots__})
        info.prev_group_rank = prev_group_rank if returning else None
        if not returning and self.config.recover == "in-process" and r > 0 and (
                self.end_of(r - 1) is None):
            joined = self._ask_running(r - 1, info)
            if joined is not None:
                return joined
        while True:
            round_store = self.round_store(r)
            index = round_store.add("join", 1) - 1
            round_store.set(f"node/{index}", round_store.encode(f"node/{index}", to_record(info)))
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
                return self._closed(r)
            if not prev_ended:
                end = self.end_of(r - 1)
                if end is not None:
                    if end[0] is RoundEnd.SUCCESS:
                        return JobEnded.OK
                    if end[0] is RoundEnd.FAILURE and self.restarts_of(r - 1) >= cfg.max_restarts:
                        return JobEnded.FAILED
                    prev_ended = True
                    prev_members = self.members(r - 1)
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
                    round_store.compare_set("closed", b"", round_store.encode("closed", target))
                    continue
            self._sleep()

    def _closed(self, r: int) -> int:
        """The number of nodes admitted to round ``r`` (its ``closed`` value, checked)."""
        store = self.round_store(r)
        count = read_value(store, "closed", store.get("closed"), int)
        if not 1 <= count <= self.config.max_nodes:
            raise LaunchError(
                f"{_where(store, 'closed')}: {count} nodes is outside [1, {self.config.max_nodes}]"
            )
        return count

    def _complete(self, r: int, count: int, index: int) -> RoundInfo:
        cfg = self.config
        round_store = self.round_store(r)
        nodes = [
            from_record(
                NodeInfo,
                self._get(round_store, f"node/{i}", f"node {i} of round {r}", dict),
                _where(round_store, f"node/{i}"),
            )
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
            # or hang. Hence MASTER_PORT changes every round. On etcd the store is the round's
            # namespace there (``store_url``); MASTER_ADDR:MASTER_PORT is then a free port
            # where worker rank 0 serves torch's own ``env://`` store, as under torchrun's
            # etcd backend (a script that does not import fastcomm).
            addr = cfg.master_addr or ordered[0].addr
            if self.etcd is None:
                self._worker_store = Store(
                    self._listen, 0, is_server=True, timeout=cfg.read_timeout, _secret=None
                )
                port = self._worker_store.port
            else:
                port = free_port(self._listen)
            master = f"{addr}:{port}"
            round_store.set("master", round_store.encode("master", master))
        addr, port = self._master(r)
        self._log(
            f"round {r}: {count} node(s), group rank {group_rank}, world size "
            f"{sum(n.nproc for n in ordered)}, restart count {restarts}, master {addr}:{port}"
        )
        return RoundInfo(
            round=r,
            group_rank=group_rank,
            nodes=ordered,
            restart_count=restarts,
            master_addr=addr,
            master_port=int(port),
            store=round_store,
            store_url=self._workers_url(r),
        )

    def _workers_url(self, r: int) -> str | None:
        return None if self.etcd is None else self.etcd.workers_url(r)

    def _master(self, r: int) -> tuple[str, int]:
        """Round ``r``'s worker store address (waits ``read_timeout`` for it)."""
        round_store = self.round_store(r)
        master = self._get(round_store, "master", f"the worker store address of round {r}", str)
        addr, _, port = master.rpartition(":")
        if not addr or not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchError(f"{_where(round_store, 'master')}: not host:port: {master!r}")
        return addr, int(port)

    # ------------------------------------------------------------------ growing in place
    def members(self, r: int) -> int:
        """The nodes of round ``r``: those it closed with and those admitted while it ran."""
        return self._closed(r) + self.round_store(r).add("grow/nodes", 0)

    def _ask_running(self, r: int, node: NodeInfo) -> RoundInfo | None:
        """``--recover in-process``: asks the running round ``r`` to take this node in (its
        node of group rank 0 answers, :meth:`admit_waiting`). The round's info once admitted;
        ``None`` when it was full or ended first (this node then waits for the next round)."""
        store = self.round_store(r)
        j = store.add("grow/asked", 1) - 1
        store.set(f"grow/ask/{j}", store.encode(f"grow/ask/{j}", to_record(node)))
        key = f"grow/answer/{j}"
        self._log(f"round {r} runs; asking it to admit this node (--recover in-process)")
        while not store.check([key]):
            if self.end_of(r) is not None:  # withdrawn, unless the answer came first
                store.compare_set(key, b"", store.encode(key, {"full": True}))
                break
            self._sleep()
        answer = read_value(store, key, store.get(key), dict)
        if "group_rank" not in answer:
            return None
        where = _where(store, key)
        nodes = [from_record(NodeInfo, n, where) for n in answer["nodes"]]
        addr, port = self._master(r)
        group_rank = answer["group_rank"]
        self._log(f"admitted to the running round {r} as group rank {group_rank}")
        return RoundInfo(
            round=r, group_rank=group_rank, nodes=nodes, restart_count=self.restarts_of(r),
            master_addr=addr, master_port=port, store=store, joined=True,
            grown_ranks=answer["grown_ranks"], store_url=self._workers_url(r),
        )

    def admitter(self, info: RoundInfo) -> bool:
        """Whether this node answers the nodes asking to join the running round ``info``: the
        node of the lowest group rank not lost whole (``lost-node/<g>``), so that losing
        group rank 0 loses no admission."""
        store = info.store
        return all(store.check([f"lost-node/{g}"]) for g in range(info.group_rank))

    def admit_waiting(self, info: RoundInfo) -> list[int]:
        """The admitting node of a running round (:meth:`admitter`) answers the nodes that
        asked to join it (:meth:`_ask_running`): each admitted while the round has room
        (``MAX`` nodes), as the next group rank. Returns the group ranks admitted."""
        store = info.store
        asked, answered = store.add("grow/asked", 0), store.add("grow/answered", 0)
        admitted = []
        for j in range(answered, asked):
            record = self._get(store, f"grow/ask/{j}", f"the node asking to join ({j})", dict)
            node = from_record(NodeInfo, record, _where(store, f"grow/ask/{j}"))
            members = self.members(info.round)
            key = f"grow/answer/{j}"
            # a node lost whole (``lost-nodes``) makes room: the same node back, or another
            if members - store.add("lost-nodes", 0) >= self.config.max_nodes:
                store.compare_set(key, b"", store.encode(key, {"full": True}))
            else:
                closed = self._closed(info.round)
                grown = [self._get(store, f"grow/node/{g}", f"grown node {g}", dict)
                         for g in range(closed, members)]
                nodes = [to_record(n) for n in info.nodes[:closed]]
                answer = {"group_rank": members, "nodes": [*nodes, *grown, record],
                          "grown_ranks": store.add("grow/ranks", 0) + node.nproc}
                store.set(f"grow/node/{members}", store.encode(f"grow/node/{members}", record))
                won = store.compare_set(key, b"", store.encode(key, answer))
                if "group_rank" in read_value(store, key, won, dict):
                    store.add("grow/ranks", node.nproc)
                    store.add("grow/nodes", 1)
                    admitted.append(members)
            store.add("grow/answered", 1)
        return admitted

    def grown_nodes(self, info: RoundInfo) -> list[NodeInfo]:
        """The nodes admitted into the running round `info` that ``info.nodes`` lacks yet
        (group ranks ``len(info.nodes)`` on), appended to it (``grown_ranks`` too, so
        ``world_size_now`` stays), and returned."""
        store, new = info.store, []
        for g in range(len(info.nodes), self.members(info.round)):
            where = _where(store, f"grow/node/{g}")
            record = self._get(store, f"grow/node/{g}", f"grown node {g}", dict)
            node = from_record(NodeInfo, record, where)
            info.nodes.append(node)
            info.grown_ranks += node.nproc
            new.append(node)
        return new

    def release_worker_store(self) -> None:
        """Stops serving the finished round's worker store (its workers are gone)."""
        self._worker_store = None

    # ------------------------------------------------------------------ leaving
    def exit_barrier(
        self, info: RoundInfo, is_host: bool, timeout: float | None = None, *, lost: int = 0
    ) -> None:
        """Counts this agent out; the store host waits (``close_timeout``) for the others and
        for agents that waited to be admitted, so none loses the store before it read the
        outcome. ``lost``: nodes of the round declared lost, not waited for. On etcd nobody
        waits for the others: the last agent out waits for those waiting to be admitted,
        then deletes the job's keys (``EtcdJob.finish``)."""
        round_store = info.store
        # read before counting out: the last agent out deletes the keys once it counted
        members = self.members(info.round) if self.etcd is not None else 0
        exited = round_store.add("exited", 1)
        if self.etcd is not None:
            if exited >= members - lost:
                self._wait_for_waiting(info, timeout, lost)
                self.etcd.finish()
            return
        if not is_host:
            return
        self._wait_for_waiting(info, timeout, lost)

    def _wait_for_waiting(self, info: RoundInfo, timeout: float | None, lost: int = 0) -> None:
        """Waits (``close_timeout``) until every agent of round ``info`` counted out and every
        agent that waited to join the next round read that the job ended."""
        round_store = info.store
        nxt = self.round_store(info.round + 1)
        deadline = time.monotonic() + (self.config.close_timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            if round_store.add("exited", 0) >= self.members(info.round) - lost and (
                nxt.add("join", 0) <= nxt.add("left", 0)
            ):
                return
            time.sleep(self.POLL_S)


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (bound, read and released)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def default_host() -> str:
    """This machine's fully qualified host name (how agents name their node)."""
    return socket.getfqdn()


def new_agent_id() -> str:
    """A job-unique id for an agent: host, pid and random bytes."""
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
