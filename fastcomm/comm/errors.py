"""Exception types raised by fastcomm's store and communicators.

All of them derive from ``RuntimeError`` so code written against torch.distributed (which raises
``RuntimeError``/``DistError``) keeps catching them; the timeout types are also ``TimeoutError``.
"""

from __future__ import annotations


class FastcommError(RuntimeError):
    """Base class of every error fastcomm raises on its own account."""


class CommTimeoutError(FastcommError, TimeoutError):
    """A collective or point-to-point operation did not finish within its timeout."""


class StoreTimeoutError(CommTimeoutError):
    """A store key did not appear (or the store could not be reached) within the timeout."""


class CommClosedError(FastcommError):
    """An operation was attempted on a communicator after ``close()`` (or after an abort)."""


class CommAbortedError(FastcommError):
    """A communicator was aborted (watchdog timeout or a peer failure) while work was pending."""


class PeerLostError(CommAbortedError):
    """An operation failed because a peer is gone: its process exited, or it marked itself
    aborted or closed.

    Args:
        message: what failed, on which rank, after how long, and which peer.
        detected_by: how the loss was seen: ``"pidfd"`` (the exit as an event), ``"poll"``
            (a look at ``/proc``), ``"flag"`` (the peer's own abort or close mark).
        seen_at: when it was seen (``time.time()``).
    """

    def __init__(self, message: str, detected_by: str = "", seen_at: float = 0.0) -> None:
        super().__init__(message, detected_by, seen_at)  # args rebuild it when unpickled
        self.detected_by = detected_by
        self.seen_at = seen_at

    def __str__(self) -> str:
        return str(self.args[0])


class CollectiveMismatchError(FastcommError):
    """The ranks issued different collectives (op, dtype, element count, reduce op or root), or
    a call's ranks disagree on its sizes: raised on every rank, its text from
    :func:`~fastcomm.comm.calls.mismatch_message`. Recognised by this type (the flight recorder
    dumps every rank's record on it), never by its text."""


class SizesDisagreement(CollectiveMismatchError, ValueError):
    """The ranks of a call of unequal sizes (a v-call, a list call handed to Gloo) disagree on
    its op, root, dtype or sizes: raised on every rank, found before any output changed, so
    the communicator stays usable."""
