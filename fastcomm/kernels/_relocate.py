"""A bucket's pack and unpack for a captured CUDA graph: addresses read on the device.

A CUDA graph replays its kernels with the arguments they were captured with. The fused pack
and unpack take their tensors' addresses from a block table in device memory, so a graph of
them can follow gradients that autograd allocates somewhere else next step, if the table's
address row is rewritten before each replay. `RelocatablePlan` keeps a block table of its own
(never one of the shared cache's, which other calls read), the table's fixed rows, and a
per-tensor address vector on the device; `relocate` (captured first in the graph) rebuilds
the address row from that vector in two small kernels, and `set_addresses` rewrites the vector
(one 8-byte-per-tensor copy, only when an address changed).

Invariants: one dtype, the flat buffer's (a DDP bucket); every address 16-byte aligned (the
kernels are built for 128-bit accesses: `set_addresses` refuses another address, and the
caller runs the eager path); the host buffers the vector is copied from are pinned once and
take turns (`_SLOTS` of them), each reused only after its last copy is done (an event per
buffer, made once); nothing here allocates after construction, so a capture allocates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._launch import VEC_BYTES, BlockTable, _layout, compute_dtype, kernel_backend
from ._pack import BLOCK, launch_pack, launch_unpack

__all__ = ["RelocatablePlan"]

#: Pinned host buffers the address vector is copied from, in turn: a buffer is written again
#: only once its last copy is done, which a ring this long leaves several steps to finish.
_SLOTS = 4


class RelocatablePlan:
    """Pack and measured unpack of a fixed layout whose addresses may change (module doc).

    Args:
        numels: element count of each tensor, in bucket order.
        dtype: the tensors' dtype, which is the flat buffer's.
        device: a CUDA device (or the CPU, where the kernels run interpreted: the tests).

    Raises:
        ValueError: the Triton kernels do not run on `device`, or `numels` is empty.
    """

    def __init__(self, numels: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
        device = torch.device(device)
        if kernel_backend(device) != "triton":
            raise ValueError(f"RelocatablePlan runs the Triton kernels, which do not run on "
                             f"{device} here (see fastcomm.kernels.kernel_backend)")
        if not numels:
            raise ValueError("RelocatablePlan needs at least one tensor")
        self.numels = [int(n) for n in numels]
        self.dtype = dtype
        self.device = device
        offsets, total = [], 0
        for n in self.numels:
            offsets.append(total)
            total += n
        self.total = total
        layout = _layout(device, BLOCK, dtype.itemsize, tuple(self.numels), tuple(offsets))
        self.n_blocks = layout.n_blocks
        self.table = torch.empty(3, max(self.n_blocks, 1), dtype=torch.int64, device=device)
        self.table[1:, : self.n_blocks].copy_(layout.rows)
        self._tensor_of = layout.tensor_of.to(device)
        self._start = layout.start_bytes.to(device)
        self._address_row = self.table[0, : self.n_blocks]
        flat_vec = max(1, VEC_BYTES // dtype.itemsize)
        if any(o % flat_vec for o, n in zip(offsets, self.numels, strict=True) if n):
            flat_vec = 1
        self._tables = [(dtype, BlockTable(self.table, self.n_blocks, VEC_BYTES, flat_vec))]
        self.addresses = torch.zeros(len(self.numels), dtype=torch.int64, device=device)
        self._cuda = device.type == "cuda"
        host = [torch.empty(len(self.numels), dtype=torch.int64) for _ in range(_SLOTS)]
        self._host = [h.pin_memory() for h in host] if self._cuda else host
        self._copied = [torch.cuda.Event() for _ in range(_SLOTS)] if self._cuda else []
        self._turn = 0
        self._nonempty = [n > 0 for n in self.numels]
        #: the addresses `addresses` holds (as last written), or None before the first
        self.ptrs: list[int] | None = None
        compute = compute_dtype(dtype)
        self._partials = torch.empty(2, max(self.n_blocks, 1), dtype=compute, device=device)

    def aligned(self, ptrs: Sequence[int]) -> bool:
        """Whether every non-empty tensor's address is 16-byte aligned (what the kernels were
        built for)."""
        return not any(p % VEC_BYTES for p, n in zip(ptrs, self._nonempty, strict=True) if n)

    def set_addresses(self, ptrs: list[int], stream: torch.cuda.Stream | None = None) -> bool:
        """Makes the next `relocate` on `stream` read `ptrs` (copied on `stream` when they
        differ from the last ones; `stream` is None on the CPU); whether it could
        (``False``: an address breaks the alignment, and the caller takes the eager path)."""
        if ptrs == self.ptrs:
            return True
        if len(ptrs) != len(self.numels) or not self.aligned(ptrs):
            return False
        turn = self._turn = (self._turn + 1) % _SLOTS
        host = self._host[turn]
        if not self._cuda:
            host.numpy()[:] = ptrs
            self.addresses.copy_(host)
        else:
            copied = self._copied[turn]
            copied.synchronize()  # its previous copy (_SLOTS changes ago) has left the buffer
            host.numpy()[:] = ptrs
            with torch.cuda.stream(stream):
                self.addresses.copy_(host, non_blocking=True)
            copied.record(stream)
        self.ptrs = list(ptrs)
        return True

    def relocate(self) -> None:
        """Rewrites the table's address row from `addresses` on the current stream (two
        small kernels; captured at the start of the graph)."""
        if not self.n_blocks:
            return
        torch.index_select(self.addresses, 0, self._tensor_of, out=self._address_row)
        self._address_row.add_(self._start)

    def pack(self, flat: torch.Tensor, scale: float) -> None:
        """The tensors at `addresses` into `flat`, times `scale` (rounded to fp32 by the
        caller), on the current stream."""
        if self.n_blocks:
            launch_pack(self._tables, flat, scale)

    def unpack_measured(self, flat: torch.Tensor, stats: torch.Tensor | None) -> None:
        """`flat` into the tensors at `addresses`, on the current stream; with `stats`, the
        ``[sum of squares, non-finite count]`` of what it wrote is written there."""
        if not self.n_blocks:
            if stats is not None:
                stats.zero_()
            return
        launch_unpack(self._tables, flat, 1.0, False, stats, partials=self._partials,
                      set_stats=True)

    def __repr__(self) -> str:
        return (f"RelocatablePlan({len(self.numels)} tensors, {self.total} x {self.dtype}, "
                f"{self.device})")
