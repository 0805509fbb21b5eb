"""Reduction ops and the dtype table shared by every communicator."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "BITWISE_OPS", "BitwiseOp", "Capabilities", "EXTRA_DTYPES", "PremulSum", "ReduceOp",
    "SHARED_BUCKET_DTYPES", "SUPPORTED_DTYPES", "check_reduction", "divide_",
]


class ReduceOp(enum.Enum):
    """Element-wise reductions of ``all_reduce`` / ``reduce_scatter``.

    ``AVG`` is the sum divided by the communicator's size; on integer tensors the division
    truncates toward zero (as NCCL's ``ncclAvg`` does). On ``bool`` tensors ``SUM`` and
    ``MAX`` are a logical or, ``PRODUCT`` and ``MIN`` a logical and (Gloo's values). The bitwise
    reductions are :class:`BitwiseOp`; :func:`check_reduction` says which op each dtype takes.
    """

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"

    @classmethod
    def coerce(cls, op: object) -> ReduceOp | BitwiseOp | PremulSum:
        """Accepts a ``ReduceOp`` or :class:`BitwiseOp`, its name (``"sum"``, ``"band"``) or
        torch's ``dist.ReduceOp`` value; a :class:`PremulSum` passes through unchanged."""
        if isinstance(op, (ReduceOp, BitwiseOp, PremulSum)):
            return op
        if isinstance(op, str):
            for kind in (cls, BitwiseOp):
                try:
                    return kind[op.upper()]
                except KeyError:
                    pass
        else:
            torch_ops = {
                dist.ReduceOp.SUM: cls.SUM,
                dist.ReduceOp.AVG: cls.AVG,
                dist.ReduceOp.MAX: cls.MAX,
                dist.ReduceOp.MIN: cls.MIN,
                dist.ReduceOp.PRODUCT: cls.PRODUCT,
                dist.ReduceOp.BAND: BitwiseOp.BAND,
                dist.ReduceOp.BOR: BitwiseOp.BOR,
                dist.ReduceOp.BXOR: BitwiseOp.BXOR,
            }
            try:
                found = torch_ops.get(op)
            except TypeError:
                found = None
            if found is not None:
                return found
        allowed = ", ".join(m.name for m in (*cls, *BitwiseOp)) + ", PremulSum(factor)"
        raise ValueError(f"unsupported reduce op {op!r}; allowed: {allowed}")


class BitwiseOp(enum.Enum):
    """The bitwise reductions of ``all_reduce`` / ``reduce`` (torch's ``BAND``, ``BOR``,
    ``BXOR``), on integer and ``bool`` tensors only, as Gloo takes them. Apart from
    :class:`ReduceOp` because no other collective and not every backend computes them: the
    contract checks the dtype (:func:`check_reduction`) and runs them where the backend does
    not (:attr:`Capabilities.extended_reductions`)."""

    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


@dataclass(frozen=True, slots=True)
class PremulSum:
    """The sum of every rank's tensor multiplied by ``factor`` first (torch's
    ``dist._make_nccl_premul_sum``): each element ends as ``x0 * f0 + x1 * f1 + ...``, every
    product rounded in the tensor's dtype, where ``f`` is the factor of the rank that
    contributed the term. The bits are those of ``tensor.mul_(factor)`` followed by a ``SUM``
    all-reduce on the same communicator; a backend that folds the multiply into its collective
    (``shm``) saves that pass over the tensor.

    ``all_reduce`` only, on floating-point tensors. Every rank of a collective passes a
    ``PremulSum`` (the shm communicator raises on every rank where one passes ``SUM`` and a peer
    ``PremulSum``); the factors may differ between ranks.

    Args:
        factor: a finite real number (converted to ``float``).

    Raises:
        TypeError: ``factor`` is not a real number (``bool`` included).
        ValueError: ``factor`` is infinite or NaN.
    """

    factor: float

    #: the op's name in messages, as a :class:`ReduceOp` member's
    name = "PREMUL_SUM"

    def __post_init__(self) -> None:
        factor = self.factor
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
            raise TypeError(
                f"PremulSum: factor must be a real number (int or float), got "
                f"{type(factor).__name__} {factor!r}"
            )
        factor = float(factor)
        if not math.isfinite(factor):
            raise ValueError(f"PremulSum: factor must be finite, got {factor!r}")
        object.__setattr__(self, "factor", factor)  # frozen: the one write, normalized


# The dtypes every backend moves and reduces (NCCL's table; Gloo and shm take the same set so a
# program behaves the same whichever communicator it gets).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
)


#: Dtypes the contract reduces beyond :data:`SUPPORTED_DTYPES` (``all_reduce``/``reduce`` only;
#: the other collectives move them as bytes): ``bool`` and ``int16`` with every op but ``bool``'s
#: ``AVG``; the unsigned ones with the ops torch computes for them on the CPU (``PRODUCT`` and the
#: bitwise ones). A backend that reduces them itself says so
#: (:attr:`Capabilities.extended_reductions`); elsewhere the contract gathers the ranks' bytes
#: and reduces them in rank order.
EXTRA_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool, torch.int16, torch.uint16, torch.uint32, torch.uint64,
)

