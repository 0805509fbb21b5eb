"""``fastcomm.init()``: the process-wide communicator, set up from the launcher's environment.

``init`` reads the rank layout through :mod:`.launch_env` (torchrun's variables, else srun's,
MPICH's or Open MPI's), agrees on it across ranks, finds or serves the ``TCPStore`` (or, with
``FASTCOMM_STORE=etcd://...``, uses the job's keys in etcd) and picks
a backend: ``FASTCOMM_BACKEND``, else ``nccl`` where every local rank can own a GPU, else
``ipc`` where local ranks share GPUs, else ``shm``/``hier``/``gloo`` from the host layout.
:func:`new_communicator` is the one place that builds backends and their parts.

Invariants: the ranks exchange their host and local layout once, and a layout that cannot be
right raises the same :class:`~.launch_env.LaunchEnvError` on every rank; an initialized
``torch.distributed`` lends its store under the prefix ``fastcomm/`` (no second bind).

The selection rules in full: docs/architecture.md.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from .. import settings
from . import flight_watch
from .base import Communicator
from .hier import HierCommunicator
from .launch_env import LaunchEnv, LaunchEnvError, detect, missing_master, read_master
from .nccl import NcclCommunicator, cupy_nccl, nccl_version
from .pg.gloo import GlooCommunicator
from .pg.torch_pg import TorchPGCommunicator, group_store
from .shm import ShmCommunicator, ShmOptions, shm_available
from .store import DEFAULT_TIMEOUT, Store, as_timedelta, store_from_env
from .topology import HostLayout, host_id

__all__ = [
    "init", "get_world", "shutdown", "new_communicator", "communicator_for", "is_initialized",
    "BACKENDS", "NcclFit", "nccl_fit", "cuda_device_count", "detected_nccl_version",
    "group_communicator", "for_new_members", "replace_world",
]

BACKENDS = settings.BACKEND.choices

SHARED_GPU_MIN_NCCL = (2, 30)
"""First NCCL release that accepts several ranks of one communicator on one GPU (with
``NCCL_MULTI_RANK_GPU_ENABLE=1``); earlier ones fail with "Duplicate GPU detected"."""

logger = logging.getLogger("fastcomm")

# group -> its shm communicator (None: the group's ranks are not all on this host), one per
# group for every DDP of the process; an entry goes when its group is garbage collected
_LOCAL_SHM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_WORLD: Communicator | None = None
_WORLD_STORE: Store | None = None
_INIT_COUNT = 0


def cuda_device_count() -> int:
    """CUDA devices this process can use (0 without CUDA): the one place ``init`` reads it."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:  # a broken driver counts as no device
        return 0


def detected_nccl_version() -> tuple[int, int, int] | None:
    """Version of the libnccl fastcomm's NCCL backend would call (``None``: CuPy's NCCL does not
    load): the one place ``init`` reads it."""
    return nccl_version()


@dataclass(frozen=True, slots=True)
class NcclFit:
    """Whether NCCL can place this host's ranks on its GPUs, and why (see :func:`nccl_fit`)."""

    ok: bool
    """NCCL can work: every local rank owns a GPU, or the ranks may share GPUs."""
    shared: bool
    """Ranks share GPUs (rank ``LOCAL_RANK`` takes device ``LOCAL_RANK % device_count``)."""
    device_count: int
    """CUDA devices present."""
    reason: str
    """One sentence for logs and skip reasons."""


def _version_str(version: tuple[int, int, int] | None) -> str:
    return "not loadable" if version is None else ".".join(map(str, version))


