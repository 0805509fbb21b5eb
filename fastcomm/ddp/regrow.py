"""Regrow: ranks join the running ranks at a step boundary: a replacement (``fastcomm-run
--recover in-process --max-restarts N``) or an elastic node's (``FASTCOMM_RECOVER_JOIN``).

The joiner's ``fastcomm.init()`` returns a stand-in world of its own (``world._joining``); its
``DDP()`` posts a request in the running DDP's recovery namespace (named by rank 0 under
``ddp-recover/current`` in the world's store). The running ranks look for one at every
``FASTCOMM_RECOVER_JOIN_EVERY``-th synchronized forward (16; at every one while a replacement
is due; one store ``check``); the first to see it sets the admission to the next such step
(``compare_set``). There the requests posted by then become the last members of a new epoch,
once every joining node among them has posted as many as its agent said it brings
(``joining_node_key``; else a step later, and past the recovery timeout without the missing
ones, as decided per step by ``compare_set``). Rank 0 posts their admissions (members, step,
bucket order, the running communicator's backend); the running ranks build its successor
(``reconfigured``: ``hier`` once shm's members span hosts), the joiners the same from the
backend's name (``world.for_new_members``), each DDP swaps it in (``DDP.replace_comm``), and
rank 0 streams the parameters, buffers and ``DDP.register_state`` objects' ``state_dict``s
(``RegisteredStates``; at the joiners' first forward). ``DDP.join_step`` tells a joiner's
loop where it is.
"""
from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import sys
import time
import warnings
from typing import Any

import torch

from fastcomm import settings
from fastcomm.comm.shm.segment import pid_start_time
from fastcomm.comm.store import joining_node_key
from fastcomm.comm.topology import host_id
from fastcomm.comm.world import for_new_members

from .broadcast import broadcast_tensors
from .recover import (
    NAMESPACE_KEY,
    Membership,
    MembershipChange,
    Recovery,
    _close_quietly,
)

__all__ = ["Grower", "RegisteredStates", "join", "joining"]

_POLL_S = 0.005
_BATCH_MAX = 64  # requests admitted at one boundary at most
_NODE_PREFIX = "node"  # FASTCOMM_RECOVER_JOIN of a joining node's workers: node<GROUP_RANK>


def _parse_request(raw: bytes) -> dict:
    """A join request: ``id`` (the identity row), ``node`` (the joining node, ``None`` for a
    replacement) and ``local_rank``."""
    request = json.loads(raw)
    if not isinstance(request, dict) or not isinstance(request.get("id"), list):
        raise RuntimeError(f"fastcomm DDP: a join request is malformed: {raw[:200]!r}")
    return request


def _replacements() -> int:
    """The replacements the launcher may start (``TORCHELASTIC_MAX_RESTARTS``, which
    ``fastcomm-run`` sets; 0 when unset or not a number)."""
    text = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "").strip()
    return int(text) if text.isdigit() else 0


def joining(comm) -> bool:
    """Whether `comm` is a replacement's stand-in world, to be replaced by joining."""
    return getattr(comm, "join_store", None) is not None


