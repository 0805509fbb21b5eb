"""In-place recovery from a lost rank (``FASTCOMM_RECOVER=in-process``, which ``fastcomm-run
--recover in-process`` sets): the survivors agree on who is left and finish the step.

A collective failing because a peer died starts an epoch: over the job's store (no extra
server) each survivor posts where it failed; the live members that posted are decided by
``compare_set`` and confirmed by a barrier that fails when one of them dies (then the next
epoch). Ranks are renumbered densely in old-rank order, the failed communicator builds its
successor over them (its ``reconfigured``) and the DDP swaps it in (``DDP.replace_comm``, the
one place that swaps it). In backward, gradients a reduction may overwrite are kept as they
arrive (``Keeper``: a reference where it can, a copy where it must), so the failed step is
reduced again among the survivors, scaled by ``1/survivors``, and ``backward()`` returns as if
nothing happened (the reducer's ``abandon_step`` ends it). Other collectives (``DDP()``'s
broadcast, the bucket rebuild, the buffers) recover and retry. Liveness: from ``/proc`` on this
host (the waits' own look where the communicator has ``capabilities.sees_lost_peers``, else
``liveness.LossWatch``); on other hosts from the keys ``fastcomm-run`` sets for the losses it
absorbs, watched by ``LossWatch``. Limits: dense gradients; across hosts, ``fastcomm-run`` and a
communicator with ``capabilities.shrinks_across_hosts``.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastcomm import settings
from fastcomm.comm.errors import (
    CommAbortedError,
    CommClosedError,
    FastcommError,
    PeerLostError,
)
from fastcomm.comm.shm.segment import pid_start_time, process_alive
from fastcomm.comm.store import lost_rank_key
from fastcomm.comm.topology import host_id
from fastcomm.kernels._launch import fp32_scale

from .liveness import LossWatch

__all__ = [
    "Keeper",
    "Membership",
    "MembershipChange",
    "Recovery",
    "RecoveryError",
    "recovery_enabled",
]

#: Where rank 0 publishes its DDP's recovery namespace in the world's store (for a joiner).
NAMESPACE_KEY = "ddp-recover/current"
#: The agreement's look at the store between two waits: the survivors reach it a few ms
#: apart, and each wait ends within this of the last one's arrival (a store's timed wait
#: cannot be cancelled cleanly, so the waits poll)
_POLL_S = 0.0005
#: Errors that say a peer went away (a timeout is a hang, the hang report's business).
LOSS_ERRORS = (CommAbortedError, CommClosedError)


class RecoveryError(FastcommError):
    """The survivors could not agree on a new membership (timeout, disagreement, excluded)."""


def launch_rank(environ=None) -> int | None:
    """This process's ``RANK`` from its launcher (``None``: unset or not a number)."""
    text = (os.environ if environ is None else environ).get("RANK", "")
    return int(text) if text.strip().isdigit() else None


def recovery_enabled(environ=None) -> bool:
    """Whether ``FASTCOMM_RECOVER`` asks for in-place recovery.

    Raises:
        ValueError: a value other than ``in-process``, ``restart`` or empty.
    """
    return settings.RECOVER.get(environ) == "in-process"


@dataclass(frozen=True, slots=True)
class MembershipChange:
    """What ``DDP.on_membership_change`` callbacks receive after a shrink.

    Attributes:
        epoch: the new epoch (1 after the first loss).
        rank: this process's new rank.
        world_size: the new number of ranks.
        lost: the ranks lost, numbered as in the previous epoch.
        members: every member's original rank (the rank at construction), in new-rank order.
        where: the collective that failed (``"backward 20"``, ``"init"``...).
        seconds: from the failure seen here to the new communicator.
        seen_at: when the recovery began here (``time.time()``).
        detected_by: how this rank learned of the loss: ``"pidfd"`` (the exit as an event),
            ``"poll"`` (a look at ``/proc``), ``"flag"`` (a peer's abort mark), ``"store"``
            (the launcher's key), ``""`` (unknown: an error that did not say).
        detected_at: when its wait saw the loss (``time.time()``; ``seen_at`` where unknown).
        phases: seconds of each part of `seconds` here, in order: ``agree`` (the survivors'
            membership), ``successor`` (the new communicator), ``replan`` (the reducer's
            buckets and whatever else follows the communicator).
    """

    epoch: int
    rank: int
    world_size: int
    lost: tuple[int, ...]
    members: tuple[int, ...]
    where: str
    seconds: float
    seen_at: float
    detected_by: str = ""
    detected_at: float = 0.0
    phases: tuple[tuple[str, float], ...] = ()


