"""What a backend lacks, done once for all of them by the :class:`~.base.Communicator` contract.

A ``PremulSum`` a backend does not fold is a ``mul_`` before a ``SUM``; a sparse tensor it
cannot reduce is densified, reduced and made sparse again; a bitwise op or extra dtype it does
not reduce is an ``all_gather`` reduced in rank order; an output overlapping its input where it
does not allow that is staged; ``reduce`` is an ``all_reduce`` of a copy kept on the root. Each
adaptation wraps the backend's own :class:`~.work.Task`, so it runs where and when that runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import checks
from .flight import run_recorded
from .reduction import reduce_gathered
from .types import BITWISE_OPS, PremulSum, ReduceOp, check_reduction
from .vcoll import input_bytes, plain_pieces, split_bytes
from .work import Task, Work

_Tensor = torch.Tensor
_STRIDED = torch.strided

__all__ = [
    "all_reduce_general",
    "empty_piece",
    "followed_by",
    "gathered",
    "overlap",
    "premultiplied",
    "reduce_by_all_reduce",
    "rooted_now",
    "rooted_pieces",
    "split_now",
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


def rooted_pieces(comm, op: str, mine: torch.Tensor, theirs: list | None, root: int):
    """The v-call pieces of ``gather`` (``op``; ``mine``: the input, ``theirs``: the root's
    outputs) or ``scatter`` (``mine``: the output, ``theirs``: the root's inputs): ``(mine's
    side, theirs's side, checked)``, every piece but the root's empty; ``checked``: the bytes
    the call's inputs give where every piece is a contiguous CPU tensor of one dtype (the
    checks of :func:`~.vcoll.check_v`, passed), else -1 (not checked).

    Raises:
        ValueError: ``root`` out of range; the root gave no ``theirs``.
    """
    size = comm.size
    if root.__class__ is not int or not 0 <= root < size:
        checks.check_peer(root, size, op, "root")
    empty = empty_piece(mine)
    pieces = [empty] * size
    pieces[root] = mine
    plain = (mine.__class__ is torch.Tensor and mine.is_cpu and mine.layout is torch.strided
             and mine.is_contiguous())
    if comm.rank != root:
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


def rooted_now(comm, kind: str, mine: torch.Tensor, theirs: list | None, root: int) -> bool:
    """A synchronous ``comm.gather`` (``kind``; ``mine``: the input, ``theirs``: the root's
    outputs) or ``comm.scatter`` (``mine``: the output, ``theirs``: the root's inputs) done,
    ``True``, where every piece is a contiguous CPU tensor of one dtype; else ``False`` having
    done nothing (the process group then stages or hands the call on). Counted and recorded
    as ``comm.gather`` / ``comm.scatter`` count and record theirs.

    Raises:
        ValueError: ``root`` out of range (as ``comm.gather`` raises it).
    """
    size = comm.size
    if (root.__class__ is not int or not 0 <= root < size or mine.__class__ is not _Tensor
            or not mine.is_cpu or mine.layout is not _STRIDED or not mine.is_contiguous()
            or comm._closed or not comm._cpu_native):
        return _rooted_general(comm, kind, mine, theirs, root)
    gather = kind == "gather"
    if comm.rank != root:
        nbytes = mine.nbytes if gather else 0
    elif theirs.__class__ is not list or len(theirs) != size:
        return _rooted_general(comm, kind, mine, theirs, root)
    elif plain_pieces(theirs, mine):
        nbytes = mine.nbytes if gather else input_bytes(theirs)
    else:
        return _rooted_general(comm, kind, mine, theirs, root)
    comm.stats.count(kind, nbytes)
    # recorded as comm.gather / comm.scatter record their calls
    run_recorded(comm.flight, kind, mine, root, _rooted_run, comm, kind, mine, theirs, root)
    return True


def _rooted_run(comm, kind: str, mine: torch.Tensor, theirs: list | None, root: int) -> None:
    """:func:`rooted_now`'s call: on the inline lane, else as a task."""
    if comm._run_inline_rooted(kind, root, mine, theirs):
        return
    pieces, others, _ = rooted_pieces(comm, kind, mine, theirs, root)
    outputs, inputs = (others, pieces) if kind == "gather" else (pieces, others)
    comm._run(comm._impl_v_call(kind, root, outputs, inputs), False)


def _rooted_general(comm, kind: str, mine: torch.Tensor, theirs: list | None,
                    root: int) -> bool:
    """:func:`rooted_now` of anything but its usual call: every check of
    :func:`rooted_pieces`."""
    pieces, others, checked = rooted_pieces(comm, kind, mine, theirs, root)
    if checked < 0 or comm._closed or not comm._cpu_native:
        return False
    outputs, inputs = (others, pieces) if kind == "gather" else (pieces, others)
    comm.stats.count(kind, checked)

    def run() -> None:
        if not comm._run_inline_v(kind, root, outputs, inputs):
            comm._run(comm._impl_v_call(kind, root, outputs, inputs), False)

    # recorded as comm.gather / comm.scatter record their calls
    run_recorded(comm.flight, kind, mine, root, run)
    return True


def split_now(comm, output: torch.Tensor, input: torch.Tensor, output_splits,
              input_splits) -> bool:
    """A synchronous ``comm.all_to_all_split`` done, ``True``, where both tensors are
    contiguous CPU tensors of one dtype and the splits are valid; else ``False`` having done
    nothing (the process group then stages or hands the call on). Counted and recorded as
    ``comm.all_to_all_split`` counts and records its calls."""
    if (comm._closed or not comm._cpu_native or input.__class__ is not _Tensor
            or not input.is_cpu or not plain_pieces((output, input), input)):
        return False
    byte_splits = split_bytes(comm.size, output, input, output_splits, input_splits)
    if byte_splits is None:
        return False
    comm.stats.count("all_to_all", input.nbytes)
    # recorded as comm.all_to_all_split records its calls
    run_recorded(comm.flight, "all_to_all_v", input, None, _split_run, comm, output, input,
                 output_splits, input_splits, byte_splits)
    return True


def _split_run(comm, output: torch.Tensor, input: torch.Tensor, output_splits, input_splits,
               byte_splits) -> None:
    """:func:`split_now`'s call: on the inline lane, else as a task."""
    if not comm._run_inline_v_split(output, input, *byte_splits):
        outputs = list(output.split_with_sizes(list(output_splits)))
        inputs = list(input.split_with_sizes(list(input_splits)))
        comm._run(comm._impl_v_call("all_to_all", -1, outputs, inputs), False)


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


def reduce_by_all_reduce(comm, tensor: torch.Tensor, root: int, op: ReduceOp) -> Task:
    """``reduce`` as an ``all_reduce`` of a copy, written back on ``root`` only."""
    scratch = tensor.clone()
    task = comm._impl_all_reduce(scratch, op)
    keep = (lambda: tensor.copy_(scratch)) if comm.rank == root else (lambda: None)
    return Task("reduce", tensor, followed_by(task, keep).run, task.executor)


def reduces_itself(target, tensor: torch.Tensor, op: ReduceOp, name: str) -> bool:
    """For a bitwise op or a dtype of :data:`~.types.EXTRA_DTYPES`: raises unless the
    contract reduces the pair (before anything is sent), then whether ``target`` reduces it
    itself (``Capabilities.extended_reductions``)."""
    check_reduction(tensor.dtype, op, name)
    return target.capabilities.extended_reductions


def gathered(comm, target, tensor: torch.Tensor, op: ReduceOp, root: int | None) -> Task:
    """A reduction ``target`` does not do itself: an ``all_gather`` of every rank's bytes,
    then the terms reduced in rank order (:func:`~.reduction.reduce_gathered`) on every rank,
    or on ``root`` only. One round of the backend's own all-gather, ``size`` times the
    tensor's bytes of scratch."""
    flat = tensor.view(-1).view(torch.uint8)
    rows = flat.new_empty((comm.size, flat.numel()))
    task = target._impl_all_gather(rows, flat)
    name = "all_reduce" if root is None else "reduce"
    if root is not None and root != comm.rank:
        return Task(name, tensor, task.run, task.executor)
    return Task(name, tensor,
                followed_by(task, lambda: reduce_gathered(rows, tensor, op)).run, task.executor)


def all_reduce_general(comm, tensor, op, async_op: bool) -> Work | None:
    """``comm.all_reduce`` of anything but a plain dense tensor with a :class:`ReduceOp`:
    every check, sparse tensors, op names and torch's ops, ``PremulSum``, tensors that
    require grad."""
    tensor = checks.untracked(tensor)
    comm._check_open("all_reduce")
    if isinstance(tensor, torch.Tensor) and tensor.layout is torch.sparse_coo:
        return _all_reduce_sparse(comm, tensor, op, async_op)
    checks.check_tensor(tensor, "all_reduce", dtypes=checks.REDUCED_DTYPES)
    op = ReduceOp.coerce(op)
    if op.__class__ is PremulSum:
        checks.check_premul_dtype(tensor, op)
    comm.stats.record("all_reduce", tensor)
    target = comm._target(tensor, "all_reduce")
    if op.__class__ is not PremulSum:
        if (op in BITWISE_OPS or tensor.dtype not in checks.DTYPES) and not reduces_itself(
            target, tensor, op, "all_reduce"
        ):
            return comm._run(gathered(comm, target, tensor, op, None), async_op)
        if not async_op and target._run_inline("all_reduce", tensor, op):
            return None
        return comm._run(target._impl_all_reduce(tensor, op), async_op)
    if tensor.dtype in target.capabilities.premul_dtypes:
        return comm._run(target._impl_all_reduce(tensor, op), async_op)
    task = target._impl_all_reduce(tensor, ReduceOp.SUM)
    if op.factor != 1.0:  # x * 1.0 == x: no pass needed
        task = premultiplied(task, tensor, op.factor)
    return comm._run(task, async_op)


def _all_reduce_sparse(comm, tensor: torch.Tensor, op: object, async_op: bool):
    """``all_reduce`` of a sparse COO tensor: natively where the backend declares it
    (``sparse_all_reduce``), else densified, reduced and made sparse again (rows that are
    zero after the reduction are dropped); the result replaces ``tensor`` in place."""
    checks.check_sparse(tensor, op)
    comm.stats.record("all_reduce", tensor._values())
    target = comm.route(tensor.device, "all_reduce")
    if target.capabilities.sparse_all_reduce:
        return comm._run(target._impl_all_reduce(tensor, ReduceOp.SUM), async_op)
    dense = tensor.to_dense()
    sparse_dim = tensor.sparse_dim()
    task = target._impl_all_reduce(dense, ReduceOp.SUM)
    task = followed_by(task, lambda: tensor.copy_(dense.to_sparse(sparse_dim)))
    return comm._run(Task("all_reduce", tensor, task.run, task.executor), async_op)
