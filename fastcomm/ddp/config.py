"""The options of :class:`fastcomm.ddp.DDP`, validated in one place.

``DDP`` takes torch's arguments and turns them into a :class:`DDPConfig`; the reducer and the
module read only the config. Bucket caps follow torch: 25 MiB buckets, and a 1 MiB first
bucket (the first gradients to arrive, so their allreduce starts early) while the cap is
left at its default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from fastcomm.kernels._launch import FLOAT_DTYPES

__all__ = ["DDPConfig", "DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_MB", "MB"]

MB = 1024 * 1024
MAX_BUCKET_CAP_MB = float(1 << 43)
"""Largest cap accepted, in MiB: 2**63 bytes, the most a tensor's byte count can hold."""
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_MB = 1.0


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

    shared_buckets: bool = field(
        default_factory=lambda: os.environ.get("FASTCOMM_DDP_SHARED_BUCKETS", "1").strip() != "0"
    )
    """Put the buckets in memory the communicator's ranks share and reduce them in place out of
    the peers' buckets, where the communicator offers it (``capabilities.shared_buckets``:
    ``shm``) and ``gradient_as_bucket_view`` is not ``False`` (see ``fastcomm.ddp.shared``).
    Default on; ``FASTCOMM_DDP_SHARED_BUCKETS=0`` turns it off."""

    shared_bucket_cap_mb: float | None = field(
        default_factory=lambda: _env_cap("FASTCOMM_DDP_SHARED_CAP_MB")
    )
    """The most MiB of ``/dev/shm`` the shared buckets may take (every rank's buckets: the
    world size times the gradients' bytes); over it, today's buffers with a warning. ``None``
    (default, or ``FASTCOMM_DDP_SHARED_CAP_MB``): no cap but ``/dev/shm``'s free space."""

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


def _env_cap(name: str) -> float | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a number of MiB") from None


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
