"""The process group's Python under ``torch.compile``: never traced.

torch's C++ calls the group's methods (``allreduce``, ``broadcast``, ...) from inside regions
Dynamo compiles (torch DDP's forward under DDPOptimizer, FSDP2's hooks). Dynamo would try to
compile each such method as a frame of its own and fail on the group, which it sees as an
opaque object (``UnsafeScriptObjectError: ... Member '_comm_for' is not registered``). The
group's code runs eagerly instead, as a C++ backend's would: `never_traced` marks the code of
every function a class defines (its methods, their nested functions and lambdas) so that Dynamo
skips those frames and everything they call, with no cost on an eager call (a flag on the code
object, read only while Dynamo's frame evaluation is on). Where the flag is not available (a
torch without it), the methods are wrapped in ``torch._disable_dynamo``, which costs a few
microseconds per call.
"""

from __future__ import annotations

import types

import torch

__all__ = ["never_traced"]


def _skip_setter():
    """A function marking a code object skipped with all it calls, or None."""
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:
        return None
    strategy = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    return lambda code: set_code_exec_strategy(code, strategy)


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def never_traced(*classes: type) -> None:
    """Makes Dynamo run every function `classes` define (not their bases') eagerly."""
    skip = _skip_setter()
    for cls in classes:
        for name, value in list(vars(cls).items()):
            fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if isinstance(value, property):
                fns = [f for f in (value.fget, value.fset, value.fdel) if f is not None]
            elif isinstance(fn, types.FunctionType):
                fns = [fn]
            else:
                continue
            for f in fns:
                if skip is not None:
                    for code in _codes(f.__code__):
                        skip(code)
                elif f is fn and not isinstance(value, (staticmethod, classmethod)):
                    setattr(cls, name, torch._disable_dynamo(fn))
