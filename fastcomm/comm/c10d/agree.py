"""Agreement of a collective handed to Gloo: every rank describes its call as a
:class:`~..calls.Call` (:func:`gloo_call`), the descriptions are compared through the
communicator, and a disagreement is a ``ValueError`` on every rank (Gloo would abort the process).

The comparison is one ``all_reduce`` (``SUM``) of 18 ``int64`` values whatever the group's size
(:func:`fingerprint`): the call's ``HEAD`` fields (``calls.encode``) and their squares -- every
rank's field is the same exactly when ``(sum x)^2 == size * sum x^2`` -- and two checksums of
what the ranks send to and expect from each other, ``sum over (r, j) of w(r, j) * (sent_r[j] -
expected_j[r])`` modulo the prime ``2^61 - 1`` for two fixed pseudo-random weight tables ``w``
(each rank's term sent as two halves, so the sum is exact in ``int64``): zero when every rank
``j`` expects what rank ``r`` sends it; where one count differs, never zero; where several do,
zero for both tables with probability about ``2^-122``. On ``shm`` that is one small-message
round in its compiled core; on ``hier`` it rides in the agreement its own collectives make.
Only where the ranks disagree are the rows gathered and compared
(:func:`~..calls.first_difference`), for a message naming both calls."""

from __future__ import annotations

from collections.abc import Sequence
from operator import mul
from typing import Any

import torch
import torch.distributed as dist

from ..calls import HEAD, Call

__all__ = ["CHECKED_OPS", "FINGERPRINT", "RED", "agrees", "as_list", "fingerprint",
           "gloo_call", "kind_of"]

RED = dist.ReduceOp.RedOpType


def kind_of(reduce_op: Any) -> int:
    """The value of a ``dist.ReduceOp``'s kind (``RedOpType``)."""
    return getattr(reduce_op, "op", reduce_op).value


def as_list(tensors: Any) -> list:
    """``[tensors]`` for one tensor, else ``tensors`` (torch passes either)."""
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors


# ---------------------------------------------------------------------- Gloo-path agreement
# Gloo aborts the process (gloo::EnforceNotMet from its own thread) when the ranks of a call
# disagree on sizes, so a collective handed to it is first described on every rank and the
# descriptions are compared through the communicator: a disagreement is a ValueError on every
# rank, as on the fast path. Point-to-point calls involve two ranks only and are not checked.
#: the group methods whose calls are compared before Gloo runs them (names of ``calls.OPS``)
CHECKED_OPS = frozenset((
    "allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather",
    "all_gather_single", "all_gather_single_coalesced", "allgather_coalesced",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "all_to_all_single", "alltoall", "gather", "scatter",
))
_SYMMETRIC = frozenset(("allreduce", "allreduce_coalesced", "reduce", "broadcast"))
_LAYOUT_MASK = (1 << 20) - 1  # a layout hash small enough that its square sums exactly in int64
_PRIME = (1 << 61) - 1  # the checksums' modulus
_HALF = 31  # a checksum term goes as (term >> 31, term & (2^31 - 1)): each sums exactly in int64
_LOW = (1 << _HALF) - 1
_WEIGHTS: dict[int, tuple[list[list[int]], list[list[int]]]] = {}  # by group size
_RANK_WEIGHTS: dict[tuple[int, int], list] = {}  # by (rank, size)
#: the fingerprint's length: the head, its squares, two checksums of two halves each
FINGERPRINT = 2 * HEAD + 4