class Grower:
    """The running ranks' side of regrow: admission at a step boundary (module docstring).

    Args:
        recovery: the DDP's ``recover.Recovery``.
        ticket: the next request to look for.
        lost: the ranks lost before (a joiner's, from its admission).
    """

    def __init__(self, recovery, ticket: int = 1, lost: int = 0) -> None:
        self.recovery = recovery
        # at exit, a replacement still waiting for admission learns there is nothing to join
        atexit.register(finished, recovery.membership.store)
        self.ticket = ticket
        self.at: int | None = None
        # each look costs a store round trip, so the running ranks look every few steps only
        self.every = settings.RECOVER_JOIN_EVERY.get()
        self.states_pending = False  # a joiner: the registered states still to receive
        self.lost = lost
        """Ranks lost so far (every rank counts the same shrinks, so all agree on it)."""
        self.replacements = _replacements()
        self.seen = 0.0  # when request `ticket` was first seen here (time.monotonic())
        self._requests: dict[int, dict] = {}
        self._sizes: dict[str, int] = {}  # the ranks each joining node brings
        recovery.callbacks.insert(0, self._changed)

    def _changed(self, change) -> None:
        self.lost += len(change.lost)

    def expected(self) -> bool:
        """Whether a replacement is on its way: the launcher starts one per loss while its
        ``--max-restarts`` last. Then every step is a boundary (one store ``check`` each):
        every rank counts the same losses and admissions at the same steps, so all switch
        together."""
        return min(self.lost, self.replacements) >= self.ticket

    def boundary(self, step: int) -> None:
        """Called at each synchronized forward with the steps done so far."""
        if self.states_pending:
            self.states_pending = False
            ddp = self.recovery.ddp
            ddp.registered_states.stream(ddp.comm)
        store = self.recovery.membership.store
        k = self.ticket
        if self.at is None:
            every = 1 if self.expected() else self.every
            # a stale answer costs one boundary; in etcd it never waits for an election, so a
            # lost member does not slow the step
            if step % every or not store.check([f"grow/request/{k}"], stale_ok=True):
                return
            self.at = int(store.compare_set(f"grow/at/{k}", "", str(step + every)))
            self.seen = time.monotonic()
        if step < self.at:
            return
        n = self._batch(k, step)
        if n == 0:  # a node's ranks still on their way: every rank looks again next step
            self.at = step + 1
            return
        self.ticket, self.at = k + n, None
        self._admit(k, n, step)

    def _batch(self, k: int, step: int) -> int:
        """How many requests from `k` on are admitted together at `step` (0: none yet), as the
        first rank here decided (``compare_set``): those posted by now, once every node among
        them has posted as many as its agent said it brings (``joining_node_key``); after the
        recovery timeout, those that came (the missing ones named)."""
        store = self.recovery.membership.store
        key = f"grow/batch/{k}/{step}"
        if store.check([key]):
            n = int(store.get(key))
        else:
            n = 1
            while n < _BATCH_MAX and store.check([f"grow/request/{k + n}"]):
                n += 1
            late = time.monotonic() - self.seen > self.recovery.membership.timeout
            ready = late or not self._missing(k, n)
            n = int(store.compare_set(key, "", str(n if ready else 0)))
        if n and self.recovery.ddp.comm.rank == 0:
            missing = self._missing(k, n)
            if missing:
                warnings.warn(
                    f"fastcomm DDP: admitting {n} joining rank(s) at step {step} without "
                    f"{'; '.join(missing)}: they had not asked within "
                    f"{self.recovery.membership.timeout:g} s ({settings.RECOVER_TIMEOUT.name})",
                    RuntimeWarning, stacklevel=2,
                )
        return n

    def _request(self, j: int) -> dict:
        """Request `j` (cached: requests are set once)."""
        if j not in self._requests:
            store = self.recovery.membership.store
            self._requests[j] = _parse_request(store.get(f"grow/request/{j}"))
        return self._requests[j]

    def _missing(self, k: int, n: int) -> list[str]:
        """The nodes among requests ``k..k+n-1`` that have not all asked, each as
        ``"node1's local ranks [1] (1 of 2 asked)"``: a node's count is what its agent
        published (``joining_node_key``), its requests counted from the first ticket on."""
        nodes = {self._request(j)["node"] for j in range(k, k + n)} - {None}
        missing = []
        for node in sorted(nodes):
            brings = self._brings(node)
            asked = sorted(r["local_rank"] for r in map(self._request, range(1, k + n))
                           if r["node"] == node)
            if len(asked) < brings:
                gone = [r for r in range(brings) if r not in asked]
                missing.append(f"{node}'s local ranks {gone} ({len(asked)} of {brings} asked)")
        return missing

    def _brings(self, node: str) -> int:
        """How many ranks joining `node` brings, as its agent published it (1 if it did not)."""
        if node not in self._sizes:
            root = self.recovery.membership.lost_store
            key = joining_node_key(node)
            self._sizes[node] = int(root.get(key)) if root.check([key]) else 1
        return self._sizes[node]

    def _admit(self, k: int, n: int, step: int) -> None:
        start, seen_at = time.monotonic(), time.time()
        recovery = self.recovery
        ddp, membership = recovery.ddp, recovery.membership
        reducer = ddp.reducer
        before = len(membership.members)
        membership.grow([self._request(j)["id"] for j in range(k, k + n)])
        old = ddp.comm
        if old.rank == 0:
            header = {
                "backend": old.backend,  # the joiners build its successor (for_new_members)
                "epoch": membership.epoch, "members": membership.members,
                "identity": membership.identity, "step": step,
                "order": [i for b in reducer.buckets for i in b.param_indices],
                "rebuilt": reducer.rebuilt, "rebuild_due": reducer.rebuild_due,
                "lost": self.lost, "next": k + n,
            }
            for j in range(k, k + n):
                header["me"] = membership.members[before + j - k]
                membership.store.set(f"grow/admit/{j}", json.dumps(header))
        reducer.leave_shared_memory()  # the region goes with the old communicator
        ddp.replace_comm(recovery.successor(old))
        _close_quietly(old)
        comm = ddp.comm
        broadcast_tensors(comm, list(reducer.params) + ddp.synced_buffers(), src=0)
        ddp.registered_states.stream(comm)
        recovery.announce(MembershipChange(
            epoch=membership.epoch, rank=comm.rank, world_size=comm.size, lost=(),
            members=tuple(membership.members), where=f"join {step}",
            seconds=time.monotonic() - start, seen_at=seen_at,
        ))


