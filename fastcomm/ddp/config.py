"""The options of :class:`fastcomm.ddp.DDP`, validated in one place.

``DDP`` takes torch's arguments and turns them into a :class:`DDPConfig`; the reducer and the
module read only the config. Bucket caps follow torch: 25 MiB buckets, and a 1 MiB first
bucket (the first gradients to arrive, so their allreduce starts early) while the cap is
left at its default.

Every threshold and environment variable (``fastcomm.settings``) behind how a bucket is reduced
is read here, once, into a field; ``plan.py`` decides each bucket's reduction from these fields
and the communicator's capabilities. The module constants below are the fields' defaults,
looked up when a config is made (tests lower them for the DDPs their checks build).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastcomm import settings
from fastcomm.kernels._launch import FLOAT_DTYPES

from .bucket import MUL_INTO_VIEWS_MAX

__all__ = ["DDPConfig", "DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_MB", "MB"]

MB = 1024 * 1024
MAX_BUCKET_CAP_MB = float(1 << 43)
"""Largest cap accepted, in MiB: 2**63 bytes, the most a tensor's byte count can hold."""
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_MB = 1.0

# By default (gradient_as_bucket_view=None) the buckets are shared only where the gradients
# average this many bytes: a bucket view costs a copy and a `.grad` store per gradient in
# Python, which the packed path does in two foreach calls per bucket; with hundreds of tiny
# gradients that outweighs the collective's saving (figures: docs/ddp.md).
SHARED_MIN_MEAN_BYTES = settings.DDP_SHARED_MIN_MEAN_BYTES.default
# A fresh gradient at least this large is staged into its shared CPU bucket (only the peers'
# parts copied in, its own slice read where autograd left it); a smaller one is copied whole:
# the staging's few slicing calls cost more than copying a few KiB (figures: docs/ddp.md).
STAGE_MIN_BYTES = 64 << 10
# A collective costs tens of microseconds of sequencing; one pass over a MiB, a few hundred:
# from this size on a CPU gradient is reduced where autograd left it (in_place.py).
IN_PLACE_MIN_BYTES = 1 << 20
# On a communicator that does not fold the PremulSum into its reduction (Gloo), the large
# gradients take a ``mul_`` pass anyway, so in place saves only the unpack's copy, while each
# collective beyond the packed bucket's one costs its issue, wake-ups and round trip. A bucket
# goes in place there when it stays one collective, or when every extra collective brings at
# least this many bytes reduced in place (the measurements behind it: docs/ddp.md).
UNFOLDED_MIN_BYTES_PER_EXTRA = 4 << 20
# A packed CPU bucket of at most this many gradients scales each into its view as it arrives:
# the pack's own limit for multiplying view by view (bucket.py); beyond it the pack's foreach
# copy and one multiply cost fewer calls than a multiply per gradient.
ARRIVAL_PACK_MAX_GRADS = MUL_INTO_VIEWS_MAX
COMPILED_BACKWARDS = settings.DDP_COMPILED_BACKWARD.choices