def nccl_fit(
    local_rank: int,
    local_world_size: int,
    *,
    device_count: int | None = None,
    version: tuple[int, int, int] | None = None,
    env: dict[str, str] | None = None,
) -> NcclFit:
    """Whether ``local_world_size`` NCCL ranks fit on this host's GPUs.

    Args:
        local_rank: this rank's index on its host (its CUDA device when it owns one).
        local_world_size: ranks on this host.
        device_count: CUDA devices (default: :func:`cuda_device_count`).
        version: NCCL version (default: :func:`detected_nccl_version`).
        env: environment read for ``NCCL_MULTI_RANK_GPU_ENABLE`` (default: ``os.environ``).

    Returns:
        An :class:`NcclFit`; ``ok`` when each local rank owns a GPU (``local_rank`` <
        ``device_count`` and ``local_world_size`` <= it) or when NCCL >= 2.30 runs with
        ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (ranks then share GPUs).
    """
    count = cuda_device_count() if device_count is None else device_count
    if count == 0:
        return NcclFit(False, False, 0, "no CUDA device is visible")
    if version is None:
        version = detected_nccl_version()
    if version is None:
        return NcclFit(False, False, count, "CuPy's NCCL bindings (libnccl) do not load")
    env = os.environ if env is None else env
    owned = f"{local_world_size} local rank(s) on {count} CUDA device(s)"
    if local_rank < count and local_world_size <= count:
        return NcclFit(True, False, count, f"{owned}: each rank owns a GPU")
    nccl = f"NCCL {_version_str(version)}"
    if tuple(version[:2]) < SHARED_GPU_MIN_NCCL:
        why = f"{nccl} refuses ranks sharing a GPU (needs >= 2.30)"
    elif env.get("NCCL_MULTI_RANK_GPU_ENABLE", "").strip() != "1":
        why = f"{nccl} shares a GPU between ranks only with NCCL_MULTI_RANK_GPU_ENABLE=1"
    else:
        return NcclFit(True, True, count, f"{owned}: ranks share GPUs ({nccl}, "
                                          "NCCL_MULTI_RANK_GPU_ENABLE=1)")
    return NcclFit(False, False, count, f"{owned}, and {why}")


def _local_layout(world_size: int) -> tuple[int, int]:
    """``(local rank, local world size)`` from the launcher (:func:`.launch_env.detect`); a
    lone process is rank 0 of 1, and where the launcher does not say, every rank is assumed
    to be on this host."""
    launch = detect()
    local_rank = launch.local_rank
    if launch.local_world_size is None:
        return local_rank, max(world_size, local_rank + 1)
    return local_rank, launch.local_world_size


def nccl_available() -> bool:
    """Whether CUDA is visible and CuPy's NCCL bindings load."""
    if cuda_device_count() == 0:
        return False
    return cupy_nccl() is not None


def default_backend(world_size: int = 1, *, cpu_tensors: bool = False) -> str:
    """The backend ``init()`` picks before looking at hosts: ``FASTCOMM_BACKEND``, else NCCL when
    every local rank can use a GPU (:func:`nccl_fit`), else ``ipc`` where ranks share GPUs
    NCCL cannot share (:func:`shared_gpu_backend`), else ``shm`` (``ipc`` and ``shm`` narrowed
    by :func:`choose_cpu_backend` once the hosts are known).

    Args:
        world_size: ranks in the job (``LOCAL_WORLD_SIZE`` when that is unset).
        cpu_tensors: the caller's tensors live on CPU, so NCCL is never the choice.
    """
    return _pick_backend(world_size, cpu_tensors)[0]


def shared_gpu_backend(fit: NcclFit, local_world_size: int) -> str | None:
    """``"ipc"`` where NCCL cannot run the job because ranks share a GPU, else ``None``.

    Why: with two processes sharing one GPU, NCCL refuses the job ("Duplicate GPU detected")
    and Gloo stages through host memory, far slower than a kernel reading the peer's buffer
    through CUDA IPC (figures: docs/architecture.md). The ``ipc`` backend's CUDA ``all_reduce``
    is such a kernel; its other CUDA ops take the same Gloo. Where NCCL can run it stays the
    choice.
    """
    if fit.ok or fit.device_count == 0 or local_world_size <= fit.device_count:
        return None
    return "ipc"


