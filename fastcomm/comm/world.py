"""``fastcomm.init()``: the process-wide communicator, set up from torchrun's environment.

``init`` reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (as
``torchrun`` and ``fastcomm-run`` set them). Rank 0 serves the ``TCPStore`` unless the launcher
serves it (``TORCHELASTIC_USE_AGENT_STORE=True``, torch's convention). When
``torch.distributed`` is already initialized, its store is reused under the prefix
``fastcomm/`` instead of binding ``MASTER_PORT`` a second time.

Backend selection (``backend=None``), in order:

1. ``FASTCOMM_BACKEND`` when set (``gloo`` forces Gloo, e.g. for ``fastcomm.ddp.DDP`` on CPU).
2. ``nccl`` when CuPy's NCCL loads and every local rank can own a GPU: ``LOCAL_RANK`` <
   :func:`cuda_device_count` and ``LOCAL_WORLD_SIZE`` <= it. Ranks may also share GPUs where NCCL
   allows it: version >= 2.30 (:func:`detected_nccl_version`, read from the loaded library) and
   ``NCCL_MULTI_RANK_GPU_ENABLE=1``; older NCCL refuses two ranks on one device.
3. ``ipc`` when CUDA devices are present but NCCL cannot run the job because the local ranks
   outnumber the GPUs (they share one): :func:`shared_gpu_backend`.
4. Otherwise the ranks exchange their host identity through the store (``FASTCOMM_HOST_ID``, or
   hostname + boot id): ``shm`` when all are on one host, ``hier`` when they span hosts and some
   host has more than one rank (shared memory inside hosts, Gloo between them), else ``gloo``.
   Where shared memory is unavailable (no Linux ``/dev/shm``) it is ``gloo``. An automatic
   ``ipc`` is narrowed the same way (it needs one host).

When CUDA devices are present and the choice is automatic, ``init`` logs one line saying which
backend it took and why (logger ``fastcomm``; a warning when it is not NCCL). The device count
and the NCCL version are read in one function each, :func:`cuda_device_count` and
:func:`detected_nccl_version`.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .base import Communicator
from .hier import HierCommunicator
from .nccl import NcclCommunicator, cupy_nccl, nccl_version
from .pg.gloo import GlooCommunicator
from .pg.torch_pg import group_store
from .shm import ShmCommunicator, shm_available
from .shm.segment import host_id
from .store import DEFAULT_TIMEOUT, Store

__all__ = [
    "init", "get_world", "shutdown", "new_communicator", "is_initialized", "BACKENDS",
    "NcclFit", "nccl_fit", "cuda_device_count", "detected_nccl_version", "local_shm_communicator",
]

BACKENDS = ("gloo", "nccl", "shm", "hier", "ipc")

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


def _env_int(name: str, default: int | None) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        if default is None:
            raise ValueError(f"environment variable {name} is not set (launch with fastcomm-run)")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


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
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)``; a lone process is rank 0 of 1, and without
    ``LOCAL_WORLD_SIZE`` every rank is assumed to be on this host."""
    local_rank = _env_int("LOCAL_RANK", 0)
    return local_rank, _env_int("LOCAL_WORLD_SIZE", max(world_size, local_rank + 1))


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

    Why: measured on one H100 with two processes sharing it (torch 2.11, NCCL 2.28.9), NCCL
    refuses the job ("Duplicate GPU detected") and Gloo, which stages through host memory,
    takes 561 us for a 4 KiB all-reduce and 18 ms for 25 MiB, while a kernel reading the peer's
    buffer through CUDA IPC sums 25 MiB in 28 us. The ``ipc`` backend's CUDA ``all_reduce`` is
    such a kernel (its end-to-end latency has not been measured yet); its other CUDA ops take
    the same Gloo. Where NCCL can run it stays the choice: no crossover with NCCL is measured.
    """
    if fit.ok or fit.device_count == 0 or local_world_size <= fit.device_count:
        return None
    return "ipc"


def _pick_backend(world_size: int, cpu_tensors: bool) -> tuple[str, NcclFit | None]:
    """:func:`default_backend`, with the :class:`NcclFit` that decided it (``None`` when NCCL
    was not considered)."""
    forced = os.environ.get("FASTCOMM_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(
                f"FASTCOMM_BACKEND={forced!r} is not a backend; allowed: {', '.join(BACKENDS)}"
            )
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


def choose_cpu_backend(hosts: list[str]) -> str:
    """``shm`` for one host, ``hier`` for several hosts with a shared one, else ``gloo``.

    Args:
        hosts: every rank's host identity, in rank order.
    """
    if len(set(hosts)) == 1:
        return "shm"
    if len(hosts) > len(set(hosts)):
        return "hier"
    return "gloo"


def new_communicator(
    backend: str,
    *,
    store: Store,
    rank: int,
    size: int,
    timeout: float | timedelta | None = None,
    device: torch.device | int | None = None,
) -> Communicator:
    """Builds a communicator of ``backend`` on ``store`` (a namespace private to it).

    Raises:
        ValueError: unknown backend.
    """
    if backend == "gloo":
        return GlooCommunicator(store, rank, size, timeout)
    if backend == "nccl":
        return NcclCommunicator(store, rank, size, timeout, device=device)
    if backend == "shm":
        return ShmCommunicator(store, rank, size, timeout)
    if backend == "hier":
        return HierCommunicator(store, rank, size, timeout)
    if backend == "ipc":
        # deliberately lazy: ipc loads Triton (its peer_reduce kernel), which no other backend
        # needs, so only a job that picks ipc pays for it
        from .ipc import IpcCommunicator

        return IpcCommunicator(store, rank, size, timeout)
    raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)} or None")


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
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    rank = _env_int("RANK", 0 if world_size == 1 else None) if rank is None else rank
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} out of range for WORLD_SIZE={world_size}")
    # only an automatic choice of shm is narrowed by host layout; an explicit or forced one is kept
    auto = backend is None and not os.environ.get("FASTCOMM_BACKEND", "").strip()
    cpu_tensors = device is not None and not isinstance(device, int) and (
        torch.device(device).type == "cpu"
    )
    fit = None
    if backend is None:
        backend, fit = _pick_backend(world_size, cpu_tensors)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)} or None")
    if backend == "nccl" and cpu_tensors:
        raise ValueError(f"rank {rank}: backend='nccl' moves CUDA tensors, got device={device!r}")
    if backend == "nccl":
        device = _check_nccl_device(rank, world_size, device)

    if store is None:
        if dist.is_available() and dist.is_initialized():
            base = Store(
                timeout=timeout,
                rank=rank,
                _base=dist.PrefixStore("fastcomm", dist.distributed_c10d._get_default_store()),
                _root=dist.distributed_c10d._get_default_store(),
                prefix="fastcomm",
            )
        else:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = _env_int("MASTER_PORT", 0 if world_size == 1 else None)
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
    if auto and backend in ("shm", "ipc") and world_size > 1:
        hosts = store.all_gather_object("init/hosts", rank, world_size, host_id(), timeout)
        layout = choose_cpu_backend(hosts)
        backend = layout if layout != "shm" else backend  # ipc, like shm, needs one host
    _say_choice(backend, fit)
    _WORLD = new_communicator(
        backend, store=store, rank=rank, size=world_size, timeout=timeout, device=device
    )
    return _WORLD


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
    _WORLD_STORE = None


def local_shm_communicator(
    process_group: dist.ProcessGroup | None = None, timeout: float | timedelta | None = None
) -> ShmCommunicator | None:
    """A shared-memory communicator over the ranks of a torch group that all run on this host.

    A collective call (every member calls it, in the same order as the group's other
    collectives): the members exchange their host identity through the group's store, and when
    they share one host they set up a :class:`~fastcomm.comm.shm.ShmCommunicator` on that
    store (CPU tensors only, no Gloo fallback). The result is cached per group, so every DDP
    of the process shares one segment. It is closed when the group is destroyed (and garbage
    collected) or at interpreter exit; its segment never stays in ``/dev/shm`` (it is unlinked
    once every rank has mapped it).

    Args:
        process_group: the group; ``None`` means ``torch.distributed``'s default group.
        timeout: limit for setup and for every operation (default: fastcomm's default).

    Returns:
        The communicator, or ``None`` when the members span hosts, this platform has no
        ``/dev/shm``, or ``FASTCOMM_BACKEND`` names another backend.
    """
    forced = os.environ.get("FASTCOMM_BACKEND", "").strip().lower()
    if forced and forced != "shm":
        return None
    if process_group is None:
        process_group = dist.distributed_c10d._get_default_group()
    if process_group in _LOCAL_SHM:
        comm = _LOCAL_SHM[process_group]
        if comm is None or not comm.closed:
            return comm
    # every rank answers the same, so every rank takes the same branch below
    if not shm_available():
        return None
    rank, size = process_group.rank(), process_group.size()
    store = group_store(process_group, rank, timeout)
    hosts = store.all_gather_object("shm/hosts", rank, size, host_id(), store.timeout)
    comm = None
    if len(set(hosts)) == 1:
        comm = ShmCommunicator(
            store.prefixed("shm", rank=rank), rank, size, timeout, fallback=False
        )
        weakref.finalize(process_group, comm.close)
    _LOCAL_SHM[process_group] = comm
    return comm