class RegisteredStates:
    """The objects registered with ``DDP.register_state`` (anything with ``state_dict`` /
    ``load_state_dict``), streamed from rank 0 to the ranks that join (regrow)."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.loading = False
        """Whether this rank joined and has not loaded rank 0's states yet."""

    def register(self, name: str, obj: Any) -> None:
        """Registers `obj` under `name` (``DDP.register_state``).

        Raises:
            TypeError: `obj` has no ``state_dict``/``load_state_dict``.
        """
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(
                f"register_state({name!r}, ...) needs state_dict() and load_state_dict(), got "
                f"{type(obj).__name__}"
            )
        self.objects[str(name)] = obj

    def stream(self, comm) -> None:
        """Rank 0's ``state_dict``s to every rank of `comm` (a collective); loaded where this
        rank is :attr:`loading`."""
        objects = self.objects
        if comm.rank == 0:
            buf = io.BytesIO()
            torch.save({name: obj.state_dict() for name, obj in objects.items()}, buf)
            data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            length = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        comm.broadcast(length, src=0)
        if comm.rank != 0:
            data = torch.empty(int(length.item()), dtype=torch.uint8)
        comm.broadcast(data, src=0)
        if not self.loading:
            return
        self.loading = False
        loaded = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)
        for name, obj in objects.items():
            if name not in loaded:
                raise RuntimeError(
                    f"fastcomm DDP (rank {comm.rank}): the joined state {name!r} was not "
                    f"registered on rank 0 (it has {sorted(loaded)})"
                )
            obj.load_state_dict(loaded[name])


def _admission(store, k: int, timeout: float) -> bytes:
    """Waits for request `k`'s admission; raises once the running ranks have finished
    (``grow/closed``, set as each exits) or after `timeout` seconds."""
    admit, closed = f"grow/admit/{k}", "grow/closed"
    deadline = time.monotonic() + timeout
    while not store.check([admit]):
        if store.check([closed]):
            raise RuntimeError(
                f"replacement {settings.RECOVER_JOIN.get()}: the running ranks finished before "
                "admitting it; nothing left to join"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"replacement {settings.RECOVER_JOIN.get()}: not admitted within {timeout:.0f} s"
            )
        time.sleep(_POLL_S)
    return store.get(admit)


def finished(store) -> None:
    """Marks that the running ranks are done (at exit): a waiting joiner gives up."""
    try:
        store.set("grow/closed", "1")
    except Exception:  # exiting anyway; a joiner then waits out its timeout
        pass


def _request_of_mine() -> dict:
    """This joiner's request: its identity row, and for a joining node's rank (its
    ``FASTCOMM_RECOVER_JOIN`` is ``node<g>``) the node and its local rank. A node's rank has a
    ``RANK`` of its own, in the row for the survivors' liveness on other hosts; a replacement's
    is the lost rank's, already named lost (``lost_rank_key``), so it is left out."""
    tag = settings.RECOVER_JOIN.get() or ""
    row = [host_id(), os.getpid(), pid_start_time(os.getpid()) or 0]
    node = tag if tag.startswith(_NODE_PREFIX) else None
    text = os.environ.get("LOCAL_RANK", "").strip()
    rank = os.environ.get("RANK", "").strip()
    if node is not None and rank.isdigit():
        row.append(int(rank))
    return {"id": row, "node": node, "local_rank": int(text) if text.isdigit() else 0}


def _import_ahead() -> None:
    """Imports ``torch._dynamo`` before the joiner asks: a ``torch.optim`` optimizer imports it
    as it is made (about 1 s), between ``DDP()`` and the first forward, while the running ranks,
    once they admitted the joiner, wait for that forward (a warm spare has it already)."""
    if "torch._dynamo" not in sys.modules:
        try:
            importlib.import_module("torch._dynamo")
        except Exception:  # the optimizer's own import reports it, where it matters
            pass


def join(ddp, timeout: float = 600.0):
    """The joiner's side: posts the request, waits for its admission, builds the members'
    communicator (replacing the stand-in ``ddp.comm``); returns ``(recovery, header)``."""
    _import_ahead()
    base = ddp.comm.join_store
    namespace = base.get(NAMESPACE_KEY, timeout).decode()
    store = base.prefixed(namespace)
    k = store.add("grow/tickets", 1)
    store.set(f"grow/request/{k}", json.dumps(_request_of_mine()))
    header = json.loads(_admission(store, k, timeout))
    membership = Membership.adopt(store, header)
    # the running ranks' kind, not the stand-in's: their successor (hier across hosts)
    comm = for_new_members(
        header["backend"], store=membership.comm_store(), rank=membership.rank,
        size=len(membership.members), timeout=ddp.comm.timeout,
        spans_hosts=membership.spans_hosts,
    )
    stand_in = ddp.replace_comm(comm)
    recovery = Recovery(ddp, membership)  # on hier across hosts: a loss watch
    recovery.grower = Grower(recovery, header.get("next", k + 1), lost=header.get("lost", 0))
    recovery.grower.states_pending = True
    _close_quietly(stand_in)
    return recovery, header
