"""Helpers of the adapter's calls with several tensors, and of writing a staged result back:
outside autograd, as Gloo writes it."""

from __future__ import annotations

from functools import partial

import torch

from ..reduction import reduce_into
from ..types import BitwiseOp, PremulSum, ReduceOp


def same_tensors(rank: int, what: str, tensors: list) -> None:
    """Raises unless every tensor of a multi-tensor call matches the first (dtype, shape,
    device), as Gloo requires."""
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.dtype != first.dtype or t.shape != first.shape or t.device != first.device:
            raise ValueError(
                f"rank {rank}: {what}: tensor {i} is {t.dtype} {tuple(t.shape)} on {t.device}, "
                f"tensor 0 {first.dtype} {tuple(first.shape)} on {first.device}; the tensors "
                "of one call must match"
            )


def combined(tensors: list, op: ReduceOp | BitwiseOp | PremulSum) -> torch.Tensor:
    """This rank's tensors reduced into one contiguous scratch in list order (``AVG`` and a
    ``PremulSum`` summed: the division and the factor belong to the ranks' reduction)."""
    local = ReduceOp.SUM if op is ReduceOp.AVG or op.__class__ is PremulSum else op
    scratch = tensors[0].detach().contiguous().clone()
    terms = [scratch] + [t.detach() for t in tensors[1:]]
    if len(terms) > 1:
        reduce_into(scratch.view(-1), [t.reshape(-1) for t in terms], local)
    return scratch


def copy_to_all(result: torch.Tensor, tensors: list) -> None:
    """Writes ``result`` into every tensor of a multi-tensor call (outside autograd)."""
    for t in tensors:
        t.detach().copy_(result)


def copier(tensor: torch.Tensor, result: torch.Tensor) -> partial:
    """The step that writes a staged ``result`` back into the caller's ``tensor``, outside
    autograd (as Gloo writes it): a tensor that requires grad is written through a detached
    alias, so the write neither fails (a leaf) nor enters the graph (a non-leaf)."""
    return partial(tensor.detach().copy_, result)
