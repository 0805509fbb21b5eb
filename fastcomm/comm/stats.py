"""Per-operation call and byte counts of a communicator (``Communicator.stats``), and the
latency of its recent calls (from its flight recorder, :mod:`.flight`)."""

from __future__ import annotations

import torch

__all__ = ["CommStats"]


class CommStats:
    """Calls and payload bytes per operation issued by this rank.

    ``bytes[op]`` counts the bytes this rank contributes (the input of ``all_gather``, the
    tensor of ``all_reduce``...), the figure compression hooks shrink. Reset with ``reset()``.
    """

    __slots__ = ("calls", "bytes", "flight")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.flight = None
        """The communicator's flight recorder (the latencies' source), or ``None``."""

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

    def latency(self) -> dict[str, dict[int, dict[str, float]]]:
        """Seconds per call of the calls still in the flight recorder's ring, by op then by
        bytes: ``{"all_reduce": {4096: {"count": 500, "p50": 8e-06, "p99": 3e-05}}}`` (empty
        when the recorder is off). Calls returned as ``async_op`` count until their ``Work``
        completed."""
        if self.flight is None:
            return {}
        out: dict[str, dict[int, dict[str, float]]] = {}
        for (op, nbytes), times in sorted(self.flight.latencies().items()):
            times.sort()
            out.setdefault(op, {})[nbytes] = {
                "count": len(times),
                "p50": times[(len(times) - 1) // 2],
                "p99": times[min(len(times) - 1, (len(times) * 99) // 100)],
            }
        return out

    def reset(self) -> None:
        """Forgets every count (and the flight recorder's calls)."""
        self.calls.clear()
        self.bytes.clear()
        if self.flight is not None:
            self.flight.clear()

    def __repr__(self) -> str:
        return f"CommStats(calls={self.calls}, bytes={self.bytes})"
