"""Host-side store and communicators (Gloo, NCCL, shared memory, hierarchical)."""

from .base import Communicator
from .errors import (
    CommAbortedError,
    CommClosedError,
    CommTimeoutError,
    FastcommError,
    StoreTimeoutError,
)
from .hier import HierCommunicator
from .pg.gloo import GlooCommunicator
from .pg.torch_pg import TorchPGCommunicator as TorchPGCommunicator
from .shm import ShmCommunicator, ShmOptions
from .store import Store
from .types import SUPPORTED_DTYPES, ReduceOp
from .work import Work
from .world import get_world, init, is_initialized, new_communicator, shutdown

__all__ = [
    "Communicator",
    "CommAbortedError",
    "CommClosedError",
    "CommTimeoutError",
    "FastcommError",
    "GlooCommunicator",
    "HierCommunicator",
    "ReduceOp",
    "SUPPORTED_DTYPES",
    "ShmCommunicator",
    "ShmOptions",
    "Store",
    "StoreTimeoutError",
    "Work",
    "get_world",
    "init",
    "is_initialized",
    "new_communicator",
    "shutdown",
]


def __getattr__(name: str):
    if name == "NcclCommunicator":  # imported lazily: CuPy is optional
        from .nccl import NcclCommunicator

        return NcclCommunicator
    raise AttributeError(f"module 'fastcomm.comm' has no attribute {name!r}")