class Membership:
    """The job's members over epochs, agreed over a store namespace.

    Made by :meth:`gather` (every rank, as its DDP is built) or :meth:`adopt` (a rank that
    joins running ones, from its admission).

    Args:
        store: the namespace in the job's store.
        key: its name in the communicator's store (a joiner finds it under ``NAMESPACE_KEY``;
            ``""`` for a joiner's).
        me: this process's original rank (its row in `identity`).
        members: the current members' original ranks, in rank order.
        identity: by original rank, each member's ``[host, pid, process start time,
            launcher rank]`` (the launcher rank may be missing: a replacement's).
        epoch: the current epoch (0 until the first change).
        timeout: seconds the members wait for each other in one epoch's agreement
            (``FASTCOMM_RECOVER_TIMEOUT`` overrides it).
    """

    def __init__(self, store, key: str, me: int, members, identity, epoch: int = 0,
                 timeout: float = 60.0) -> None:
        self.store = store
        self.key = key
        self.me = me
        self.epoch = epoch
        self.members = list(members)
        self.identity = [list(row) for row in identity]
        self.timeout = settings.RECOVER_TIMEOUT.get(default=timeout)
        self._host = host_id()
        self.lost_store = store.root()
        """The job's store at its root, where the launcher names the ranks it lost."""

    @classmethod
    def gather(cls, comm, timeout: float | None = None) -> Membership:
        """Every rank's membership over a new namespace of ``comm.store``: a collective (every
        rank gathers every rank's host, pid, start time and launcher rank through the store).

        Raises:
            RuntimeError: ``comm`` has no store.
        """
        store = getattr(comm, "store", None)
        if store is None:
            raise RuntimeError(
                f"fastcomm DDP (rank {comm.rank}): {settings.RECOVER.name}=in-process needs a "
                f"communicator with a store; {type(comm).__name__} has none"
            )
        key = comm.next_key("ddp-recover")
        namespace = store.prefixed(key)
        mine = [host_id(), os.getpid(), pid_start_time(os.getpid()) or 0, launch_rank()]
        identity = namespace.all_gather_object("ids", comm.rank, comm.size, mine, comm.timeout)
        return cls(namespace, key, comm.rank, range(comm.size), identity,
                   timeout=60.0 if timeout is None else timeout)

    @classmethod
    def adopt(cls, store, header: dict) -> Membership:
        """A joiner's membership, from its admission (``regrow``): it is the member the header
        names (``me``), else the last."""
        members = header["members"]
        return cls(store, "", header.get("me", members[-1]), members, header["identity"],
                   epoch=header["epoch"])

    def grow(self, rows: list[list]) -> None:
        """The next epoch: the current members, then one joining member per identity row
        (every member grows alike, from the same rows)."""
        self.identity.extend(list(row) for row in rows)
        self.members = self.members + list(range(len(self.identity) - len(rows),
                                                 len(self.identity)))
        self.epoch += 1

    def comm_store(self):
        """The namespace of the current epoch's communicator, this member's view."""
        return self.store.prefixed(f"epoch{self.epoch}/comm", rank=self.rank)

    @property
    def spans_hosts(self) -> bool:
        """Whether the current members run on more than one host (else liveness is read from
        ``/proc``)."""
        return len({self.identity[m][0] for m in self.members}) > 1

    @property
    def host(self) -> str:
        """This process's host (``topology.host_id``)."""
        return self._host

    @property
    def rank(self) -> int:
        """This process's rank in the current epoch."""
        return self.members.index(self.me)

    def launch_rank(self, original: int) -> int | None:
        """Member `original`'s ``RANK`` from its launcher (``None``: unknown)."""
        row = self.identity[original]
        return row[3] if len(row) > 3 else None

    def lost_key(self, original: int) -> str | None:
        """The store key the launcher sets when member `original`, on another host, is lost
        (``None``: on this host, or its launcher rank is unknown)."""
        rank = self.launch_rank(original)
        if rank is None or self.identity[original][0] == self._host:
            return None
        return lost_rank_key(rank)

    def alive(self, original: int) -> bool:
        """Whether member `original` still runs: on this host from ``/proc``, on another from
        the launcher's key (alive until it names it lost)."""
        host, pid, start = self.identity[original][:3]
        if original == self.me:
            return True
        if host != self._host:
            key = self.lost_key(original)
            return key is None or not self.lost_store.check([key])
        return process_alive(pid, start or None)

    def _key(self, epoch: int, what: str, rank: int | None = None) -> str:
        return f"epoch{epoch}/{what}" + ("" if rank is None else f"/{rank}")

    def _post_here(self, epoch: int, where: str) -> None:
        self.store.set(self._key(epoch, "here", self.me), where)

    def agree(self, where: str) -> list[int]:
        """Agrees with the other survivors on the next epoch's members (original ranks, in
        new-rank order); every survivor gets the same list, or raises ``RecoveryError``."""
        for _ in range(len(self.members) + 1):
            epoch = self.epoch + 1
            self._post_here(epoch, where)
            members = self._decide(epoch)
            confirmed = self._confirm(epoch, members)
            self.epoch, self.members = epoch, members
            if confirmed:
                self._check_where(epoch, where)
                return members
        raise RecoveryError(f"rank {self.me}: no membership settled after {self.epoch} epochs")

    def _decide(self, epoch: int) -> list[int]:
        """The first complete list of live members that posted, as the store decided it."""
        decided = self._key(epoch, "members")
        start = time.monotonic()
        while True:
            if self.store.check([decided]):
                break
            alive = [r for r in self.members if self.alive(r)]
            if self.store.check([self._key(epoch, "here", r) for r in alive]):
                self.store.compare_set(decided, "", json.dumps(alive))
                break
            self._waited(start, f"the survivors of epoch {epoch - 1} to report")
            time.sleep(_POLL_S)
        members = json.loads(self.store.get(decided))
        if self.me not in members:
            raise RecoveryError(
                f"rank {self.me}: left out of epoch {epoch} (members {members}); this rank "
                "was taken for lost"
            )
        return members

    def _confirm(self, epoch: int, members: list[int]) -> bool:
        """A barrier of `members` that fails (``False``) as soon as one of them is gone."""
        self.store.set(self._key(epoch, "ready", self.me), "1")
        start = time.monotonic()
        keys = [self._key(epoch, "ready", r) for r in members]
        while not self.store.check(keys):
            if any(not self.alive(r) for r in members):
                # gone before it confirmed: nobody can pass this barrier, all go on to the next
                return False
            self._waited(start, f"the members {members} of epoch {epoch} to confirm")
            time.sleep(_POLL_S)
        return True

    def _check_where(self, epoch: int, where: str) -> None:
        seen = {r: self.store.get(self._key(epoch, "here", r)).decode() for r in self.members}
        if len(set(seen.values())) > 1:
            raise RecoveryError(
                f"rank {self.me}: the survivors failed at different collectives ({seen}); "
                "their states may differ, so the job cannot go on in place"
            )

    def _waited(self, start: float, what: str) -> None:
        elapsed = time.monotonic() - start
        if elapsed > self.timeout:
            raise RecoveryError(
                f"rank {self.me}: recovery timed out after {elapsed:.1f} s waiting for {what} "
                f"({settings.RECOVER_TIMEOUT.name}={self.timeout:g})"
            )


