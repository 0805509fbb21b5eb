"""Host-side store and communicators (Gloo, NCCL, shared memory, hierarchical, ipc).

Names load lazily (PEP 562): ``import fastcomm.comm.store`` must not pull in a backend or
Triton, because the launcher needs only the store.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> submodule (relative to this package) that defines it.
_LAZY: dict[str, str] = {
    "Capabilities": ".types",
    "CollectiveMismatchError": ".errors",
    "Communicator": ".base",
    "CommAbortedError": ".errors",
    "CommClosedError": ".errors",
    "CommTimeoutError": ".errors",
    "PeerLostError": ".errors",  # a CommAbortedError: a peer exited, aborted or closed
    "EtcdStore": ".etcd_store",  # a c10d store in an etcd cluster
    "FastcommError": ".errors",
    "FastcommProcessGroup": ".c10d",  # the torch.distributed backend "fastcomm"
    "monitored_barrier": ".c10d",  # dist.monitored_barrier for the backend's groups
    "StoreTimeoutError": ".errors",
    "GlooCommunicator": ".pg.gloo",
    "HierCommunicator": ".hier",
    "NcclCommunicator": ".nccl",  # CuPy is optional: loads only when asked for
    "IpcCommunicator": ".ipc",
    "ShmCommunicator": ".shm",
    "ShmOptions": ".shm",
    "Store": ".store",
    "TorchPGCommunicator": ".pg.torch_pg",
    "PremulSum": ".types",
    "ReduceOp": ".types",
    "SUPPORTED_DTYPES": ".types",
    "Work": ".work",
    "communicator_for": ".world",
    "get_world": ".world",
    "group_communicator": ".world",
    "init": ".world",
    "is_initialized": ".world",
    "new_communicator": ".world",
    "shutdown": ".world",
}

__all__ = [
    "Capabilities",
    "CollectiveMismatchError",
    "Communicator",
    "CommAbortedError",
    "CommClosedError",
    "CommTimeoutError",
    "EtcdStore",
    "FastcommError",
    "FastcommProcessGroup",
    "GlooCommunicator",
    "HierCommunicator",
    "IpcCommunicator",
    "PeerLostError",
    "PremulSum",
    "ReduceOp",
    "SUPPORTED_DTYPES",
    "ShmCommunicator",
    "ShmOptions",
    "Store",
    "StoreTimeoutError",
    "Work",
    "communicator_for",
    "get_world",
    "group_communicator",
    "init",
    "is_initialized",
    "monitored_barrier",
    "new_communicator",
    "shutdown",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastcomm.comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
