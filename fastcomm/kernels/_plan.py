"""A bucket's pack and unpack planned once: per call, only the checks and the bytes.

`PackPlan` validates a *layout* (the tensors' shapes and dtypes, in order, on one device) once
and keeps: views of each flat buffer it served (keyed by address, dtype and length; the views
hold the storage alive), a scratch buffer per dtype, the Triton block tables (rebuilt when a
tensor's address changes) and the implementation chosen at plan time.

Invariants: each call still checks element counts, dtypes and (for the kernel) contiguity,
raising what `pack` raises; results are bit-identical to `pack`/`unpack` with the same
arguments (but a NaN's payload cast from a strided tensor). The torch path is `_pack`'s, with
the plan as its `TorchLayout`.

What the plan saves, and when the torch copies beat the kernel: docs/kernels.md.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from ._launch import (
    FLOAT_DTYPES,
    FLOAT_SET,
    block_table,
    check_out,
    check_tensor,
    fp32_scale,
    keep_for_launch,
    kernel_backend,
    scan_tensors,
)
from ._pack import BLOCK, launch_pack, launch_unpack, pack_torch, unpack_torch

__all__ = ["PackPlan"]

_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")
_DTYPE = operator.attrgetter("dtype")
_NUMEL = torch.Tensor.numel
_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous

#: Flat buffers whose views a plan keeps (a bucket's own, a hook's scratch, a hook's result).
_VIEW_CACHE = 3

#: On CUDA, a copy of at most this many tensors and this many bytes takes
#: ``_foreach_copy_`` (host-bound: its host time beats a Triton launch's); larger buckets
#: take the fused kernel, which stays at the copy limit for large tensors. On one H200 the
#: kernel copied 8 x 1M fp32 at 3.0 TB/s and ``_foreach_copy_`` at 2.3 (probe.log of
#: bench/results/gpu-h200-2026-11-28-4138442): past 16 MiB the device time it saves is worth
#: more than the few microseconds of host time the launch costs beyond the foreach call.
FOREACH_MAX_TENSORS = 64
FOREACH_MAX_BYTES = 16 << 20
#: ... and a scaled fp32/fp64 copy of at most this many bytes takes ``_foreach_copy_`` and one
#: ``mul_`` of the flat buffer (the same single rounding as the kernel): a second pass over
#: the bytes, cheaper than a launch only while the bucket is small.
FOREACH_SCALED_MAX_BYTES = 1 << 20


def foreach_on_device(
    device: torch.device, n_tensors: int, nbytes: int, dtype: torch.dtype | None, scale: float
) -> bool:
    """Whether a plan on a kernel device copies with ``_foreach_copy_`` instead of the kernel.

    Only small buckets on CUDA, where the host time of a launch dominates: copies without a
    cast (`dtype` is the one dtype of tensors and buffer; None when a cast happens), scaled
    only in fp32/fp64 (where ``copy`` then ``mul_`` rounds exactly as the kernel does).
    """
    if device.type != "cuda" or dtype is None or n_tensors > FOREACH_MAX_TENSORS:
        return False
    if scale == 1.0:
        return nbytes <= FOREACH_MAX_BYTES
    return dtype in (torch.float32, torch.float64) and nbytes <= FOREACH_SCALED_MAX_BYTES


class PackPlan:
    """Packs a fixed layout of tensors into flat buffers and back, planned once.

    Args:
        tensors: the bucket's tensors as they will be passed to `pack`/`unpack`: contiguous
            floating tensors on one device, any shapes (including empty); mixed dtypes allowed.

    Raises:
        TypeError, ValueError: as `pack` for the same tensors.

    Example::

        plan = PackPlan(grads)
        plan.pack(grads, bucket_flat, scale=1 / world)
        ...
        plan.unpack(bucket_flat, grads)
    """

    __slots__ = (
        "layout", "numels", "offsets", "total", "device", "dtypes", "backend",
        "_cat_1d", "_groups", "_views", "_tables", "_table_ptrs", "_scratch", "_dtype_list",
        "_on_cuda", "_partials",
    )

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        scan = scan_tensors("tensors", tensors)
        #: ``(shape, dtype)`` of each tensor, in order (calls are checked against the counts
        #: and dtypes; the shapes give the views).
        self.layout = list(map(_SHAPE_DTYPE, scan.tensors))
        self.numels = scan.numels
        self.offsets = scan.offsets
        self.total = scan.total
        self.device = scan.device if scan.device is not None else torch.device("cpu")
        #: Distinct dtypes of the tensors, in first-seen order.
        self.dtypes = list(dict.fromkeys(scan.dtypes))
        self._dtype_list = scan.dtypes
        self._on_cuda = self.device.type == "cuda"
        #: ``"triton"`` or ``"torch"``: the implementation chosen for this device.
        self.backend = kernel_backend(self.device)
        # 1-D tensors on CPU gather with one cat, the fastest gather there (no views needed).
        self._cat_1d = self.device.type == "cpu" and all(len(s) == 1 for s, _ in self.layout)
        # Indices of each dtype's tensors (one launch / one vectorized copy per dtype).
        self._groups = {d: [i for i, dt in enumerate(scan.dtypes) if dt == d] for d in self.dtypes}
        # (buffer, its address, dtype, length, views), the most recent first.
        self._views: list[tuple] = []
        self._tables: dict[int, list] = {}  # flat itemsize -> [(dtype, BlockTable)]
        self._table_ptrs: list[int] | None = None
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self._partials: dict[int, torch.Tensor] = {}  # flat itemsize -> the stats scratch

    def __len__(self) -> int:
        return len(self.layout)

    def __repr__(self) -> str:
        kinds = ", ".join(str(d) for d in self.dtypes)
        return (f"PackPlan({len(self.layout)} tensors, {self.total} elements of {kinds or '-'}, "
                f"{self.device}, {self.backend})")

    # ------------------------------------------------------------------ checks
    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether `tensors` have the planned element counts and dtypes (and, where the kernel
        reads their addresses, are contiguous: torch's copies take any strides)."""
        try:
            return (
                isinstance(tensors, (list, tuple))
                and list(map(_NUMEL, tensors)) == self.numels
                and list(map(_DTYPE, tensors)) == self._dtype_list
                and (self.backend == "torch" or all(map(_IS_CONTIGUOUS, tensors)))
            )
        except (AttributeError, TypeError):  # a non-tensor in the list
            return False

    def _check(self, tensors) -> None:
        if self.matches(tensors):
            return
        if self.backend == "torch":  # strides are fine there: name a non-tensor or a dtype
            self._check_loose(tensors)
            return
        scan = scan_tensors("tensors", tensors)  # raises for non-tensors, strides, devices
        if len(scan.tensors) != len(self.layout):
            raise ValueError(f"tensors has {len(scan.tensors)} tensors; this plan was made "
                             f"for {len(self.layout)}")
        for i, (t, (shape, dtype)) in enumerate(zip(scan.tensors, self.layout, strict=True)):
            if t.numel() != shape.numel() or t.dtype != dtype:
                raise ValueError(
                    f"tensors[{i}] has shape {tuple(t.shape)} and dtype {t.dtype}; this plan "
                    f"was made for shape {tuple(shape)} and dtype {dtype} (make a new plan)"
                )
        raise AssertionError("unreachable")  # pragma: no cover

    def _check_loose(self, tensors) -> None:
        """Raises as `_check` for the torch backend, where strided tensors are allowed."""
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
            raise TypeError(f"tensors must be a list or tuple of tensors, got "
                            f"{type(tensors).__name__}")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_SET:
                check_tensor(f"tensors[{i}]", t, dtypes=FLOAT_DTYPES)  # raises TypeError
        if len(tensors) != len(self.layout):
            raise ValueError(f"tensors has {len(tensors)} tensors; this plan was made "
                             f"for {len(self.layout)}")
        for i, (t, (shape, dtype)) in enumerate(zip(tensors, self.layout, strict=True)):
            if t.numel() != shape.numel() or t.dtype != dtype:
                raise ValueError(
                    f"tensors[{i}] has shape {tuple(t.shape)} and dtype {t.dtype}; this plan "
                    f"was made for shape {tuple(shape)} and dtype {dtype} (make a new plan)"
                )
        raise AssertionError("unreachable")  # pragma: no cover

    def _explain(self, tensors) -> None:
        """Raises ValueError naming the first tensor whose shape differs from the plan's."""
        for i, (t, (shape, _)) in enumerate(zip(tensors, self.layout, strict=True)):
            if t.shape != shape:
                raise ValueError(f"tensors[{i}] has shape {tuple(t.shape)}; this plan was made "
                                 f"for shape {tuple(shape)} (make a new plan)")

    def _check_flat(self, name: str, flat) -> None:
        try:  # the usual, checked without building messages or device objects
            if (flat.is_cuda == self._on_cuda and flat.dtype in FLOAT_SET and flat.dim() == 1
                    and flat.numel() == self.total and flat.is_contiguous()
                    and (not self._on_cuda or flat.get_device() == self.device.index)):
                return
        except (AttributeError, TypeError):
            pass
        check_tensor(name, flat, dtypes=FLOAT_DTYPES)
        # An empty layout has no device of its own: any buffer of length 0 will do.
        device = self.device if self.layout else flat.device
        check_out(name, flat, numel=self.total, dtype=flat.dtype, device=device)

    # ------------------------------------------------------------------ cached state
    # `views`, `cat_inputs` and `scratch` (with `dtypes`) make the plan the `TorchLayout` of
    # the torch pack and unpack.
    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` shaped like the planned tensors (cached per buffer)."""
        first = self._views[0] if self._views else None
        if first is not None and first[0] is flat and first[1] == flat.data_ptr():
            return first[4]  # the buffer of the last call, the same object: no key to build
        key = (flat.data_ptr(), flat.dtype, flat.numel())
        for entry in self._views:
            if entry[1:4] == key:
                return entry[4]
        views = [
            part.view(shape)
            for part, (shape, _) in zip(flat.split(self.numels), self.layout, strict=True)
        ] if self.layout else []
        self._views.insert(0, (flat, *key, views))
        del self._views[_VIEW_CACHE:]
        return views

    def cat_inputs(self, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor] | None:
        """`tensors` as they are for one ``torch.cat`` where all are 1-D on CPU, else None
        (the torch path then copies through `views`)."""
        return tensors if self._cat_1d else None

    def scratch(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The plan's scratch buffer of `dtype` (`flat`'s length), kept for the next call."""
        buf = self._scratch.get(dtype)
        if buf is None:
            buf = self._scratch[dtype] = torch.empty(flat.numel(), dtype=dtype,
                                                      device=flat.device)
        return buf

    def block_tables(self, tensors, flat: torch.Tensor) -> list:
        """``(dtype, BlockTable)`` per dtype of `tensors` placed in `flat` (kept until an
        address changes): what a kernel walking this bucket launches over, e.g. a fused
        unpack variant; `tensors` must have passed this plan's checks."""
        ptrs = list(map(_DATA_PTR, tensors))
        if ptrs != self._table_ptrs:  # reallocated tensors: their addresses are in the tables
            scan = scan_tensors("tensors", tensors)
            if scan.device != self.device:
                raise ValueError(f"tensors are on {scan.device}; this plan was made for "
                                 f"{self.device}")
            self._tables.clear()
            self._table_ptrs = ptrs
        itemsize = flat.element_size()
        tables = self._tables.get(itemsize)
        if tables is not None:
            for _, bt in tables:  # held across calls, maybe made under another stream
                keep_for_launch(bt)
        else:
            tables = self._tables[itemsize] = [
                (
                    dtype,
                    block_table(
                        [ptrs[i] for i in idx], [self.numels[i] for i in idx],
                        [self.offsets[i] for i in idx], dtype.itemsize, flat, BLOCK,
                    ),
                )
                for dtype, idx in self._groups.items()
            ]
        return tables

    def _foreach_on_device(self, scale: float, flat_dtype: torch.dtype) -> bool:
        if self.dtypes != [flat_dtype]:
            return False
        dtype = self.dtypes[0]
        nbytes = self.total * dtype.itemsize
        return foreach_on_device(self.device, len(self.layout), nbytes, dtype, scale)

    # ------------------------------------------------------------------ pack
    def pack(
        self,
        tensors: Sequence[torch.Tensor],
        out: torch.Tensor,
        *,
        scale: float = 1.0,
    ) -> torch.Tensor:
        """`pack(tensors, out, scale=scale, dtype=out.dtype)`, with the planning reused.

        Args:
            tensors: tensors of the planned layout (any addresses).
            out: contiguous 1-D floating buffer of the planned total length on the plan's
                device; its dtype is the packed dtype.
            scale: every element is multiplied by it (rounded to fp32) before the cast.

        Returns:
            `out`.

        Raises:
            TypeError, ValueError: tensors not of the planned layout, or a bad `out`/`scale`.
        """
        self._check(tensors)
        self._check_flat("out", out)
        scale = fp32_scale(scale)
        if not self.layout:
            return out
        if self.backend == "torch" or self._foreach_on_device(scale, out.dtype):
            try:
                pack_torch(tensors, out, scale, self)
            except RuntimeError:
                self._explain(tensors)  # a shape torch's copies refuse
                raise
        elif self.total:
            launch_pack(self.block_tables(tensors, out), out, scale)
        return out

    # ------------------------------------------------------------------ unpack
    def unpack(
        self,
        flat: torch.Tensor,
        tensors: Sequence[torch.Tensor],
        *,
        scale: float = 1.0,
        accumulate: bool = False,
    ) -> None:
        """`unpack(flat, tensors, scale=scale, accumulate=accumulate)`, planning reused.

        Raises:
            TypeError, ValueError: tensors not of the planned layout, or a bad `flat`,
                `scale` or `accumulate`.
        """
        self._check(tensors)
        self._check_flat("flat", flat)
        if not isinstance(accumulate, bool):
            raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
        scale = fp32_scale(scale)
        if not self.layout:
            return
        plain = not accumulate and scale == 1.0  # the only unpack on CUDA that skips the kernel
        if self.backend == "torch" or (plain and self._foreach_on_device(scale, flat.dtype)):
            try:
                unpack_torch(flat, tensors, scale, accumulate, self)
            except RuntimeError:
                self._explain(tensors)  # a shape torch's copies refuse
                raise
        elif self.total:
            launch_unpack(self.block_tables(tensors, flat), flat, scale, accumulate)

    # ------------------------------------------------------------------ measured unpack
    def unpack_measured(
        self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], stats: torch.Tensor
    ) -> None:
        """``unpack(flat, tensors)`` that also writes ``[sum of squares, non-finite count]``
        of the values it stored into `stats` (float32, 2 elements, on the plan's device):
        what `unpack_with_stats` adds, written instead, from the same pass on CUDA (one
        kernel and one sum, no allocation: the per-block scratch is the plan's).

        Raises:
            TypeError, ValueError: as `unpack`, or `stats` not a float32 (2,) tensor on the
                plan's device.
        """
        self._check(tensors)
        self._check_flat("flat", flat)
        if (not isinstance(stats, torch.Tensor) or stats.dtype != torch.float32
                or stats.shape != (2,) or stats.device != flat.device):
            got = (f"a {stats.dtype} tensor of shape {tuple(stats.shape)} on {stats.device}"
                   if isinstance(stats, torch.Tensor) else type(stats).__name__)
            raise ValueError(f"stats is {got}; expected float32 of shape (2,) on {flat.device}")
        if not self.layout or not self.total:
            stats.zero_()
            return
        if self.backend == "torch":
            unpack_torch(flat, tensors, 1.0, False, self)
            values = [t.reshape(-1) for t in tensors if t.numel()]
            compute = torch.float64 if torch.float64 in (flat.dtype, *self.dtypes) else (
                torch.float32)
            both = torch.cat(values) if len(values) > 1 else values[0]
            stats[0] = torch.linalg.vector_norm(both, dtype=compute).square()
            stats[1] = both.numel() - torch.isfinite(both).sum()
            return
        tables = self.block_tables(tensors, flat)
        partials = None
        if len(tables) == 1:
            n_blocks = tables[0][1].n_blocks
            itemsize = flat.element_size()
            partials = self._partials.get(itemsize)
            compute = torch.float64 if torch.float64 in (flat.dtype, *self.dtypes) else (
                torch.float32)
            if partials is None or partials.shape[1] != n_blocks or partials.dtype != compute:
                partials = self._partials[itemsize] = torch.empty(
                    2, n_blocks, dtype=compute, device=flat.device
                )
        launch_unpack(tables, flat, 1.0, False, stats, partials=partials, set_stats=True)