class Keeper:
    """Each parameter's local gradient of this backward, kept as it arrives where its
    reduction may overwrite it (the redo's input), at the least cost:

    - a bucket view's fresh gradient (``.grad`` was ``None``): a reference to autograd's own
      tensor, which the reduction only reads (no copy);
    - a gradient reduced where it lies (a bucket view accumulated into, an in-place large
      gradient, a comm hook's bucket): a copy;
    - a packed bucket's gradient: nothing (its ``.grad`` is written only once every bucket's
      reduction is done, the reducer's order with recovery on).
    """

    _NOTHING, _REFERENCE, _COPY = 0, 1, 2

    def __init__(self, reducer) -> None:
        self.reducer = reducer
        n = len(reducer.params)
        self.saved: list[torch.Tensor | None] = [None] * n
        self.copies: list[torch.Tensor | None] = [None] * n
        self.stamp = [-1] * n
        self._modes: list[int] = []
        self._for = None  # the strategies the modes were made for

    def _refresh(self) -> list[int]:
        from .in_place import InPlaceAllReduce
        from .strategy import ARRIVAL_PACKED, PACKED

        reducer = self.reducer
        modes = [self._NOTHING] * len(reducer.params)
        for bucket, strategy in zip(reducer.buckets, reducer.strategies, strict=True):
            if bucket.sparse or strategy is PACKED or strategy is ARRIVAL_PACKED:
                continue
            if isinstance(strategy, InPlaceAllReduce):
                for k in strategy.plan.large:
                    modes[bucket.param_indices[k]] = self._COPY
                continue
            kind = self._REFERENCE if strategy.grads_in_flat and not hasattr(
                strategy, "hook") else self._COPY
            for i in bucket.param_indices:
                modes[i] = kind
        self._modes, self._for = modes, reducer.strategies
        return modes

    def keep(self, i: int, grad: torch.Tensor | None) -> None:
        """Keeps parameter `i`'s fresh gradient where needed (called from its hook)."""
        modes = self._modes if self._for is self.reducer.strategies else self._refresh()
        mode = modes[i]
        if mode == self._NOTHING or grad is None or grad.is_sparse:
            return
        reducer = self.reducer
        view = reducer.grad_views[i]
        if mode == self._REFERENCE and view is not None and grad.data_ptr() != view.data_ptr():
            self.saved[i] = grad.detach()
        else:
            buf = self.copies[i]
            if buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype:
                buf = self.copies[i] = torch.empty_like(
                    grad, memory_format=torch.contiguous_format
                )
            buf.copy_(grad.detach())
            self.saved[i] = buf
        self.stamp[i] = reducer.synced_iterations

    def has(self, i: int) -> bool:
        """Whether parameter `i`'s local gradient of this step is kept here (not in
        ``.grad``)."""
        return self.stamp[i] == self.reducer.synced_iterations and self.saved[i] is not None

    def local(self, i: int) -> torch.Tensor:
        """Parameter `i`'s local gradient of this step (zeros when it got none)."""
        p = self.reducer.params[i]
        if self.has(i):
            return self.saved[i]
        if p.grad is not None and not p.grad.is_sparse:
            return p.grad
        return torch.zeros_like(p)


