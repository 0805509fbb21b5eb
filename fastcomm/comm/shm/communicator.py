"""``shm`` communicator: collectives between the ranks of one host through shared memory.

Ranks copy into, reduce out of and copy from one POSIX shared-memory segment per communicator
(``schedules``: one entry point per op). CPU tensors go through the segment; CUDA tensors go to
the ``fallback``. Collectives run in issue order on one executor (a synchronous call on the
caller's thread when nothing is pending, with no task built); sends and receives have an
executor per peer. A failed operation marks this rank ABORTED, so peers fail fast. Run one rank
per core (``OMP_NUM_THREADS=1``). Invariants in full: ``docs/shm.md``.
"""

from __future__ import annotations

import atexit
import os
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ... import settings
from ..backend import VKind
from ..base import Communicator
from ..errors import CommAbortedError, CommClosedError, FastcommError, SizesDisagreement
from ..store import Store
from ..topology import host_id
from ..types import Capabilities, PremulSum, ReduceOp
from ..work import OrderedExecutor, Task, wrap_error
from .buckets import ShmBucketRegion
from .core import PREMUL_KINDS
from .flags import PeerFlags, fence_supported
from .p2p import Mailboxes
from .reductions import Reduction
from .schedules import SegmentSchedules
from .segment import ABORTED, CLOSED, Segment, pid_start_time, shm_supported

__all__ = ["ShmCommunicator", "ShmOptions", "shm_available"]

_LIVE: weakref.WeakSet = weakref.WeakSet()


def shm_available() -> bool:
    """Whether this platform supports the ``shm`` communicator (Linux ``/dev/shm``, fences)."""
    return shm_supported() and fence_supported()


@dataclass(kw_only=True, slots=True)
class ShmOptions:
    """Tuning of a :class:`ShmCommunicator` (every rank must pass the same values)."""

    # the environment checks its values itself, so a bad one is named by its variable rather
    # than by the field (__post_init__)
    slot_bytes: int = field(default_factory=settings.SHM_SLOT_BYTES.get)
    """Bytes of each rank's slot in each of the two halves: the chunk a round moves. Multiple of
    4096; default 1 MiB (``FASTCOMM_SHM_SLOT_BYTES``): large enough that per-round Python costs
    stay small, small enough that a chunk is still in cache when the peers read it."""

    one_shot_max: int | None = field(default_factory=settings.SHM_ONE_SHOT_BYTES.get)
    """Largest all-reduce, in bytes, done in one shot instead of reduce-scatter + all-gather
    (``FASTCOMM_SHM_ONE_SHOT_BYTES``). ``None`` (default): ``512 KiB / size``, i.e. 256 KiB on
    2 ranks, the crossover found there (one shot reads every peer's copy, so the crossover
    falls as ranks are added; docs/shm.md)."""

    spin_us: float | None = field(default_factory=settings.SHM_SPIN_US.get)
    """Microseconds a waiting rank polls in a tight loop (``FASTCOMM_SHM_SPIN_US``). ``None``
    (default): 20 when the ranks fit on the cores this process may use, else 0 (polling would
    only delay the rank being waited for); and 0 while the host's load average exceeds 1.5x
    those cores, for the same reason (sampled once a second)."""

    yield_us: float = field(default_factory=settings.SHM_YIELD_US.get)
    """Microseconds a waiting rank then polls between ``sched_yield()`` calls (which hand the
    core to any runnable thread) before it sleeps on a futex; default 1000
    (``FASTCOMM_SHM_YIELD_US``)."""

    compiled: bool = field(default_factory=settings.SHM_COMPILED.get)
    """Use the compiled core where it was built at install: small collectives run in it (one C
    call per call), so does each send/recv chunk (one mailbox slot), and a ``PremulSum`` is
    folded into the reduction (no pass of its own).
    ``FASTCOMM_SHM_COMPILED=0`` turns it off; without a C compiler at install the pure-Python
    path runs either way."""

    mbox_bytes: int | None = None
    """Bytes of each mailbox slot of send/recv (two per ordered pair of ranks). ``None``: 256 KiB,
    less for many ranks."""

    def __post_init__(self) -> None:
        if not isinstance(self.compiled, bool):
            raise TypeError(f"compiled must be a bool, got {self.compiled!r}")
        if not isinstance(self.slot_bytes, int) or self.slot_bytes < 4096 or self.slot_bytes % 4096:
            raise ValueError(
                f"slot_bytes must be a positive multiple of 4096, got {self.slot_bytes!r}"
            )
        if self.one_shot_max is not None and (
            not isinstance(self.one_shot_max, int) or self.one_shot_max < 0
        ):
            raise ValueError(
                f"one_shot_max must be an int >= 0 or None, got {self.one_shot_max!r}"
            )
        if self.spin_us is not None and not 0 <= self.spin_us <= 1e6:
            raise ValueError(f"spin_us must be in [0, 1e6] or None, got {self.spin_us!r}")
        if not 0 <= self.yield_us <= 1e7:
            raise ValueError(f"yield_us must be in [0, 1e7], got {self.yield_us!r}")
        if self.mbox_bytes is not None and (self.mbox_bytes < 4096 or self.mbox_bytes % 4096):
            raise ValueError(
                f"mbox_bytes must be a positive multiple of 4096 or None, got {self.mbox_bytes!r}"
            )