def _pick_backend(world_size: int, cpu_tensors: bool) -> tuple[str, NcclFit | None]:
    """:func:`default_backend`, with the :class:`NcclFit` that decided it (``None`` when NCCL
    was not considered)."""
    forced = settings.BACKEND.get()
    if forced is not None:
        return forced, None
    cpu = "shm" if shm_available() else "gloo"
    if cpu_tensors:  # the caller trains on CPU: NCCL could not move its tensors
        return cpu, None
    local_rank, local_world = _local_layout(world_size)
    fit = nccl_fit(local_rank, local_world)
    if fit.ok:
        return "nccl", fit
    shared = shared_gpu_backend(fit, local_world) if cpu == "shm" else None
    return shared or cpu, fit


def _say_choice(backend: str, fit: NcclFit | None) -> None:
    """One log line on the automatic choice where GPUs are present: which backend, and why."""
    if fit is None or fit.device_count == 0:
        return  # no GPU: nothing surprising to explain
    if backend == "nccl":
        logger.info("fastcomm.init: backend nccl (%s)", fit.reason)
    elif backend == "ipc":
        logger.warning(
            "fastcomm.init: backend ipc (CUDA all_reduce by kernels over CUDA IPC, other CUDA "
            "ops through Gloo), not nccl: %s", fit.reason,
        )
    else:
        logger.warning(
            "fastcomm.init: backend %s on CPU tensors, not nccl: %s", backend, fit.reason
        )


def _check_nccl_device(rank: int, world_size: int, device) -> int | torch.device:
    """The device an explicit ``backend="nccl"`` will use, or a clear error before any
    collective when it cannot work."""
    local_rank, local_world = _local_layout(world_size)
    fit = nccl_fit(local_rank, local_world)
    count = fit.device_count
    if device is None:
        device = local_rank % count if fit.shared else local_rank
    index = device if isinstance(device, int) else torch.device(device).index
    if count == 0 or (index is not None and index >= count) or not fit.ok:
        asked = "the current device" if index is None else f"CUDA device {index}"
        raise RuntimeError(
            f"rank {rank} (LOCAL_RANK={local_rank} of {local_world}): backend='nccl' asked for "
            f"{asked}, but this process sees {count} CUDA device(s) ({fit.reason}); use "
            f"backend=None (picks a CPU backend), fewer ranks per node, or NCCL >= 2.30 with "
            f"NCCL_MULTI_RANK_GPU_ENABLE=1"
        )
    return device