#: The bitwise reductions (integer and ``bool`` tensors only).
BITWISE_OPS = frozenset(BitwiseOp)

_ARITHMETIC = frozenset((ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT))
_BITWISE_ONLY = frozenset((ReduceOp.PRODUCT, *BITWISE_OPS))
# every dtype the contract reduces -> the ops it takes on it
_REDUCE_OPS: dict[torch.dtype, frozenset] = {
    **{d: _ARITHMETIC for d in SUPPORTED_DTYPES if d.is_floating_point},
    **{d: _ARITHMETIC | BITWISE_OPS for d in SUPPORTED_DTYPES if not d.is_floating_point},
    torch.bool: _ARITHMETIC - {ReduceOp.AVG} | BITWISE_OPS,
    torch.int16: _ARITHMETIC | BITWISE_OPS,
    torch.uint16: _BITWISE_ONLY,
    torch.uint32: _BITWISE_ONLY,
    torch.uint64: _BITWISE_ONLY,
}


def check_reduction(dtype: torch.dtype, op: ReduceOp | BitwiseOp, name: str) -> None:
    """Raises unless the contract reduces ``dtype`` with ``op`` (before anything is sent, so
    every rank raises alike).

    Raises:
        TypeError: a dtype it does not reduce, or an op the dtype does not take (the bitwise
            ops of a floating-point tensor: Gloo's ``Cannot use ReduceOp.BAND with non-integral
            dtype``; ``AVG`` of a ``bool`` tensor).
    """
    ops = _REDUCE_OPS.get(dtype)
    if ops is not None and op in ops:
        return
    if ops is None:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in _REDUCE_OPS)
        raise TypeError(f"{name}: cannot reduce dtype {dtype}; reduced dtypes: {allowed}")
    if op in BITWISE_OPS and dtype.is_floating_point:
        raise TypeError(
            f"{name}: Cannot use ReduceOp.{op.name} with non-integral dtype {dtype}; the bitwise "
            "ops take integer and bool tensors"
        )
    allowed = ", ".join(sorted(o.name for o in ops))
    raise TypeError(f"{name}: ReduceOp.{op.name} of dtype {dtype} is not supported; "
                    f"{str(dtype).removeprefix('torch.')} takes {allowed}")


# integer dtypes by their largest value: an AVG over more ranks than that divides in int64
_INT_MAX = {d: torch.iinfo(d).max for d in (*SUPPORTED_DTYPES, torch.int16)
            if not d.is_floating_point}


def divide_(tensor: torch.Tensor, size: int) -> None:
    """In-place ``tensor / size`` (``AVG``'s division of a sum of ``size`` terms): torch's
    ``div_``; integers truncate toward zero (NCCL's ncclAvg). Where an integer dtype cannot
    hold ``size`` (int8 over 128 ranks; torch would divide by ``size`` cast to the dtype), the
    division runs in int64, as the shm compiled core's does."""
    if tensor.is_floating_point():
        tensor.div_(size)
    elif size > _INT_MAX[tensor.dtype]:
        tensor.copy_(tensor.to(torch.int64).div_(size, rounding_mode="trunc"))
    else:
        tensor.div_(size, rounding_mode="trunc")