class ShmCommunicator(Communicator):
    """Collectives through a shared-memory segment, for ranks on one host.

    Args:
        store: a store namespace private to this communicator.
        rank: this process's rank.
        size: number of ranks (all on this host).
        timeout: limit for setup and for every operation.
        options: tuning (:class:`ShmOptions`); the same on every rank.
        fallback: the communicator that moves non-CPU tensors (``None``: they raise).
        reduce: the schedules' reduction (:data:`~.schedules.Reduction`; default torch ops in
            the tensors' dtype); the same kind on every rank.

    Raises:
        FastcommError: the platform lacks ``/dev/shm``, the ranks are on different hosts, or the
            segment could not be set up.
    """

    backend = "shm"

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float | timedelta | None = None,
        *,
        options: ShmOptions | None = None,
        fallback: Communicator | None = None,
        reduce: Reduction | None = None,
        survivors_of: tuple[ShmCommunicator, list[int]] | None = None,
    ) -> None:
        super().__init__(store, rank, size, timeout, fallback=fallback)
        if not shm_available():
            raise FastcommError("the shm communicator needs Linux /dev/shm and memory fences")
        self.options = opts = options or ShmOptions()
        mbox = opts.mbox_bytes or max(16 << 10, min(256 << 10, (64 << 20) // (2 * size * size)))
        mbox -= mbox % 4096
        one_shot = opts.one_shot_max if opts.one_shot_max is not None else (512 << 10) // size
        if survivors_of is None:
            self._check_peers(store, rank, size, [host_id(), opts.slot_bytes, mbox, one_shot])
        spin = opts.spin_us
        if spin is None:
            spin = 20.0 if size <= len(os.sched_getaffinity(0)) else 0.0
        if survivors_of is None:
            self._seg = Segment.setup(store, rank, size, opts.slot_bytes, mbox, self.timeout)
        else:  # they held one segment and checked all this: no store round (`reconfigured`)
            old, survivors = survivors_of
            if len(survivors) != size:
                raise ValueError(f"rank {rank}: {size} ranks but survivors {survivors}")
            # read from the old one's records, which outlive its mapping (closed meanwhile)
            known = {**old._flags.identity, old.rank: (os.getpid(), pid_start_time(os.getpid()))}
            identities = [known[r] for r in survivors]
            self._seg = Segment.setup_successor(
                old._seg_name, identities, store.prefix, rank, opts.slot_bytes, mbox,
                self.timeout,
            )
        self._seg_name = self._seg.name
        self._flags = PeerFlags(
            self._seg, rank, self.timeout.total_seconds(), spin, opts.yield_us,
            crowd_check=opts.spin_us is None,
        )
        u8 = torch.frombuffer(self._seg.mm, dtype=torch.uint8)
        self._schedules = SegmentSchedules(
            self._flags, self._seg.layout, u8, one_shot, reduce, compiled=opts.compiled
        )
        self._v = self._schedules.v
        self._v_fits = self._v.fits()  # a v-call's header leaves every peer room in a slot
        self._p2p: dict[tuple[str, int], OrderedExecutor] = {}
        self._mailboxes: Mailboxes | None = None
        self._broken: BaseException | None = None
        # every element is summed in rank order whatever its place (layout free); a
        # PremulSum is folded into the compiled core's reduction (float32/float64)
        premul = frozenset(d for d in PREMUL_KINDS if self._schedules.fuses_premul(d))
        # the schedules reduce the bitwise ops and the extra dtypes with torch ops over typed
        # slot views (the default reduction; a custom one, ipc's kernel, may not cover them)
        self.capabilities = Capabilities(
            layout_free=True, premul_dtypes=premul, extended_reductions=reduce is None,
            shared_buckets=frozenset({"cpu"}) if reduce is None else frozenset(),
            tagged_p2p=True, sees_lost_peers=True,
        )
        self._regions = 0  # bucket regions made: each its own store keys
        self._live_regions: weakref.WeakSet[ShmBucketRegion] = weakref.WeakSet()
        self._reduce = reduce
        self._pid = os.getpid()
        _LIVE.add(self)

    def _check_peers(self, store: Store, rank: int, size: int, mine: list) -> None:
        """The ranks share a host and agree on the protocol's sizes, checked once here (a
        store round): a per-rank FASTCOMM_SHM_* value would otherwise pick different
        algorithms."""
        everyone = store.all_gather_object("shm/hosts", rank, size, mine, self.timeout)
        hosts = [entry[0] for entry in everyone]
        if len(set(hosts)) > 1:
            raise FastcommError(
                f"rank {rank}: the shm communicator needs every rank on one host, got hosts "
                f"{dict(enumerate(hosts))}; use the 'hier' or 'gloo' backend"
            )
        for name, k in (("slot_bytes", 1), ("mbox_bytes", 2), ("one_shot_max", 3)):
            values = {r: entry[k] for r, entry in enumerate(everyone)}
            if len(set(values.values())) > 1:
                raise FastcommError(
                    f"rank {rank}: the shm ranks disagree on {name}: {values} (rank: bytes); "
                    f"every rank must pass the same ShmOptions / FASTCOMM_SHM_* values"
                )

    @property
    def device(self) -> torch.device:
        """CPU: the tensors this communicator moves itself (CUDA ones take its fallback)."""
        return torch.device("cpu")

    def reconfigured(
        self, store: Store, rank: int, size: int, *, spans_hosts: bool = False,
        survivors: list[int] | None = None,
    ) -> Communicator:
        """As :meth:`Communicator.reconfigured`. Given `survivors` (a shrink: every new member
        holds this communicator, their ranks here in new-rank order) on one host, the
        successor's segment is made from what they share, without a store round: its name
        follows from the new rank 0's identity recorded here and the successor's namespace
        (``Segment.setup_successor``), and the host and sizes were checked at this one's
        setup."""
        return type(self).for_new_members(store, rank, size, self.timeout, old=self,
                                          spans_hosts=spans_hosts, survivors=survivors)

    @classmethod
    def for_new_members(
        cls, store: Store, rank: int, size: int, timeout: timedelta, *,
        old: Communicator | None = None, spans_hosts: bool = False,
        survivors: list[int] | None = None,
    ) -> Communicator:
        """shm over new members of this host, with ``old``'s options (the environment's for a
        rank that joins them, as ``old``'s were) and no Gloo fallback, the same on every
        member; ``hier`` where they span hosts (a node joined from another host). With
        `survivors` (see :meth:`reconfigured`) its segment is made without a store round."""
        if spans_hosts:
            from ..hier import HierCommunicator

            return HierCommunicator.for_new_members(store, rank, size, timeout)
        from ..world import new_communicator  # world imports every backend

        return new_communicator(
            cls.backend, store=store, rank=rank, size=size, timeout=timeout, fallback=False,
            options=None if old is None else old.options,
            survivors_of=None if old is None or survivors is None else (old, list(survivors)),
        )

    @property
    def broken(self) -> BaseException | None:
        """The error this communicator failed with (a failed operation, :meth:`abort`): every
        later call raises; ``None`` while it works."""
        return self._broken

    @property
    def segment_name(self) -> str:
        """The segment's name under ``/dev/shm`` while it was being set up."""
        return self._seg.name

    def bucket_region(
        self, area_bytes: int, max_buckets: int, cap_bytes: int | None = None,
        device: torch.device | str = "cpu",
    ) -> ShmBucketRegion | str:
        """Shared DDP bucket memory over this communicator's ranks (``capabilities.
        shared_buckets``; a collective: every rank calls it with the same arguments).

        Args:
            area_bytes: bytes of each rank's area (a multiple of 4096).
            max_buckets: the most buckets the region will hold.
            cap_bytes: the most bytes of ``/dev/shm`` the region may take (``None``: no cap).
            device: where the buckets live: CPU only.

        Returns:
            The region (:class:`~.buckets.ShmBucketRegion`), or on every rank the reason it was
            not made (over the cap, ``/dev/shm`` too small): the caller keeps its own buffers.
        """
        if torch.device(device).type != "cpu":
            raise ValueError(
                f"{self._where()}: shm hands out bucket memory on cpu only, got {device}"
            )
        self._check_open("bucket_region")
        self._regions += 1
        opts = self.options
        spin = opts.spin_us
        if spin is None:
            spin = 20.0 if self.size <= len(os.sched_getaffinity(0)) else 0.0
        region = ShmBucketRegion.setup(
            self.store, f"shm/buckets/{self._regions}", self.rank, self.size, area_bytes,
            max_buckets, self.timeout, cap_bytes=cap_bytes, spin_us=spin,
            yield_us=opts.yield_us,
        )
        if not isinstance(region, str):
            self._live_regions.add(region)  # closed with the communicator: peers fail fast
            region.comm_stats = self.stats  # the buckets' bytes count among this one's
        return region

    def _new_child(self, store: Store, rank: int, size: int, timeout: timedelta):
        return ShmCommunicator(store, rank, size, timeout, options=self.options,
                               reduce=self._reduce)

    @property
    def mailboxes(self) -> Mailboxes:
        """The tagged send/recv engine (``p2p``: tags, any-source receives, one progress loop
        for many operations), built on first use; the torch backend's point-to-point runs on
        it. It shares the mailbox streams with :meth:`send`/:meth:`recv`: use one or the
        other on a communicator."""
        engine = self._mailboxes
        if engine is None:
            engine = self._mailboxes = Mailboxes(
                self._schedules.streams, self.timeout.total_seconds(), self._abort
            )
        return engine

    # ------------------------------------------------------------------ execution
    def _p2p_executor(self, kind: str, peer: int) -> OrderedExecutor:
        """The executor of sends to (``kind="send"``) or receives from ``peer``: one of its own,
        so a blocked send never stalls a collective or another peer's traffic."""
        executor = self._p2p.get((kind, peer))
        if executor is None:
            name = f"fastcomm-shm-r{self.rank}-{kind}{peer}"
            executor = self._p2p[(kind, peer)] = OrderedExecutor(name, self.rank, self._run_task)
        return executor

    def _run_task(self, task: Task, start: float) -> None:
        """Runs ``task`` unless this communicator failed or closed meanwhile; a failure marks
        this rank ABORTED (see :meth:`_abort`)."""
        if self._broken is not None:
            raise CommAbortedError(
                f"rank {self.rank}: {task.op} refused: this shm communicator failed earlier "
                f"({self._broken})"
            )
        if self._closed:
            raise CommClosedError(
                f"{self._where()}: {task.op} was pending when close() was called"
            )
        try:
            task.run()
        except BaseException as exc:
            self._abort(task.op, start, exc)

    def _abort(self, op: str, start: float, exc: BaseException) -> None:
        """Marks this rank ABORTED (peers then fail fast) and raises ``exc``, wrapped; a
        ``SizesDisagreement`` passes unchanged and aborts nothing (every rank raised after the
        same round: the segment is still in step)."""
        if isinstance(exc, SizesDisagreement):
            raise exc
        error = wrap_error(op, self.rank, start, exc) if isinstance(exc, Exception) else exc
        self._broken = error
        self._flags.mark(ABORTED, f"{op} failed: {type(exc).__name__}: {exc}")
        if error is exc:
            raise exc
        raise error from exc

    # ------------------------------------------------------------------ collectives
    # Every op has one entry in the schedules, named after it, taking the op's arguments and
    # the time the call began: the entry itself takes the compiled core (one C call when the
    # call fits one slot and the peers are there) or the Python rounds. A blocking call with
    # nothing queued before it runs the entry on the caller's thread with no task or Work built:
    # below a few KiB that bookkeeping would cost as much as moving the bytes. (Routing sends
    # only CPU tensors here; a tensor subclass takes the task.)
    def _collective(self, name: str, entry, tensor: torch.Tensor | None, blocking: bool,
                    *args) -> Task | None:
        """Runs the schedules' ``entry`` for op ``name`` with ``args`` and the start time: on
        the caller's thread when the call blocks and nothing is queued (a failure aborts the
        communicator), else as a task on the executor (`tensor`: the one its Work reports)."""
        if (blocking and not self._executor.busy and self._broken is None
                and (tensor is None or type(tensor) is torch.Tensor)):
            start = time.monotonic()
            try:
                entry(*args, start)
            except BaseException as exc:
                self._abort(name, start, exc)
            return None
        return self._task(name, tensor, lambda: entry(*args, time.monotonic()))

    def _impl_all_reduce(self, tensor: torch.Tensor, op: ReduceOp | PremulSum,
                         blocking: bool = False) -> Task | None:
        return self._collective("all_reduce", self._schedules.all_reduce, tensor, blocking,
                                tensor, op)

    def _impl_reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp,
                     blocking: bool = False) -> Task | None:
        return self._collective("reduce", self._schedules.reduce, tensor, blocking,
                                tensor, root, op)

    def _impl_broadcast(self, tensor: torch.Tensor, src: int,
                        blocking: bool = False) -> Task | None:
        return self._collective("broadcast", self._schedules.broadcast, tensor, blocking,
                                tensor, src)

    def _impl_all_gather(self, output: torch.Tensor, input: torch.Tensor,
                         blocking: bool = False) -> Task | None:
        return self._collective("all_gather", self._schedules.all_gather, output, blocking,
                                output, input)

    def _impl_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                             blocking: bool = False) -> Task | None:
        return self._collective("reduce_scatter", self._schedules.reduce_scatter, output,
                                blocking, output, input, op)

    def _impl_all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                         blocking: bool = False) -> Task | None:
        return self._collective("all_to_all", self._schedules.all_to_all, output, blocking,
                                output, input)

    def _impl_barrier(self, blocking: bool = False) -> Task | None:
        return self._collective("barrier", self._schedules.barrier, None, blocking)

    # ------------------------------------------------------------------ point to point
    # A blocking send or recv runs on the caller's thread, with no Work or task built, when
    # nothing is pending on that peer's executor of its kind (so messages keep their issue
    # order); any size, as the executor would run it there.
    def _impl_send(self, tensor: torch.Tensor, dst: int, blocking: bool = False) -> Task | None:
        return self._p2p_op("send", self._schedules.send, tensor, dst, blocking)

    def _impl_recv(self, tensor: torch.Tensor, src: int, blocking: bool = False) -> Task | None:
        return self._p2p_op("recv", self._schedules.recv, tensor, src, blocking)

    def _p2p_op(self, kind: str, entry, tensor: torch.Tensor, peer: int,
                blocking: bool) -> Task | None:
        """A send or recv (``kind``; ``entry``: its schedule) of ``tensor`` with ``peer``."""
        if blocking and self._broken is None and type(tensor) is torch.Tensor:
            executor = self._p2p.get((kind, peer))
            if executor is None or not executor.busy:
                start = time.monotonic()
                try:
                    entry(tensor, peer, start)
                except BaseException as exc:
                    self._abort(kind, start, exc)
                return None
        return Task(kind, tensor, lambda: entry(tensor, peer, time.monotonic()),
                    self._p2p_executor(kind, peer))

    # ------------------------------------------------------------------ unequal sizes
    # A blocking v-call with nothing queued runs on the caller's thread (as the collectives
    # above); a failure aborts the communicator's v-calls (`_abort`), but a disagreement
    # leaves it usable (every rank raised after the same round). More ranks than a slot has
    # headers for take the contract's default v-call.
    def _impl_v_call(self, kind: VKind, root: int, outputs: list, inputs: list,
                     blocking: bool = False) -> Task | None:
        if not self._v_fits:
            return super()._impl_v_call(kind, root, outputs, inputs)
        run = self._v.run
        if blocking and not self._executor.busy and self._broken is None:
            start = time.monotonic()
            try:
                run(kind, root, outputs, inputs)
            except BaseException as exc:
                self._abort(kind, start, exc)
            return None
        return self._task(kind, outputs[self.rank], lambda: run(kind, root, outputs, inputs))

    def _impl_gather(self, input: torch.Tensor, outputs: list | None, root: int,
                     blocking: bool = False) -> Task | None:
        if blocking and self._rooted_lane("gather", input, outputs, root):
            return None
        return super()._impl_gather(input, outputs, root, blocking)

    def _impl_scatter(self, output: torch.Tensor, inputs: list | None, root: int,
                      blocking: bool = False) -> Task | None:
        if blocking and self._rooted_lane("scatter", output, inputs, root):
            return None
        return super()._impl_scatter(output, inputs, root, blocking)

    def _rooted_lane(self, kind: VKind, mine: torch.Tensor, theirs: list | None,
                    root: int) -> bool:
        """A gather or scatter (``kind``) done on the caller's thread where nothing is queued,
        with no list of pieces made (``VSchedule.run_rooted``); ``False``, having done
        nothing, otherwise."""
        if not self._v_fits or self._executor.busy or self._broken is not None:
            return False
        start = time.monotonic()
        try:
            self._v.run_rooted(kind, root, mine, theirs)
        except BaseException as exc:
            self._abort(kind, start, exc)
        return True

    def _impl_all_to_all_split(self, output: torch.Tensor, input: torch.Tensor,
                               output_splits: list[int], input_splits: list[int],
                               byte_splits: tuple[list[int], list[int]],
                               blocking: bool = False) -> Task | None:
        if blocking and self._v_fits and not self._executor.busy and self._broken is None:
            start = time.monotonic()  # the pieces' offsets: no view made
            try:
                self._v.run_split(output, input, *byte_splits)
            except BaseException as exc:
                self._abort("all_to_all", start, exc)
            return None
        return super()._impl_all_to_all_split(output, input, output_splits, input_splits,
                                              byte_splits, blocking)

    # ------------------------------------------------------------------ lifetime
    def abort(self, error: BaseException) -> None:
        """Fails this communicator from any thread: this rank is marked ABORTED (its peers' waits
        fail at once), its own waits raise ``CommClosedError`` within a sleep slice and later
        calls raise ``error``; the mapping stays until :meth:`close`."""
        if self._broken is not None or self._closed or os.getpid() != self._pid:
            return
        self._broken = error
        self._flags.mark(ABORTED, f"aborted: {error}")

    def _impl_close(self) -> None:
        _LIVE.discard(self)
        if os.getpid() != self._pid:
            return  # a forked child: the mapping and the rank's state belong to the parent
        if self._broken is None:
            self._flags.mark(CLOSED, "closed")
        for region in list(self._live_regions):
            region.close()
        executors = [self._executor, *self._p2p.values()]
        stopped = all([executor.close(timeout=5.0) for executor in executors])
        if self._mailboxes is not None:
            stopped = self._mailboxes.close(timeout=5.0) and stopped
        if stopped:  # no thread can touch the mapping any more: unmap it now
            self._schedules = self._v = None
            self._flags.release()
            self._seg.close()


@atexit.register
def _close_all() -> None:
    """Marks this process's communicators closed at exit, so peers fail fast, not by timeout."""
    for comm in list(_LIVE):
        if comm._pid != os.getpid():
            continue  # inherited through fork(): the parent still uses it
        try:
            comm.close()
        except Exception:  # exiting anyway; never mask the interpreter's own exit status
            pass

