"""``torch.compile(DDP(model))``: the gradient hooks inside one compiled backward.

A synchronized step's forward is compiled with each reduced parameter passed through a tap
(``torch.func.functional_call``), an identity whose backward hands the parameter's gradient
to ``fastcomm::ddp_grad_ready``, an opaque op with an ordered effect, which no compiler
removes or reorders against the others. The op does what the parameter's ``AccumulateGrad``
and DDP's hook do in eager mode (``Reducer.on_traced_grad``): the gradient goes into its
bucket, and the bucket is launched as soon as it is full. The tap returns no gradient to the
parameter, so autograd accumulates nothing after the compiled backward; the write-back at
its end fills ``.grad``.

Where each op runs is the compiler's schedule. AOTAutograd's backward graph has the taps'
backwards last (the autograd engine, which it traces, runs the nodes made first last);
inductor's scheduler moves each op up to where its gradient is made, since the op frees that
buffer (``reorder_for_peak_memory``, on by default). A backend that keeps AOTAutograd's order
(``aot_eager``) runs the ops at the end of the backward: the same results, no overlap.

One forward graph and one backward graph per step, where torch's DDPOptimizer compiles a
forward and a backward per bucket (``compiled_backward="split"`` keeps that path).

The op's `grad` is a buffer of the compiled graph, which may reuse it once the op returns:
every path copies it before returning (into its bucket, or into a ``.grad`` of its own).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["Taps", "available", "run_tapped"]

_NAME = "ddp_grad_ready"
_LIB = f"fastcomm::{_NAME}"
_LIBS: list = []
_OWNERS: dict[int, weakref.ref] = {}  # a DDP's key -> the DDP (its reducer read per call)
_KEYS = itertools.count(1)


def _register() -> bool:
    try:
        from torch._library.effects import EffectType
    except ImportError:  # a torch without effectful custom ops: the split path
        return False
    # a plain library op (not torch.library.custom_op, whose Python wrappers cost tens of
    # microseconds a call): the dispatcher calls the kernel below directly
    lib = torch.library.Library("fastcomm", "FRAGMENT")
    lib.define(f"{_NAME}(Tensor grad, int owner, int index) -> Tensor")
    lib.impl(_NAME, _grad_ready, "CompositeExplicitAutograd")
    torch.library.register_fake(_LIB, _grad_ready_fake, lib=lib)
    torch.library._register_effectful_op(_LIB, EffectType.ORDERED)
    _LIBS.append(lib)  # a Library's registrations last while it does
    return True


def _grad_ready(grad: torch.Tensor, owner: int, index: int) -> torch.Tensor:
    ref = _OWNERS.get(owner)
    ddp = None if ref is None else ref()
    if ddp is None:
        raise RuntimeError(
            f"fastcomm DDP: a compiled backward handed over parameter {index}'s gradient for "
            f"a DDP (key {owner}) that no longer exists"
        )
    ddp.reducer.on_traced_grad(index, grad)
    return grad.new_empty(0)


def _grad_ready_fake(grad: torch.Tensor, owner: int, index: int) -> torch.Tensor:
    return grad.new_empty(0)


def available() -> bool:
    """Whether this torch can keep an opaque op in a compiled backward (effectful ops)."""
    return _AVAILABLE


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param: torch.Tensor, owner: int, index: int) -> torch.Tensor:
        ctx.set_materialize_grads(False)  # an unused parameter stays without a gradient
        ctx.owner, ctx.index = owner, index
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is not None:
            torch.ops.fastcomm.ddp_grad_ready(grad, ctx.owner, ctx.index)
        return None, None, None


class Taps:
    """A DDP's taps: its reduced dense parameters by name, and the key its op calls carry.

    Attributes:
        broken: Dynamo broke the tapped call's graph: the taps sit in the first graph, whose
            backward runs last, so the later graphs' buckets would wait for it. The DDP takes
            the split path from the next step on (DDPOptimizer splits each graph).
    """

    def __init__(self, ddp: Any) -> None:
        reducer = ddp.reducer
        self.broken = False
        self.key = next(_KEYS)
        _OWNERS[self.key] = weakref.ref(ddp)
        weakref.finalize(ddp, _OWNERS.pop, self.key, None)
        self.params = tuple(
            (name, p, i)
            for i, (name, p) in enumerate(zip(reducer.names, reducer.params, strict=True))
            if i not in reducer.sparse
        )


def run_tapped(module: nn.Module, taps: Taps, inputs: tuple, kwargs: dict) -> Any:
    """`module`'s call through `call_tapped`, compiled (Dynamo intercepts the frames this
    calls); marks the taps broken when that compile broke the graph."""
    breaks = torch._dynamo.utils.counters["graph_break"]
    before = sum(breaks.values())
    output = call_tapped(module, taps, inputs, kwargs)
    if sum(breaks.values()) != before:
        taps.broken = True
    return output


def call_tapped(module: nn.Module, taps: Taps, inputs: tuple, kwargs: dict) -> Any:
    """`module`'s call with every tapped parameter passed through its tap (a frame Dynamo
    compiles)."""
    key = taps.key
    tapped = {name: _Tap.apply(p, key, i) for name, p, i in taps.params}
    return torch.func.functional_call(module, tapped, inputs, kwargs)


_AVAILABLE = _register()
