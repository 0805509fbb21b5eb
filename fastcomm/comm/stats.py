"""Per-operation call and byte counts of a communicator (``Communicator.stats``)."""

from __future__ import annotations

import torch

__all__ = ["CommStats"]


class CommStats:
    """Calls and payload bytes per operation issued by this rank.

    ``bytes[op]`` counts the bytes this rank contributes (the input of ``all_gather``, the
    tensor of ``all_reduce``...), the figure compression hooks shrink. Reset with ``reset()``.
    """

    __slots__ = ("calls", "bytes")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def record(self, op: str, tensor: torch.Tensor | None) -> None:
        """Counts one call of ``op`` and the bytes of ``tensor`` (``None``: no payload)."""
        calls = self.calls
        calls[op] = calls.get(op, 0) + 1
        if tensor is not None:
            nbytes = self.bytes
            nbytes[op] = nbytes.get(op, 0) + tensor.nbytes

    def count(self, op: str, nbytes: int) -> None:
        """Counts one call of ``op`` that moved ``nbytes`` (a caller that knows the size)."""
        self.calls[op] = self.calls.get(op, 0) + 1
        self.bytes[op] = self.bytes.get(op, 0) + nbytes

    @property
    def total_bytes(self) -> int:
        """Bytes of every operation together."""
        return sum(self.bytes.values())

    def reset(self) -> None:
        """Forgets every count."""
        self.calls.clear()
        self.bytes.clear()

    def __repr__(self) -> str:
        return f"CommStats(calls={self.calls}, bytes={self.bytes})"
