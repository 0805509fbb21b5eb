"""``--rdzv-backend etcd``: the job's rendezvous, the agents' liveness and the workers' store in
an etcd cluster, so that no node serves anything and any node may die.

Every key of a job lives under ``fastcomm-run/<run id>/`` in etcd:

    lease                 the job's lease id (16 hex digits), put on that lease
    g<lease id>/          the live generation of the job:
      rdzv/fastcomm.launch/<run id>/r<r>/...  the rendezvous rounds (``rendezvous``)
      alive/<agent id>                        each agent's liveness key, on its own lease
      w<r>/...                                round ``r``'s workers' store (``FASTCOMM_STORE``)
      rdzv.receipts/, w<r>.receipts/          the stores' clients' ``add`` receipts

The first agent of a job grants the job's lease and puts ``lease`` with it (a transaction on
version 0: one agent wins), then deletes what older generations left (a job of this run id that
ended without cleaning up). Every agent keeps the job's lease alive while it runs: once every
agent is gone it expires, so the next job of this run id starts a generation of its own. The
agent that leaves a finished job last (the round's ``exited`` count) revokes it and deletes the
generation.

Each agent puts ``alive/<agent id>`` on a lease of its own whose TTL is the heartbeat limit
(``keep_alive_interval * keep_alive_max_attempt``, whole seconds), renewed every
``keep_alive_interval`` by a thread: an agent's death, or its node's, shows as the key expiring
(:class:`LeaseBeats`). An agent whose own lease expired stops, since the others take it for
lost. Every call to etcd is bounded by the heartbeat limit (at least ``MIN_CALL_S``, which an
election and one silent member fit in): a cluster that lost its majority stops every agent
with one line.

Each agent lists the members on its own machine first, for itself and its workers: a client
stays with the member that answered last, so a node's death costs the others no request to its
member. Standard library and ``fastcomm.comm`` stores only (no backend).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from fastcomm.comm.etcd import EtcdClient, EtcdError, EtcdUnavailableError, Lease
from fastcomm.comm.store import Store

from .config import LaunchConfig
from .errors import Failure, LaunchError
from .heartbeat import lost_node_failure
from .net import is_local_address

__all__ = ["ETCD_ROOT", "EtcdJob", "LeaseBeats", "etcd_loss", "local_first"]

#: Where the jobs of fastcomm-run live in etcd (``<root>/<run id>/``).
ETCD_ROOT = "fastcomm-run"
#: The shortest bound of one call to etcd: an election (about a second) and a member that
#: does not answer (``REQUEST_S``) fit in it.
MIN_CALL_S = 5.0
#: Seconds one request to one member may take before the next one is tried.
REQUEST_S = 1.0
#: The shortest TTL of the job's lease: it outlives a pause of every agent's renewals.
MIN_JOB_TTL_S = 10


def local_first(endpoints: tuple[str, ...]) -> tuple[str, ...]:
    """``endpoints`` with the members on this machine first (then in the order given)."""
    def here(endpoint: str) -> bool:
        host = endpoint.rpartition(":")[0].strip("[]")
        return is_local_address(host)

    mine = [e for e in endpoints if here(e)]
    return (*mine, *(e for e in endpoints if e not in mine))


def route_endpoint(endpoints: tuple[str, ...]) -> tuple[str, int]:
    """``(host, port)`` of a member on another machine (the first such), else of the first: the
    address that routes to it is the one the other nodes reach this one at."""
    remote = [e for e in endpoints if not is_local_address(e.rpartition(":")[0].strip("[]"))]
    host, _, port = (remote or list(endpoints))[0].rpartition(":")
    return host.strip("[]"), int(port)


def etcd_loss(exc: BaseException) -> EtcdUnavailableError | None:
    """The ``EtcdUnavailableError`` behind ``exc`` (itself, its cause or its context), if any:
    the cluster could not serve a call (lost its majority, or cannot be reached)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, EtcdUnavailableError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


