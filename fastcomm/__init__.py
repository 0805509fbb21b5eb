"""fastcomm: kernel-centric collectives and gradient bucketing for PyTorch."""

from .comm import (
    CommClosedError,
    CommTimeoutError,
    Communicator,
    FastcommError,
    ReduceOp,
    Store,
    StoreTimeoutError,
    Work,
    get_world,
    init,
    is_initialized,
    shutdown,
)

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
    "shutdown",
]
