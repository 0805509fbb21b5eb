"""Gradient buckets: assignment, flat buffers, and the ``GradBucket`` seen by comm hooks.

`build_buckets` makes a reducer's buckets: the dense ones (`Bucket`, grouped by
`assign_buckets`), then a `SparseBucket` per parameter with sparse gradients (``sparse.py``).

Assignment (`assign_buckets`): parameters are taken in a given order (reverse registration
order at first, the observed arrival order after the rebuild) and appended to the open bucket
of their dtype and device; a bucket closes once it holds at least its cap (torch's rule, so a
bucket may pass its cap by one tensor). Caps are used in launch order and the last repeats.

Layout: bucket ``b`` owns ``flat``, one 1-D buffer of its dtype holding its parameters'
gradients back to back in bucket order; ``views[i]`` is parameter ``i``'s slice shaped like
the parameter. With ``gradient_as_bucket_view`` the ``.grad`` of each parameter *is* that
view (so ``flat`` aliases the gradients); otherwise ``flat`` is a staging buffer that the
fused pack kernel fills and the unpack kernel empties.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastcomm import kernels
from fastcomm.kernels._launch import fp32_scale

__all__ = [
    "Bucket",
    "GradBucket",
    "SparseBucket",
    "assign_buckets",
    "build_buckets",
    "empty_sparse_like",
    "pack_bucket",
    "unpack_bucket",
    "unpack_grads",
]

# CPU buckets of these dtypes pack and unpack through the bucket's own views with torch ops: the
# kernels' torch reference does the same arithmetic (x * scale rounds once in fp32/fp64) but
# first re-validates every tensor and re-slices the flat buffer, a host cost per tensor per
# step (docs/ddp.md).
CPU_VIEW_DTYPES = (torch.float32, torch.float64)
# up to this many tensors, one multiply per tensor straight into its view (one pass over the
# bytes); beyond, one foreach copy then one multiply of the whole bucket (two passes, but two
# calls instead of hundreds)
MUL_INTO_VIEWS_MAX = 32


def assign_buckets(
    params: Sequence[torch.Tensor], order: Sequence[int], caps_bytes: Sequence[int]
) -> list[list[int]]:
    """Groups parameter indices, taken in `order`, into buckets of one dtype and device.

    Args:
        params: every parameter, indexed by position.
        order: the indices in the order their gradients are expected.
        caps_bytes: byte caps of the buckets of each (dtype, device), in order; the last
            repeats.

    Returns:
        Buckets (lists of indices) in launch order: closed buckets as they close, then the
        still-open ones in the order they were opened.
    """
    open_buckets: dict[tuple, tuple[list[int], list[int]]] = {}  # key -> (indices, [bytes, n])
    done: list[list[int]] = []
    for i in order:
        p = params[i]
        key = (p.dtype, p.device)
        indices, state = open_buckets.setdefault(key, ([], [0, 0]))
        indices.append(i)
        state[0] += p.numel() * p.element_size()
        if state[0] >= caps_bytes[min(state[1], len(caps_bytes) - 1)]:
            done.append(indices)
            open_buckets[key] = ([], [0, state[1] + 1])
    done.extend(indices for indices, _ in open_buckets.values() if indices)
    return done


class Bucket:
    """One bucket's parameters, their layout in ``flat`` and scratch buffers for hooks."""

    __slots__ = (
        "index", "param_indices", "params", "names", "offsets", "numel", "dtype", "device",
        "flat", "views", "scratch", "_plan", "shared",
    )
    sparse = False  # see SparseBucket

    def __init__(self, index: int, param_indices: list[int], params, names,
                 shared_memory=None) -> None:
        self.index = index
        self.param_indices = param_indices
        self.params = [params[i] for i in param_indices]
        self.names = [names[i] for i in param_indices]
        first = self.params[0]
        self.dtype, self.device = first.dtype, first.device
        self.offsets = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.scratch: dict[object, torch.Tensor] = {}
        # its place in shared bucket memory (shared.py), if any: then no private buffer
        self.shared = None if shared_memory is None else shared_memory.take(self)
        self.use_flat(
            torch.zeros(total, dtype=self.dtype, device=self.device) if self.shared is None
            else self.shared.flat
        )

    def use_flat(self, flat: torch.Tensor) -> None:
        """Makes `flat` (same dtype, device and size) the bucket's buffer, views re-cut."""
        if flat.dtype != self.dtype or flat.device != self.device or flat.numel() != self.numel:
            raise ValueError(
                f"bucket {self.index}: a flat buffer of {flat.numel()} x {flat.dtype} on "
                f"{flat.device} cannot replace {self.numel} x {self.dtype} on {self.device}"
            )
        self.flat = flat
        self.views = [
            flat[o : o + p.numel()].view(p.shape)
            for o, p in zip(self.offsets, self.params, strict=True)
        ]
        self._plan = None

    @property
    def plan(self) -> kernels.PackPlan:
        """The pack/unpack plan of this bucket's gradients (built on first use, then reused)."""
        if self._plan is None:
            self._plan = kernels.PackPlan(self.views)
        return self._plan

    def scratch_buffer(self, key: object, dtype: torch.dtype, numel: int | None = None):
        """A buffer reused across iterations (hooks' compressed copies); zeros when new."""
        numel = self.numel if numel is None else numel
        buf = self.scratch.get(key)
        if buf is None or buf.dtype != dtype or buf.numel() != numel:
            buf = torch.zeros(numel, dtype=dtype, device=self.device)
            self.scratch[key] = buf
        return buf

    def grad_targets(
        self, unused: frozenset[int], create_graph: bool = False
    ) -> list[torch.Tensor | None]:
        """Where the bucket's reduced gradients go: each parameter's ``.grad`` (made when it
        has none; detached under `create_graph`), ``None`` for the parameters in `unused` (no
        rank produced their gradient)."""
        if not unused and not create_graph:  # the usual step: every .grad, as it is
            targets = [p.grad for p in self.params]
            for k, g in enumerate(targets):
                if g is None:
                    p = self.params[k]
                    targets[k] = p.grad = torch.empty_like(p)
            return targets
        targets: list[torch.Tensor | None] = []
        for i, p in zip(self.param_indices, self.params, strict=True):
            if i in unused:
                targets.append(None)
                continue
            g = p.grad
            if g is None:
                g = p.grad = torch.empty_like(p)
            targets.append(g.detach() if create_graph else g)
        return targets

    def __repr__(self) -> str:
        return (
            f"Bucket({self.index}, {len(self.params)} params, {self.numel} x {self.dtype}, "
            f"{self.device})"
        )


