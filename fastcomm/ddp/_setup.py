"""What a DDP is built from, shared by its constructor and its unpickling.

The communicator it reduces over, the default process group, the parameters it reduces and
the mixed-precision settings: module-level functions, so that ``ddp.py`` and ``pickling.py``
both import them from here (pickling.py needs ddp.py for type annotations only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastcomm.comm.base import Communicator
from fastcomm.kernels._launch import FLOAT_DTYPES

__all__ = [
    "check_mixed_precision",
    "default_group",
    "reduce_dtype_of",
    "reduced_parameters",
    "resolve_comm",
    "torch_members",
]


def resolve_comm(comm, process_group, module: nn.Module | None = None) -> Communicator:
    """The communicator a DDP of `module` uses (the order is in ``ddp.py``'s module docstring).

    A collective call when it picks the shared-memory communicator (the ranks exchange their
    host identity): every rank must call it, as every rank constructs the DDP.
    """
    if comm is not None:
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a fastcomm Communicator, got {type(comm).__name__}")
        return comm
    from fastcomm.comm import group_communicator

    if process_group is not None:
        return group_communicator(process_group)
    import fastcomm

    if fastcomm.is_initialized():
        return fastcomm.get_world()
    if dist.is_available() and dist.is_initialized():
        cpu_only = module is not None and all(p.device.type == "cpu" for p in module.parameters())
        return group_communicator(None, cpu_only=cpu_only)
    raise RuntimeError(
        "fastcomm DDP needs a communicator: call torch.distributed.init_process_group(...) or "
        "fastcomm.init() first, or pass comm= (a fastcomm communicator) or process_group="
    )


def torch_members(comm, process_group, resolved: Communicator) -> tuple[int, ...] | None:
    """The global ranks of the torch group whose members are `resolved`'s (the DDP's
    communicator): the group passed, else torch's default group where it is as large; ``None``
    for a communicator passed in (no torch group is known to share its members)."""
    if comm is not None:
        return None
    group = process_group if process_group is not None else default_group()
    if group is None or group.size() != resolved.size:
        return None
    return tuple(dist.get_process_group_ranks(group))


def default_group() -> dist.ProcessGroup | None:
    """torch's default process group, or None when torch.distributed is not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_group()
    return None


def reduced_parameters(module: nn.Module, ignore: set[str]):
    """(names, params): parameters requiring grad, deduplicated, in registration order."""
    names, params, seen = [], [], set()
    for mod_name, mod in module.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            fqn = f"{mod_name}.{p_name}" if mod_name else p_name
            if not p.requires_grad or fqn in ignore or id(p) in seen:
                continue
            seen.add(id(p))
            names.append(fqn)
            params.append(p)
    return names, params


# The reduce kernels take every float dtype, but mixed precision is a narrowing of fp32, as in
# torch DDP's _MixedPrecision: float64 is left out on purpose.
_MIXED_PRECISION_DTYPES = tuple(d for d in FLOAT_DTYPES if d is not torch.float64)


def check_mixed_precision(mp: Any) -> None:
    """Raise a ValueError naming the field of `mp` whose dtype mixed precision does not take."""
    for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        value = getattr(mp, name, None)
        if value is not None and value not in _MIXED_PRECISION_DTYPES:
            raise ValueError(f"mixed_precision.{name}={value}; expected float16/bfloat16/float32")


def reduce_dtype_of(mp: Any) -> torch.dtype | None:
    """The dtype gradients are reduced in under `mp`, or None for their own (float32)."""
    if mp is None:
        return None
    dtype = getattr(mp, "reduce_dtype", None) or getattr(mp, "param_dtype", None)
    return None if dtype in (None, torch.float32) else dtype
