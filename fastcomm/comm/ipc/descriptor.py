"""Call descriptors of the ipc CUDA protocol and the errors built from them (no CuPy).

A descriptor is one int64 naming a call (op, element count, dtype, reduce op); every barrier of
the call compares it with the peers'. This module encodes and decodes them and words the errors
a barrier's report raises (a disagreement, a timeout). Protocol: ``docs/ipc.md``.
"""

from __future__ import annotations

import torch

from ...kernels._peer_signal import disagreeing_ranks, missing_ranks
from ..errors import FastcommError
from ..types import ReduceOp

__all__ = [
    "CUDA_DTYPES", "CUDA_OPS", "MAX_NUMEL", "SETUP_DESCRIPTOR", "call_descriptor",
    "describe_call", "disagreement_error", "disagreement_message", "timeout_message",
]

#: dtypes the transport reduces (fp32 accumulation).
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Reductions it runs.
CUDA_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN)

# A call's descriptor (one int64, compared by every barrier of the call): opcode in bits
# 56..62, dtype in 48..55, reduce op in 41..47, element count in 1..40 and bit 0 set. It is
# odd and >= 2**56 whatever the call, so Triton compiles one variant of the barrier for all
# of them (it specializes integers equal to 1, divisible by 16, or past 32 bits).
_OPCODES = {"barrier": 1, "all_reduce": 2, "bucket_all_reduce": 3}  # 3: region.py
_DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(CUDA_DTYPES)}
_REDOP_CODES = {op: i + 1 for i, op in enumerate(CUDA_OPS)}
#: Element counts a descriptor holds (2**40 fp16 elements are 2 TiB: past any GPU's memory).
MAX_NUMEL = 1 << 40
#: The descriptor of the setup barrier, which is part of no collective.
SETUP_DESCRIPTOR = (_OPCODES["barrier"] << 56) | 1


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
    """The descriptor of a call (layout above `_OPCODES`): what every rank's barriers of the
    call compare. `numel` must be below `MAX_NUMEL` (`check_all_reduce` makes sure)."""
    return (
        (_OPCODES[name] << 56)
        | (_DTYPE_CODES.get(dtype, 0) << 48)
        | (_REDOP_CODES.get(op, 0) << 41)
        | (numel << 1)
        | 1
    )


def describe_call(descriptor: int) -> str:
    """A descriptor in words: ``all_reduce of 1024 float32 SUM``, ``the setup barrier``."""
    names = {v: k for k, v in _OPCODES.items()}
    dtypes = {v: str(k).removeprefix("torch.") for k, v in _DTYPE_CODES.items()}
    ops = {v: k.name for k, v in _REDOP_CODES.items()}
    opcode = (descriptor >> 56) & 0x7F
    name = names.get(opcode, f"op {opcode}")
    if name == "barrier":
        return "the setup barrier"
    numel = (descriptor >> 1) & (MAX_NUMEL - 1)
    dtype, redop = (descriptor >> 48) & 0xFF, (descriptor >> 41) & 0x7F
    return (f"{name} of {numel} {dtypes.get(dtype, f'dtype {dtype}')} "
            f"{ops.get(redop, f'op {redop}')}")


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
    names = {v: k for k, v in _OPCODES.items()}
    op = names.get((mine >> 56) & 0x7F, "a collective")
    return (
        f"rank {rank}: {op} disagrees with rank {peer}{also}: rank {rank} called "
        f"{describe_call(mine)}, "
        f"rank {peer} called {describe_call(theirs)} (barrier {epoch}); every rank must make "
        "the same calls in the same order; the CUDA IPC transport is aborted"
    )


def disagreement_error(rank: int, control) -> FastcommError | None:
    """The error of a disagreement reported in the control block `control` (a sequence of
    its words), or None when it holds none (yet).

    The descriptors (never 0) are stored before the report, but the host may see the words of
    pinned memory land in another order: until both have, there is no verdict.
    """
    report, epoch, mine, theirs = (int(control[i]) for i in range(1, 5))
    if report >= 0 or not (mine and theirs):
        return None
    return FastcommError(disagreement_message(rank, report, epoch, mine, theirs))

