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
