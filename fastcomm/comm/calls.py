"""One description of a collective call: what the ranks of every backend compare before they
move data, and the one message that names where they differ.

A :class:`Call` names the op, the dtype, the element count the ranks share, the reduce op and
the root (or src); a call whose ranks move unequal amounts (the v-calls, Gloo's list forms)
also names the elements this rank sends to and expects from each rank. Backends exchange it as
a fixed-width ``int64`` row (:func:`encode`, :func:`decode`: ``HEAD`` fields, then ``sent`` and
``expected`` per rank); where a compiled core or a kernel compares fixed words it is packed
into shm's two descriptor words (:func:`shm_words`) or ipc's one (:func:`ipc_word`). Each
backend keeps only how its rows travel; :func:`tensor_call` and :func:`v_call` build a call,
:func:`describe` words it and :func:`first_difference` (rows) / :func:`calls_difference` (calls)
and :func:`mismatch_message` word a disagreement, the same way on every backend.

Codes (ops, dtypes, reduce ops) count from 1, 0 meaning none: the shm compiled core and the
shm fast paths write descriptor words with them, so tables only ever grow at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .types import EXTRA_DTYPES, SUPPORTED_DTYPES, BitwiseOp, ReduceOp

__all__ = [
    "Call", "DTYPES", "DTYPE_CODES", "HEAD", "OPS", "OP_CODES", "PREMUL_CODE", "REDUCE_CODES",
    "REDUCE_OP_CODES", "calls_difference", "decode", "describe", "encode", "first_difference",
    "from_ipc_word", "from_shm_words", "ipc_word", "mismatch_message", "reduce_name",
    "shm_word_a", "shm_word_b", "shm_words", "tensor_call", "v_call",
]

#: every op a row may name; shm's eight first (the compiled core's codes), then ipc's bucket
#: all-reduce, the v-calls, and the ProcessGroup methods the c10d backend hands to Gloo
OPS = (
    "all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "barrier",
    "reduce", "all_to_all_v", "bucket_all_reduce", "gather", "scatter", "all_gather_coalesced",
    "allreduce", "allreduce_coalesced", "allgather", "all_gather_single",
    "all_gather_single_coalesced", "allgather_coalesced", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "all_to_all_single", "alltoall",
)
OP_CODES = {name: i + 1 for i, name in enumerate(OPS)}
# the contract's dtypes first, then the extra ones, then every other torch dtype (the v-calls
# move any dtype as bytes)
_OTHER_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}
                       - set(SUPPORTED_DTYPES + EXTRA_DTYPES), key=str)
DTYPES = (*SUPPORTED_DTYPES, *EXTRA_DTYPES, *_OTHER_DTYPES)
DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(DTYPES)}
#: reduce ops by name (``ReduceOp``'s, PremulSum's, ``BitwiseOp``'s)
REDUCE_OPS = (*(op.value for op in ReduceOp), "premul_sum", *(op.value for op in BitwiseOp))
REDUCE_CODES = {name: i + 1 for i, name in enumerate(REDUCE_OPS)}
PREMUL_CODE = REDUCE_CODES["premul_sum"]
_UNKNOWN_REDUCE = 0x7F  # a reduce op the table does not name (a torch one fastcomm never runs)
#: by reduce op member
REDUCE_OP_CODES = {op: REDUCE_CODES[op.value] for op in (*ReduceOp, *BitwiseOp)}

#: a row's fields before the per-rank lists: op, dtype, numel, reduce op, root, two-step, layout
HEAD = 7


@dataclass(frozen=True, slots=True)
class Call:
    """One rank's description of a collective call."""

    op: str
    """The op's name (one of ``OPS``)."""
    dtype: torch.dtype | None = None
    """The tensors' dtype; ``None`` for a call without tensors (``barrier``)."""
    numel: int = -1
    """Elements every rank passes alike (``all_gather``: the input's); -1: none (``barrier``,
    or a call described by ``sent``/``expected``)."""
    reduce_op: str | None = None
    """The reduce op's lowercase name (``"sum"``, ``"premul_sum"``, ``"band"``), or ``None``."""
    root: int = -1
    """The root (``reduce``, ``gather``, ``scatter``) or src (``broadcast``); -1: none."""
    two_step: bool = False
    """shm: an all-reduce or reduce past ``one_shot_max`` (two publishes a round)."""
    layout: int = 0
    """A small hash of how the elements split into tensors (coalesced calls); 0: one tensor."""
    sent: tuple[int, ...] = ()
    """Elements this rank sends to each rank (calls of unequal sizes; else empty)."""
    expected: tuple[int, ...] = ()
    """Elements this rank expects from each rank (``sent``'s counterpart)."""


def encode(call: Call) -> list[int]:
    """``call`` as a row of ``HEAD + 2 * len(call.sent)`` int64 values (what ranks exchange)."""
    reduce_code = 0 if call.reduce_op is None else REDUCE_CODES.get(call.reduce_op,
                                                                    _UNKNOWN_REDUCE)
    return [OP_CODES[call.op], DTYPE_CODES.get(call.dtype, 0), call.numel, reduce_code,
            call.root, int(call.two_step), call.layout, *call.sent, *call.expected]