def new_communicator(
    backend: str,
    *,
    store: Store,
    rank: int,
    size: int,
    timeout: float | timedelta | None = None,
    device: torch.device | int | None = None,
    fallback: bool = True,
    options: ShmOptions | None = None,
    watch: bool = True,
    survivors_of: tuple[Communicator, list[int]] | None = None,
) -> Communicator:
    """Builds a communicator of ``backend`` on ``store`` (a namespace private to it), with the
    parts it composes: the one place that builds backends.

    - ``gloo``, ``nccl``: alone.
    - ``shm``: with a Gloo fallback for CUDA tensors (unless ``fallback=False``).
    - ``hier``: this host's ``shm``, the leaders' Gloo and a flat Gloo over every rank (its
      fallback), from the ranks' host layout (a store exchange).
    - ``ipc``: a ``shm`` communicator reducing with the ``peer_reduce`` kernel, and a Gloo
      fallback for CUDA ops other than ``all_reduce`` (unless ``fallback=False``).

    Sub-communicators (``split``) are built the same way (the communicator's ``make_child``).

    Args:
        backend: one of :data:`BACKENDS`.
        store, rank, size, timeout: as for every communicator.
        device: NCCL's CUDA device.
        fallback: build the Gloo fallback of ``shm`` and ``ipc``.
        options: the shared-memory tuning of ``shm``, ``ipc`` and ``hier``'s host part.
        watch: give it the flight thread's heartbeat, dumps and early warning
            (:mod:`.flight_watch`); its sub-communicators are recorded, not watched.
        survivors_of: ``shm`` only: ``(old, ranks)``, the shm communicator these ranks of it
            survive (``ShmCommunicator.reconfigured``): its segment is made without a store
            round.

    Raises:
        ValueError: unknown backend.
    """
    timeout = as_timedelta(timeout, DEFAULT_TIMEOUT)

    def gloo(at: Store) -> GlooCommunicator:
        return GlooCommunicator(at, rank, size, timeout)

    if backend == "gloo":
        comm = gloo(store)
    elif backend == "nccl":
        comm = NcclCommunicator(store, rank, size, timeout, device=device)
    elif backend == "shm":
        side = gloo(store.prefixed("fallback")) if fallback else None
        comm = ShmCommunicator(store, rank, size, timeout, options=options, fallback=side,
                               survivors_of=survivors_of)
    elif backend == "hier":
        comm = _build_hier(store, rank, size, timeout, options)
    elif backend == "ipc":
        # deliberately lazy: ipc loads Triton (its peer_reduce kernel), which no other backend
        # needs, so only a job that picks ipc pays for it
        from .ipc import IpcCommunicator, cpu_reduction

        reduce = cpu_reduction()  # before any setup: a misconfigured FASTCOMM_KERNELS raises
        cpu = ShmCommunicator(
            store.prefixed("cpu"), rank, size, timeout, options=options, reduce=reduce
        )
        side = gloo(store.prefixed("fallback")) if fallback else None
        comm = IpcCommunicator(store, rank, size, timeout, cpu=cpu, fallback=side)
    else:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)} or None")
    comm.make_child = partial(_child, backend, device, fallback, options)
    if watch:
        flight_watch.watch(comm)
    return comm


def for_new_members(
    backend: str,
    *,
    store: Store,
    rank: int,
    size: int,
    timeout: float | timedelta | None = None,
    spans_hosts: bool = False,
) -> Communicator:
    """The communicator that the members holding one of kind ``backend`` (a communicator's
    ``backend``: one of :data:`BACKENDS`, or ``"torch"``) build with its ``reconfigured``, for
    a rank that joins them holding none (``fastcomm.ddp.regrow``); arguments as there.

    Raises:
        ValueError: unknown backend.
    """
    if backend == "ipc":
        from .ipc import IpcCommunicator as kind  # lazy: it loads Triton (new_communicator)
    else:
        kinds = {"gloo": GlooCommunicator, "nccl": NcclCommunicator, "shm": ShmCommunicator,
                 "hier": HierCommunicator, "torch": TorchPGCommunicator}
        if backend not in kinds:
            raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}, "
                             "torch")
        kind = kinds[backend]
    return kind.for_new_members(
        store, rank, size, as_timedelta(timeout, DEFAULT_TIMEOUT), spans_hosts=spans_hosts
    )


def replace_world(
    old: Communicator, new: Communicator, first_members: tuple[int, ...] | None = None
) -> None:
    """Records that ``new`` replaces ``old`` (in-place recovery's shrink, a regrow): from now
    on :func:`get_world` returns ``new`` where it returned ``old``, ``old.replaced_by`` names
    ``new`` (a comm hook's state made with ``old`` follows the line:
    ``fastcomm.ddp.hooks.default.successor``), and ``new.first_members`` keeps the global torch
    ranks of the line's first communicator (``first_members`` where ``old`` is the first: a
    torch group of those ranks stands for the line, ``hooks.default.hook_comm``)."""
    global _WORLD
    old.replaced_by = new
    new.first_members = getattr(old, "first_members", first_members)
    if _WORLD is old:
        _WORLD = new


