"""The arithmetic of a reduction over the ranks' terms, shared by the shared-memory backends.

A *reduction* is ``reduce(out, terms, op)``: it writes ``terms[0] (op) terms[1] (op) ...`` into
``out``, in rank order (``AVG`` included: divided by ``len(terms)``). ``shm``'s schedules take
one as a parameter: the default, :func:`torch_reduce`, runs torch ops in the buffers' dtype;
``ipc`` passes one that calls the Triton kernel ``fastcomm.kernels.peer_reduce`` and keeps
:func:`torch_reduce` for the cases the kernel does not cover. Both reduce in rank order, so
either gives every rank the same bits, but the two do not round alike: all ranks of a
communicator must use the same one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .types import BitwiseOp, ReduceOp, divide_

__all__ = ["BINARY_OPS", "Reduction", "reduce_gathered", "reduce_into", "torch_reduce"]

BINARY_OPS = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.MIN: torch.minimum,
    BitwiseOp.BAND: torch.bitwise_and,
    BitwiseOp.BOR: torch.bitwise_or,
    BitwiseOp.BXOR: torch.bitwise_xor,
}

#: ``reduce(out, terms, op)``: ``out = terms[0] (op) terms[1] (op) ...`` in rank order, ``AVG``
#: divided by ``len(terms)``. ``out`` may alias ``terms[0]`` or ``terms[1]`` but no later term.
Reduction = Callable[[torch.Tensor, list[torch.Tensor], ReduceOp], None]


def reduce_into(out: torch.Tensor, terms: list[torch.Tensor], op: ReduceOp) -> None:
    """``out = terms[0] (op) terms[1] (op) ...`` in order, without allocating.

    ``out`` may alias ``terms[0]`` or ``terms[1]`` but no later term. ``AVG`` sums (the caller
    divides).
    """
    if len(terms) == 1:
        if out.data_ptr() != terms[0].data_ptr():
            out.copy_(terms[0])
        return
    fn = BINARY_OPS[op]
    fn(terms[0], terms[1], out=out)
    for term in terms[2:]:
        fn(out, term, out=out)


def torch_reduce(out: torch.Tensor, terms: list[torch.Tensor], op: ReduceOp) -> None:
    """The default :data:`Reduction`: :func:`reduce_into`, then ``AVG``'s division."""
    reduce_into(out, terms, op)  # a module-level lookup per call: tests may wrap reduce_into
    if op is ReduceOp.AVG:
        divide_(out, len(terms))


def reduce_gathered(rows: torch.Tensor, out: torch.Tensor, op: ReduceOp) -> None:
    """``out = rows[0] (op) rows[1] (op) ...``: the reduction of a gathered ``(size, nbytes)``
    ``uint8`` block whose row ``r`` holds rank ``r``'s bytes of a tensor of ``out``'s dtype
    (the contract's reduction for a backend that does not reduce the dtype or op itself), in
    rank order, as :func:`torch_reduce`."""
    flat = out.view(-1)
    torch_reduce(flat, [row.view(out.dtype) for row in rows], op)