def _numel(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def _per_rank(sizes: list[int], size: int) -> list[int]:
    """``sizes`` if it has an entry per rank, else ``-1`` for each (a list of the wrong
    length, which Gloo refuses itself when every rank passes one)."""
    return sizes if len(sizes) == size else [-1] * size


def _even(numel: int, size: int) -> int:
    return numel // size if numel % size == 0 else -1


def _flows(op: str, size: int, args: tuple) -> tuple[list, list[int], list[int]]:
    """What a collective handed to Gloo moves: ``(this rank's tensors, sent_to,
    expected_from)``, the elements this rank sends to each rank and expects from each. The
    ranks' calls agree when rank ``r``'s ``sent_to[j]`` is rank ``j``'s ``expected_from[r]``.

    Args:
        op: the group method's name (one of ``CHECKED_OPS``).
        size: the group's size.
        args: the arguments handed to Gloo, options last.
    """
    *tensors, opts = args
    if op in _SYMMETRIC:  # (tensors, opts): the same tensors on every rank
        mine = tensors[0]
        return mine, [_numel(mine)] * size, [_numel(mine)] * size
    if op == "gather":  # ([[t per rank]] on the root, else []), [t]
        outputs, mine = tensors
        sent = [0] * size
        sent[opts.rootRank % size] = _numel(mine)
        expected = [t.numel() for t in outputs[0]] if outputs else [0] * size
        return mine, sent, _per_rank(expected, size)
    if op == "scatter":  # [t], ([[t per rank]] on the root, else [])
        mine, inputs = tensors
        expected = [0] * size
        expected[opts.rootRank % size] = _numel(mine)
        sent = [t.numel() for t in inputs[0]] if inputs else [0] * size
        return mine, _per_rank(sent, size), expected
    if op == "allgather":  # [[t per rank]], [t]
        outputs, mine = tensors
        expected = [t.numel() for t in outputs[0]] if outputs else []
        return mine, [_numel(mine)] * size, _per_rank(expected, size)
    if op == "allgather_coalesced":  # [[t per input] per rank], [t per input]
        outputs, mine = tensors
        return mine, [_numel(mine)] * size, _per_rank([_numel(row) for row in outputs], size)
    if op == "reduce_scatter":  # [t], [[t per rank]]
        mine, inputs = tensors
        sent = [t.numel() for t in inputs[0]] if inputs else []
        return mine, _per_rank(sent, size), [_numel(mine)] * size
    if op == "alltoall":  # [t per rank], [t per rank]
        outputs, inputs = tensors
        sent = _per_rank([t.numel() for t in inputs], size)
        return inputs, sent, _per_rank([t.numel() for t in outputs], size)
    if op == "all_to_all_single":  # output, input, output splits, input splits

        def split(t: torch.Tensor, splits: Sequence[int]) -> list[int]:
            if not splits:
                return [_even(t.numel(), size)] * size
            row = t[0].numel() if t.dim() and len(t) else 0
            return _per_rank([n * row for n in splits], size)

        output, input, out_splits, in_splits = tensors
        return [input], split(input, in_splits), split(output, out_splits)
    # all_gather_single / reduce_scatter_single and their coalesced forms: output(s), input(s)
    outputs, inputs = (as_list(t) for t in tensors)
    if "gather" in op:
        return inputs, [_numel(inputs)] * size, [_even(_numel(outputs), size)] * size
    return inputs, [_even(_numel(inputs), size)] * size, [_numel(outputs)] * size


def gloo_call(op: str, size: int, args: tuple) -> Call:
    """This rank's call of a collective handed to Gloo: no shared element count, the elements
    it sends to each rank and expects from each instead (the arguments handed to Gloo, options
    last)."""
    tensors, sent, expected = _flows(op, size, args)
    opts = args[-1]
    reduce_op = getattr(opts, "reduceOp", None)
    # symmetric ops: every tensor's size agrees, not only the total (hash of ints: the same
    # in every process)
    layout = hash(tuple(t.numel() for t in tensors)) & _LAYOUT_MASK if op in _SYMMETRIC else 0
    return Call(op, tensors[0].dtype if tensors else None,
                reduce_op=None if reduce_op is None else RED(kind_of(reduce_op)).name.lower(),
                root=getattr(opts, "rootRank", -1), layout=layout, sent=tuple(sent),
                expected=tuple(expected))


def _weights(size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two ``size x size`` tables of weights in ``[1, 2^61 - 1)``, the same in every process
    (a splitmix64 step of the pair's index; made once per group size)."""
    tables = _WEIGHTS.get(size)
    if tables is None:
        mask = (1 << 64) - 1

        def weight(index: int) -> int:
            x = (index * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & mask
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
            return 1 + (x ^ (x >> 31)) % (_PRIME - 1)

        tables = _WEIGHTS[size] = tuple(
            [[weight((k * size + r) * size + j) for j in range(size)] for r in range(size)]
            for k in (0, 1)
        )
    return tables


def _rank_weights(rank: int, size: int) -> list[tuple[list[int], list[int]]]:
    """Per table: ``rank``'s row (weights of what it sends) and column (of what it expects)."""
    key = (rank, size)
    found = _RANK_WEIGHTS.get(key)
    if found is None:
        found = _RANK_WEIGHTS[key] = [
            (table[rank], [table[i][rank] for i in range(size)]) for table in _weights(size)
        ]
    return found


def fingerprint(rank: int, size: int, row: list[int]) -> list[int]:
    """This rank's 18 terms of the agreement's ``SUM`` (module docstring) for its ``row``
    (:func:`~..calls.encode` of its :func:`gloo_call`)."""
    head = row[:HEAD]
    sent, expected = row[HEAD:HEAD + size], row[HEAD + size:]
    terms = head + [h * h for h in head]
    for out, back in _rank_weights(rank, size):
        term = (sum(map(mul, out, sent)) - sum(map(mul, back, expected))) % _PRIME
        terms += (term >> _HALF, term & _LOW)
    return terms


def agrees(total: list[int], size: int) -> bool:
    """Whether the ranks' summed fingerprints (:func:`fingerprint`) say they agree."""
    for f in range(HEAD):
        if total[f] * total[f] != size * total[HEAD + f]:
            return False
    hi0, lo0, hi1, lo1 = total[2 * HEAD:]
    return ((hi0 << _HALF) + lo0) % _PRIME == 0 and ((hi1 << _HALF) + lo1) % _PRIME == 0
