"""Call descriptors of the ipc CUDA protocol and the errors built from them (no CuPy).

A descriptor is one int64 naming a call (op, element count, dtype, reduce op:
``calls.ipc_word``); every barrier of the call compares it with the peers'. This module names
the ipc calls and words the errors a barrier's report raises (a disagreement, a timeout).
Protocol: ``docs/ipc.md``.
"""

from __future__ import annotations

import torch

from ...kernels._peer_signal import disagreeing_ranks, missing_ranks
from ..calls import IPC_MAX_NUMEL, Call, describe, from_ipc_word, ipc_word, mismatch_message
from ..errors import CollectiveMismatchError
from ..types import ReduceOp

__all__ = [
    "CUDA_DTYPES", "CUDA_OPS", "MAX_NUMEL", "SETUP_DESCRIPTOR", "call_descriptor",
    "describe_call", "disagreement_error", "disagreement_message", "timeout_message",
]

#: dtypes the transport reduces (fp32 accumulation).
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Reductions it runs.
CUDA_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN)

#: Element counts a descriptor holds (2**40 fp16 elements are 2 TiB: past any GPU's memory).
MAX_NUMEL = IPC_MAX_NUMEL
#: The descriptor of the setup barrier, which is part of no collective.
SETUP_DESCRIPTOR = ipc_word(Call("barrier"))


def timeout_message(rank: int, op: str, elapsed: float, limit: float, mask: int, epoch: int):
    """The text of the error a barrier that gave up raises (names the missing ranks)."""
    if mask:
        who = f"rank(s) {missing_ranks(mask)} never reached barrier {epoch}"
    else:
        who = "no barrier reported missing ranks (the device did not get that far)"
    return (
        f"rank {rank}: {op} over CUDA IPC did not finish within {limit:.1f} s (elapsed "
        f"{elapsed:.1f} s): {who}; the transport is aborted"
    )


def call_descriptor(name: str, numel: int = 0, dtype: torch.dtype | None = None,
                    op: ReduceOp | None = None) -> int:
    """The descriptor of a call (``calls.ipc_word``): what every rank's barriers of the call
    compare. `numel` must be below `MAX_NUMEL` (`check_all_reduce` makes sure)."""
    return ipc_word(Call(name, dtype, numel, None if op is None else op.value))


def describe_call(descriptor: int) -> str:
    """A descriptor in words (``calls.describe``): ``all_reduce(float32, 1024 elements, op
    sum)``, ``barrier()`` for the setup barrier."""
    return describe(from_ipc_word(descriptor))


def disagreement_message(rank: int, report: int, epoch: int, mine: int, theirs: int) -> str:
    """The text of the error a barrier's disagreement report raises (names both calls).

    Args:
        rank: this rank.
        report: ``control[1]``, `DISAGREE` and the disagreeing peers' bits.
        epoch: the barrier (``control[2]``).
        mine, theirs: this rank's and the lowest disagreeing peer's descriptor.
    """
    peers = disagreeing_ranks(report)
    peer = peers[0] if peers else -1
    also = f" (ranks {peers} disagree with it)" if len(peers) > 1 else ""
    call = from_ipc_word(mine)
    problem = (f"rank {rank} called {describe(call)} but rank {peer} called "
               f"{describe(from_ipc_word(theirs))}{also} (barrier {epoch})")
    return (f"{mismatch_message(rank, call.op, problem)}; the CUDA IPC transport is aborted")


def disagreement_error(rank: int, control) -> CollectiveMismatchError | None:
    """The error of a disagreement reported in the control block `control` (a sequence of
    its words), or None when it holds none (yet).

    The descriptors (never 0) are stored before the report, but the host may see the words of
    pinned memory land in another order: until both have, there is no verdict.
    """
    report, epoch, mine, theirs = (int(control[i]) for i in range(1, 5))
    if report >= 0 or not (mine and theirs):
        return None
    return CollectiveMismatchError(disagreement_message(rank, report, epoch, mine, theirs))