class Recovery:
    """One DDP's recovery: the membership, the callbacks, and the redo of a failed step.

    Args:
        ddp: the DDP (its communicator is replaced after each change, ``DDP.replace_comm``).
        membership: a joiner's (``Membership.adopt``); ``None``: gathered now, a collective.
    """

    def __init__(self, ddp, membership: Membership | None = None) -> None:
        self.ddp = ddp
        self.membership = Membership.gather(ddp.comm) if membership is None else membership
        caps = ddp.comm.capabilities
        self.supported = not self.membership.spans_hosts or caps.shrinks_across_hosts
        """Whether a loss can be recovered from: one host, or a communicator that shrinks
        across hosts."""
        self.watch: LossWatch | None = None
        self.callbacks: list[Callable[[MembershipChange], None]] = []
        self.changes: list[MembershipChange] = []
        self.grower = None  # a regrow.Grower, set by DDP
        if not self.supported:
            warnings.warn(
                f"fastcomm DDP (rank {ddp.comm.rank}): {settings.RECOVER.name}=in-process shrinks "
                "in place only when every rank runs on one host, or across hosts on a "
                "communicator that can be aborted and rebuilt over the survivors (hier, gloo, "
                f"nccl); these ranks span hosts on {ddp.comm.backend}, so a lost rank fails the "
                "others as without it",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            self.follow(ddp.comm)
        if membership is None and ddp.comm.rank == 0:  # where a joiner finds it (regrow)
            ddp.comm.store.set(NAMESPACE_KEY, self.membership.key)

    def attach(self, reducer) -> None:
        """The reducer's side: it keeps each gradient a reduction may overwrite (`Keeper`)
        and hands the end of a backward to :meth:`finalize`."""
        reducer.keeper = Keeper(reducer)
        reducer.recovery = self

    def follow(self, comm) -> None:
        """Watches `comm`, the DDP's communicator from now on: the liveness watch started where
        it needs one and is not running yet (members on other hosts, whose losses the launcher
        names; or members here that `comm`'s waits cannot see die:
        ``capabilities.sees_lost_peers``), and a call of `comm` that failed on a peer's closed
        connection waits for the watch to name the lost rank (``loss_grace``: the socket
        closes before ``/proc`` or the launcher says it)."""
        here = not comm.capabilities.sees_lost_peers
        if self.watch is None and (here or self.membership.spans_hosts):
            self.watch = LossWatch(self.membership, _comm_of(self), here=here)
        if self.watch is not None and hasattr(comm, "loss_grace"):
            comm.loss_grace = self.membership.timeout

    # ------------------------------------------------------------------ comm
    def run(self, fn: Callable[[], object], where: str):
        """``fn()`` (a collective), recovering and retrying it while peers are lost."""
        for _ in range(len(self.membership.members)):
            try:
                return fn()
            except LOSS_ERRORS as exc:
                self.shrink(where, exc)
        return fn()

    def shrink(self, where: str, cause: BaseException, redo: bool = False) -> MembershipChange:
        """Closes the failed communicator (on a thread of its own), agrees on the survivors and
        swaps theirs in. `redo`: the failed backward is redone next (`finalize`), which writes
        every gradient it keeps again: those leave the shared region without a copy."""
        ddp, start, seen_at = self.ddp, time.monotonic(), time.time()
        lost = _peer_lost(cause)
        old = ddp.comm
        reducer = getattr(ddp, "reducer", None)
        if reducer is not None:  # its shared region goes with the failed communicator
            reducer.leave_shared_memory(reducer.keeper.has if redo else None)
        before = list(self.membership.members)
        # its threads drain and its mapping goes while the survivors agree and build the
        # successor (off the step's path: tens of ms on a busy host); nothing uses it now
        threading.Thread(target=_close_quietly, args=(old,), name="fastcomm-close-failed").start()
        members = self.membership.agree(where)
        agreed = time.monotonic()
        successor = self.successor(old, [before.index(r) for r in members])
        built = time.monotonic()
        ddp.replace_comm(successor)
        end = time.monotonic()
        change = MembershipChange(
            epoch=self.membership.epoch, rank=ddp.comm.rank, world_size=ddp.comm.size,
            lost=tuple(before.index(r) for r in before if r not in members),
            members=tuple(members), where=where, seconds=end - start,
            seen_at=seen_at, detected_by=getattr(lost, "detected_by", ""),
            detected_at=getattr(lost, "seen_at", 0.0) or seen_at,
            phases=(("agree", agreed - start), ("successor", built - agreed),
                    ("replan", end - built)),
        )
        self.announce(change)
        return change

    def successor(self, old, survivors: list[int] | None = None):
        """`old`'s successor over the current epoch's members (``old.reconfigured``): a
        collective of those members. `survivors`: their ranks in `old`, where every member
        holds it (a shrink)."""
        membership = self.membership
        return old.reconfigured(membership.comm_store(), membership.rank,
                                len(membership.members), spans_hosts=membership.spans_hosts,
                                survivors=survivors)

    def announce(self, change: MembershipChange) -> None:
        """Records `change` and calls the ``on_membership_change`` callbacks with it."""
        self.changes.append(change)
        for fn in list(self.callbacks):
            fn(change)

    # ------------------------------------------------------------------ backward
    def finalize(self, reducer) -> None:
        """The reducer's end of backward, with the failed step redone among the survivors."""
        try:
            reducer.finish_backward()
            return
        except LOSS_ERRORS as exc:
            cause: BaseException = exc
        where = f"backward {reducer.synced_iterations}"
        for _ in range(len(self.membership.members)):
            self.shrink(where, cause, redo=True)
            try:
                redo_step(reducer, reducer.keeper)
                return
            except LOSS_ERRORS as exc:
                cause = exc
        raise RecoveryError(f"{where}: the redo kept failing") from cause


def _peer_lost(error: BaseException | None) -> PeerLostError | None:
    """The ``PeerLostError`` at the root of `error` (its causes and contexts), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, PeerLostError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _comm_of(recovery: Recovery) -> Callable[[], object]:
    """The communicator in use by `recovery`'s DDP, ``None`` once it is gone (the watch thread
    holds no reference that would keep the DDP alive)."""
    ref = weakref.ref(recovery)

    def current():
        alive = ref()
        return None if alive is None else alive.ddp.comm

    return current


def redo_step(reducer, keeper: Keeper) -> None:
    """Reduces every dense gradient of this step again over ``reducer.comm`` from `keeper`'s
    copies and writes the averages into ``.grad`` (the bucket views where they are ``.grad``);
    then the reducer ends the step (``abandon_step``). The buckets in the successor's shared
    memory are reduced there in place, as a backward's are (each copy staged: the part in this
    rank's own slice is read where it is); the other gradients are scaled by ``1/size`` and
    all-reduced together in one flat tensor per dtype."""
    comm = reducer.comm
    scale = fp32_scale(1.0 / comm.size)
    in_place = _redo_in_place(reducer, keeper)
    dense = [i for i in range(len(reducer.params))
             if i not in reducer.sparse and i not in in_place]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in dense:
        by_dtype.setdefault(reducer.params[i].dtype, []).append(i)
    for indices in by_dtype.values():
        flat = torch.cat([keeper.local(i).reshape(-1) for i in indices]).mul_(scale)
        comm.all_reduce(flat)
        offset = 0
        for i in indices:
            p = reducer.params[i]
            value = flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
            target = reducer.grad_views[i] if reducer.bucket_view else p.grad
            if target is None:
                target = torch.empty_like(p)
            target.copy_(value)
            p.grad = target
    reducer.abandon_step()


def _redo_in_place(reducer, keeper: Keeper) -> set[int]:
    """Stages `keeper`'s copies into the reducer's shared buckets, launches each, in bucket
    order, waits for them all, and makes each such ``.grad`` its view; the parameters done."""
    if reducer.shared is None:
        return set()
    done: set[int] = set()
    launched = []
    region = reducer.shared.region
    for bucket in reducer.buckets:
        if bucket.shared is None:
            continue
        for k, i in enumerate(bucket.param_indices):
            local = keeper.local(i)
            if local.data_ptr() != reducer.grad_views[i].data_ptr():  # else in place already
                bucket.shared.stage(bucket.offsets[k], local.reshape(-1).to(bucket.dtype))
            done.add(i)
        launched.append(region.launch(bucket.shared, reducer.scale))
    for result in launched:
        result.wait()
    for i in done:
        reducer.params[i].grad = reducer.grad_views[i]
    return done


def _close_quietly(comm) -> None:
    """Closes the failed communicator (its threads drained, its peers told); errors ignored."""
    try:
        comm.close()
    except Exception:  # it failed already; the survivors' new one replaces it
        pass
