"""Plan of the ipc CUDA transport: options, layouts and the step sequence (no CuPy).

An allreduce is a list of rounds (`plan_rounds`) and each round a list of steps
(`all_reduce_steps`: copy in, barrier, reduce, copy out), pure host logic; `run_steps` hands
them to a `StepOps`: the transport's CUDA calls (``cuda.py``), or CPU calls over POSIX shared
memory in the tests. Workspace layout, one-shot and two-shot rounds, buffer alternation:
``docs/ipc.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple, Protocol

import torch

from ... import settings
from ...kernels._launch import fp32_scale
from ...kernels._peer_reduce import launch_peer_reduce_table
from ...kernels._peer_signal import flag_area_words
from ..errors import FastcommError
from ..types import ReduceOp
from .descriptor import CUDA_DTYPES, CUDA_OPS, MAX_NUMEL

__all__ = [
    "ALIGN", "CHUNK_ALIGN", "Barrier", "CopyIn", "CopyOut", "EpochClock", "IpcCudaOptions",
    "Reduce", "Round", "StepOps", "WorkspaceLayout", "agreed_options", "all_reduce_steps",
    "check_agreed_options", "check_all_reduce", "max_spins_for", "plan_rounds", "reduce_step",
    "run_steps", "two_shot_chunk", "workspace_layout",
]

#: Alignment of every area of a workspace and of two-shot chunks (bytes): 128-bit accesses.
ALIGN = 256
CHUNK_ALIGN = 16

#: The options the environment sets, each with its variable.
_ENV_FIELDS = ((settings.IPC_CUDA_WORKSPACE_BYTES, "workspace_bytes"),
               (settings.IPC_CUDA_TWO_SHOT_BYTES, "two_shot_bytes"))


@dataclasses.dataclass(kw_only=True, slots=True)
class IpcCudaOptions:
    """Sizes and bounds of the CUDA transport."""

    workspace_bytes: int = settings.IPC_CUDA_WORKSPACE_BYTES.default
    """Bytes of the data area per rank, split into two alternating buffers; larger messages
    are chunked into rounds of half of it."""
    two_shot_bytes: int = settings.IPC_CUDA_TWO_SHOT_BYTES.default
    """Rounds of at least this many bytes run two-shot, smaller ones one-shot. Not measured
    yet: one-shot reads ``size`` times the round per rank, two-shot twice, so two-shot wins
    once bandwidth, not latency, dominates."""
    spins_per_second: int = 4_000_000
    """Upper estimate of a barrier's spins per second; with the timeout it bounds the spin
    (`max_spins_for`), a backstop to the host's stop word."""

    def __post_init__(self) -> None:
        if self.workspace_bytes < 2 * ALIGN or self.workspace_bytes % (2 * ALIGN):
            raise ValueError(
                f"workspace_bytes={self.workspace_bytes} must be a positive multiple of "
                f"{2 * ALIGN} (two buffers of {ALIGN}-byte aligned size)"
            )
        if self.two_shot_bytes < 1:
            raise ValueError(f"two_shot_bytes={self.two_shot_bytes} must be >= 1")
        if self.spins_per_second < 1:
            raise ValueError(f"spins_per_second={self.spins_per_second} must be >= 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> IpcCudaOptions:
        """Defaults, overridden by ``FASTCOMM_IPC_CUDA_WORKSPACE_BYTES`` and
        ``FASTCOMM_IPC_CUDA_TWO_SHOT_BYTES`` (integers, bytes)."""
        given = [(var, field) for var, field in _ENV_FIELDS if var.is_set(env)]
        values = {field: var.get(env) for var, field in given}
        try:
            return cls(**values)
        except ValueError as exc:  # name the variable the bad value came from
            named = ", ".join(f"{var.name}={var.text(env)}" for var, _ in given)
            raise ValueError(f"{exc} (from {named})") from None


class WorkspaceLayout(NamedTuple):
    """Byte offsets of the areas of every rank's workspace (identical on every rank)."""

    buffer_bytes: int  # size of each of the two data buffers
    data_offsets: tuple[int, int]  # data buffer of even and odd rounds
    result_offset: int  # one-shot result (read and written by its own rank only)
    result_bytes: int
    flags_offset: int  # three int64 words per rank (epoch, two descriptors)
    total_bytes: int


def _align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def workspace_layout(options: IpcCudaOptions, size: int) -> WorkspaceLayout:
    """The layout of a workspace for `size` ranks."""
    buffer_bytes = options.workspace_bytes // 2
    result_bytes = _align(min(options.two_shot_bytes, buffer_bytes))
    result_offset = 2 * buffer_bytes
    flags_offset = result_offset + result_bytes
    total = flags_offset + _align(8 * flag_area_words(size))
    return WorkspaceLayout(
        buffer_bytes, (0, buffer_bytes), result_offset, result_bytes, flags_offset, total
    )


class Round(NamedTuple):
    start: int  # first element of the round in the tensor
    numel: int
    two_shot: bool


def plan_rounds(numel: int, itemsize: int, layout: WorkspaceLayout, two_shot_bytes: int):
    """Splits an allreduce of `numel` elements into rounds of at most one data buffer each.

    Returns:
        A list of `Round`; empty for ``numel == 0``.
    """
    per_round = layout.buffer_bytes // itemsize
    rounds = []
    for start in range(0, numel, per_round):
        n = min(per_round, numel - start)
        rounds.append(Round(start, n, n * itemsize >= two_shot_bytes))
    return rounds


def two_shot_chunk(numel: int, itemsize: int, size: int, rank: int) -> tuple[int, int]:
    """``(lo, hi)``, the elements of a two-shot round `rank` reduces.

    Chunks are ``ceil(numel / size)`` elements rounded up to 16 bytes (aligned accesses), so
    for a size not divisible by the world, or a small one, the last ranks' chunks are shorter
    or empty (``lo == hi``); together they cover ``[0, numel)`` exactly once.
    """
    per_align = max(1, CHUNK_ALIGN // itemsize)
    chunk = -(-numel // size)
    chunk = -(-chunk // per_align) * per_align
    lo = min(rank * chunk, numel)
    return lo, min(lo + chunk, numel)


class EpochClock:
    """Barrier epochs and round parity, advanced identically on every rank.

    Every rank issues the same collectives with the same sizes, so counting barriers and rounds
    locally gives every rank the same epoch for the same barrier. Epochs start at 1 (flag words
    start zeroed).
    """

    __slots__ = ("epoch", "rounds")

    def __init__(self) -> None:
        self.epoch = 0
        self.rounds = 0

    def next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def next_parity(self) -> int:
        self.rounds += 1
        return (self.rounds - 1) % 2


class CopyIn(NamedTuple):
    tensor_byte: int  # offset in the caller's tensor
    ws_byte: int  # offset in this rank's workspace
    nbytes: int


class CopyOut(NamedTuple):
    ws_byte: int
    tensor_byte: int
    nbytes: int


class Barrier(NamedTuple):
    epoch: int


class Reduce(NamedTuple):
    src_byte: int  # offset in every rank's workspace
    dst_byte: int  # offset in this rank's (to_all False) or every rank's workspace
    numel: int
    to_all: bool


def all_reduce_steps(
    numel: int,
    itemsize: int,
    rank: int,
    size: int,
    layout: WorkspaceLayout,
    two_shot_bytes: int,
    clock: EpochClock,
) -> list:
    """The steps of one allreduce on `rank` (``docs/ipc.md``); advances `clock`.

    An empty allreduce is a single barrier: it meets the peers' call (and its descriptor)."""
    if not numel:
        return [Barrier(clock.next_epoch())]
    steps: list = []
    for rnd in plan_rounds(numel, itemsize, layout, two_shot_bytes):
        data = layout.data_offsets[clock.next_parity()]
        nbytes = rnd.numel * itemsize
        steps.append(CopyIn(rnd.start * itemsize, data, nbytes))
        steps.append(Barrier(clock.next_epoch()))
        if not rnd.two_shot:
            steps.append(Reduce(data, layout.result_offset, rnd.numel, False))
            steps.append(CopyOut(layout.result_offset, rnd.start * itemsize, nbytes))
            continue
        lo, hi = two_shot_chunk(rnd.numel, itemsize, size, rank)
        if hi > lo:
            steps.append(Reduce(data + lo * itemsize, data + lo * itemsize, hi - lo, True))
        steps.append(Barrier(clock.next_epoch()))
        steps.append(CopyOut(data, rnd.start * itemsize, nbytes))
    return steps


class StepOps(Protocol):
    """What executes the steps: CUDA calls in the transport, CPU calls in the tests."""

    def copy(self, dst_addr: int, src_addr: int, nbytes: int) -> None: ...

    def barrier(self, epoch: int) -> None: ...

    def reduce(self, step: Reduce) -> None: ...


def run_steps(steps: list, ops: StepOps, tensor_addr: int, own_base: int) -> None:
    """Executes `steps` of an allreduce of the tensor at `tensor_addr` (see `StepOps`)."""
    for step in steps:
        kind = type(step)
        if kind is CopyIn:
            ops.copy(own_base + step.ws_byte, tensor_addr + step.tensor_byte, step.nbytes)
        elif kind is Barrier:
            ops.barrier(step.epoch)
        elif kind is Reduce:
            ops.reduce(step)
        else:
            ops.copy(tensor_addr + step.tensor_byte, own_base + step.ws_byte, step.nbytes)


def reduce_step(step: Reduce, bases: torch.Tensor, own: torch.Tensor, dtype: torch.dtype,
                op: str) -> None:
    """Launches `step`'s `peer_reduce_table` over the workspace table `bases` (rank order;
    `own` is this rank's entry, a one-element view of it)."""
    if not step.numel:  # two-shot: the last ranks' chunks may be empty
        return
    dst = bases if step.to_all else own
    # no per-launch checks: the tables were checked at setup, dtype and op by the caller
    # (check_all_reduce), the offsets come from the plan (aligned by construction)
    scale = fp32_scale(1.0 / bases.numel()) if op == "avg" else 1.0
    launch_peer_reduce_table(
        bases, dst, step.src_byte, step.dst_byte, step.numel, dtype, op, scale
    )


def max_spins_for(timeout_s: float, spins_per_second: int) -> int:
    """A barrier's spin bound: at least `timeout_s` at `spins_per_second`, capped to int63."""
    return min(int(max(timeout_s, 0.0) * spins_per_second) + 1, (1 << 62))


def check_all_reduce(tensor: torch.Tensor, op, device: torch.device) -> ReduceOp:
    """Validates an allreduce's operands; returns the op as a `ReduceOp`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in CUDA_DTYPES:
        allowed = ", ".join(str(d) for d in CUDA_DTYPES)
        raise TypeError(f"the CUDA IPC allreduce takes {allowed}; got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"tensor is on {tensor.device}; this transport runs on {device}")
    if not tensor.is_contiguous():
        raise ValueError(f"tensor (shape {tuple(tensor.shape)}, strides {tensor.stride()}) "
                         "is not contiguous")
    if tensor.numel() >= MAX_NUMEL:
        raise ValueError(f"tensor has {tensor.numel()} elements; the CUDA IPC allreduce takes "
                         f"fewer than 2**40")
    op = ReduceOp.coerce(op)
    if op not in CUDA_OPS:
        allowed = ", ".join(o.name for o in CUDA_OPS)
        raise ValueError(f"the CUDA IPC allreduce runs {allowed}; got {op.name}")
    return op


def agreed_options(options: IpcCudaOptions) -> tuple[int, int]:
    """The options every rank must share: the workspace size fixes every offset a peer reads
    and writes, the two-shot bound which schedule (and how many barriers) a round runs."""
    return (options.workspace_bytes, options.two_shot_bytes)


def check_agreed_options(rank: int, gathered: list) -> None:
    """Raises on every rank (each holds the same gathered list) when the ranks' `agreed_options`
    differ, naming both sides and the variables that set them.

    Raises:
        FastcommError: ranks disagree (every rank raises the same message).
    """
    first = tuple(gathered[0])
    for peer, theirs in enumerate(gathered):
        if tuple(theirs) != first:
            names = [f"{field} ({var.name})" for var, field in _ENV_FIELDS]
            differ = "; ".join(
                f"{name}: rank 0 has {a}, rank {peer} has {b}"
                for name, a, b in zip(names, first, theirs, strict=True)
                if a != b
            )
            raise FastcommError(
                f"rank {rank}: the ranks of the CUDA IPC transport disagree on its options "
                f"({differ}); every rank must use the same IpcCudaOptions"
            )

