"""Task combinators and operand helpers of the :class:`~.base.Communicator` contract.

What a backend lacks is done once for all of them by the front end with these: a ``PremulSum``
a backend does not fold is a ``mul_`` before a ``SUM`` (:func:`premultiplied`); an output
overlapping its input where the backend does not allow that is staged (:func:`staged`); a step
after a backend's task (a sparse tensor made sparse again, a copy kept on the root) follows it
(:func:`followed_by`). Each wraps the backend's own :class:`~.work.Task`, so it runs where and
when that runs. None of them reads a communicator's state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import checks
from .types import ReduceOp, check_reduction
from .vcoll import input_bytes, plain_pieces
from .work import Task, Work

__all__ = [
    "empty_piece",
    "followed_by",
    "overlap",
    "premultiplied",
    "reduces_itself",
    "rooted_pieces",
    "staged",
]


def followed_by(task: Task, after: Callable[[], None]) -> Task:
    """``task``, followed by ``after()`` once its data is in place (on the task's executor, or
    on the caller's thread for a task issued at once, which then waits for its data)."""
    inner = task.run

    def run() -> None:
        work = inner()
        if work is not None:
            work.wait()
        after()

    return Task(task.op, task.output, run, task.executor)


def premultiplied(task: Task, tensor: torch.Tensor, factor: float) -> Task:
    """``task`` (a ``SUM`` of ``tensor``) preceded by ``tensor.mul_(factor)``, run where and
    when the task runs: after the collectives queued before it on a backend that queues its
    tasks, at the call on one that issues at once (as the caller's own ``mul_`` would)."""
    reduce = task.run

    def run() -> Work | None:
        tensor.mul_(factor)
        return reduce()

    return Task(task.op, task.output, run, task.executor)


_EMPTY: dict[tuple, torch.Tensor] = {}
_EMPTY_CPU: dict[torch.dtype, torch.Tensor] = {}  # the usual case, found without a device object


def empty_piece(like: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``like``'s dtype and device (the piece of a v-call a rank neither
    sends nor receives), made once per dtype and device."""
    if like.is_cpu:
        empty = _EMPTY_CPU.get(like.dtype)
        if empty is None:
            empty = _EMPTY_CPU[like.dtype] = like.new_empty(0)
        return empty
    key = (like.dtype, like.device)
    empty = _EMPTY.get(key)
    if empty is None:
        empty = _EMPTY[key] = like.new_empty(0)
    return empty


def rooted_pieces(rank: int, size: int, op: str, mine: torch.Tensor, theirs: list | None,
                  root: int):
    """The v-call pieces of ``gather`` (``op``; ``mine``: the input, ``theirs``: the root's
    outputs) or ``scatter`` (``mine``: the output, ``theirs``: the root's inputs) on rank
    ``rank`` of ``size``: ``(mine's side, theirs's side, checked)``, every piece but the root's
    empty; ``checked``: the bytes the call's inputs give where every piece is a contiguous CPU
    tensor of one dtype (the checks of ``Communicator``'s v-calls, passed), else -1 (not
    checked).

    Raises:
        ValueError: ``root`` out of range; the root gave no ``theirs``.
    """
    if root.__class__ is not int or not 0 <= root < size:
        checks.check_peer(root, size, op, "root")
    empty = empty_piece(mine)
    pieces = [empty] * size
    pieces[root] = mine
    plain = (mine.__class__ is torch.Tensor and mine.is_cpu and mine.layout is torch.strided
             and mine.is_contiguous())
    if rank != root:
        theirs = [empty] * size
        if plain:
            return pieces, theirs, mine.nbytes if op == "gather" else 0
    elif theirs is None:
        per_rank = "output" if op == "gather" else "input"
        raise ValueError(f"{op}: rank {root} is the root and needs one {per_rank} per rank")
    elif plain and theirs.__class__ is list and len(theirs) == size and plain_pieces(theirs,
                                                                                      mine):
        return pieces, theirs, mine.nbytes if op == "gather" else input_bytes(theirs)
    return pieces, theirs, -1


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (contiguous) share bytes."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def staged(target, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``input``, or a copy of it where it overlaps ``output`` and ``target`` does not
    take overlapping operands (``Capabilities.in_place``)."""
    if target.capabilities.in_place or not input.numel() or not overlap(output, input):
        return input
    return input.clone()


def reduces_itself(target, tensor: torch.Tensor, op: ReduceOp, name: str) -> bool:
    """For a bitwise op or a dtype of :data:`~.types.EXTRA_DTYPES`: raises unless the
    contract reduces the pair (before anything is sent), then whether ``target`` reduces it
    itself (``Capabilities.extended_reductions``)."""
    check_reduction(tensor.dtype, op, name)
    return target.capabilities.extended_reductions
