"""fastcomm: kernel-centric collectives and gradient bucketing for PyTorch.

The names below load lazily (PEP 562), so importing a submodule such as ``fastcomm.comm.store``
does not load the communicators.

Importing the package registers the ``torch.distributed`` backend ``"fastcomm"`` (CPU and
CUDA): ``dist.init_process_group("fastcomm")``. Registration loads no communicator; the first
group of the backend loads ``fastcomm.comm.c10d``. Under srun or mpiexec it also sets torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) from the launcher's where they are absent (:mod:`fastcomm.comm.launch_env`),
and where ``FASTCOMM_STORE`` names the job's store (in etcd) torch's ``env://`` rendezvous
takes it from there, as ``fastcomm.init()`` does.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "CommClosedError",
    "CommTimeoutError",
    "Communicator",
    "FastcommError",
    "ReduceOp",
    "Store",
    "StoreTimeoutError",
    "Work",
    "get_world",
    "init",
    "is_initialized",
    "monitored_barrier",
    "shutdown",
]


def _create_process_group(opts: Any, backend_options: Any = None) -> Any:
    # torch's creator for the backend; the adapter (and every communicator) loads on first use
    from .comm.c10d import create_process_group

    return create_process_group(opts, backend_options)


def _register_torch_backend() -> None:
    """Registers ``"fastcomm"`` with ``torch.distributed`` (once per process)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without its distributed package
        return
    if not dist.is_available() or "FASTCOMM" in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        "fastcomm", _create_process_group, extended_api=True, devices=["cpu", "cuda"]
    )


def _route_env_rendezvous() -> None:
    """torch's ``env://`` (``init_process_group``'s default) takes the job's store from
    ``FASTCOMM_STORE`` where it is set, as ``fastcomm.init()`` does (``fastcomm-run
    --rdzv-backend etcd`` sets it: the store is in etcd, no rank serves one); torch's own
    handler runs where it is not."""
    rendezvous = sys.modules.get("torch.distributed.rendezvous")
    handlers = getattr(rendezvous, "_rendezvous_handlers", None)
    if not isinstance(handlers, dict) or getattr(handlers.get("env"), "fastcomm", False):
        return
    torch_env = handlers.get("env")
    if torch_env is None:  # pragma: no cover - a torch without env://
        return

    def env(url: str, **kwargs: Any):
        from . import settings

        if not settings.STORE.is_set():
            return torch_env(url, **kwargs)
        from .comm.store import env_rendezvous

        return env_rendezvous(url, kwargs.get("timeout"))

    env.fastcomm = True
    handlers["env"] = env


def _export_launcher_env() -> None:
    """Under srun or mpiexec, torchrun's variables from the launcher's (where absent), so
    ``init_process_group("fastcomm")`` and other readers of ``RANK``/``WORLD_SIZE`` see the job."""
    from .comm.launch_env import export_torchrun_env

    export_torchrun_env()


_register_torch_backend()
_route_env_rendezvous()
_export_launcher_env()


def __getattr__(name: str) -> Any:
    # every public name is re-exported from fastcomm.comm, which loads it lazily itself
    if name not in __all__:
        raise AttributeError(f"module 'fastcomm' has no attribute {name!r}")
    value = getattr(importlib.import_module(".comm", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
