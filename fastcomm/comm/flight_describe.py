"""The flight recorder's slots in words, made only when a dump is written (:mod:`.flight`).

A slot keeps raw fields: the op, a tensor (in flight) or ``(dtype, numel)`` (ended), the reduce
op or root, two ``perf_counter_ns`` stamps and a state. Here they become one JSON-ready row with
the :class:`~.calls.Call` of the call and its :func:`~.calls.describe` text.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .calls import OPS, Call, describe

__all__ = ["STATES", "entry", "nbytes_of", "wall"]

#: A slot's state, by its code.
STATES = ("empty", "issued", "started", "completed", "failed")
# perf_counter_ns to wall-clock seconds: stamps are taken with the cheap clock on the hot path
_WALL_OFFSET = time.time() - time.perf_counter_ns() / 1e9


def wall(stamp_ns: int) -> float:
    """A ``perf_counter_ns`` stamp as seconds since the epoch."""
    return stamp_ns / 1e9 + _WALL_OFFSET

_ROOTED = {"broadcast", "reduce", "gather", "scatter"}


def _dtype_numel(arg: Any) -> tuple[torch.dtype | None, int, int]:
    """``(dtype, numel, pieces)`` of a slot's argument (a tensor, a list of them, or a
    ``(dtype, numel)`` pair)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.numel(), 1
    if isinstance(arg, tuple) and len(arg) == 2 and isinstance(arg[0], torch.dtype):
        return arg[0], int(arg[1]), 1
    if isinstance(arg, list | tuple):
        tensors = [a for a in arg if isinstance(a, torch.Tensor)]
        if tensors:
            return tensors[0].dtype, tensors[0].numel(), len(tensors)
    return None, -1, 0


def nbytes_of(arg: Any) -> int:
    """Bytes of a slot's argument (0 without a tensor)."""
    dtype, numel, _ = _dtype_numel(arg)
    if dtype is None or numel < 0:
        return 0
    return numel * dtype.itemsize


def _reduce_name(extra: Any) -> str | None:
    value = getattr(extra, "value", None)
    if isinstance(value, str):
        return value
    if isinstance(extra, str):
        return extra.lower()
    name = type(extra).__name__
    return "premul_sum" if name == "PremulSum" else None


_REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_v"}


def call_of(op: str, arg: Any, extra: Any) -> Call:
    """The :class:`Call` a slot describes (a reducing call without its op: the default sum)."""
    dtype, numel, _ = _dtype_numel(arg)
    if extra is None and op in _REDUCING:
        extra = "sum"
    known = op in OPS
    root = extra if op in _ROOTED and isinstance(extra, int) else -1
    return Call(
        op=op if known else "all_reduce",
        dtype=dtype,
        numel=numel,
        reduce_op=None if op in _ROOTED and op != "reduce" else _reduce_name(extra),
        root=root,
    )


def entry(seq: int, op: str | None, arg: Any, extra: Any, state: int, t0: int, t1: int
          ) -> dict:
    """One slot as a JSON-ready row: ``seq``, ``op``, ``state``, ``call`` (its fields),
    ``desc`` (in words), ``issued`` and ``ended`` (epoch s; ``None`` while in flight)."""
    dtype, numel, pieces = _dtype_numel(arg)
    call = call_of(op or "?", arg, extra)
    desc = describe(call)
    if call.op != op:  # an op the call table does not know (send, recv...)
        desc = f"{op}{desc[len(call.op):]}"
    if pieces > 1:
        desc += f" x{pieces} tensors"
    return {
        "seq": seq,
        "op": op,
        "state": STATES[state],
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "numel": numel,
        "reduce_op": call.reduce_op,
        "root": call.root if call.root >= 0 else (extra if isinstance(extra, int) else None),
        "desc": desc,
        "issued": wall(t0) if t0 else None,
        "ended": wall(t1) if t1 else None,
    }