def _child(backend, device, fallback, options, store, rank, size, timeout) -> Communicator:
    """A sub-communicator of a ``backend`` communicator (its ``make_child``)."""
    return new_communicator(
        backend, store=store, rank=rank, size=size, timeout=timeout, device=device,
        fallback=fallback, options=options, watch=False,
    )


def _build_hier(
    store: Store, rank: int, size: int, timeout: timedelta, options: ShmOptions | None
) -> HierCommunicator:
    """``hier``'s parts, from the host layout (see :mod:`fastcomm.comm.hier`)."""
    layout = HostLayout.exchange(store, "hier/hosts", rank, size, timeout)
    local = layout.local
    intra = leaders = None
    if len(local) > 1:
        intra = ShmCommunicator(
            store.prefixed(f"hier/host{layout.host}", rank=layout.local_rank),
            layout.local_rank, len(local), timeout, options=options,
        )
    if layout.is_leader and layout.num_hosts > 1:
        leaders = GlooCommunicator(
            store.prefixed("hier/leaders", rank=layout.host), layout.host, layout.num_hosts,
            timeout,
        )
    flat = GlooCommunicator(store.prefixed("hier/world"), rank, size, timeout)
    return HierCommunicator(
        store, rank, size, timeout, layout=layout, intra=intra, leaders=leaders, flat=flat
    )


def communicator_for(
    store: Store,
    rank: int,
    size: int,
    timeout: float | timedelta | None = None,
    *,
    backend: str | None = None,
    device: torch.device | int | None = None,
    launch: LaunchEnv | None = None,
) -> Communicator:
    """The communicator :func:`init` would build on ``store`` for these ranks.

    A collective call: every rank calls it with its own ``rank``. With ``backend=None`` the
    choice follows the module docstring (``FASTCOMM_BACKEND``, NCCL where every local rank
    owns a GPU and ``device`` is not CPU, ``ipc`` where ranks share GPUs, else by host layout:
    ``shm``, ``hier`` or ``gloo``).

    Args:
        store: a namespace private to the communicator, the same on every rank.
        rank: this process's rank in ``[0, size)``.
        size: number of ranks.
        timeout: limit for setup and for every collective.
        backend: a backend name, or ``None`` to choose.
        device: where this rank's tensors live (see :func:`init`).
        launch: the launcher's layout of these ranks, checked across them (the world's
            communicator; ``None`` for a subgroup, whose layout the launcher does not know).

    Raises:
        ValueError: unknown backend, or ``backend="nccl"`` with a CPU ``device``.
        LaunchEnvError: ``launch`` cannot be right (on every rank, naming the ranks).
        RuntimeError: ``backend="nccl"`` where this rank cannot have a GPU.
    """
    plan = _plan(rank, size, backend, device)
    return _build_planned(store, rank, size, timeout, plan, launch)


@dataclass(frozen=True, slots=True)
class _Plan:
    """A backend choice made before any store exchange (see :func:`_plan`)."""

    backend: str
    device: torch.device | int | None
    fit: NcclFit | None
    by_hosts: bool  # an automatic shm/ipc, still to be narrowed by the host layout


def _plan(rank: int, size: int, backend: str | None, device) -> _Plan:
    """The backend and device :func:`communicator_for` will build, checked before anything
    connects (so a bad request fails fast, naming the rank)."""
    # only an automatic choice of shm is narrowed by host layout; an explicit or forced one is kept
    auto = backend is None and not settings.BACKEND.is_set()
    cpu_tensors = device is not None and not isinstance(device, int) and (
        torch.device(device).type == "cpu"
    )
    fit = None
    if backend is None:
        backend, fit = _pick_backend(size, cpu_tensors)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)} or None")
    if backend == "nccl" and cpu_tensors:
        raise ValueError(f"rank {rank}: backend='nccl' moves CUDA tensors, got device={device!r}")
    if backend == "nccl":
        device = _check_nccl_device(rank, size, device)
    return _Plan(backend, device, fit, auto and backend in ("shm", "ipc") and size > 1)


