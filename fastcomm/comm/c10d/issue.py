"""How the process group issues its calls (:class:`IssueOps`, a base of
:class:`~.group.FastcommProcessGroup`): a communicator call as a work, finished or pending; the
several calls of a coalesced op as one work; a call handed on to the torch backend beside the
communicator (Gloo, or a device map's CUDA backend), a collective handed to Gloo compared
across the ranks first (``agree``); and torch's coalescing of the works of several calls."""

from __future__ import annotations

import sys
import time

import torch

from ..calls import encode, first_difference, mismatch_message
from ..errors import FastcommError, SizesDisagreement
from ..work import wrap_error
from .agree import CHECKED_OPS, FINGERPRINT, agrees, fingerprint, gloo_call
from .works import FastcommWork, FinishedWork, finished_work

__all__ = ["IssueOps"]

_refcount = sys.getrefcount
# _done's count of references is CPython's up to 3.13 (3.14 may skip counting borrowed
# references): elsewhere every finished call gets a handle of its own
_REUSE_DONE = sys.implementation.name == "cpython" and sys.version_info < (3, 14)
# c10d's ProcessGroup method -> the Backend method that implements it (forwarding to Gloo/NCCL)
_BACKEND_NAMES = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
}
# a coalesced method a backend may lack -> the per-tensor method it is done with
_PER_TENSOR = {
    "allgather_into_tensor_coalesced": "_allgather_base",
    "reduce_scatter_tensor_coalesced": "_reduce_scatter_base",
}


class IssueOps:
    """The issuing half of :class:`~.group.FastcommProcessGroup` (which sets ``_rank``,
    ``_size``, ``_name``, ``gloo``, ``communicator``, ``agreed``, ``_coalescing`` and
    ``_backend_for``)."""

    def _issue(self, op: str, outputs: list, async_op: bool, fn, *args, post=None):
        """Runs the communicator call ``fn(*args, async_op)``: to completion on this thread
        when torch issues the call synchronously (the communicator's synchronous lane), else
        as its asynchronous work; ``post`` completes the call once the data is in place."""
        if async_op:
            work = fn(*args, True)
            if work is None and post is None:
                handle = finished_work(outputs)
            else:
                handle = FastcommWork(op, self._rank, outputs, (work,) if work else (), post)
        else:
            fn(*args, False)
            if post is not None:
                post()
            handle = self._done(outputs)
        if self._coalescing is not None:
            self._coalescing.append(handle)
        return handle

    _last_done: FinishedWork | None = None

    def _done(self, outputs: list) -> FinishedWork:
        """The handle of a call that finished before it returned: the group's previous one
        when nothing holds that any more (torch's ``dist.all_reduce`` drops it once ``wait()``
        returned), else a new one. Making a ``dist._Work`` costs more than the rest of the
        adapter's part of a call; a handle someone still holds (a caller, C++, a coalescing
        list) is never reused, so each holder keeps its own outputs."""
        work = self._last_done
        # 3: the attribute, `work` and the argument: no one else holds it
        if _REUSE_DONE and _refcount(work) == 3:
            return work.holding(outputs)
        work = self._last_done = finished_work(outputs)
        return work

    def _issue_all(self, op: str, outputs: list, async_op: bool, calls: list):
        """Several communicator calls (a coalesced op) as one work."""
        works = [fn(*args, True) for fn, *args in calls]
        handle = FastcommWork(op, self._rank, outputs, [w for w in works if w is not None])
        if not async_op:
            handle.wait()
        if self._coalescing is not None:
            self._coalescing.append(handle)
        return handle

    def _coalesced(self, op: str, outputs: list, inputs: list, opts, calls: list):
        """A coalesced op of output/input pairs: the pairs' communicator calls as one work, or
        the whole op handed on (:meth:`_forward`) when any pair has none."""
        if any(call is None for call in calls):
            return self._forward(op, outputs, inputs[0], outputs, inputs, opts)
        return self._issue_all(op, outputs, opts.asyncOp, calls)

    def _forward(self, op: str, outputs: list, tensor: torch.Tensor | None, *args,
                 peer: int | None = None) -> FastcommWork:
        """Hands the call to the torch backend beside the communicator (Gloo; for CUDA tensors
        a device map's own backend), unchanged; a collective handed to Gloo after the ranks
        agreed on its sizes (:meth:`_agree`). Its errors name this rank, the operation, the
        group and the peer of a send or receive (Gloo's own text does not say who is late)."""
        backend = self._backend_for(tensor)
        name = _BACKEND_NAMES.get(op, op)
        where = f"{backend.name()} in group {self._name!r} of {self._size} ranks"
        call = op
        op = f"{op} (through {where}{'' if peer is None else f', peer rank {peer}'})"
        if call in CHECKED_OPS and backend is self.gloo:
            self._agree(op, call, args)
        method = getattr(backend, name, None)
        try:
            if method is None and name in _PER_TENSOR:  # Gloo has no coalesced form of these
                method = getattr(backend, _PER_TENSOR[name])
                outs, ins, *opts = args
                works = [method(o, i, *opts) for o, i in zip(outs, ins, strict=True)]
            else:
                works = [method(*args)]
        except RuntimeError as exc:
            raise wrap_error(op, self._rank, time.monotonic(), exc) from exc
        handle = FastcommWork(op, self._rank, outputs, works)
        if self._coalescing is not None:
            self._coalescing.append(handle)
        return handle

    _agree_buffer: tuple | None = None  # (int64 tensor, its NumPy view), made on first use

    def _agree(self, what: str, op: str, args: tuple) -> None:
        """Compares the call's descriptor across the ranks (through the communicator, within
        the group's timeout): one small ``all_reduce`` of its fingerprint (see ``agree``), and
        only where that says the ranks differ, an ``all_gather`` of the descriptors for the
        message; raises ``ValueError`` on every rank when they disagree."""
        row = encode(gloo_call(op, self._size, args))
        total = self._agree_buffer
        if total is None:  # one buffer per group, filled through NumPy (no tensor per call)
            buf = torch.zeros(FINGERPRINT, dtype=torch.int64)
            total = self._agree_buffer = (buf, buf.numpy())
        buf, values = total
        values[:] = fingerprint(self._rank, self._size, row)
        self.agreed[op] += 1
        try:
            self.communicator.all_reduce(buf)
            if agrees(values.tolist(), self._size):
                return
            mine = torch.tensor(row, dtype=torch.int64)
            rows = mine.new_empty((self._size, mine.numel()))
            self.communicator.all_gather(rows, mine)
        except FastcommError as exc:
            raise type(exc)(f"rank {self._rank}: {what}: comparing the ranks' sizes: {exc}") \
                from exc
        problem = first_difference(rows.tolist()) or "their calls' fingerprints differ"
        raise SizesDisagreement(mismatch_message(self._rank, what, problem))

    def _start_coalescing(self, device: torch.device) -> None:
        self._coalescing = []

    def _end_coalescing(self, device: torch.device) -> FastcommWork:
        handles, self._coalescing = self._coalescing or [], None
        return FastcommWork("coalesced", self._rank, [], handles) if handles else finished_work([])