class SparseBucket:
    """A bucket holding one parameter with a sparse gradient (no flat buffer, no views; see
    ``sparse.py``)."""

    __slots__ = (
        "index", "param_indices", "params", "names", "offsets", "numel", "dtype", "device",
        "flat", "views", "scratch", "reduced",
    )
    sparse = True
    shared = None  # never in shared bucket memory (shared.py)

    def __init__(self, index: int, param_index: int, params, names) -> None:
        p = params[param_index]
        self.index = index
        self.param_indices = [param_index]
        self.params = [p]
        self.names = [names[param_index]]
        self.offsets = [0]
        self.numel = p.numel()
        self.dtype, self.device = p.dtype, p.device
        self.flat = None
        self.views = [None]
        self.scratch: dict[object, torch.Tensor] = {}
        self.reduced: torch.Tensor | None = None  # this iteration's allreduce input/output

    def __repr__(self) -> str:
        return f"SparseBucket({self.index}, {self.names[0]!r}, {self.dtype}, {self.device})"


def build_buckets(
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    order: Sequence[int],
    caps_bytes: Sequence[int],
    sparse: set[int],
    shared_memory=None,
) -> list[Bucket | SparseBucket]:
    """Dense buckets of `order` (without the sparse parameters), then one per sparse one;
    the dense ones in `shared_memory` (a ``shared.SharedBuckets``) where it takes them."""
    dense_order = [i for i in order if i not in sparse] if sparse else list(order)
    groups = assign_buckets(params, dense_order, caps_bytes) if dense_order else []
    buckets: list[Bucket | SparseBucket] = [
        Bucket(b, idx, params, names, shared_memory) for b, idx in enumerate(groups)
    ]
    for i in order:
        if i in sparse:
            buckets.append(SparseBucket(len(buckets), i, params, names))
    return buckets



