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
from .errors import FastcommError
from .work import Task

__all__ = ["KINDS", "SizesDisagreement", "check_v", "default_task", "overlaps",
           "raise_disagreement"]

#: the v-calls (names of ``calls.OPS``)
KINDS = ("gather", "scatter", "all_to_all", "all_gather", "reduce_scatter", "all_gather_coalesced")
_STRIDED = torch.strided


class SizesDisagreement(FastcommError, ValueError):
    """The ranks of a v-call disagree on its op, root, dtype or sizes (raised on every rank,
    the communicator still usable)."""


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
    comm._check_open(op)
    outputs, inputs = list(outputs), list(inputs)
    size = comm.size
    if len(outputs) == size and len(inputs) == size:
        first = inputs[0]
        if type(first) is torch.Tensor:  # the usual call, checked in one pass
            dtype, device = first.dtype, first.device
            if all(type(t) is torch.Tensor and t.dtype is dtype and t.layout is _STRIDED
                   and t.is_contiguous() and t.device == device for t in outputs + inputs):
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
