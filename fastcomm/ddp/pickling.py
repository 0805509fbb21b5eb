"""Pickling a whole DDP module (``torch.save(ddp_model, f)``), as torch DDP allows it.

What is pickled: the wrapped module and the DDP's options. What is not: the communicator,
the torch process group and the reducer (with its autograd hooks, buckets and comm hook) --
they hold sockets, threads and shared memory. Unpickling finds the communicator the way a
DDP built without ``comm=``/``process_group=`` does (``resolve_comm``) and builds a fresh
reducer over the loaded parameters; like torch, it does not broadcast them again (every rank
loads the same file) and it forgets a registered comm hook.

Like torch, pickling needs a communicator that unpickling can find again: a DDP built with
``comm=`` or with a ``process_group`` other than the default one raises ``RuntimeError``.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from ._setup import (
    default_group,
    reduce_dtype_of,
    reduced_parameters,
    resolve_comm,
    torch_members,
)
from .reducer import Reducer
from .regrow import RegisteredStates
from .sparse import sparse_param_indices

__all__ = ["ddp_getstate", "ddp_setstate"]

# what __getstate__ leaves out: rebuilt by __setstate__
_TRANSIENT = ("comm", "process_group", "reducer", "active_join", "_recovery",
              "registered_states", "_taps")


def ddp_getstate(ddp: nn.Module) -> dict[str, Any]:
    """``DDP.__getstate__``: the module's state without communicator, group and reducer.

    Raises:
        RuntimeError: the DDP reduces over a communicator given explicitly (``comm=``, or a
            ``process_group`` that is not the default group), which unpickling cannot find.
    """
    if ddp._comm_given:
        raise RuntimeError(
            "DDP Pickling/Unpickling are only supported when using DDP with the default "
            "process group. That is, when you have called init_process_group (or "
            "fastcomm.init()) and have not passed process_group or comm to the DDP "
            f"constructor (this DDP reduces over {ddp.comm!r})"
        )
    if ddp.active_join is not None:
        raise RuntimeError("a DDP cannot be pickled inside its join() context")
    state = copy.copy(ddp.__dict__)
    for key in _TRANSIENT:
        state.pop(key, None)
    state["_comm_hook_registered"] = False
    return state


def ddp_setstate(ddp: nn.Module, state: dict[str, Any]) -> None:
    """``DDP.__setstate__``: restores the module, with a communicator found again and a new
    reducer."""
    comm = resolve_comm(None, None, state["_modules"]["module"])
    nn.Module.__setstate__(ddp, {
        **state,
        "active_join": None,
        "_recovery": None,  # an unpickled copy does not shrink in place
        "_taps": None,  # its own, made by its first compiled forward (taps.py)
        "registered_states": RegisteredStates(),
        "comm": comm,
        "process_group": default_group(),
        "_torch_members": torch_members(None, None, comm),
    })
    names, params = reduced_parameters(ddp.module, ddp.parameters_to_ignore)
    ddp.reducer = Reducer(
        params, names, ddp.comm, ddp.config, sparse_param_indices(ddp.module, params)
    )
    reduce_dtype = reduce_dtype_of(ddp.mixed_precision)
    if reduce_dtype is not None:
        from .hooks.default import make_cast_hook

        ddp.reducer.comm_hook = make_cast_hook(reduce_dtype)