# ---------------------------------------------------------------------- pack / unpack
def _flush_pack(run, out, start, end, scale) -> None:
    if run:
        kernels.pack(run, out[start:end], scale=scale, dtype=out.dtype)


def pack_bucket(bucket: Bucket, grads: Sequence[torch.Tensor | None], out, *, scale=1.0):
    """Packs a bucket's `grads` into `out` (a flat buffer of its size) with the fused kernel.

    ``None`` gradients (parameters that got none) contribute zeros. The common case, every
    gradient present and contiguous, is exactly one ``kernels.pack`` launch (on CPU, for
    fp32/fp64 buckets, torch ops through the bucket's views).
    """
    if out is bucket.flat and out.dtype in CPU_VIEW_DTYPES and out.device.type == "cpu":
        try:
            _pack_cpu_views(bucket, grads, fp32_scale(scale))
            return out
        except (TypeError, RuntimeError):
            pass  # a None or sparse gradient: the general path below rewrites all of `out`
    try:  # the plan validates every gradient before it writes: no second pass here
        return bucket.plan.pack(grads, out, scale=scale)
    except (TypeError, ValueError):
        pass  # a None or non-contiguous gradient: pack the runs between them
    run: list[torch.Tensor] = []
    run_start = 0
    for g, p, off in zip(grads, bucket.params, bucket.offsets, strict=True):
        if g is None:
            _flush_pack(run, out, run_start, off, scale)
            run = []
            out[off : off + p.numel()].zero_()
            run_start = off + p.numel()
        else:
            run.append(g if g.is_contiguous() else g.contiguous())
    _flush_pack(run, out, run_start, bucket.numel, scale)
    return out


def _pack_cpu_views(bucket: Bucket, grads: Sequence[torch.Tensor | None], scale: float) -> None:
    """``bucket.flat = cat(grads) * scale`` through the bucket's views (shaped like the
    parameters, as the gradients are; any strides); ``TypeError`` on a ``None`` gradient."""
    scale_into_views(bucket.views, grads, scale, bucket.flat)


def scale_into_views(
    views: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], scale: float, flat: torch.Tensor
) -> None:
    """``views[i] = grads[i] * scale`` on CPU, where `views` tile all of `flat` in order (one
    multiply per view up to `MUL_INTO_VIEWS_MAX` views, else a foreach copy and one multiply
    of `flat`: the same bits either way). ``TypeError`` on a ``None`` gradient."""
    if scale != 1.0 and len(views) <= MUL_INTO_VIEWS_MAX:
        for g, view in zip(grads, views, strict=True):
            torch.mul(g, scale, out=view)
        return
    torch._foreach_copy_(views, grads)
    if scale != 1.0:
        flat.mul_(scale)


