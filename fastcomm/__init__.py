"""fastcomm: kernel-centric collectives and gradient bucketing for PyTorch.

The names below load lazily (PEP 562), so importing a submodule such as ``fastcomm.comm.store``
does not load the communicators.
"""

from __future__ import annotations

import importlib
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
    "shutdown",
]

# Public name -> submodule that defines it (all re-exported from fastcomm.comm).
_LAZY: dict[str, str] = {
    "CommClosedError": ".comm.errors",
    "CommTimeoutError": ".comm.errors",
    "FastcommError": ".comm.errors",
    "StoreTimeoutError": ".comm.errors",
    "Communicator": ".comm.base",
    "ReduceOp": ".comm.types",
    "Store": ".comm.store",
    "Work": ".comm.work",
    "get_world": ".comm.world",
    "init": ".comm.world",
    "is_initialized": ".comm.world",
    "shutdown": ".comm.world",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastcomm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
