"""Collectives of unequal sizes (``gather``, ``scatter``, ``all_to_all_v``, ``all_gather_v``,
``reduce_scatter_v``): what every backend shares.

Each is one *v-call*: rank ``q`` sends ``inputs[r]`` to every rank ``r`` and receives
``outputs[q]`` from every rank ``q``, pieces of any size (empty included) moved as bytes.

Invariants: each rank's call (:func:`~.calls.v_call`) is compared on every rank before any
output changes; a difference raises :class:`SizesDisagreement` (a ``ValueError``) with the
same message everywhere, and the communicator stays usable. ``shm`` folds the comparison into
the call's first round; every other backend uses :func:`default_task`.

More: docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .calls import HEAD, encode, first_difference, mismatch_message, v_call
from .errors import SizesDisagreement
from .work import Task

__all__ = ["KINDS", "SizesDisagreement", "check_v", "default_task", "input_bytes", "overlaps",
           "plain_pieces", "raise_disagreement", "split_bytes"]

#: the v-calls (names of ``calls.OPS``)
KINDS = ("gather", "scatter", "all_to_all", "all_gather", "reduce_scatter", "all_gather_coalesced")
_STRIDED = torch.strided


def raise_disagreement(rank: int, kind: str, problem: str) -> None:
    """Raises :class:`SizesDisagreement` with the one mismatch text (:mod:`~.calls`)."""
    raise SizesDisagreement(mismatch_message(rank, kind, problem))


def check_v(comm, op: str, outputs: Sequence, inputs: Sequence) -> tuple[list, list]:
    """Checks a v-call's pieces (before anything is sent): lists of ``size`` tensors, dense,
    contiguous, one dtype, on one device. Returns them as lists.

    Raises:
        TypeError: not tensors, or dtypes that differ.
        ValueError: lists of the wrong length, non-contiguous or sparse pieces, devices that
            differ.
    """
    if comm._closed:
        comm._check_open(op)
    outputs, inputs = list(outputs), list(inputs)  # the caller's lists may change later
    size = comm.size
    if len(outputs) == size and len(inputs) == size:
        first = inputs[0]
        if first.__class__ is torch.Tensor:  # the usual call, checked in one pass
            if plain_pieces(outputs, first) and plain_pieces(inputs, first):
                return outputs, inputs
    for name, pieces in (("outputs", outputs), ("inputs", inputs)):
        if len(pieces) != size:
            raise ValueError(f"{op}: {name} has {len(pieces)} tensors; expected one per rank "
                             f"({size})")
    first = inputs[0] if isinstance(inputs[0], torch.Tensor) else None
    for name, pieces in (("outputs", outputs), ("inputs", inputs)):
        for i, t in enumerate(pieces):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: {name}[{i}] must be a torch.Tensor, got "
                                f"{type(t).__name__}")
            if t.layout is not _STRIDED:
                raise ValueError(f"{op}: {name}[{i}] has layout {t.layout}; dense tensors only")
            if not t.is_contiguous():
                raise ValueError(f"{op}: {name}[{i}] must be contiguous (shape "
                                 f"{tuple(t.shape)}, strides {t.stride()})")
            if first is not None and t.dtype != first.dtype:
                raise TypeError(f"{op}: {name}[{i}] has dtype {t.dtype}, inputs[0] "
                                f"{first.dtype}; one dtype per call")
            if first is not None and t.device != first.device:
                raise ValueError(f"{op}: {name}[{i}] is on {t.device}, inputs[0] on "
                                 f"{first.device}")
    return outputs, inputs


def input_bytes(inputs: list) -> int:
    """The bytes a v-call's ``inputs`` give (a tensor sent to every rank, as ``all_gather_v``
    sends it, counts once)."""
    first = inputs[0]
    for t in inputs:  # a loop: a generator costs more than the test at a few pieces
        if t is not first:
            return sum([t.nbytes for t in inputs])
    return first.nbytes


def plain_pieces(pieces, first: torch.Tensor) -> bool:
    """Whether every piece is a dense contiguous tensor of ``first``'s dtype and device (a
    loop: a generator costs more than the checks themselves at a few pieces)."""
    dtype = first.dtype
    if first.is_cpu:  # no device object built per piece
        for t in pieces:
            if (t.__class__ is not torch.Tensor or t.dtype is not dtype
                    or t.layout is not _STRIDED or not t.is_cpu or not t.is_contiguous()):
                return False
        return True
    device = first.device
    for t in pieces:
        if (t.__class__ is not torch.Tensor or t.dtype is not dtype or t.layout is not _STRIDED
                or not t.is_contiguous() or t.device != device):
            return False
    return True


_SPLIT_BYTES: dict[tuple, tuple | None] = {}
_SPLIT_CACHE = 512  # signatures kept (the cache starts over beyond)


def split_bytes(size: int, output: torch.Tensor, input: torch.Tensor, output_splits,
                input_splits) -> tuple[list[int], list[int]] | None:
    """The bytes of each piece of an ``all_to_all`` of row blocks (``all_to_all_split``):
    ``(output's, input's)``, or ``None`` where the splits are not ``size`` sizes >= 0 summing
    to the tensor's rows along dim 0 (``checks.check_splits`` says why). Worked out once per
    (shapes, dtype, splits): the key costs a fraction of the checks."""
    try:
        key = (size, output.shape, input.shape, input.dtype, tuple(output_splits),
               tuple(input_splits))
        found = _SPLIT_BYTES.get(key, False)
    except TypeError:  # splits that do not hash: worked out every time
        key, found = None, False
    if found is not False:
        return found
    result = []
    for t, splits in ((output, output_splits), (input, input_splits)):
        rows = t.shape[0] if t.dim() else -1
        if rows < 0 or len(splits) != size or sum(splits) != rows or min(splits) < 0:
            result = None
            break
        row_bytes = t.nbytes // rows if rows else 0
        result.append([n * row_bytes for n in splits])
    found = None if result is None else tuple(result)
    if key is not None and (found is None or all(
            b.__class__ is int for part in found for b in part)):
        if len(_SPLIT_BYTES) >= _SPLIT_CACHE:
            _SPLIT_BYTES.clear()
        _SPLIT_BYTES[key] = found
    return found


def overlaps(outputs: Sequence[tuple[int, int]], inputs: Sequence[tuple[int, int]]) -> bool:
    """Whether the span of the outputs' bytes meets the span of the inputs' (``(address,
    bytes)`` pairs; a cheap, safe over-estimate: a schedule that writes outputs while inputs
    are still to be sent then stages its inputs)."""

    def span(pieces):
        live = [(a, a + n) for a, n in pieces if n]
        return (min(a for a, _ in live), max(b for _, b in live)) if live else None

    a, b = span(outputs), span(inputs)
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


def _wait(task: Task) -> None:
    work = task.run()
    if work is not None:
        work.wait()


def default_task(comm, kind: str, root: int, outputs: list, inputs: list) -> Task:
    """A v-call on a backend without a schedule of its own: the rows exchanged by its
    ``all_gather`` and compared, then one ``all_to_all`` of the pieces padded to the largest
    (bytes). Ordered as the backend orders its own calls (the executor of its tasks)."""
    size, rank = comm.size, comm.rank
    esize = inputs[0].element_size()
    mine = torch.tensor(encode(v_call(kind, root, outputs, inputs)), dtype=torch.int64)
    device = inputs[0].device
    mine = mine.to(device)
    rows = mine.new_empty((size, mine.numel()))
    gather = comm._impl_all_gather(rows, mine)

    def run() -> None:
        _wait(gather)
        table = rows.tolist()
        problem = first_difference(table)
        if problem is not None:
            raise_disagreement(rank, kind, problem)
        widest = max(max(row[HEAD:]) for row in table) * esize  # the dtypes agree
        if widest == 0:
            return
        sent = torch.zeros((size, widest), dtype=torch.uint8, device=device)
        for r, t in enumerate(inputs):
            if t.nbytes:
                sent[r, : t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
        got = torch.empty_like(sent)
        _wait(comm._impl_all_to_all(got, sent))
        for q, t in enumerate(outputs):
            if t.nbytes:
                t.reshape(-1).view(torch.uint8).copy_(got[q, : t.nbytes])

    return Task(kind, outputs[rank] if outputs else None, run, gather.executor)
