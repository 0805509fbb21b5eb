"""Collectives of unequal sizes (``gather``, ``scatter``, ``all_to_all_v``, ``all_gather_v``,
``reduce_scatter_v``): what every backend shares.

Each is one *v-call*: rank ``q`` sends ``inputs[r]`` to every rank ``r`` and receives
``outputs[q]`` from every rank ``q``, pieces of any size (empty included) moved as bytes.

Invariants: each rank's call (:func:`~.calls.v_call`) is compared on every rank before any
output changes; a difference raises :class:`SizesDisagreement` (a ``ValueError``) with the
same message everywhere, and the communicator stays usable. ``shm`` folds the comparison into
the call's first round; every other backend uses the contract's default
(``CommBackend._impl_v_call``: the sizes gathered, then one padded ``all_to_all``).

More: docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .calls import mismatch_message
from .errors import SizesDisagreement

__all__ = ["KINDS", "SizesDisagreement", "input_bytes", "overlaps", "plain_pieces",
           "raise_disagreement", "split_bytes"]

#: the v-calls (names of ``calls.OPS``)
KINDS = ("gather", "scatter", "all_to_all", "all_gather", "reduce_scatter", "all_gather_coalesced")
_STRIDED = torch.strided


def raise_disagreement(rank: int, kind: str, problem: str) -> None:
    """Raises :class:`SizesDisagreement` with the one mismatch text (:mod:`~.calls`)."""
    raise SizesDisagreement(mismatch_message(rank, kind, problem))


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
