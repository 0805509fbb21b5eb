"""Reduction ops and the dtype table shared by every communicator."""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

__all__ = ["ReduceOp", "SUPPORTED_DTYPES", "divide_"]


class ReduceOp(enum.Enum):
    """Element-wise reductions of ``all_reduce`` / ``reduce_scatter``.

    ``AVG`` is the sum divided by the communicator's size; on integer tensors the division
    truncates toward zero (as NCCL's ``ncclAvg`` does).
    """

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"

    @classmethod
    def coerce(cls, op: object) -> ReduceOp:
        """Accepts a ``ReduceOp``, its name (``"sum"``) or torch's ``dist.ReduceOp`` value."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return cls[op.upper()]
            except KeyError:
                pass
        else:
            torch_ops = {
                dist.ReduceOp.SUM: cls.SUM,
                dist.ReduceOp.AVG: cls.AVG,
                dist.ReduceOp.MAX: cls.MAX,
                dist.ReduceOp.MIN: cls.MIN,
                dist.ReduceOp.PRODUCT: cls.PRODUCT,
            }
            try:
                found = torch_ops.get(op)
            except TypeError:
                found = None
            if found is not None:
                return found
        allowed = ", ".join(m.name for m in cls)
        raise ValueError(f"unsupported reduce op {op!r}; allowed: {allowed}")


# The dtypes every backend moves and reduces (NCCL's table; Gloo and shm take the same set so a
# program behaves the same whichever communicator it gets).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
)


def divide_(tensor: torch.Tensor, size: int) -> None:
    """In-place ``tensor / size``; integers truncate toward zero (NCCL's ncclAvg)."""
    if tensor.is_floating_point():
        tensor.div_(size)
    else:
        tensor.div_(size, rounding_mode="trunc")