@dataclass(kw_only=True, slots=True)
class DDPConfig:
    """Options of a fastcomm DDP.

    Raises:
        ValueError: a bucket cap that is not a finite number in (0, 2**43] MiB, or an empty
            ``bucket_cap_mb_list``.
        TypeError: a flag that is not a bool, a cap that is not a number, or a
            ``bucket_cap_mb_list`` that is not a list or tuple.
    """

    bucket_cap_mb: float | None = None
    """Bucket size limit in MiB (``None``: 25 MiB with a 1 MiB first bucket, as torch)."""

    bucket_cap_mb_list: list[float] | None = None
    """Per-bucket limits in MiB, in launch order; the last one repeats. Overrides
    ``bucket_cap_mb``."""

    find_unused_parameters: bool = False
    """Traverse the autograd graph from the forward's outputs each iteration and mark the
    parameters it does not reach ready, so their buckets do not wait for them."""

    gradient_as_bucket_view: bool | None = None
    """Make every ``.grad`` a view into its bucket's flat buffer: no pack/unpack copies, and
    one buffer instead of two. ``None`` (default): on where the buckets go into shared memory
    (``shared_buckets``), else off, torch's default."""

    shared_buckets: bool = field(default_factory=settings.DDP_SHARED_BUCKETS.get)
    """Put the buckets in memory the communicator's ranks share and reduce them in place out of
    the peers' buckets, where the communicator offers it (``capabilities.shared_buckets``:
    ``shm``) and ``gradient_as_bucket_view`` is not ``False`` (see ``fastcomm.ddp.shared``).
    Default on; ``FASTCOMM_DDP_SHARED_BUCKETS=0`` turns it off."""

    shared_bucket_cap_mb: float | None = field(default_factory=settings.DDP_SHARED_CAP_MB.get)
    """The most MiB of ``/dev/shm`` the shared buckets may take (every rank's buckets: the
    world size times the gradients' bytes); over it, today's buffers with a warning. ``None``
    (default, or ``FASTCOMM_DDP_SHARED_CAP_MB``): no cap but ``/dev/shm``'s free space."""

    hand_over_grads: bool = field(default_factory=settings.DDP_HAND_OVER.get)
    """Without bucket views, write a CPU bucket's reduced gradients back by making each
    ``.grad`` that autograd created in this backward a view of the reduced buffer, instead of
    copying the buffer into it (``gradient_as_bucket_view``'s saving without its aliasing: the
    buffer is written again only once no gradient holds it). Default on;
    ``FASTCOMM_DDP_HAND_OVER=0`` copies, as torch DDP does."""

    cuda_graphs: bool = field(default_factory=settings.DDP_CUDA_GRAPHS.get)
    """Replay each packed CUDA bucket's pack, all-reduce and unpack from a CUDA graph captured
    after its first launch, where the communicator offers it (``capabilities.
    graph_all_reduce``: NCCL; see ``fastcomm.ddp.graphs``): one host call per bucket instead of
    the eager path's checks, records and launches, the same bits. Default on;
    ``FASTCOMM_DDP_CUDA_GRAPHS=0`` turns it off."""

    compiled_backward: str = field(default_factory=settings.DDP_COMPILED_BACKWARD.get)
    """Under ``torch.compile(DDP(model))``, how the compiled backward hands the buckets over:
    ``"traced"``: one forward and one backward graph, each gradient handed to its bucket by an
    op inside the backward as it is made (``fastcomm.ddp.taps``); ``"split"``: Dynamo's
    DDPOptimizer compiles a graph per bucket, and the eager hooks run between them (torch DDP's
    way); ``"auto"`` (default, or ``FASTCOMM_DDP_COMPILED_BACKWARD``): traced for CPU
    parameters, split for CUDA ones, where the traced path has not been measured yet."""

    static_graph: bool = False
    """The set of used parameters and the order gradients arrive in never change: the first
    iteration reduces everything at the end of backward and learns the unused set; later
    iterations mark that set ready without traversing the graph."""

    forward_sync_buffers: bool = True
    """Broadcast rank 0's buffers (BatchNorm statistics) at the start of every forward that
    follows a synchronized iteration."""

    init_sync: bool = True
    """On construction, check that every rank has the same parameters and broadcast rank 0's
    parameters (and buffers, see ``init_sync_buffers``)."""

    init_sync_buffers: bool = True
    """Whether the construction-time broadcast includes buffers."""

    skip_all_reduce_unused_params: bool = False
    """Do not reduce a bucket whose parameters all went unused this iteration, and skip the
    exchange of the used-parameter map. Valid only when every rank has the same unused set
    (torch's requirement for the same flag)."""

    batched_grad_copy: bool = False
    """Accepted for torch compatibility; fastcomm always copies a bucket's gradients with
    one fused pack kernel, which is what torch's flag turns on."""

    first_bucket_mb: float = field(default=DEFAULT_FIRST_BUCKET_MB)
    """Cap of the first bucket in MiB, used only while ``bucket_cap_mb`` and
    ``bucket_cap_mb_list`` are both ``None``."""

    shared_min_mean_bytes: int = field(
        default_factory=lambda: settings.DDP_SHARED_MIN_MEAN_BYTES.get(
            default=SHARED_MIN_MEAN_BYTES
        )
    )
    """With ``gradient_as_bucket_view=None``, the buckets are shared only where the gradients
    they would hold average this many bytes or more (default 16 KiB, or
    ``FASTCOMM_DDP_SHARED_MIN_MEAN_BYTES``; 0 shares every model's buckets). The same bound
    decides which CPU buckets ``hand_over_grads`` applies to: below it, the per-gradient
    work of either costs more than the copy it saves."""

    stage_min_bytes: int = field(default_factory=lambda: STAGE_MIN_BYTES)
    """Bytes from which a fresh gradient is staged into its shared CPU bucket (only the peers'
    parts copied in) rather than copied whole (default 64 KiB)."""

    in_place_min_bytes: int = field(default_factory=lambda: IN_PLACE_MIN_BYTES)
    """Bytes from which a gradient of a packed CPU bucket is reduced where autograd left it
    (``in_place.py``; default 1 MiB)."""

    unfolded_min_bytes_per_extra: int = field(
        default_factory=lambda: UNFOLDED_MIN_BYTES_PER_EXTRA
    )
    """Where the communicator does not fold ``PremulSum`` into its reduction, the bytes reduced
    in place each collective beyond the packed bucket's one must bring (default 4 MiB)."""

    arrival_pack_max_grads: int = field(default_factory=lambda: ARRIVAL_PACK_MAX_GRADS)
    """A packed CPU fp32/fp64 bucket of at most this many gradients packs each as it arrives
    (default 32)."""

    def __post_init__(self) -> None:
        if self.gradient_as_bucket_view is not None and not isinstance(
            self.gradient_as_bucket_view, bool
        ):
            raise TypeError(
                "gradient_as_bucket_view must be a bool or None, got "
                f"{type(self.gradient_as_bucket_view).__name__} {self.gradient_as_bucket_view!r}"
            )
        if self.shared_bucket_cap_mb is not None:
            _check_cap("shared_bucket_cap_mb", self.shared_bucket_cap_mb)
        for name in (
            "find_unused_parameters",
            "shared_buckets",
            "hand_over_grads",
            "cuda_graphs",
            "static_graph",
            "forward_sync_buffers",
            "init_sync",
            "init_sync_buffers",
            "skip_all_reduce_unused_params",
            "batched_grad_copy",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        if self.compiled_backward not in COMPILED_BACKWARDS:
            raise ValueError(
                f"compiled_backward must be one of {', '.join(map(repr, COMPILED_BACKWARDS))}, "
                f"got {self.compiled_backward!r}"
            )
        if self.bucket_cap_mb is not None:
            _check_cap("bucket_cap_mb", self.bucket_cap_mb)
        if self.bucket_cap_mb_list is not None:
            if not isinstance(self.bucket_cap_mb_list, (list, tuple)):
                raise TypeError(
                    "bucket_cap_mb_list must be a list of MiB caps, got "
                    f"{type(self.bucket_cap_mb_list).__name__} {self.bucket_cap_mb_list!r}"
                )
            if len(self.bucket_cap_mb_list) == 0:
                raise ValueError("bucket_cap_mb_list must hold at least one cap, got []")
            for i, cap in enumerate(self.bucket_cap_mb_list):
                _check_cap(f"bucket_cap_mb_list[{i}]", cap)
        _check_cap("first_bucket_mb", self.first_bucket_mb)
        for name in (
            "shared_min_mean_bytes",
            "stage_min_bytes",
            "in_place_min_bytes",
            "unfolded_min_bytes_per_extra",
            "arrival_pack_max_grads",
        ):
            _check_count(name, getattr(self, name))

    @property
    def bucket_caps_bytes(self) -> list[int]:
        """Byte caps of buckets 0, 1, ... in launch order; the last one repeats."""
        if self.bucket_cap_mb_list:
            return [max(1, int(cap * MB)) for cap in self.bucket_cap_mb_list]
        if self.bucket_cap_mb is not None:
            return [max(1, int(self.bucket_cap_mb * MB))]
        return [int(self.first_bucket_mb * MB), int(DEFAULT_BUCKET_CAP_MB * MB)]

    @property
    def bucket_bytes_cap(self) -> int:
        """The largest cap (torch's ``DDP.bucket_bytes_cap``)."""
        return max(self.bucket_caps_bytes)

    @property
    def rebuild_buckets(self) -> bool:
        """Whether buckets are rebuilt once in arrival order (torch: not with a dynamic
        unused set, whose arrival order may change every iteration)."""
        return self.static_graph or not self.find_unused_parameters


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be 0 or more, got {value}")


def _check_cap(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of MiB, got {type(value).__name__} {value!r}")
    # an infinite or huge cap would overflow the byte count later, inside the reducer's setup
    if not 0 < value <= MAX_BUCKET_CAP_MB:  # also refuses NaN
        raise ValueError(
            f"{name} must be a finite number of MiB in (0, {MAX_BUCKET_CAP_MB:.0f}], "
            f"got {value!r}"
        )


def check_param_dtype(name: str, param: torch.Tensor) -> None:
    """Raise a TypeError naming `name` if its dtype cannot be bucketed."""
    if param.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"parameter {name!r} has dtype {param.dtype}; fastcomm DDP reduces float32, "
            "float16, bfloat16 and float64 parameters (exclude others with "
            "DDP._set_params_and_buffers_to_ignore_for_model)"
        )
