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

def __getattr__(name: str) -> Any:
    # every public name is re-exported from fastcomm.comm, which loads it lazily itself
    if name not in __all__:
        raise AttributeError(f"module 'fastcomm' has no attribute {name!r}")
    value = getattr(importlib.import_module(".comm", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
