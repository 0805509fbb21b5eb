"""Point-to-point of the ``fastcomm`` process group: ``send``, ``recv``, ``recv_anysource``.

On a group whose CPU communicator is ``shm``, a dense CPU tensor of any dtype moves as its
bytes through the communicator's tagged engine (:class:`~fastcomm.comm.shm.p2p.Mailboxes`);
the usual call (one contiguous tensor of one chunk) is one call of the engine's compiled lane
(``Mailboxes.lane``), every other one (a non-contiguous tensor: through a copy) goes through
:meth:`_send`/:meth:`_recv`. Anything else (CUDA, sparse, a ``hier`` or ``gloo``
communicator) is handed to the Gloo group (or a device map's CUDA backend) unchanged.

Invariants: ``dist.batch_isend_irecv`` reaches this group as one ``send``/``recv`` per
operation (torch does not coalesce for a Python group); a send to or receive from this rank
itself raises ``ValueError``; complex tensors travel as their real view on both sides.

What torch calls, and when: docs/torch_backend.md.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..calls import DTYPE_CODES as _CODES
from ..errors import CommAbortedError, CommClosedError, CommTimeoutError
from ..flight import ended
from ..shm.p2p import MessageMismatchError
from .issue import _REUSE_DONE
from .multi import copier
from .works import FinishedWork, finished_work, thread_future, wait_seconds

__all__ = ["MessageMismatchError", "MessageWork", "P2POps"]

_STRIDED = torch.strided
_TAG_MIN, _TAG_MAX = -(1 << 63), (1 << 63) - 1
_increment_version = torch._C._increment_version
_refcount = sys.getrefcount


class _Received(FinishedWork):
    """A receive that finished before its call returned, with the rank it came from."""

    __slots__ = ("_src",)

    def holding(self, outputs: list, src: int) -> _Received:
        """This handle, now of a receive into ``outputs`` from rank ``src`` (made once per
        group, reused while nobody holds it)."""
        self._outputs, self._src = outputs, src
        return self

    def _source_rank(self) -> int:
        return self._src

    source_rank = _source_rank


class MessageWork(dist._Work):
    """The handle of a send or receive still in flight on the engine: ``wait()`` moves every
    pending operation until this one is done (``post`` then completes a receive: the copy
    into a non-contiguous tensor, autograd's version counter), raising its error naming the
    rank, the operation and the peer. ``_source_rank()`` is the sender of a receive."""

    __slots__ = ("_engine", "_op", "_outputs", "_post", "_error", "_finished", "_future",
                 "_flight")

    def __init__(self, engine, op, outputs: list, post, flight: tuple | None = None) -> None:
        super().__init__()
        self._engine = engine
        self._op = op
        self._outputs = outputs
        self._post = post
        self._error: BaseException | None = None
        self._finished = False
        self._future: torch.futures.Future | None = None
        self._flight = flight  # (recorder, seq) until the operation ends

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Blocks until the operation is done and raises its error.

        Args:
            timeout: a limit for this wait (``None`` or zero: the group's timeout ends an
                operation whose peer never comes, aborting the communicator); when it passes,
                ``CommTimeoutError`` is raised and the operation is left pending.
        """
        if not self._finished:
            try:
                self._engine.wait(self._op, wait_seconds(timeout))
            except CommTimeoutError:
                if not self._op.done:  # this wait's own limit: the operation goes on
                    raise
                self._settle()
                raise
            except BaseException as exc:
                self._error = exc
                self._finished = True
                ended(self._flight, exc)
                self._flight = None
                raise
            self._settle()
        if self._error is not None:
            raise self._error
        return True

    def _settle(self) -> None:
        if self._finished:
            return
        error = self._op.error
        if error is None and self._post is not None:
            try:
                self._post()
            except BaseException as exc:  # kept for every later wait() and the future
                error = exc
        self._error = error
        self._finished = True
        ended(self._flight, error)
        self._flight = None

    def is_completed(self) -> bool:
        if not self._finished:
            engine = self._engine
            if not self._op.done:
                with engine._lock:
                    engine._progress()
            if self._op.done:
                self._settle()
        return self._finished

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error if self.is_completed() else None

    def result(self) -> list:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def _source_rank(self) -> int:
        """The sender of a receive (torch reads it as ``work._source_rank()``)."""
        self.wait()
        return self._op.source

    source_rank = _source_rank

    def get_future(self) -> torch.futures.Future:
        """A future of the output tensors, completed by a thread of its own that waits."""
        if self._future is None:
            self._future = thread_future(self.wait, lambda: self._outputs, "fastcomm-p2p-future")
        return self._future

    def __repr__(self) -> str:
        op = self._op
        where = "any rank" if op.peer is None else f"rank {op.peer}"
        return f"MessageWork({op.kind} {where}, {'done' if self._finished else 'pending'})"


def _recorded(comm, name: str, tensor: torch.Tensor, peer: int | None) -> tuple | None:
    """The call recorded in ``comm``'s flight recorder, as ``comm.send``/``comm.recv`` record
    theirs: ``(recorder, seq)``, or ``None`` with the recorder off."""
    recorder = comm.flight
    return None if recorder is None else (recorder, recorder.issue(name, tensor, peer))


class P2POps:
    """The point-to-point half of :class:`~.group.FastcommProcessGroup` (which sets ``_rank``,
    ``_size``, ``communicator``, ``_coalescing``, and the engine state below to ``None``:
    ``_mailboxes``, ``_lane``, ``_last_received``); see the module docstring."""

    def _received(self, tensors: list, src: int) -> _Received:
        """The handle of a receive that finished at once: the group's previous one when nothing
        holds that any more (as ``IssueOps._done``: making a ``dist._Work`` costs more than the
        rest of the call), else a new one."""
        work = self._last_received
        # 3: the attribute, `work` and the argument: no one else holds it
        if work is None or not _REUSE_DONE or _refcount(work) != 3:
            work = self._last_received = _Received()
        return work.holding(tensors, src)

    def _engine(self, tensor: torch.Tensor):
        """The group's tagged engine for ``tensor``, or ``None`` (hand the call to Gloo)."""
        if not tensor.is_cpu or tensor.layout is not _STRIDED:
            return None
        engine = self._mailboxes
        if engine is None:
            comm = self.communicator
            if not comm.capabilities.tagged_p2p:
                self._mailboxes = False
                return None
            engine = self._mailboxes = comm.mailboxes
            self._lane = engine.lane(comm, FinishedWork, _Received, _REUSE_DONE)
        return engine or None

    def _checked(self, tensors: Any, peer: int | None, tag: Any, op: str) -> torch.Tensor:
        """The one tensor of a send or receive, after the checks torch leaves to the group."""
        if tensors.__class__ is list and len(tensors) == 1 and peer.__class__ is int and (
                tag.__class__ is int and 0 <= peer < self._size and peer != self._rank
                and _TAG_MIN <= tag <= _TAG_MAX):
            tensor = tensors[0]
            if tensor.__class__ is torch.Tensor:
                return tensor  # the usual call, checked without building any message
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if len(tensors) != 1 or not isinstance(tensors[0], torch.Tensor):
            raise ValueError(f"rank {self._rank}: {op} takes a list of one tensor, got "
                             f"{len(tensors)} items")
        if peer is not None and (not isinstance(peer, int) or isinstance(peer, bool)
                                 or not 0 <= peer < self._size or peer == self._rank):
            raise ValueError(
                f"rank {self._rank}: {op}: peer rank {peer!r} must be another rank of the group "
                f"(0..{self._size - 1}, not {self._rank})"
            )
        if not isinstance(tag, int) or isinstance(tag, bool) or not _TAG_MIN <= tag <= _TAG_MAX:
            raise ValueError(f"rank {self._rank}: {op}: tag {tag!r} must be an int in "
                             f"[-2**63, 2**63)")
        return tensors[0]

    def _check_usable(self, op: str) -> None:
        """Raises when the communicator was closed or failed earlier (nothing is issued)."""
        comm = self.communicator
        if comm.closed:
            raise CommClosedError(f"rank {self._rank}: {op} called after close() of this "
                                  f"group's communicator")
        if comm.broken is not None:
            raise CommAbortedError(
                f"rank {self._rank}: {op} refused: this group's shm communicator failed earlier "
                f"({comm.broken})"
            )

    def _issued(self, tensors: list, engine, op, post, flight: tuple | None = None) -> Any:
        """The handle of an operation the engine took: finished already, or pending."""
        if op.done and self._coalescing is None:
            ended(flight, op.error)
            if op.error is not None:
                raise op.error
            if post is not None:
                post()
            if op.kind == "send":
                return finished_work(tensors)
            return _Received().holding(tensors, op.source)
        handle = MessageWork(engine, op, tensors, post, flight)
        if flight is not None:  # recorded as pending until the operation ends (MessageWork)
            flight[0].pending(flight[1])
        if self._coalescing is not None:
            self._coalescing.append(handle)
        return handle

    def send(self, tensors: list, dstRank: int, tag: int = 0) -> Any:  # noqa: N803 - torch's
        """The group's ``send``: see the module docstring. The usual call (one contiguous CPU
        tensor of one chunk to another rank, not coalescing) is one call of the engine's compiled
        lane (:meth:`~fastcomm.comm.shm.p2p.Mailboxes.lane`), with :meth:`_send`'s checks, record
        and handle; anything else, or a peer not ready within the spin budget, goes to
        :meth:`_send`."""
        lane = self._lane
        if lane is not None and self._coalescing is None:
            work = lane.send(tensors, dstRank, tag)
            if work is None or work is False:  # False: tried at once already
                return self._send(tensors, dstRank, tag, work is None)
            return work
        return self._send(tensors, dstRank, tag)

    def _send(self, tensors: list, dst: int, tag: int, now: bool = True) -> Any:
        """:meth:`send` of any call: every check, staging, handing on (``now``: a one-chunk
        message is tried at once first)."""
        tensor = self._checked(tensors, dst, tag, "send")
        engine = self._mailboxes
        if not engine or not tensor.is_cpu or tensor.layout is not _STRIDED:
            engine = self._engine(tensor)
            if engine is None:
                return self._forward("send", tensors, tensor, tensors, dst, tag, peer=dst)
        comm = self.communicator
        if comm.closed or comm.broken is not None:
            self._check_usable("send")
        comm.stats.record("send", tensor)
        engine.check_rejects(dst, "send to")
        code = _CODES[tensor.dtype]
        flight = _recorded(comm, "send", tensor, dst)
        try:
            if tensor.is_contiguous():
                if now and self._coalescing is None and engine.send_now(
                        tensor.data_ptr(), tensor.nbytes, dst, tag, code):
                    ended(flight, None)
                    return self._done(tensors)
                data = tensor
            else:
                data = tensor.contiguous()
            op = engine.isend(data, dst, tag, code)
        except BaseException as exc:
            ended(flight, exc)
            raise
        return self._issued(tensors, engine, op, None, flight)

    def recv(self, tensors: list, srcRank: int | None, tag: int = 0) -> Any:  # noqa: N803
        """The group's ``recv`` (``srcRank``: a rank) and ``recv_anysource`` (``None``). The usual
        call (one contiguous CPU tensor of one chunk from another rank, as :meth:`send`'s) is one
        call of the engine's compiled lane; anything else goes to :meth:`_recv`."""
        lane = self._lane
        if lane is not None and self._coalescing is None:
            work = lane.recv(tensors, srcRank, tag)
            if work is None or work is False:  # False: tried at once already
                return self._recv(tensors, srcRank, tag, work is None)
            return work
        return self._recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors: list, tag: int = 0) -> Any:
        """:meth:`recv` from whichever rank's message comes first (torch's
        ``recv_anysource``); its handle's ``_source_rank()`` names that rank."""
        lane = self._lane
        if lane is not None and self._coalescing is None:
            work = lane.recv(tensors, None, tag)
            if work is None or work is False:  # False: tried at once already
                return self._recv(tensors, None, tag, work is None)
            return work
        return self._recv(tensors, None, tag)

    def _recv(self, tensors: list, src: int | None, tag: int, now: bool = True) -> Any:
        """:func:`recv` of any call: every check, staging, handing on (``now``: a one-chunk
        message from a named rank is tried at once first)."""
        name = "recv" if src is not None else "recv_anysource"
        tensor = self._checked(tensors, src, tag, name)
        engine = self._mailboxes
        if not engine or not tensor.is_cpu or tensor.layout is not _STRIDED:
            engine = self._engine(tensor)
            if engine is None:
                if src is None:
                    return self._forward(name, tensors, tensor, tensors, tag)
                return self._forward(name, tensors, tensor, tensors, src, tag, peer=src)
        comm = self.communicator
        if comm.closed or comm.broken is not None:
            self._check_usable(name)
        comm.stats.record("recv", None)
        code = _CODES[tensor.dtype]
        if src is not None:
            engine.check_rejects(src, "receive from")
        flight = _recorded(comm, "recv", tensor, src)
        try:
            if tensor.is_contiguous():
                if now and src is not None and self._coalescing is None and engine.recv_now(
                        tensor.data_ptr(), tensor.nbytes, src, tag, code):
                    ended(flight, None)
                    _increment_version((tensor,))  # written behind autograd's back
                    return self._received(tensors, src)
                data, post = tensor, partial(_increment_version, (tensor,))
            else:
                data = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                post = copier(tensor, data)
            op = engine.irecv(data, src, tag, code)
        except BaseException as exc:
            ended(flight, exc)
            raise
        return self._issued(tensors, engine, op, post, flight)