def unpack_bucket(bucket: Bucket, flat: torch.Tensor, targets: Sequence[torch.Tensor | None]):
    """Unpacks `flat` (the reduced bucket) into `targets` (``None``: leave that slice unread).

    On CPU, when `flat` is the bucket's own buffer (or a flat view of all of it), one foreach
    copy from the bucket's views (exact, any target strides); otherwise :func:`unpack_grads`.
    """
    own = bucket.flat
    if flat.device.type == "cpu" and (
        flat is own
        or (flat.data_ptr() == own.data_ptr() and flat.dtype == own.dtype
            and flat.numel() == own.numel())
    ):
        # not `None in targets`: that compares every tensor with None through Tensor.__eq__
        if all(t is not None for t in targets):
            torch._foreach_copy_(list(targets), bucket.views)
        else:
            pairs = [(t, v) for t, v in zip(targets, bucket.views, strict=True) if t is not None]
            if pairs:
                torch._foreach_copy_([t for t, _ in pairs], [v for _, v in pairs])
        return
    unpack_grads(flat, targets, bucket.offsets, bucket.numel, plan=bucket.plan)


def unpack_grads(
    flat: torch.Tensor,
    targets: Sequence[torch.Tensor | None],
    offsets: Sequence[int],
    numel: int,
    *,
    scale: float = 1.0,
    plan: kernels.PackPlan | None = None,
) -> None:
    """Unpacks `flat` into `targets` (``None``: leave that slice unread) with the fused kernel.

    ``offsets[i]`` is target ``i``'s start in `flat`; the common case, every target present
    and contiguous, is one ``kernels.unpack`` launch (through `plan`, the bucket's, when
    given). Non-contiguous targets (channels-last gradients) are filled through a contiguous
    copy.
    """
    try:  # unpack validates every target before it writes: no second pass here
        if plan is not None:
            plan.unpack(flat, targets, scale=scale)
        else:
            kernels.unpack(flat, targets, scale=scale)
        return
    except (TypeError, ValueError):
        pass  # a None or non-contiguous target: unpack the runs between them
    run: list[torch.Tensor] = []
    fixups: list[tuple[torch.Tensor, torch.Tensor]] = []
    run_start = 0
    ends = list(offsets[1:]) + [numel]
    for t, off, end in zip(targets, offsets, ends, strict=True):
        if t is None:
            if run:
                kernels.unpack(flat[run_start:off], run, scale=scale)
            run = []
            run_start = end
            continue
        if not t.is_contiguous():
            tmp = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            fixups.append((t, tmp))
            t = tmp
        run.append(t)
    if run:
        kernels.unpack(flat[run_start:numel], run, scale=scale)
    for t, tmp in fixups:
        t.copy_(tmp)


