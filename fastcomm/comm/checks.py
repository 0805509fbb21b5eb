"""The argument checks of the :class:`~.base.Communicator` contract.

They run before anything is sent, so a bad call raises on the calling rank alone and never
leaves a peer waiting on half a collective; each error names the operation, the argument and
what is allowed. The usual operands pass each check's first test without building a message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .types import EXTRA_DTYPES, SUPPORTED_DTYPES, PremulSum, ReduceOp
from .vcoll import plain_pieces

__all__ = [
    "DTYPES",
    "REDUCED_DTYPES",
    "bad_sizes",
    "check_p2p",
    "check_pair",
    "check_pieces",
    "check_peer",
    "check_premul_dtype",
    "check_reduce_scatter_op",
    "check_split_args",
    "check_sparse",
    "check_splits",
    "check_tensor",
    "plain_pair",
    "reject_premul",
    "untracked",
]

#: dtypes every operation moves
DTYPES = frozenset(SUPPORTED_DTYPES)
_REDUCED_ORDER = SUPPORTED_DTYPES + EXTRA_DTYPES
#: dtypes ``all_reduce`` and ``reduce`` take (the rest reduce through the contract)
REDUCED_DTYPES = frozenset(_REDUCED_ORDER)
_STRIDED = torch.strided


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def untracked(tensor: Any) -> Any:
    """``tensor``, or where autograd tracks it a detached alias of the same storage.

    A collective writes its result in place without recording the write in the graph, as Gloo
    and NCCL do (torch refuses ``out=`` ops on a tracked tensor in grad mode, and an in-place op
    would add the communicator's arithmetic to the graph). Every tensor enters the contract
    through here, so no backend sees a tracked one; anything else passes through to the checks
    that name it.
    """
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        return tensor.detach()
    return tensor


def reject_premul(op: ReduceOp | PremulSum, name: str) -> None:
    """Raises for a :class:`PremulSum` given to an operation other than ``all_reduce``.

    Raises:
        TypeError: ``op`` is a ``PremulSum``.
    """
    if op.__class__ is PremulSum:
        raise TypeError(
            f"{name}: {op!r} is supported by all_reduce only; multiply the input by "
            f"{op.factor!r} first and pass ReduceOp.SUM"
        )


def check_premul_dtype(tensor: torch.Tensor, op: PremulSum) -> None:
    """Raises unless ``tensor`` is floating point (a ``PremulSum`` multiplies it).

    Raises:
        TypeError: an integer or bool tensor.
    """
    if not tensor.is_floating_point():
        raise TypeError(
            f"all_reduce: {op!r} needs a floating-point tensor, got dtype "
            f"{tensor.dtype}; multiply first and reduce with ReduceOp.SUM"
        )


def check_reduce_scatter_op(op: object) -> ReduceOp:
    """``op`` as a :class:`ReduceOp` that ``reduce_scatter`` takes.

    Raises:
        TypeError: a ``PremulSum`` or an op only ``all_reduce``/``reduce`` take.
        ValueError: an unknown op.
    """
    op = ReduceOp.coerce(op)
    reject_premul(op, "reduce_scatter")
    if op.__class__ is not ReduceOp:
        raise TypeError(f"reduce_scatter: {op.name} is reduced by all_reduce and reduce only")
    return op


def check_tensor(
    t: object, op: str, name: str = "tensor", dtypes: frozenset = DTYPES
) -> torch.Tensor:
    """``t``, checked: a contiguous strided tensor of one of ``dtypes``.

    Raises:
        TypeError: not a tensor, a dtype not in ``dtypes``, a sparse layout.
        ValueError: not contiguous.
    """
    if type(t) is torch.Tensor and t.dtype in DTYPES and t.is_contiguous():
        return t  # the usual case, checked without building any message
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes and t.dtype in REDUCED_DTYPES:
        raise TypeError(
            f"{op}: {name} has dtype {t.dtype}, which all_reduce and reduce take; "
            f"{op} moves these: {_names(dtypes)}"
        )
    if t.dtype not in dtypes:
        allowed = _names(SUPPORTED_DTYPES if dtypes is DTYPES else _REDUCED_ORDER)
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; allowed: {allowed}")
    if t.layout is not _STRIDED:
        raise TypeError(
            f"{op}: {name} has layout {t.layout}; only all_reduce takes sparse tensors "
            "(torch.sparse_coo)"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be contiguous (shape {tuple(t.shape)}, "
            f"strides {t.stride()}); call .contiguous() first"
        )
    return t


def check_sparse(tensor: torch.Tensor, op: object) -> None:
    """Raises unless a sparse ``all_reduce`` of ``tensor`` with ``op`` is supported.

    Raises:
        TypeError: an unsupported dtype.
        ValueError: an op other than ``SUM``.
    """
    if tensor.dtype not in DTYPES:
        raise TypeError(
            f"all_reduce: tensor has dtype {tensor.dtype}; allowed: {_names(SUPPORTED_DTYPES)}"
        )
    if ReduceOp.coerce(op) is not ReduceOp.SUM:
        raise ValueError(f"all_reduce: sparse tensors are reduced with SUM only, got {op!r}")


def check_pair(output: object, input: object, op: str) -> None:
    """Checks ``output`` and ``input`` (:func:`check_tensor`) and that they match.

    Raises:
        TypeError: as :func:`check_tensor`; different dtypes.
        ValueError: as :func:`check_tensor`; different devices.
    """
    check_tensor(output, op, "output")
    check_tensor(input, op, "input")
    if output.dtype != input.dtype:
        raise TypeError(f"{op}: output dtype {output.dtype} != input dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{op}: output on {output.device} but input on {input.device}")


def plain_pair(output: object, input: object) -> bool:
    """Whether ``output`` and ``input`` are the usual operands (plain contiguous CPU tensors of
    one supported dtype that autograd does not track): then every check of :func:`check_pair`
    holds, tested in a fraction of its time (the caller adds its own state: open, moving CPU
    tensors itself)."""
    return (
        type(output) is torch.Tensor
        and type(input) is torch.Tensor
        and output.is_cpu
        and input.is_cpu
        and output.dtype is input.dtype
        and input.dtype in DTYPES
        and not output.requires_grad
        and not input.requires_grad
        and output.is_contiguous()
        and input.is_contiguous()
    )


def bad_sizes(op: str, name: str, got: int, what: str, size: int, per_rank: int) -> ValueError:
    """The error of a tensor ``name`` of ``got`` elements where ``size * per_rank`` were due."""
    return ValueError(
        f"{op}: {name} has {got} elements; expected size * {what}.numel() = "
        f"{size} * {per_rank} = {size * per_rank}"
    )


def check_peer(peer: object, size: int, op: str, name: str) -> int:
    """``peer``, checked: a rank in ``[0, size)``.

    Raises:
        ValueError: not an int in range.
    """
    if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < size:
        raise ValueError(f"{op}: {name}={peer!r} out of range; allowed: 0..{size - 1}")
    return peer


def check_p2p(rank: int, size: int, tensor: object, peer: object, op: str, name: str,
              verb: str) -> None:
    """The checks of ``send``/``recv`` on rank ``rank`` of ``size``: a valid tensor, a peer
    that is another rank.

    Raises:
        TypeError, ValueError: as :func:`check_tensor`; ``peer`` out of range or this rank.
    """
    check_tensor(tensor, op)
    check_peer(peer, size, op, name)
    if peer == rank:
        raise ValueError(f"{op}: {name}={peer} is this rank; a rank cannot {verb} itself")


def check_splits(size: int, output: torch.Tensor, input: torch.Tensor,
                 output_splits, input_splits) -> list[list[int]]:
    """The bytes of each piece of ``all_to_all_split``, ``[output's, input's]``.

    Raises:
        ValueError: splits that are not ``size`` non-negative ints summing to the rows.
    """
    byte_splits = []
    for name, t, splits in (("output", output, output_splits), ("input", input, input_splits)):
        rows = t.shape[0] if t.dim() else -1
        if rows < 0 or len(splits) != size or sum(splits) != rows or min(splits) < 0:
            raise ValueError(
                f"all_to_all: {name}_splits {list(splits)} must be {size} sizes >= 0 "
                f"summing to the {name}'s {rows} rows (shape {tuple(t.shape)})")
        row_bytes = t.nbytes // rows if rows else 0
        byte_splits.append([n * row_bytes for n in splits])
    return byte_splits


def check_split_args(color: object, key: object) -> None:
    """Raises unless ``color`` and ``key`` of ``split`` are ints or ``None``.

    Raises:
        TypeError: another type (``bool`` included).
    """
    if color is not None and (not isinstance(color, int) or isinstance(color, bool)):
        raise TypeError(f"split: color must be an int or None, got {color!r}")
    if key is not None and (not isinstance(key, int) or isinstance(key, bool)):
        raise TypeError(f"split: key must be an int or None, got {key!r}")


def check_pieces(size: int, op: str, outputs: Sequence, inputs: Sequence) -> tuple[list, list]:
    """Checks a v-call's pieces (before anything is sent): lists of ``size`` tensors, dense,
    contiguous, one dtype, on one device. Returns them as lists.

    Raises:
        TypeError: not tensors, or dtypes that differ.
        ValueError: lists of the wrong length, non-contiguous or sparse pieces, devices that
            differ.
    """
    outputs, inputs = list(outputs), list(inputs)  # the caller's lists may change later
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