def decode(row: Sequence[int]) -> Call:
    """The call of a row from :func:`encode` (anything after its two lists is ignored, the
    lists' length taken from ``len(row)``: pass the row cut to ``HEAD + 2 * size``)."""
    op, dtype, numel, reduce_code, root, two_step, layout = (int(x) for x in row[:HEAD])
    half = (len(row) - HEAD) // 2
    return Call(
        op=OPS[op - 1] if 0 < op <= len(OPS) else f"op{op}",
        dtype=DTYPES[dtype - 1] if 0 < dtype <= len(DTYPES) else None,
        numel=numel,
        reduce_op=(None if not reduce_code else REDUCE_OPS[reduce_code - 1]
                   if reduce_code <= len(REDUCE_OPS) else f"op{reduce_code}"),
        root=root, two_step=bool(two_step), layout=layout,
        sent=tuple(int(x) for x in row[HEAD:HEAD + half]),
        expected=tuple(int(x) for x in row[HEAD + half:HEAD + 2 * half]),
    )


def describe(call: Call) -> str:
    """A call in words: ``all_reduce(float32, 10 elements, op sum)``, ``broadcast(int8, 3
    elements, src 1)``, ``gather(float32, root 0, sending [0, 4], expecting [0, 0])``."""
    what = []
    if call.dtype is not None:
        what.append(str(call.dtype).removeprefix("torch."))
    if call.numel >= 0:
        what.append(f"{call.numel} elements")
    if call.reduce_op is not None:
        what.append(f"op {call.reduce_op}")
    if call.root >= 0:
        what.append(f"{'src' if call.op == 'broadcast' else 'root'} {call.root}")
    if call.two_step:
        what.append("two-step")
    if call.sent or call.expected:
        what.append(f"sending {list(call.sent)}, expecting {list(call.expected)}")
    return f"{call.op}({', '.join(what)})"


def reduce_name(op: object) -> str | None:
    """The name a :class:`Call` holds for a reduce op: a ``ReduceOp``'s or ``BitwiseOp``'s value,
    ``"premul_sum"`` for a ``PremulSum``, ``None`` for ``None``."""
    if op is None:
        return None
    value = getattr(op, "value", None)
    return value if isinstance(value, str) else "premul_sum"


def tensor_call(op: str, tensor: torch.Tensor | None = None, reduce_op: object = None,
                root: int = -1) -> Call:
    """The call of ``op`` on ``tensor``, the one whose element count the ranks share (the input
    of ``all_gather`` and ``all_to_all``, the output of ``reduce_scatter``; ``None``: a call
    without tensors). ``reduce_op``: a ``ReduceOp``, ``BitwiseOp``, ``PremulSum`` or ``None``."""
    if tensor is None:
        return Call(op, reduce_op=reduce_name(reduce_op), root=root)
    return Call(op, tensor.dtype, tensor.numel(), reduce_name(reduce_op), root)


def v_call(op: str, root: int, outputs: Sequence[torch.Tensor],
           inputs: Sequence[torch.Tensor]) -> Call:
    """The call of a v-call (``fastcomm.comm.vcoll``): ``inputs[r]`` to rank ``r``,
    ``outputs[q]`` from rank ``q``, in ``inputs[0]``'s dtype; ``root`` -1 where none."""
    return Call(op, inputs[0].dtype, root=root, sent=tuple(t.numel() for t in inputs),
                expected=tuple(t.numel() for t in outputs))


def _head(call: Call) -> tuple:
    return (call.op, call.dtype, call.numel, call.reduce_op, call.root, call.two_step,
            call.layout)


def calls_difference(calls: Sequence[Call], ranks: Sequence[int] | None = None) -> str | None:
    """The first way the ranks' calls disagree, in words, or ``None``: the same text on every
    rank that holds the same calls.

    Args:
        calls: one per rank; where each holds ``sent``/``expected`` lists of ``len(calls)``
            entries, rank ``q``'s ``sent[r]`` must be rank ``r``'s ``expected[q]`` too.
        ranks: the rank of each call (default: its index).
    """
    ranks = range(len(calls)) if ranks is None else ranks
    first = calls[0]
    size = len(calls)
    flows = all(len(c.sent) == size and len(c.expected) == size for c in calls)
    for rank, call in zip(ranks, calls, strict=True):
        if _head(call) != _head(first) or (not flows and call != first):
            return (f"rank {ranks[0]} called {describe(first)} but rank {rank} called "
                    f"{describe(call)}")
    if not flows:
        return None
    for q, mine in enumerate(calls):
        for r in range(size):
            sent, expected = mine.sent[r], calls[r].expected[q]
            if sent != expected:
                return (f"rank {ranks[q]} sends {sent} elements to rank {ranks[r]}, which "
                        f"expects {expected} from it (rank {ranks[q]}: {describe(mine)}; "
                        f"rank {ranks[r]}: {describe(calls[r])})")
    return None


