"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``).

torch DDP's rule: a parameter whose module produces sparse gradients gets a bucket of its own
(``bucket.SparseBucket``), outside the dense flat buffers (and ``gradient_as_bucket_view``),
and its gradient is all-reduced as a sparse COO tensor by `SparseAllReduce`.

Invariants: sparse buckets launch after the dense ones, in the same order on every rank;
``.grad`` keeps its sparse layout (``Communicator.all_reduce`` reduces natively where
``capabilities.sparse_all_reduce``, else densifies and re-sparsifies). A comm hook receives
the unscaled sparse gradient as ``bucket.buffer()``.

Why sparse buckets launch last, and the transport: docs/ddp.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fastcomm.comm.work import Work

from .bucket import SparseBucket, empty_sparse_like
from .strategy import BucketStrategy

__all__ = ["SparseAllReduce", "sparse_param_indices"]


def sparse_param_indices(module: nn.Module, params: Sequence[torch.Tensor]) -> set[int]:
    """Indices into `params` of the parameters whose module produces sparse gradients."""
    index_of = {id(p): i for i, p in enumerate(params)}
    found: set[int] = set()
    for mod in module.modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse:
            for p in mod.parameters(recurse=False):
                i = index_of.get(id(p))
                if i is not None:
                    found.add(i)
    return found


def sparse_gradient(bucket: SparseBucket, grad: torch.Tensor | None) -> torch.Tensor:
    """The sparse COO gradient a sparse bucket reduces: `grad` itself, a zero for none, or
    the sparse form of a dense gradient (dense and sparse uses accumulated into one)."""
    if grad is None:
        return empty_sparse_like(bucket.params[0])
    if not grad.is_sparse:
        return grad.detach().to_sparse(1)
    return grad


def sparse_all_reduce(comm, grad: torch.Tensor, scale: float) -> tuple[Work, torch.Tensor]:
    """Starts the allreduce of the sparse `grad` times `scale` over `comm`: its ``Work`` and
    the tensor that holds the sum once it is done (see the module docstring)."""
    grad = grad.coalesce() if not grad.is_coalesced() else grad
    if scale != 1.0:
        grad = grad * scale
    return comm.all_reduce(grad, async_op=True), grad


class SparseAllReduce(BucketStrategy):
    """A sparse bucket's reduction: its scaled COO gradient all-reduced, the sum its
    ``.grad`` (see the module docstring)."""

    __slots__ = ()
    hook_value_kind = "the reduced gradient (sparse, or dense shaped like the parameter)"

    def launch(self, reducer, bucket: SparseBucket, grads) -> tuple[Work, torch.Tensor]:
        return sparse_all_reduce(reducer.comm, sparse_gradient(bucket, grads[0]), reducer.scale)

    def wait(self, reducer, bucket: SparseBucket, result) -> torch.Tensor:
        work, grad = result
        work.wait()
        return grad.coalesce()

    def write_back(self, reducer, bucket: SparseBucket, value, unused: frozenset[int]) -> None:
        if bucket.param_indices[0] not in unused:
            bucket.params[0].grad = value

    def shadow(self, reducer, bucket: SparseBucket) -> Work:
        # a joined rank's zero gradient
        return sparse_all_reduce(reducer.comm, empty_sparse_like(bucket.params[0]), 1.0)[0]

    def hook_gradients(self, bucket: SparseBucket, grads) -> list[torch.Tensor]:
        return [sparse_gradient(bucket, grads[0])]

    def hook_value(self, bucket: SparseBucket, value: object) -> torch.Tensor:
        p = bucket.params[0]
        if not isinstance(value, torch.Tensor) or value.numel() != p.numel():
            raise ValueError(
                f"comm hook future of sparse bucket {bucket.index} ({bucket.names[0]!r}) "
                f"resolved to {type(value).__name__}; expected a tensor shaped "
                f"{tuple(p.shape)}"
            )
        return value if value.is_sparse else value.view(p.shape)


#: Shared by every sparse bucket (it holds nothing of its own).
SPARSE = SparseAllReduce()
