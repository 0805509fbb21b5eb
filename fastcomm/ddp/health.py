"""Training health from the unpack: gradient norm, non-finite gradients, named hangs.

`GradHealth` makes a reducer's unpack measure what it writes (`PackPlan.unpack_measured`, or a
CUDA graph's unpack, `fastcomm.ddp.graphs`), so each bucket also leaves
``[sum of squares, non-finite count]`` in one row of ``stats`` (float32, on the gradients'
device, never read by the host unless asked). Every rank holds the same averaged gradients,
hence the same rows: the norm and the NaN/Inf verdict need no collective. Where the unpack
runs torch ops (CPU), or a bucket was reduced in place, rows are filled on demand.

Invariant: the rows are used only when the last synchronized backward unpacked every bucket
and every ``.grad`` is still the tensor the unpack wrote, at the same version counter;
otherwise `clip_grad_norm_` computes what torch computes.

Hang pinpointing lives in `fastcomm.ddp._readiness`. Validity rules in detail: docs/ddp.md.
"""

from __future__ import annotations

import functools
import math
from weakref import ref as _weakref

import torch

from fastcomm import kernels

from . import _readiness
from .bucket import unpack_bucket, unpack_grads

__all__ = ["GradHealth"]

_MAX_NAMES = 10


class GradHealth:
    """Per-bucket gradient statistics of a reducer, and what DDP computes from them.

    Args:
        reducer: the DDP's reducer (its buckets, parameters and names).
        check_finite: raise ``FloatingPointError`` at the end of a synchronized backward
            whose averaged gradients hold NaN or Inf.
        eager: measure in the unpack (``unpack_with_stats``) rather than on demand. Default:
            where the unpack is a Triton kernel (CUDA), whose statistics cost no extra
            memory traffic. On the CPU the torch unpack cannot fuse them: measuring there
            costs one norm pass, so it is done only when asked for (``clip_grad_norm_``,
            ``check_finite``, ``nonfinite_grads``), over the gradients the unpack wrote.
    """

    def __init__(self, reducer, *, check_finite: bool = False, eager: bool | None = None):
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {type(check_finite).__name__}")
        self.reducer = reducer
        self.check_finite = check_finite
        if eager is None:
            eager = kernels.kernel_backend(reducer.buckets[0].device) == "triton"
        self.eager = eager
        self._lazy: dict[int, list[torch.Tensor]] = {}  # bucket -> targets not yet measured
        self.stats: torch.Tensor | None = None  # [n_buckets, 2]: sum of squares, non-finite
        self._stale = False  # stats still hold an earlier step's rows (zeroed on first use)
        self._step = -1  # reducer.synced_iterations the stats belong to
        self._unpacked = 0  # buckets unpacked with stats in that step
        self._complete = False  # every bucket unpacked, no stray gradient left out
        # (parameter, its grad, the grad's version) as the unpack left them
        # (params, weak references to the targets, versions): weak, so that the gradients a
        # step wrote are freed by zero_grad(set_to_none=True) and the next step's take their
        # memory (a captured bucket then finds its gradients where they were)
        self._written: list[tuple[list, list, list[int]]] = []
        self.last_norm_source = ""  # "unpack", "buckets" or "torch": for tests and logging
        self.readiness = _readiness.Readiness(reducer)

    # ------------------------------------------------------------------ reducer side
    def begin_step(self) -> None:
        """Called by the reducer before it unpacks the buckets of a synchronized backward."""
        # Where the unpack measures (eager), every bucket's unpack writes its row, so nothing
        # is zeroed here: a bucket replayed from a CUDA graph wrote its row during backward,
        # before this call. Elsewhere the rows are zeroed when first measured.
        self._stale = not self.eager
        if self.eager:
            self.ensure_stats()
        self._unpacked = 0
        self._complete = not self.reducer.bucket_view
        self._written = []
        self._lazy = {}
        self._step = -1

    def ensure_stats(self) -> torch.Tensor:
        """The ``[n_buckets, 2]`` rows, made (zeroed) when missing or of another shape."""
        n = len(self.reducer.buckets)
        device = self.reducer.buckets[0].device
        if self.stats is None or self.stats.shape[0] != n or self.stats.device != device:
            self.stats = torch.zeros(n, 2, dtype=torch.float32, device=device)
        return self.stats

    def _zero_stats(self) -> None:
        self.ensure_stats().zero_()

    def unpack(self, bucket, value: torch.Tensor, targets: list[torch.Tensor | None]) -> None:
        """The reducer's unpack of one reduced bucket, measuring what it writes."""
        if not self.eager:
            unpack_bucket(bucket, value, targets)
            self._lazy[bucket.index] = targets  # _measure skips the None entries
            self._record(bucket, targets)
            return
        row = self.stats[bucket.index]
        try:  # the usual bucket: the plan's measured unpack writes the row, one pass
            bucket.plan.unpack_measured(value, targets, row)
        except (TypeError, ValueError):
            # a gap (unused parameter) or a channels-last gradient: the plain unpack
            unpack_grads(value, targets, bucket.offsets, bucket.numel, plan=bucket.plan)
            row.zero_()
            self._measure(targets, row)
        self._record(bucket, targets)

    def written(self, bucket, targets: list[torch.Tensor | None]) -> None:
        """The reducer wrote `bucket`'s averaged gradients into `targets` without an unpack
        (reduced in place, see ``in_place.py``): measured like an unpack's."""
        if self.eager:
            row = self.stats[bucket.index]
            row.zero_()
            self._measure(targets, row)
        else:
            self._lazy[bucket.index] = targets
        self._record(bucket, targets)

    def captured(self, bucket, targets: list[torch.Tensor]) -> None:
        """`bucket`'s unpack ran in a CUDA graph replayed during backward, which wrote its
        row of ``stats`` (``fastcomm.ddp.graphs``): recorded as an unpack."""
        self._record(bucket, targets)

    def _record(self, bucket, targets: list[torch.Tensor | None]) -> None:
        self._unpacked += 1
        # one record per bucket on the hot path; clip_grad_norm_ checks it parameter by parameter
        versions = [t._version for t in targets if t is not None]
        if len(versions) != len(targets) and any(
            t is None and p.grad is not None for t, p in zip(targets, bucket.params, strict=True)
        ):
            self._complete = False  # a stale gradient the unpack did not write
        refs = [None if t is None else _weakref(t) for t in targets]
        self._written.append((bucket.params, refs, versions))

    @staticmethod
    def _measure(targets, stats: torch.Tensor) -> None:
        present = [t for t in targets if t is not None and t.numel()]
        if not present:
            return
        dtype = kernels._launch.compute_dtype(*{t.dtype for t in present})
        norms = torch._foreach_norm(present, dtype=dtype)
        sum_sq = torch.stack(norms).square().sum().to(torch.float32)
        stats[0] += sum_sq
        if sum_sq.device.type == "cpu" and math.isfinite(sum_sq):
            return  # a finite sum of squares proves every value finite (free to read here)
        bad = torch.stack([(~torch.isfinite(t)).sum() for t in present]).sum()
        stats[1] += bad.to(torch.float32)

    def _materialize(self) -> None:
        """Measures the buckets the unpack left unmeasured (see ``eager``)."""
        if self._stale:
            self._zero_stats()
            self._stale = False
        for index, targets in self._lazy.items():
            self._measure(targets, self.stats[index])
        self._lazy = {}

    def end_step(self) -> None:
        """Called once the reducer counted the synchronized step (after every unpack)."""
        reducer = self.reducer
        self._step = reducer.synced_iterations
        if self._unpacked != len(reducer.buckets):
            self._complete = False
        if self.check_finite:
            names = self.nonfinite_names()
            if names:
                raise FloatingPointError(self._nonfinite_message(names))

    def wait(self, bucket) -> torch.Tensor | None:
        """The reducer's wait for a bucket, explaining a timeout by the ranks' readiness."""
        return self.readiness.wait(bucket)

    # ------------------------------------------------------------------ non-finite
    def _bucket_counts(self) -> list[float]:
        """Non-finite values per bucket in the last synchronized step (a host sync); 1 for
        a bucket nothing measured (its parameters are then checked one by one)."""
        reducer = self.reducer
        if self._step == reducer.synced_iterations and self._unpacked == len(reducer.buckets):
            self._materialize()
            return self.stats[:, 1].tolist()
        if reducer.bucket_view:  # no unpack: the flat buffers are the gradients
            flats = [b.flat for b in reducer.buckets]
            return torch.stack([(~torch.isfinite(f)).sum() for f in flats]).tolist()
        return [1.0] * len(reducer.buckets)

    def nonfinite_names(self) -> list[str]:
        """Qualified names of the parameters whose averaged gradient holds NaN or Inf.

        Per-parameter detail is computed only for buckets whose count is nonzero.
        """
        names = []
        for bucket, count in zip(self.reducer.buckets, self._bucket_counts(), strict=True):
            if count == 0:
                continue
            for name, p in zip(bucket.names, bucket.params, strict=True):
                g = p.grad
                if g is not None and not bool(torch.isfinite(g).all()):
                    names.append(name)
        return names

    def _nonfinite_message(self, names: list[str]) -> str:
        comm = self.reducer.comm
        shown = ", ".join(names[:_MAX_NAMES])
        if len(names) > _MAX_NAMES:
            shown += f", ... ({len(names) - _MAX_NAMES} more)"
        return (
            f"fastcomm DDP (rank {comm.rank} of {comm.size}): synchronized step "
            f"{self.reducer.synced_iterations}: the averaged gradients of {len(names)} "
            f"parameter(s) hold NaN or Inf: {shown} (check_finite=True)"
        )

    # ------------------------------------------------------------------ clip_grad_norm_
    def _stats_valid(self) -> bool:
        reducer = self.reducer
        if not self._complete or self._step != reducer.synced_iterations:
            return False
        pairs = [
            (p, ref)
            for params, refs, _ in self._written
            for p, ref in zip(params, refs, strict=True)
            if ref is not None
        ]
        versions = [v for _, _, vs in self._written for v in vs]
        if len(pairs) != sum(p.grad is not None for p in reducer.params):
            return False
        for (p, ref), v in zip(pairs, versions, strict=True):
            g = p.grad
            if g is None or g is not ref() or g._version != v:
                return False
        return True

    def _views_intact(self) -> bool:
        reducer = self.reducer
        for p, view in zip(reducer.params, reducer.grad_views, strict=True):
            g = p.grad
            if g is None or g.shape != view.shape or g.data_ptr() != view.data_ptr():
                return False
        return True

    def clip_grad_norm_(
        self,
        parameters: list[torch.nn.Parameter],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` over `parameters` (the module's), from the stats when
        they hold (see the module docstring)."""
        reducer = self.reducer
        grads = [p.grad for p in parameters if p.grad is not None]
        known = reducer.index_of
        source = ""
        if (
            float(norm_type) == 2.0
            and grads
            and all(id(p) in known for p in parameters if p.grad is not None)
        ):
            if reducer.bucket_view:
                if self._views_intact():
                    source = "buckets"
            elif self._stats_valid():
                source = "unpack"
        if not source:
            self.last_norm_source = "torch"
            return torch.nn.utils.clip_grad_norm_(
                parameters, max_norm, norm_type, error_if_nonfinite, foreach
            )
        if source == "unpack":
            self._materialize()
            sum_sq = self.stats[:, 0].sum()
        else:
            flats = [b.flat for b in reducer.buckets]
            sum_sq = torch.stack([_sum_sq(f) for f in flats]).sum()
        dtype = functools.reduce(torch.promote_types, {g.dtype for g in grads})
        total_norm = sum_sq.sqrt().to(dtype)
        self.last_norm_source = source
        if error_if_nonfinite and (total_norm.isnan() or total_norm.isinf()):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` "
                "is non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        clip_coef = max_norm / (total_norm + 1e-6)  # torch's coefficient, in its dtype
        if total_norm.device.type == "cpu" and bool(clip_coef >= 1.0):
            # torch multiplies by the clamped 1.0 anyway (no host sync on CUDA); on the CPU
            # reading the norm is free and x * 1.0 == x, so the pass is skipped.
            return total_norm
        if source == "buckets":
            # The flat buffers are the gradients: scale a few large tensors, not every one.
            clip_coef = torch.clamp(clip_coef, max=1.0)
            for f in flats:
                f.mul_(clip_coef.to(f.dtype))
        else:
            torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)
        return total_norm


def _sum_sq(flat: torch.Tensor) -> torch.Tensor:
    compute = torch.float64 if flat.dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(flat, dtype=compute).square().to(torch.float32)