def first_difference(rows: Sequence[Sequence[int]],
                     ranks: Sequence[int] | None = None) -> str | None:
    """:func:`calls_difference` of the ranks' rows (:func:`encode`; a row may hold more after
    its two lists of ``len(rows)`` entries, or no lists at all)."""
    cut = HEAD + 2 * len(rows)
    return calls_difference([decode(row[:cut] if len(row) >= cut else row) for row in rows],
                            ranks)


def mismatch_message(rank: int, op: str, problem: str) -> str:
    """The one text of a disagreement's error on every backend (``problem``: from
    :func:`first_difference`)."""
    return (f"rank {rank}: {op}: collective mismatch: {problem}; every rank must issue the "
            "same collectives in the same order with the same sizes, dtypes, ops and roots")


# ---------------------------------------------------------------------- shm's descriptor words
# A: opcode << 56 | dtype << 48 | reduce op << 40 | numel mod 2**40 (the two-step flag in the
# opcode's top bit); B: numel >> 40 << 32 | root + 1 (0: no root). The compiled core and the
# fast paths build A from these fields themselves.
TWO_STEP = 0x80
OPCODE_MASK = (1 << 56) - 1  # a word A without its opcode
NUMEL_BITS = (1 << 40) - 1
#: by dtype: (element size, the dtype's field of word A)
DTYPE_SIZE_AND_FIELD = {
    dtype: (torch.empty((), dtype=dtype).element_size(), code << 48)
    for dtype, code in DTYPE_CODES.items() if dtype in SUPPORTED_DTYPES + EXTRA_DTYPES
}


def shm_word_a(op: str, tensor: torch.Tensor | None, reduce_code: int = 0,
               two_step: bool = False) -> int:
    """Word A of ``op`` on ``tensor`` (the hot paths' form of :func:`shm_words`)."""
    opcode = OP_CODES[op] | (TWO_STEP if two_step else 0)
    if tensor is None:
        return opcode << 56
    return ((opcode << 56) | (DTYPE_CODES[tensor.dtype] << 48) | (reduce_code << 40)
            | (tensor.numel() & NUMEL_BITS))


def shm_word_b(numel: int, root: int = -1) -> int:
    """Word B: the element count past 40 bits, then the root + 1 (0 without one)."""
    return ((numel >> 40) << 32) | (0 if root is None or root < 0 else root + 1)


def shm_words(call: Call) -> tuple[int, int]:
    """``call`` as shm's descriptor words ``(A, B)`` (no ``sent``/``expected``/``layout``)."""
    numel = max(call.numel, 0)
    reduce_code = 0 if call.reduce_op is None else REDUCE_CODES[call.reduce_op]
    opcode = OP_CODES[call.op] | (TWO_STEP if call.two_step else 0)
    word_a = ((opcode << 56) | (DTYPE_CODES.get(call.dtype, 0) << 48) | (reduce_code << 40)
              | (numel & NUMEL_BITS))
    return word_a, shm_word_b(numel, call.root)


def from_shm_words(word_a: int, word_b: int = 0) -> Call:
    """The call of shm's descriptor words (a call without a dtype has no element count)."""
    opcode, dtype = word_a >> 56, (word_a >> 48) & 0xFF
    numel = (word_a & NUMEL_BITS) | ((word_b >> 32) << 40)
    return decode([opcode & ~TWO_STEP, dtype, numel if dtype or numel else -1,
                   (word_a >> 40) & 0xFF, (word_b & 0xFFFFFFFF) - 1, opcode >> 7, 0])


# ---------------------------------------------------------------------- ipc's descriptor
# One int64 every barrier of a call compares: opcode in bits 56..62, dtype in 48..55, reduce op
# in 41..47, element count in 1..40 and bit 0 set. It is odd and >= 2**56 whatever the call, so
# Triton compiles one variant of the barrier for all of them (it specializes integers equal to
# 1, divisible by 16, or past 32 bits).
IPC_MAX_NUMEL = 1 << 40


def ipc_word(call: Call) -> int:
    """``call`` as ipc's descriptor (``numel`` below ``IPC_MAX_NUMEL``)."""
    reduce_code = 0 if call.reduce_op is None else REDUCE_CODES[call.reduce_op]
    return ((OP_CODES[call.op] << 56) | (DTYPE_CODES.get(call.dtype, 0) << 48)
            | (reduce_code << 41) | (max(call.numel, 0) << 1) | 1)


def from_ipc_word(word: int) -> Call:
    """The call of an ipc descriptor (a call without a dtype has no element count)."""
    dtype, numel = (word >> 48) & 0xFF, (word >> 1) & (IPC_MAX_NUMEL - 1)
    return decode([(word >> 56) & 0x7F, dtype, numel if dtype or numel else -1,
                   (word >> 41) & 0x7F, -1, 0, 0])
