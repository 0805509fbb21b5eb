"""Point-to-point of the ``fastcomm`` process group: ``send``, ``recv``, ``recv_anysource``.

What torch 2.13 calls: ``dist.send``/``dist.isend`` call the group's ``send([t], dst, tag)``,
``dist.recv``/``dist.irecv`` its ``recv([t], src, tag)``, or ``recv_anysource([t], tag)`` when
``src`` is ``None`` (then ``work._source_rank()`` for the sender); the blocking forms wait on
the work at once. ``dist.batch_isend_irecv`` coalesces (``_start_coalescing``) only when the
group's type is ``ProcessGroup`` itself with a C++ backend that coalesces; for this Python
subclass it calls ``send``/``recv`` once per operation and returns their works, so a batch is
as many entries of one engine, and the first ``wait()`` moves all of them.

On a group whose CPU communicator is ``shm`` (every rank on one host), a dense CPU tensor of
any dtype moves as its bytes through the communicator's tagged engine
(:class:`~fastcomm.comm.shm.p2p.Mailboxes`: tags honoured, any-source receives, a size or dtype
mismatch raised on both ranks, no deadlock in either direction); a non-contiguous tensor through
a contiguous copy (a receive copies back once the data is in). Anything else (CUDA tensors,
sparse ones, a ``hier`` or ``gloo`` communicator) is handed to the Gloo group (or a device map's
CUDA backend) unchanged, as before.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CommAbortedError
from ..shm.p2p import MessageMismatchError, dtype_code
from .works import FastcommWork, FinishedWork, _finished

__all__ = ["MessageMismatchError", "recv", "send"]

_STRIDED = torch.strided
_TAG_MIN, _TAG_MAX = -(1 << 63), (1 << 63) - 1
_increment_version = torch._C._increment_version


class _Received(FinishedWork):
    """A receive that finished before its call returned, with the rank it came from."""

    __slots__ = ("_src",)

    def _source_rank(self) -> int:
        return self._src

    source_rank = _source_rank


class _MessageWork:
    """One engine operation as the inner work of a :class:`FastcommWork`."""

    __slots__ = ("_engine", "_op")

    def __init__(self, engine, op) -> None:
        self._engine = engine
        self._op = op

    def wait(self, timeout: float | None = None) -> bool:
        self._engine.wait(self._op, timeout)
        return True

    def is_completed(self) -> bool:
        op = self._op
        if not op.done:
            with self._engine._lock:
                self._engine._progress()
        return op.done

    def _source_rank(self) -> int:
        return self._op.source

    def get_future(self) -> torch.futures.Future:
        raise RuntimeError("no future of its own: FastcommWork waits on a thread")


def _engine(group, tensor: torch.Tensor):
    """The group's tagged engine for ``tensor``, or ``None`` (hand the call to Gloo)."""
    if not tensor.is_cpu or tensor.layout is not _STRIDED:
        return None
    engine = group._mailboxes
    if engine is None:
        comm = group.communicator
        if not hasattr(type(comm), "mailboxes"):
            group._mailboxes = False
            return None
        engine = group._mailboxes = comm.mailboxes
    return engine or None


def _checked(group, tensors: Any, peer: int | None, tag: Any, op: str) -> torch.Tensor:
    """The one tensor of a send or receive, after the checks torch leaves to the group."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    if len(tensors) != 1 or not isinstance(tensors[0], torch.Tensor):
        raise ValueError(f"rank {group._rank}: {op} takes a list of one tensor, got "
                         f"{len(tensors)} items")
    if peer is not None and (not isinstance(peer, int) or not 0 <= peer < group._size
                             or peer == group._rank):
        raise ValueError(
            f"rank {group._rank}: {op}: peer rank {peer!r} must be another rank of the group "
            f"(0..{group._size - 1}, not {group._rank})"
        )
    if not isinstance(tag, int) or not _TAG_MIN <= tag <= _TAG_MAX:
        raise ValueError(f"rank {group._rank}: {op}: tag {tag!r} must be an int in "
                         f"[-2**63, 2**63)")
    return tensors[0]


def _check_usable(group, op: str) -> None:
    """Raises when the communicator was closed or failed earlier (nothing is issued)."""
    comm = group.communicator
    comm._check_open(op)
    if comm._broken is not None:
        raise CommAbortedError(
            f"rank {group._rank}: {op} refused: this group's shm communicator failed earlier "
            f"({comm._broken})"
        )


def _pending(group, op_name: str, tensors: list, engine, op, post) -> FastcommWork:
    handle = FastcommWork(op_name, group._rank, tensors, (_MessageWork(engine, op),), post)
    if group._coalescing is not None:
        group._coalescing.append(handle)
    return handle


def send(group, tensors: list, dst: int, tag: int) -> Any:
    """The group's ``send``: see the module docstring."""
    tensor = _checked(group, tensors, dst, tag, "send")
    engine = _engine(group, tensor)
    if engine is None:
        return group._forward("send", tensors, tensor, tensors, dst, tag, peer=dst)
    _check_usable(group, "send")
    group.communicator.stats.record("send", tensor)
    data = tensor if tensor.is_contiguous() else tensor.contiguous()
    op = engine.isend(data, dst, tag, dtype_code(tensor.dtype))
    if op.done and op.error is None and group._coalescing is None:
        return _finished(tensors)
    return _pending(group, f"send to rank {dst}", tensors, engine, op, None)


def recv(group, tensors: list, src: int | None, tag: int) -> Any:
    """The group's ``recv`` (``src``: a rank) and ``recv_anysource`` (``src``: ``None``)."""
    name = "recv" if src is not None else "recv_anysource"
    tensor = _checked(group, tensors, src, tag, name)
    engine = _engine(group, tensor)
    if engine is None:
        if src is None:
            return group._forward(name, tensors, tensor, tensors, tag)
        return group._forward(name, tensors, tensor, tensors, src, tag, peer=src)
    _check_usable(group, name)
    group.communicator.stats.record("recv", None)
    data = tensor if tensor.is_contiguous() else torch.empty_like(
        tensor, memory_format=torch.contiguous_format)

    def post() -> None:  # the bytes were written behind autograd's back
        if data is not tensor:
            with torch.no_grad():
                tensor.copy_(data)
        else:
            _increment_version((tensor,))

    op = engine.irecv(data, src, tag, dtype_code(tensor.dtype))
    if op.done and group._coalescing is None:
        if op.error is not None:
            raise op.error
        post()
        work = _Received()
        work._outputs, work._src = tensors, op.source
        return work
    where = "any rank" if src is None else f"rank {src}"
    return _pending(group, f"{name} from {where}", tensors, engine, op, post)
