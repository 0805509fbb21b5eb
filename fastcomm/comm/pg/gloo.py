"""Gloo communicator: torch's ``ProcessGroupGloo`` built directly on a fastcomm store.

No global ``torch.distributed`` state is touched: the process group is private to this object,
so a program may hold several (``split``) beside an ``init_process_group`` of its own. The
collectives are ``ProcessGroupCommunicator``'s (``process_group.py``): handles complete in
issue order on a per-communicator thread, with ``AVG`` applied as ``SUM`` and a division.

A lost rank (in-place recovery's watch, from any thread): :meth:`~.process_group.
ProcessGroupCommunicator.abort` stops the host waits within ``ABORT_SLICE_S`` (Gloo's own abort
does not release a waiting call) and refuses later calls; the aborted group is stranded, kept
past the interpreter's exit, so that neither :meth:`close` nor the exit waits on it.
"""

from __future__ import annotations

import atexit
import ctypes
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import FastcommError
from ..store import Store
from ..types import Capabilities
from .process_group import ProcessGroupCommunicator

__all__ = ["ABORT_SLICE_S", "GlooCommunicator"]

#: Seconds a wait on Gloo sleeps before it looks whether the communicator was aborted.
ABORT_SLICE_S = 0.02

# groups of aborted communicators: an operation on a lost peer (a powered-off host answers
# nothing) may still run in one until its timeout, and destroying the group waits for it
_STRANDED: list = []


@atexit.register
def _strand_forever() -> None:
    """Keeps the stranded groups alive past the interpreter's finalization: destroying one
    would hold the exit for up to the collective timeout (minutes) while its operation waits on
    a peer that is gone; the process's exit ends its threads instead."""
    for group in _STRANDED:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


class GlooCommunicator(ProcessGroupCommunicator):
    """Collectives over TCP with Gloo, on CPU tensors (and CUDA tensors, staged by Gloo).

    Args:
        store: a store namespace private to this communicator.
        rank: this process's rank.
        size: number of ranks.
        timeout: limit for connecting and for every collective.

    Raises:
        FastcommError: the full mesh could not be connected within ``timeout``.
    """

    backend = "gloo"
    abort_slice_s = ABORT_SLICE_S

    def __init__(
        self,
        store: Store,
        rank: int,
        size: int,
        timeout: float | timedelta | None = None,
    ) -> None:
        super().__init__(store, rank, size, timeout)
        # CPU tensors, and CUDA ones staged through host memory; sparse COO natively; with
        # more than two ranks an element's sum order depends on its place in the ring's chunks
        self.capabilities = Capabilities(
            devices=frozenset({"cpu", "cuda"}), sparse_all_reduce=True, layout_free=size <= 2,
            shrinks_across_hosts=True,
        )
        start = time.monotonic()
        try:
            self.process_group = dist.ProcessGroupGloo(
                store.prefixed("gloo").torch_store, rank, size, self.timeout
            )
        except RuntimeError as exc:
            raise FastcommError(
                f"rank {rank}: Gloo could not connect {size} ranks through the store at "
                f"{store.address} after {time.monotonic() - start:.1f} s: {exc}"
            ) from exc

    @property
    def device(self) -> torch.device:
        """CPU: Gloo's own device (it also moves CUDA tensors, staged through host memory)."""
        return torch.device("cpu")

    def _impl_close(self) -> None:
        super()._impl_close()
        # The group is destroyed here, not left to the garbage collector: the caller usually
        # still holds this communicator (``comm = fastcomm.init()`` lives until the interpreter
        # exits). A Gloo worker thread that finished the last collective still holds its work
        # (and the tensors whose Python objects the caller dropped): releasing them takes the
        # GIL. Left to the interpreter's exit, that thread asks for the GIL while the
        # interpreter finalizes, is ended by pthread_exit inside a noexcept destructor, and the
        # process dies of "terminate called without an active exception" (SIGABRT) after all
        # its work succeeded. Destroying the group joins those threads now, with the GIL
        # released (torch's binding drops it to destroy a group), so they finish first.
        group, self.process_group = self.process_group, None
        if self._aborted is not None:
            _STRANDED.append(group)
            return
        try:
            group.shutdown()
        except RuntimeError:
            pass  # already torn down by a failed peer; the destruction below releases the rest
        del group