def _build_planned(
    store: Store, rank: int, size: int, timeout, plan: _Plan, launch: LaunchEnv | None = None
) -> Communicator:
    timeout = as_timedelta(timeout, DEFAULT_TIMEOUT)
    backend = plan.backend
    hosts = None
    if launch is not None and size > 1:
        hosts = agree_on_layout(store, "init/layout", rank, size, timeout, launch)
    if plan.by_hosts:
        if hosts is None:
            hosts = HostLayout.exchange(store, "init/hosts", rank, size, timeout)
        by_hosts = hosts.backend()
        backend = by_hosts if by_hosts != "shm" else backend  # ipc, like shm, needs one host
    _say_choice(backend, plan.fit)
    return new_communicator(
        backend, store=store, rank=rank, size=size, timeout=timeout, device=plan.device
    )


def agree_on_layout(
    store: Store, key: str, rank: int, size: int, timeout: timedelta, launch: LaunchEnv
) -> HostLayout:
    """Every rank's host and its launcher's local layout, gathered once through ``store``.

    A collective call. Each rank's own problem (:meth:`LaunchEnv.problem`) travels with it,
    so a rank with a bad layout still answers and every rank raises the same error instead of
    waiting for it; so does a host whose ranks disagree with each other or with their count.

    Raises:
        LaunchEnvError: naming each rank or host whose layout cannot be right.
    """
    mine = [host_id(), launch.local_rank, launch.local_world_size, launch.problem()]
    rows = store.all_gather_object(key, rank, size, mine, timeout)
    problems = [f"rank {r}: {row[3]}" for r, row in enumerate(rows) if row[3]]
    names = list(dict.fromkeys(row[0] for row in rows))
    for name in names:
        problems += _host_problems(name, [(r, row) for r, row in enumerate(rows)
                                          if row[0] == name])
    if problems:
        # the store's server may be rank 0's: it leaves only once every rank has read the rows
        store.set(f"{key}/read/{rank}", b"1")
        if rank == 0:
            store.wait([f"{key}/read/{r}" for r in range(size)], timeout, op="agree_on_layout")
        raise LaunchEnvError(
            f"rank {rank}: the {launch.launcher} layout of this job cannot be right (every "
            f"rank raises this): " + "; ".join(problems)
        )
    return HostLayout(rank, tuple(names.index(row[0]) for row in rows))


def _host_problems(name: str, members: list[tuple[int, list]]) -> list[str]:
    """What is wrong with one host's local layout (its ranks' ``[host, local rank, local
    world size, problem]`` rows)."""
    declared = {row[2] for _, row in members}
    if None in declared:  # the launcher did not say: nothing to compare
        return []
    ranks = [r for r, _ in members]
    host = name.split("/")[0]
    said = ", ".join(f"rank {r}: local rank {row[1]} of {row[2]}" for r, row in members)
    if declared != {len(members)}:
        return [f"host {host} runs {len(members)} rank(s) {ranks} but they say ({said})"]
    if sorted(row[1] for _, row in members) != list(range(len(members))):
        return [f"host {host}'s local ranks are not 0..{len(members) - 1} ({said})"]
    return []


def _rendezvous(launch: LaunchEnv | None, rank: int, world_size: int) -> tuple[str, int]:
    """Where the world's store listens (``MASTER_ADDR`` defaults to loopback under torchrun's
    variables); raises naming what the launcher left unset."""
    if launch is None:  # the caller numbered the ranks: only MASTER_* come from the environment
        launch = LaunchEnv("torchrun", rank, world_size, 0, None, *read_master(os.environ), "")
    addr, port = launch.master_addr, launch.master_port
    if world_size > 1 and (port is None or (addr is None and launch.launcher != "torchrun")):
        raise LaunchEnvError(f"rank {rank}: {missing_master(launch)}")
    return addr or "127.0.0.1", port or 0