# ---------------------------------------------------------------------- torch's contract
class GradBucket:
    """What a comm hook receives: torch's ``dist.GradBucket`` contract, plus fused packing.

    torch's methods: ``index()``, ``buffer()`` (the flat gradients, unscaled, packed on first
    use), ``gradients()`` (views of ``buffer()`` shaped like the parameters), ``parameters()``,
    ``is_last()``, ``set_buffer(tensor)``.

    fastcomm's additions, used by the built-in hooks: ``packed(dtype, scale)`` packs the
    gradients straight into a buffer of another dtype with the scale applied (one kernel,
    instead of ``buffer()`` then a cast), ``scale()`` is the averaging factor the reducer
    would apply (``1/world``, or what ``join`` says), ``comm`` is the DDP's communicator and
    ``parameter_names()`` the parameters' qualified names.
    """

    __slots__ = ("_bucket", "_grads", "_buffer", "_last", "_scale", "_bucket_view", "comm")

    def __init__(
        self,
        bucket: Bucket,
        grads: list[torch.Tensor | None] | None,
        *,
        is_last: bool,
        scale: float,
        bucket_view: bool,
        comm,
    ) -> None:
        self._bucket = bucket
        self._grads = grads  # None: a joined rank's shadow bucket (zeros)
        self._buffer: torch.Tensor | None = None
        self._last = is_last
        self._scale = scale
        self._bucket_view = bucket_view
        self.comm = comm

    # torch's contract ---------------------------------------------------------------
    def index(self) -> int:
        """The bucket's position in the DDP's bucket order."""
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat gradient of the bucket (packed on first call), as the hook reduces it."""
        if self._buffer is None and self._bucket.sparse:
            self._buffer = self._sparse_gradient()
        if self._buffer is None:
            flat = self._bucket.flat
            if self._grads is None:
                flat.zero_()
            elif not self._bucket_view:
                pack_bucket(self._bucket, self._grads, flat)
            self._buffer = flat
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient as a view of :meth:`buffer` (the sparse one itself)."""
        buf = self.buffer()
        if buf.is_sparse:
            return [buf]
        return [
            buf[o : o + p.numel()].view(p.shape)
            for o, p in zip(self._bucket.offsets, self._bucket.params, strict=True)
        ]

    def parameters(self) -> list[torch.Tensor]:
        """The parameters of the bucket, in bucket order."""
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the iteration to be reduced."""
        return self._last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the flat gradient the reducer unpacks (torch's contract)."""
        self._buffer = buffer

    def _sparse_gradient(self) -> torch.Tensor:
        if self._grads is not None:
            return self._grads[0]
        return empty_sparse_like(self._bucket.params[0])

    # fastcomm's additions -------------------------------------------------------------
    def scale(self) -> float:
        """The averaging factor of this iteration (``1 / world_size`` unless joined)."""
        return self._scale

    def parameter_names(self) -> list[str]:
        """The qualified names of the bucket's parameters, in bucket order."""
        return list(self._bucket.names)

    def numel(self) -> int:
        """Elements of the bucket's gradients together."""
        return self._bucket.numel

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the bucket's parameters and flat gradient."""
        return self._bucket.dtype

    def packed(
        self, dtype: torch.dtype | None = None, scale: float = 1.0, *, numel: int | None = None
    ) -> torch.Tensor:
        """The gradients times `scale`, as a flat buffer of `dtype`, in one fused kernel.

        Args:
            dtype: dtype of the result (default: the bucket's).
            scale: factor applied while packing (e.g. ``bucket.scale()`` to average).
            numel: length of the result when it must be longer than the bucket (the tail is
                zeros), e.g. padded to whole quantization blocks per rank.

        Returns:
            With the bucket's own dtype and length, the bucket's flat buffer (scaled in
            place); otherwise a scratch buffer of the bucket, reused every iteration.
        """
        bucket = self._bucket
        if bucket.sparse:
            raise TypeError(
                f"bucket {bucket.index} holds the sparse gradient of {bucket.names[0]!r}: "
                "packed() makes dense buffers; reduce bucket.buffer() (a sparse tensor) instead"
            )
        dtype = bucket.dtype if dtype is None else dtype
        numel = bucket.numel if numel is None else numel
        if numel < bucket.numel:
            raise ValueError(f"numel={numel} is shorter than the bucket ({bucket.numel})")
        if dtype == bucket.dtype and numel == bucket.numel:
            full = out = bucket.flat
        else:
            full = bucket.scratch_buffer(("packed", dtype, numel), dtype, numel)
            out = full[: bucket.numel]
        if self._grads is None:  # a joined rank's shadow bucket
            return full.zero_()
        if self._buffer is not None and self._buffer is not bucket.flat:
            kernels.pack([self._buffer.reshape(-1)], out, scale=scale, dtype=dtype)
        elif self._bucket_view or self._buffer is not None:
            if out is bucket.flat:
                if scale != 1.0:
                    out.mul_(scale)
            else:
                kernels.pack([bucket.flat], out, scale=scale, dtype=dtype)
        else:
            pack_bucket(bucket, self._grads, out, scale=scale)
        return full


def empty_sparse_like(p: torch.Tensor) -> torch.Tensor:
    """A sparse COO zero shaped like `p` (one sparse dim, as an embedding's gradient).

    A joined rank's shadow of a sparse bucket contributes this zero to the allreduce.
    """
    indices = torch.empty(1, 0, dtype=torch.int64, device=p.device)
    values = torch.empty(0, *p.shape[1:], dtype=p.dtype, device=p.device)
    return torch.sparse_coo_tensor(indices, values, p.shape)
