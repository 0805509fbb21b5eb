"""``fastcomm.init()``: the process-wide communicator, set up from torchrun's environment.

``init`` reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (as
``torchrun`` and ``fastcomm-run`` set them). Rank 0 serves the ``TCPStore`` unless the launcher
serves it (``TORCHELASTIC_USE_AGENT_STORE=True``, torch's convention). When
``torch.distributed`` is already initialized, its store is reused under the prefix
``fastcomm/`` instead of binding ``MASTER_PORT`` a second time.

Backend selection (``backend=None``), in order:

1. ``FASTCOMM_BACKEND`` when set (``gloo`` forces Gloo, e.g. for ``fastcomm.ddp.DDP`` on CPU).
2. ``nccl`` when CUDA and CuPy's NCCL are available.
3. Otherwise the ranks exchange their host identity through the store (``FASTCOMM_HOST_ID``, or
   hostname + boot id): ``shm`` when all are on one host, ``hier`` when they span hosts and some
   host has more than one rank (shared memory inside hosts, Gloo between them), else ``gloo``.
   Where shared memory is unavailable (no Linux ``/dev/shm``) it is ``gloo``.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .base import DEFAULT_TIMEOUT, Communicator
from .store import Store, as_timedelta

__all__ = ["init", "get_world", "shutdown", "new_communicator", "is_initialized", "BACKENDS"]

BACKENDS = ("gloo", "nccl", "shm", "hier")

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


def nccl_available() -> bool:
    """Whether CUDA is visible and CuPy's NCCL bindings load."""
    if not torch.cuda.is_available():
        return False
    from .nccl import cupy_nccl

    return cupy_nccl() is not None


def default_backend() -> str:
    """The backend ``init()`` picks before looking at hosts: ``FASTCOMM_BACKEND``, else NCCL when
    available, else ``shm`` (narrowed by :func:`choose_cpu_backend` once the hosts are known)."""
    forced = os.environ.get("FASTCOMM_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(
                f"FASTCOMM_BACKEND={forced!r} is not a backend; allowed: {', '.join(BACKENDS)}"
            )
        return forced
    if nccl_available():
        return "nccl"
    from .shm import shm_available

    return "shm" if shm_available() else "gloo"


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
        from .gloo import GlooCommunicator

        return GlooCommunicator(store, rank, size, timeout)
    if backend == "nccl":
        from .nccl import NcclCommunicator

        return NcclCommunicator(store, rank, size, timeout, device=device)
    if backend == "shm":
        from .shm import ShmCommunicator

        return ShmCommunicator(store, rank, size, timeout)
    if backend == "hier":
        from .hier import HierCommunicator

        return HierCommunicator(store, rank, size, timeout)
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
        backend: ``"nccl"``, ``"gloo"``, ``"shm"``, ``"hier"`` or ``None`` (NCCL when CUDA and
            CuPy are there, else ``shm``/``hier``/``gloo`` by host layout; see the module
            docstring).
        timeout: limit for rendezvous and for every collective.
        rank: overrides ``RANK`` (default 0 when unset and ``world_size`` is 1).
        world_size: overrides ``WORLD_SIZE`` (default 1).
        store: an existing store namespace to build on, instead of the environment's.
        device: CUDA device for NCCL (default ``LOCAL_RANK``).

    Returns:
        The communicator, also returned later by :func:`get_world`.

    Raises:
        RuntimeError: ``init`` was already called (call ``shutdown()`` first).
        ValueError: malformed environment or unknown backend.
    """
    global _WORLD, _WORLD_STORE, _INIT_COUNT
    if _WORLD is not None:
        raise RuntimeError("fastcomm.init() was already called; call fastcomm.shutdown() first")
    timeout = as_timedelta(timeout, DEFAULT_TIMEOUT)
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    rank = _env_int("RANK", 0 if world_size == 1 else None) if rank is None else rank
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} out of range for WORLD_SIZE={world_size}")
    # only an automatic choice of shm is narrowed by host layout; an explicit or forced one is kept
    auto = backend is None and not os.environ.get("FASTCOMM_BACKEND", "").strip()
    if backend is None:
        backend = default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)} or None")
    if device is None and backend == "nccl":
        device = _env_int("LOCAL_RANK", 0)

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
    if auto and backend == "shm" and world_size > 1:
        from ._shm_segment import host_id

        hosts = store.all_gather_object("init/hosts", rank, world_size, host_id(), timeout)
        backend = choose_cpu_backend(hosts)
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
    return _WORLD is not None


def shutdown() -> None:
    """Closes the world communicator and its store connection (idempotent)."""
    global _WORLD, _WORLD_STORE
    if _WORLD is not None:
        _WORLD.close()
    _WORLD = None
    _WORLD_STORE = None