def init(
    backend: str | None = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    store: Store | None = None,
    device: torch.device | int | None = None,
) -> Communicator:
    """Creates the world communicator (once per process) and returns it.

    Args:
        backend: ``"nccl"``, ``"gloo"``, ``"shm"``, ``"hier"``, ``"ipc"`` or ``None`` (NCCL
            when every local rank can use a GPU, ``ipc`` when ranks share GPUs NCCL cannot
            share, else ``shm``/``hier``/``gloo`` by host layout; see the module docstring).
        timeout: limit for rendezvous and for every collective.
        rank: overrides ``RANK`` (default 0 when unset and ``world_size`` is 1).
        world_size: overrides ``WORLD_SIZE`` (default 1).
        store: an existing store namespace to build on, instead of the environment's.
        device: where this rank's tensors live. A CUDA device (or index) is NCCL's device
            (default ``LOCAL_RANK``, or ``LOCAL_RANK % devices`` where ranks share GPUs);
            ``"cpu"`` keeps ``backend=None`` off NCCL even where every rank has a GPU.

    Returns:
        The communicator, also returned later by :func:`get_world`.

    Raises:
        RuntimeError: ``init`` was already called (call ``shutdown()`` first).
        ValueError: malformed environment or unknown backend.
        RuntimeError: ``backend="nccl"`` where this rank has no GPU of its own and NCCL does
            not allow sharing one (names the rank, the device asked for and those present).
    """
    global _WORLD, _WORLD_STORE, _INIT_COUNT
    if _WORLD is not None:
        raise RuntimeError("fastcomm.init() was already called; call fastcomm.shutdown() first")
    launch = detect() if rank is None or world_size is None else None
    world_size = launch.world_size if world_size is None else world_size
    rank = launch.rank if rank is None else rank
    if not 0 <= rank < world_size:
        where = f" ({launch.describe()})" if launch is not None else ""
        raise ValueError(f"RANK={rank} out of range for WORLD_SIZE={world_size}{where}")
    if launch is not None and (launch.rank, launch.world_size) != (rank, world_size):
        launch = None  # the caller's own numbering: the launcher's local layout may not fit it
    plan = _plan(rank, world_size, backend, device)
    if store is None:
        if dist.is_available() and dist.is_initialized():
            base = Store(
                timeout=timeout,
                rank=rank,
                _base=dist.PrefixStore("fastcomm", dist.distributed_c10d._get_default_store()),
                _root=dist.distributed_c10d._get_default_store(),
                prefix="fastcomm",
            )
        elif (etcd := store_from_env(timeout=timeout, rank=rank)) is not None:
            base = etcd  # FASTCOMM_STORE=etcd://...: no rank serves the store
        else:
            host, port = _rendezvous(launch, rank, world_size)
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            base = Store(
                host,
                port,
                is_server=(rank == 0 and not agent_store),
                timeout=timeout,
                rank=rank,
            )
        _WORLD_STORE = base
        _INIT_COUNT += 1
        store = base.prefixed(f"fastcomm/world{_INIT_COUNT}", rank=rank)
    if settings.RECOVER_JOIN.get():  # a replacement: DDP joins the running ranks
        _WORLD = _joining(store, timeout)
        return _WORLD
    try:
        _WORLD = _build_planned(store, rank, world_size, timeout, plan, launch)
        if _WORLD.flight is not None:
            _WORLD.flight.name = "world"
    except BaseException:
        _WORLD_STORE = None  # a failed init keeps no server port or connection open
        raise
    return _WORLD


def _joining(store: Store, timeout) -> Communicator:
    """A replacement's stand-in world (``fastcomm-run --recover in-process``): a communicator
    of this rank alone, carrying the running ranks' world store (``join_store``) where
    ``fastcomm.ddp``'s recovery admits it and replaces it."""
    backend = "shm" if shm_available() else "gloo"
    comm = new_communicator(backend, store=store.prefixed(f"joiner/{os.getpid()}", rank=0),
                            rank=0, size=1, timeout=timeout, fallback=False)
    comm.join_store = store
    return comm