class EtcdJob:
    """One agent's view of its job in etcd.

    Args:
        cfg: the launch configuration (``rdzv_endpoints``, ``run_id``, the heartbeat settings,
            ``join_timeout``).
        secret: the job secret the rendezvous values are signed with (``None``: unsigned).
        check_stop: raises once the agent got a stop signal (checked while etcd is awaited).
        log: prints a line of the agent's.
    """

    def __init__(self, cfg: LaunchConfig, secret: bytes | None, check_stop: Callable[[], None],
                 log: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.endpoints = local_first(cfg.rdzv_endpoints)
        self.root = f"{ETCD_ROOT}/{cfg.run_id}"
        self.call_s = max(cfg.heartbeat_limit, MIN_CALL_S)
        """Seconds one call to etcd may take, with its failovers."""
        self.request_s = REQUEST_S
        """Seconds one request to one member may take before the next member is tried."""
        self.ttl = max(1, math.ceil(cfg.heartbeat_limit))
        """The TTL of this agent's liveness lease (whole seconds)."""
        self.secret = secret
        self.check_stop = check_stop
        self.log = log
        self.client = EtcdClient(self.endpoints, request_timeout=self.request_s,
                                 timeout=self.call_s)
        self.generation: str | None = None
        """``g<job lease id>``: the job's live generation (set by :meth:`open`)."""
        self.job_lease: Lease | None = None
        self.lease: Lease | None = None
        """This agent's liveness lease."""
        self._store = None  # the rendezvous store's EtcdStore (closed by close())

    # ------------------------------------------------------------------ names
    @property
    def prefix(self) -> str:
        """The generation's prefix in etcd: ``fastcomm-run/<run id>/g<lease id>``."""
        return f"{self.root}/{self.generation}"

    def alive_key(self, agent_id: str) -> str:
        """The liveness key of agent ``agent_id``."""
        return f"{self.prefix}/alive/{agent_id}"

    def workers_url(self, r: int) -> str:
        """Round ``r``'s workers' store, as their ``FASTCOMM_STORE``."""
        return f"etcd://{','.join(self.endpoints)}/{self.prefix}/w{r}"

    @property
    def address(self) -> str:
        """The cluster, as messages name it."""
        return f"etcd://{','.join(self.endpoints)}"

    # ------------------------------------------------------------------ opening
    def open(self, agent_id: str) -> Store:
        """Joins the job's generation (or starts one), puts this agent's liveness key on a
        kept-alive lease and returns the rendezvous store (the generation's namespace).

        Raises:
            LaunchError: the cluster could not be reached (or could not serve) within the join
                timeout.
        """
        from fastcomm.comm.etcd_store import EtcdStore  # etcd only where asked for

        cfg = self.cfg
        start = time.monotonic()
        while True:
            self.check_stop()
            try:
                self._join_generation()
                self.lease = self.client.grant(self.ttl).keep_alive(
                    min(cfg.keep_alive_interval, self.ttl / 3))
                self.client.put(self.alive_key(agent_id), agent_id, lease=self.lease.id)
                break
            except EtcdUnavailableError as exc:
                waited = time.monotonic() - start
                if waited >= cfg.join_timeout:
                    raise LaunchError(
                        f"could not use the etcd cluster at {','.join(self.endpoints)} within "
                        f"the join timeout ({cfg.join_timeout:g} s): {exc}"
                    ) from None
                time.sleep(min(0.5, cfg.join_timeout - waited))
        self._store = EtcdStore(self.endpoints, f"{self.prefix}/rdzv", self.call_s,
                                request_timeout=self.request_s)
        return Store(timeout=self.call_s, _root=self._store, _secret=self.secret)

    def _join_generation(self) -> None:
        """Finds the job's live generation (its lease still kept), or starts one."""
        key = f"{self.root}/lease"
        job_ttl = max(MIN_JOB_TTL_S, math.ceil(2 * self.cfg.heartbeat_limit))
        while True:
            self.check_stop()
            kv = self.client.get(key)
            if kv is not None:
                try:
                    lease_id = int(kv.value, 16)
                    ttl = self.client.refresh(lease_id)
                except ValueError:
                    raise LaunchError(f"etcd key {key!r} at {self.address} holds "
                                      f"{kv.value[:40]!r}, not a lease id") from None
                except EtcdUnavailableError:
                    raise
                except EtcdError:
                    continue  # it expired since: start a generation of our own
                self._keep_job_lease(Lease(self.client, lease_id, ttl))
                return
            lease = self.client.grant(job_ttl)
            won, _ = self.client.compare_and_set(key, f"{lease.id:016x}", prev_version=0,
                                                 lease=lease.id)
            if not won:
                self.client.revoke(lease.id)
                continue
            self._keep_job_lease(lease)
            self._sweep()
            return

    def _keep_job_lease(self, lease: Lease) -> None:
        self.job_lease = lease.keep_alive(lease.ttl / 3)
        self.generation = f"g{lease.id:016x}"

    def _sweep(self) -> None:
        """Deletes the keys of the job's older generations (``[g, g<mine>/)`` and
        ``[g<mine>0, h)``: every ``g<16 hex digits>/`` but this generation's)."""
        mine = f"{self.root}/{self.generation}"
        deleted = self.client.delete_range(f"{self.root}/g", f"{mine}/")
        deleted += self.client.delete_range(f"{mine}0", f"{self.root}/h")
        if deleted:
            self.log(f"deleted {deleted} key(s) an earlier job of run id {self.cfg.run_id!r} "
                     f"left in etcd")

    # ------------------------------------------------------------------ liveness
    @property
    def lease_lost(self) -> bool:
        """Whether this agent's liveness lease was lost (the others take it for lost)."""
        return self.lease is not None and self.lease.lost is not None

    def check_lease(self) -> None:
        """Raises once this agent's liveness lease is lost: the other agents take this node for
        lost, so it must stop. ``EtcdUnavailableError`` where the cluster cannot serve a call
        (it lost its majority, or this node lost it), else ``LaunchError``."""
        if self.lease_lost:
            self.client.get(f"{self.root}/lease")  # says why, where the cluster is lost
            raise LaunchError(
                f"this node's liveness lease in etcd ({self.address}) was not renewed within "
                f"its {self.ttl} s: the other nodes take it for lost ({self.lease.lost})"
            )

    def heartbeats(self, info) -> LeaseBeats:
        """The liveness watch of round ``info``."""
        return LeaseBeats(self, info)

    # ------------------------------------------------------------------ leaving
    def finish(self) -> None:
        """The last agent out of a finished job: revokes the job's lease (a new agent then
        starts a new generation) and deletes this generation's keys (best effort)."""
        try:
            if self.job_lease is not None:
                self.job_lease.revoke()
            self.client.delete_prefix(f"{self.prefix}/")
        except EtcdError as exc:
            self.log(f"could not delete the job's keys in etcd ({exc}); the next job of run id "
                     f"{self.cfg.run_id!r} deletes them")

    def close(self, reachable: bool = True) -> None:
        """Stops renewing the leases and revokes this agent's (its liveness key goes at once);
        closes the connections. Best effort; with ``reachable=False`` (the cluster could not
        serve a call) nothing is asked of it: the leases expire on their own."""
        for lease in (self.lease, self.job_lease):
            if lease is not None:
                lease.stop(wait=False)
        if not reachable:
            return
        if self.lease is not None:
            try:
                self.client.revoke(self.lease.id, timeout=min(self.call_s, 2.0))
            except EtcdError:
                pass  # it expires within its TTL
        if self._store is not None:
            self._store.close()
        self.client.close()


class LeaseBeats:
    """The liveness watch of one round on etcd: an agent is lost once its liveness key expired
    (:class:`EtcdJob`). The same calls as ``heartbeat.Heartbeats``.

    Args:
        job: this agent's job in etcd.
        info: the running round (its nodes' agent ids).
    """

    def __init__(self, job: EtcdJob, info) -> None:
        self.job = job
        self.info = info
        self.interval = job.cfg.keep_alive_interval
        self.limit = float(job.ttl)
        self.next_beat = 0.0

    def beat(self, now: float) -> bool:
        """Whether a look at the peers is due at monotonic time ``now`` (every
        ``keep_alive_interval``); checks this agent's own lease first (its renewal runs on a
        thread of its own).

        Raises:
            LaunchError: this agent's lease was lost.
        """
        if now < self.next_beat:
            return False
        self.next_beat = now + self.interval
        self.job.check_lease()
        return True

    def lost_peer(self, peers: list[int], now: float) -> Failure | None:
        """The first of ``peers`` whose liveness key expired, as a lost-node failure dated one
        TTL back (its last renewal at the latest), or ``None``."""
        if not peers:
            return None
        info = self.info
        keys = {g: self.job.alive_key(info.nodes[g].agent_id).encode() for g in peers}
        absent, _ = self.job.client.missing(list(keys.values()))
        for g in peers:
            if keys[g] not in absent:
                continue
            return lost_node_failure(
                info, g, self.limit,
                f"no heartbeat from the agent of node {g}: its liveness lease in etcd "
                f"expired (TTL {self.job.ttl} s)")
        return None
