"""What a shared bucket region's in-place all-reduces moved: one counter class for every
backend that hands DDP bucket memory (``shm``'s segment, ``ipc``'s peer-mapped GPU memory)."""

from __future__ import annotations

__all__ = ["RegionStats"]


class RegionStats:
    """Bytes this rank's in-place all-reduces moved (each region's module docstring says
    how many per bucket).

    Attributes:
        buckets: bucket all-reduces run.
        gradient_bytes: their bytes together.
        written: bytes written (reductions and copies), into any rank's area.
        read: bytes read, this rank's own area included.
        peer_read: bytes read out of the peers' areas.
    """

    __slots__ = ("buckets", "gradient_bytes", "written", "read", "peer_read")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forgets every count."""
        self.buckets = self.gradient_bytes = self.written = self.read = self.peer_read = 0

    def per_gradient_byte(self) -> dict[str, float]:
        """Written, read, peer-read and moved (written + peer-read) bytes per gradient byte."""
        g = max(1, self.gradient_bytes)
        return {
            "written": self.written / g,
            "read": self.read / g,
            "peer_read": self.peer_read / g,
            "moved": (self.written + self.peer_read) / g,
        }

    def __repr__(self) -> str:
        return (
            f"RegionStats(buckets={self.buckets}, gradient_bytes={self.gradient_bytes}, "
            f"written={self.written}, read={self.read}, peer_read={self.peer_read})"
        )