def get_world() -> Communicator:
    """The communicator made by :func:`init`.

    Raises:
        RuntimeError: ``init`` has not been called.
    """
    if _WORLD is None:
        raise RuntimeError("fastcomm.get_world() called before fastcomm.init()")
    return _WORLD


def is_initialized() -> bool:
    """Whether :func:`init` has made the world communicator (and no :func:`shutdown` since)."""
    return _WORLD is not None


def shutdown() -> None:
    """Closes the world communicator and its store connection (idempotent)."""
    global _WORLD, _WORLD_STORE
    if _WORLD is not None:
        _WORLD.close()
    _WORLD = None
    store, _WORLD_STORE = _WORLD_STORE, None
    close = getattr(getattr(store, "_root", None), "close", None)
    if close is not None:  # an etcd store: its connections, its client's lease
        close()


def group_communicator(
    process_group: dist.ProcessGroup | None = None,
    *,
    cpu_only: bool = False,
    timeout: float | timedelta | None = None,
) -> Communicator:
    """The communicator that reduces over a torch group's ranks, for code written against
    fastcomm (``fastcomm.ddp.DDP``, the comm hooks).

    - A group of the ``fastcomm`` torch backend: the communicator it already runs on.
    - With ``cpu_only`` (the caller's tensors are all on CPU), a group whose ranks all run on
      this host: a shared-memory communicator on the group's store, cached per group (every
      DDP of the process shares one segment), closed when the group is destroyed or at exit.
      ``FASTCOMM_BACKEND`` naming another backend opts out.
    - Otherwise the group itself, adapted (:class:`~.pg.torch_pg.TorchPGCommunicator`).

    A collective call when it may build the shared-memory communicator (the members exchange
    their host identity through the group's store): every member calls it, in the same order
    as the group's other collectives.

    Args:
        process_group: the group; ``None`` means ``torch.distributed``'s default group.
        cpu_only: the tensors reduced over it are CPU tensors.
        timeout: limit for setup and for every operation (default: fastcomm's default).
    """
    if process_group is None:
        process_group = dist.distributed_c10d._get_default_group()
    own = getattr(process_group, "communicator", None)
    if isinstance(own, Communicator):  # a group of the fastcomm backend: no second wrap
        return own
    if cpu_only:
        shm = _local_shm(process_group, timeout)
        if shm is not None:
            return shm
    comm = TorchPGCommunicator(process_group, timeout)
    cuda = comm.device.type == "cuda"
    comm.make_child = partial(
        _child, "nccl" if cuda else "gloo", comm.device if cuda else None, True, None
    )
    return comm


def _local_shm(
    process_group: dist.ProcessGroup, timeout: float | timedelta | None
) -> ShmCommunicator | None:
    """``group_communicator``'s shared-memory case, or ``None`` when the members span hosts,
    this platform has no ``/dev/shm`` or ``FASTCOMM_BACKEND`` names another backend."""
    forced = settings.BACKEND.text().lower()  # any name but shm opts out
    if forced and forced != "shm":
        return None
    if process_group in _LOCAL_SHM:
        comm = _LOCAL_SHM[process_group]
        if comm is None or not comm.closed:
            return comm
    # every rank answers the same, so every rank takes the same branch below
    if not shm_available():
        return None
    rank, size = process_group.rank(), process_group.size()
    store = group_store(process_group, rank, timeout)
    layout = HostLayout.exchange(store, "shm/hosts", rank, size, store.timeout)
    comm = None
    if layout.num_hosts == 1:
        comm = ShmCommunicator(store.prefixed("shm", rank=rank), rank, size, timeout)
        weakref.finalize(process_group, comm.close)
    _LOCAL_SHM[process_group] = comm
    return comm