#: The dtypes a shared bucket region holds, per device type (``Capabilities.shared_buckets``):
#: on CPU those whose ``PremulSum`` the compiled core reduces in the communicator's own bits,
#: on CUDA those the ``peer_reduce`` kernel accumulates in fp32.
SHARED_BUCKET_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "cpu": (torch.float32, torch.float64),
    "cuda": (torch.float32, torch.float16, torch.bfloat16),
}


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a communicator can do, as data: DDP and the torch.distributed adapter ask these
    instead of naming backends.

    Every field describes the communicator's own transport; what it hands to a fallback (CUDA
    tensors on ``shm``, say) is the fallback's to declare (:meth:`Communicator.route`).
    """

    devices: frozenset[str] = frozenset({"cpu"})
    """Device types whose tensors it moves itself (``"cpu"``, ``"cuda"``)."""

    all_reduce_devices: frozenset[str] = frozenset()
    """Device types it moves for ``all_reduce`` only, beyond ``devices`` (``ipc``'s CUDA
    transport)."""

    sparse_all_reduce: bool = False
    """Reduces sparse COO tensors natively; elsewhere ``all_reduce`` densifies them, reduces,
    and makes the result sparse again (same values, more bytes)."""

    layout_free: bool = False
    """An ``all_reduce`` gives each element a value that does not depend on where the element
    sits in the tensor (the ranks' terms are combined in one fixed order for every element, or
    there are only two terms): reducing gradients one by one gives the bits of reducing them
    packed into one buffer."""

    premul_dtypes: frozenset[torch.dtype] = frozenset()
    """Dtypes whose :class:`PremulSum` it folds into the reduction (no pass of its own, the
    bits of ``mul_`` then ``SUM``); others are multiplied first."""

    extended_reductions: bool = False
    """Reduces the bitwise ops and :data:`EXTRA_DTYPES` itself (with the ops
    :func:`check_reduction` allows); elsewhere the contract runs such a reduction as an
    ``all_gather`` of the ranks' bytes and a reduction in rank order on every rank."""
    shared_buckets: frozenset[str] = frozenset()
    """Device types whose DDP bucket memory it hands out, memory every rank reads in place, and
    whose buckets it all-reduces there out of the peers' copies, nothing staged
    (``bucket_region(...)``, a collective returning a region, or the reason it cannot):
    ``shm`` on CPU (:class:`~fastcomm.comm.shm.buckets.ShmBucketRegion`), ``ipc`` on CUDA
    (:class:`~fastcomm.comm.ipc.cuda_region.CudaBucketRegion`). Elsewhere DDP's buckets are
    ordinary memory reduced by ``all_reduce``."""

    tagged_p2p: bool = False
    """Has a tagged point-to-point engine (its ``mailboxes`` property: tags, any-source
    receives, one progress loop for many operations) on which the ``torch.distributed`` adapter
    runs ``send``/``recv`` of CPU tensors (``shm``); elsewhere the adapter hands them to Gloo."""

    graph_all_reduce: bool = False
    """Offers ``graph_lane()`` (:class:`~fastcomm.comm.graph_lane.GraphLane`): an all-reduce of
    CUDA tensors enqueued inside a CUDA graph being captured, and the graph's replays issued,
    recorded and timed out as its own calls (NCCL); DDP captures its buckets there."""

    in_place: bool = True
    """``all_gather`` and ``all_to_all`` accept an output that overlaps the input (torch's
    ``all_gather_into_tensor`` with the input a slice of the output, as FSDP2 calls it);
    elsewhere the input is copied first. An overlapping ``reduce_scatter`` is always staged."""

    sees_lost_peers: bool = False
    """Its waits notice by themselves that a peer on this host died (shared memory reads the
    peer's ``/proc`` entry while it waits: ``shm``, ``hier``): in-place recovery needs no
    liveness watch for this host's members. Elsewhere a Gloo wait sees a dead peer only as a
    closed socket, when it reads from it, and a NCCL kernel spins forever, so a thread reads
    ``/proc`` and calls ``abort`` (``fastcomm.ddp.liveness``)."""

    shrinks_across_hosts: bool = False
    """In-place recovery can go on without a rank lost on another host: ``abort`` stops its
    pending calls and ``reconfigured`` builds the survivors' (``hier``, ``gloo``, ``nccl``).
    Elsewhere (``shm`` and ``ipc`` live on one host; a torch group's waits cannot be
    aborted) ranks spanning hosts fail as without recovery."""
