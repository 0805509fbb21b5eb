"""CUDA transport of the ipc backend: allreduce by Triton kernels over peers' GPU memory.

Every rank allocates one *workspace* on its GPU (``cudaMalloc``, once), exports it as a CUDA IPC
handle through the store and opens every peer's (its own is used directly), so each process
holds the address of every rank's workspace; an int64 table of them lives on the device.
A workspace (`WorkspaceLayout`) holds two data buffers (alternating between rounds), a result
buffer for one-shot rounds and a flag area (three int64 words per rank, see
`fastcomm.kernels.peer_signal`).

An allreduce is a list of rounds of at most one data buffer each (`plan_rounds`), and each
round a list of steps (`all_reduce_steps`, pure host logic, tested on CPU):

- one-shot (round below ``two_shot_bytes``): copy in -> barrier -> every rank reduces all
  ranks' buffers into its result buffer -> copy out;
- two-shot: copy in -> barrier -> rank ``r`` reduces chunk ``r`` (`two_shot_chunk`) of all
  buffers and writes it into chunk ``r`` of *every* buffer in place (no other rank reads or
  writes chunk ``r``) -> barrier -> copy out.

Round ``k`` uses data buffer ``k % 2``. Rank ``q`` overwrites its buffer of round ``k`` in round
``k + 2``, after the first barrier of round ``k + 1``, which every peer reaches only after its
reads and its copy out of round ``k``: so no barrier is needed after a round, and a small
allreduce costs one barrier. An empty allreduce is one barrier and nothing else, so that it
meets the peers' call and is compared with it like any other.

Agreement: ranks must make the same calls, or a peer reads past the other's data or waits at
a barrier the other never reaches. Every barrier of a call carries the call's *descriptor*
(`call_descriptor`: op, element count, dtype and reduce op in one int64), which the barrier
stores next to its flag and compares with every peer's once they arrived (no extra round).
A difference is reported in the control block at the call's first barrier on every rank; the
host then raises a `FastcommError` naming both calls (`disagreement_message`) on every rank,
and the transport is aborted as after a timeout (every later barrier returns at once, every
later call is refused).

`run_steps` turns steps into calls on a `StepOps`; the CUDA ones (memcpy, `peer_signal`,
`peer_reduce_table` on the transport's stream) are the only part that needs a GPU. The tests
run the same steps through CPU ops over POSIX shared memory between processes.

Streams: everything runs on ``transport.stream``, which first waits on the caller's current
stream; the `Work` returned makes the caller's stream wait on the collective (``wait()``),
like the NCCL communicator's. One stream for every call keeps the rounds of consecutive calls
in order whatever stream the caller is on (the buffer alternation relies on it).

Ranks sharing a GPU: without MPS the GPU time-slices between the processes' contexts, so a
barrier kernel spinning in one process holds its SM until the slice passes and the other
process's kernels can run; it completes, but a barrier may then cost a time slice. Under MPS
the processes' kernels run concurrently and a barrier costs a few flag round trips.

Setup: after mapping, the ranks meet once at a barrier through the flags (it checks the
mappings and compiles the signal kernel before the first collective).

Timeouts: a barrier spins at most ``max_spins`` times (`max_spins_for` the timeout) and reads a
stop word the host may set; the watchdog (`fastcomm.comm.stream.StreamWatchdog`, NCCL's too)
polls the pending collectives' events and, past the timeout, sets the stop word, so a rank that
never arrives makes the others fail with `CommTimeoutError` naming the op, the elapsed time and
the missing ranks. The transport then refuses further collectives. Each call returns an
`EventWork` that also reads the barrier's report.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import NamedTuple, Protocol

import torch

from ...kernels._launch import fp32_scale
from ...kernels._peer_reduce import MAX_PEERS, launch_peer_reduce_table
from ...kernels._peer_signal import (
    CONTROL_WORDS,
    check_peer_signal,
    disagreeing_ranks,
    flag_area_words,
    launch_peer_signal,
    missing_ranks,
)
from ..errors import CommAbortedError, CommTimeoutError, FastcommError
from ..store import Store, as_timedelta
from ..stream import EventWork, StreamWatchdog
from ..types import ReduceOp

__all__ = [
    "CudaIpcTransport",
    "agreed_options",
    "check_agreed_options",
    "IpcCudaOptions",
    "WorkspaceLayout",
    "all_reduce_steps",
    "call_descriptor",
    "describe_call",
    "disagreement_error",
    "disagreement_message",
    "plan_rounds",
    "two_shot_chunk",
    "workspace_layout",
]

ENV_WORKSPACE = "FASTCOMM_IPC_CUDA_WORKSPACE_BYTES"
ENV_TWO_SHOT = "FASTCOMM_IPC_CUDA_TWO_SHOT_BYTES"

#: dtypes the transport reduces (fp32 accumulation).
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Reductions it runs.
CUDA_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN)
#: Alignment of every area of a workspace and of two-shot chunks (bytes): 128-bit accesses.
ALIGN = 256
CHUNK_ALIGN = 16

# A call's descriptor (one int64, compared by every barrier of the call): opcode in bits
# 56..62, dtype in 48..55, reduce op in 41..47, element count in 1..40 and bit 0 set. It is
# odd and >= 2**56 whatever the call, so Triton compiles one variant of the barrier for all
# of them (it specializes integers equal to 1, divisible by 16, or past 32 bits).
_OPCODES = {"barrier": 1, "all_reduce": 2, "bucket_all_reduce": 3}  # 3: buckets.py
_DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(CUDA_DTYPES)}
_REDOP_CODES = {op: i + 1 for i, op in enumerate(CUDA_OPS)}
#: Element counts a descriptor holds (2**40 fp16 elements are 2 TiB: past any GPU's memory).
MAX_NUMEL = 1 << 40
#: The descriptor of the setup barrier, which is part of no collective.
SETUP_DESCRIPTOR = (_OPCODES["barrier"] << 56) | 1


@dataclasses.dataclass(kw_only=True, slots=True)
class IpcCudaOptions:
    """Sizes and bounds of the CUDA transport."""

    workspace_bytes: int = 32 << 20
    """Bytes of the data area per rank, split into two alternating buffers; larger messages
    are chunked into rounds of half of it."""
    two_shot_bytes: int = 512 << 10
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
        env = os.environ if env is None else env
        values = {}
        for name, field in ((ENV_WORKSPACE, "workspace_bytes"), (ENV_TWO_SHOT, "two_shot_bytes")):
            text = env.get(name, "").strip()
            if text:
                try:
                    values[field] = int(text)
                except ValueError:
                    raise ValueError(f"{name}={text!r} is not an integer number of bytes") from None
        try:
            return cls(**values)
        except ValueError as exc:  # name the variable the bad value came from
            given = ", ".join(f"{n}={env.get(n, '').strip()}" for n in (ENV_WORKSPACE, ENV_TWO_SHOT)
                              if env.get(n, "").strip())
            raise ValueError(f"{exc} (from {given})") from None


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
    """The steps of one allreduce on `rank` (see the module docstring); advances `clock`.

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


def timeout_message(rank: int, op: str, elapsed: float, limit: float, mask: int, epoch: int):
    """The text of the error a barrier that gave up raises (names the missing ranks)."""
    if mask:
        who = f"rank(s) {missing_ranks(mask)} never reached barrier {epoch}"
    else:
        who = "no barrier reported missing ranks (the device did not get that far)"
    return (
        f"rank {rank}: {op} over CUDA IPC did not finish within {limit:.1f} s (elapsed "
        f"{elapsed:.1f} s): {who}; the transport is aborted"
    )


def call_descriptor(name: str, numel: int = 0, dtype: torch.dtype | None = None,
                    op: ReduceOp | None = None) -> int:
    """The descriptor of a call (layout above `_OPCODES`): what every rank's barriers of the
    call compare. `numel` must be below `MAX_NUMEL` (`check_all_reduce` makes sure)."""
    return (
        (_OPCODES[name] << 56)
        | (_DTYPE_CODES.get(dtype, 0) << 48)
        | (_REDOP_CODES.get(op, 0) << 41)
        | (numel << 1)
        | 1
    )


def describe_call(descriptor: int) -> str:
    """A descriptor in words: ``all_reduce of 1024 float32 SUM``, ``the setup barrier``."""
    names = {v: k for k, v in _OPCODES.items()}
    dtypes = {v: str(k).removeprefix("torch.") for k, v in _DTYPE_CODES.items()}
    ops = {v: k.name for k, v in _REDOP_CODES.items()}
    opcode = (descriptor >> 56) & 0x7F
    name = names.get(opcode, f"op {opcode}")
    if name == "barrier":
        return "the setup barrier"
    numel = (descriptor >> 1) & (MAX_NUMEL - 1)
    dtype, redop = (descriptor >> 48) & 0xFF, (descriptor >> 41) & 0x7F
    return (f"{name} of {numel} {dtypes.get(dtype, f'dtype {dtype}')} "
            f"{ops.get(redop, f'op {redop}')}")


def disagreement_message(rank: int, report: int, epoch: int, mine: int, theirs: int) -> str:
    """The text of the error a barrier's disagreement report raises (names both calls).

    Args:
        rank: this rank.
        report: ``control[1]``, `DISAGREE` and the disagreeing peers' bits.
        epoch: the barrier (``control[2]``).
        mine, theirs: this rank's and the lowest disagreeing peer's descriptor.
    """
    peers = disagreeing_ranks(report)
    peer = peers[0] if peers else -1
    also = f" (ranks {peers} disagree with it)" if len(peers) > 1 else ""
    names = {v: k for k, v in _OPCODES.items()}
    op = names.get((mine >> 56) & 0x7F, "a collective")
    return (
        f"rank {rank}: {op} disagrees with rank {peer}{also}: rank {rank} called "
        f"{describe_call(mine)}, "
        f"rank {peer} called {describe_call(theirs)} (barrier {epoch}); every rank must make "
        "the same calls in the same order; the CUDA IPC transport is aborted"
    )


def disagreement_error(rank: int, control) -> FastcommError | None:
    """The error of a disagreement reported in the control block `control` (a sequence of
    its words), or None when it holds none (yet).

    The descriptors (never 0) are stored before the report, but the host may see the words of
    pinned memory land in another order: until both have, there is no verdict.
    """
    report, epoch, mine, theirs = (int(control[i]) for i in range(1, 5))
    if report >= 0 or not (mine and theirs):
        return None
    return FastcommError(disagreement_message(rank, report, epoch, mine, theirs))


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
            names = (f"workspace_bytes ({ENV_WORKSPACE})", f"two_shot_bytes ({ENV_TWO_SHOT})")
            differ = "; ".join(
                f"{name}: rank 0 has {a}, rank {peer} has {b}"
                for name, a, b in zip(names, first, theirs, strict=True)
                if a != b
            )
            raise FastcommError(
                f"rank {rank}: the ranks of the CUDA IPC transport disagree on its options "
                f"({differ}); every rank must use the same IpcCudaOptions"
            )


# --------------------------------------------------------------------------- CUDA layer


def _cupy_cuda():
    try:
        from cupy import cuda
    except Exception as exc:  # ImportError, or CUDA errors while loading
        raise RuntimeError(
            "the CUDA IPC transport needs CuPy (pip install 'fastcomm[cuda12]')"
        ) from exc
    return cuda


class CudaIpcTransport:
    """Allreduce of CUDA tensors of ranks on one node through mapped peer workspaces.

    Args:
        store: a store namespace private to this transport (IPC handles and the close barrier).
        rank: this process's rank.
        size: number of ranks (at most 16).
        timeout: limit of every collective (seconds or ``timedelta``).
        device: this rank's CUDA device (index or ``torch.device``).
        options: sizes and bounds; default `IpcCudaOptions.from_env()`.

    Raises:
        RuntimeError: no CUDA or CuPy, or a peer's GPU this process cannot access.
    """

    def __init__(self, store: Store, rank: int, size: int, timeout, device, *, options=None):
        if not 1 <= size <= MAX_PEERS:
            raise ValueError(f"the CUDA IPC transport spans 1..{MAX_PEERS} ranks, got {size}")
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA IPC transport needs a CUDA device")
        cuda = _cupy_cuda()
        runtime = self._rt = cuda.runtime
        self.store, self.rank, self.size = store, rank, size
        self.timeout = as_timedelta(timeout, timedelta(minutes=5))
        index = device if isinstance(device, int) else torch.device(device).index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self.options = options or IpcCudaOptions.from_env()
        self.layout = workspace_layout(self.options, size)
        self._closed = False
        self._failure: BaseException | None = None
        self._timed_out: tuple[str, float] | None = None
        self._opened: list[int] = []
        self._base = 0
        self._bus_ids: list[str] = []  # every rank's GPU, for the regions' mappings
        self._regions: list = []  # bucket regions (buckets.py), closed before the workspace
        self._region_count = 0
        # CuPy keeps its own current device (it may load another libcudart than torch's)
        self._cupy_device = cuda.Device(self.device.index)
        with torch.cuda.device(self.device), self._cupy_device:
            self._base = runtime.malloc(self.layout.total_bytes)
            try:
                runtime.memset(self._base, 0, self.layout.total_bytes)
                runtime.deviceSynchronize()  # zeroed flags before any peer can see them
                handle = runtime.ipcGetMemHandle(self._base)
                bus_id = runtime.deviceGetPCIBusId(self.device.index)
                peers = store.all_gather_object(
                    "ipc_cuda/workspaces", rank, size,
                    (handle, bus_id, agreed_options(self.options)), self.timeout,
                )
                # before any peer memory is opened: a differing layout would read past it
                check_agreed_options(rank, [p[2] for p in peers])
                self._bus_ids = [bus for _, bus, _ in peers]
                bases = [self._open(r, h, bus) for r, (h, bus, _) in enumerate(peers)]
            except BaseException:
                self._release()
                raise
        self._bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        # Pinned host memory is mapped at the same address on the device (UVA): the host reads
        # the barrier's report and writes its stop request without touching a stream.
        self._control = torch.zeros(CONTROL_WORDS, dtype=torch.int64, pin_memory=True)
        attrs = runtime.pointerGetAttributes(self._control.data_ptr())
        if attrs.devicePointer != self._control.data_ptr():
            self._release()
            raise RuntimeError("pinned host memory is not mapped at its host address (no UVA)")
        # the same words through ctypes: a read costs tens of ns (Work.wait reads them)
        self._words = (ctypes.c_int64 * CONTROL_WORDS).from_address(self._control.data_ptr())
        self._max_spins = max_spins_for(self.timeout.total_seconds(),
                                        self.options.spins_per_second)
        self._clock = EpochClock()
        self.stream = torch.cuda.Stream(self.device)
        self._future_stream = torch.cuda.Stream(self.device)
        self._caller_ready = torch.cuda.Event()
        self._ops = _CudaOps(self)
        self._watchdog = StreamWatchdog(
            f"fastcomm-ipc-cuda-watchdog-r{rank}", self.timeout.total_seconds(), 0.01,
            self._stuck, check=self._barrier_report,
        )
        self._first_barrier()

    def _first_barrier(self) -> None:
        """One barrier through the mapped flags before the first collective.

        It proves every mapping works end to end and compiles the signal kernel here, not in
        the first collective while the peers already spin.
        """
        start = time.monotonic()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self._ops.descriptor = SETUP_DESCRIPTOR
            self._ops.barrier(self._clock.next_epoch())
        done = torch.cuda.Event()
        done.record(self.stream)
        limit = self.timeout.total_seconds()
        while not done.query():
            if time.monotonic() - start > limit:
                self._timed_out = ("setup barrier", time.monotonic() - start)
                self._words[0] = 1
                break
            time.sleep(0.001)
        done.synchronize()
        error = self.failure()
        if error is not None:
            self.close()
            raise error

    def _open(self, peer: int, handle: bytes, bus_id: str) -> int:
        if peer == self.rank:
            return self._base
        ptr = self.map_peer(peer, handle, bus_id)
        self._opened.append(ptr)
        return ptr

    def map_peer(self, peer: int, handle: bytes, bus_id: str | None = None) -> int:
        """Opens rank ``peer``'s IPC ``handle`` (its GPU ``bus_id``, default the one it
        reported at setup) and returns the address; the caller closes it
        (``ipcCloseMemHandle``) once no kernel of any rank reads it.

        Raises:
            RuntimeError: the peer's GPU is not visible here or has no peer access.
        """
        bus_id = self._bus_ids[peer] if bus_id is None else bus_id
        here = self.device.index
        try:
            there = self._rt.deviceGetByPCIBusId(bus_id)
        except Exception as exc:  # CUDARuntimeError: not among this process's visible devices
            raise RuntimeError(
                f"rank {self.rank}: rank {peer}'s GPU {bus_id} is not visible to this process "
                f"(CUDA_VISIBLE_DEVICES?): the CUDA IPC transport maps every peer's memory"
            ) from exc
        if there != here and not torch.cuda.can_device_access_peer(here, there):
            raise RuntimeError(
                f"rank {self.rank}: rank {peer}'s GPU {bus_id} (device {there} here) cannot be "
                f"accessed from device {here} (no peer access): the CUDA IPC transport needs it"
            )
        return self._rt.ipcOpenMemHandle(handle)  # lazily enables peer access

    # ------------------------------------------------------------------ collective
    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM):
        """Enqueues an in-place allreduce of `tensor`; returns its `Work`.

        Raises:
            TypeError: a dtype other than fp32/fp16/bf16.
            ValueError: another device, a non-contiguous tensor, or an op other than
                sum/avg/max/min.
            CommAbortedError: an earlier collective failed (the transport is aborted).
        """
        op = check_all_reduce(tensor, op, self.device)
        self._raise_if_unusable("all_reduce")

        def issue() -> None:
            # planned here, under the enqueue lock: the epochs and buffers must follow the
            # enqueue order
            steps = all_reduce_steps(
                tensor.numel(), tensor.element_size(), self.rank, self.size, self.layout,
                self.options.two_shot_bytes, self._clock,
            )
            ops = self._ops
            ops.dtype, ops.op = tensor.dtype, op.value
            ops.descriptor = call_descriptor("all_reduce", tensor.numel(), tensor.dtype, op)
            run_steps(steps, ops, tensor.data_ptr(), self._base)

        return self.enqueue("all_reduce", tensor, issue)

    def enqueue(self, op: str, output: torch.Tensor, issue) -> EventWork:
        """Runs ``issue()`` (it launches a collective's kernels) on the transport's stream,
        after the caller's stream, under the lock that orders every rank's epochs; returns the
        collective's `EventWork`, tracked by the watchdog. A failure while launching aborts
        the transport: part of the steps are enqueued, so this rank's epochs no longer match
        its peers'."""
        with self._watchdog.lock, torch.cuda.device(self.device):
            ready = self._caller_ready
            ready.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(ready)
            try:
                with torch.cuda.stream(self.stream):
                    issue()
            except BaseException as exc:
                self._failure = FastcommError(
                    f"rank {self.rank}: {op} failed while enqueueing its steps "
                    f"(the CUDA IPC transport is aborted): {exc!r}"
                )
                self._words[0] = 1
                raise self._failure from exc
            event = torch.cuda.Event()
            event.record(self.stream)
            work = EventWork(op, self.rank, output, self.device, event, (output,),
                             self._future_stream, failure=self.failure)
            self._watchdog.track(work)
        return work

    def bucket_region(self, area_bytes: int, max_buckets: int, cap_bytes: int | None = None):
        """DDP bucket memory on this rank's GPU that every rank maps, all-reduced in place
        (:class:`~.buckets.CudaBucketRegion`); a collective: every rank calls it alike.

        Returns:
            The region, or on every rank the reason it was not made (over ``cap_bytes``, the
            GPU out of memory): the caller keeps its own buffers.
        """
        from .buckets import CudaBucketRegion

        self._raise_if_unusable("bucket_region")
        self._region_count += 1
        region = CudaBucketRegion.setup(
            self, area_bytes, max_buckets, cap_bytes, f"ipc_cuda/region/{self._region_count}"
        )
        if not isinstance(region, str):
            self._regions.append(region)
        return region

    # ------------------------------------------------------------------ failure
    def _raise_if_unusable(self, op: str) -> None:
        if self._closed:
            raise CommAbortedError(f"rank {self.rank}: {op} on a closed CUDA IPC transport")
        error = self.failure()
        if error is not None:
            raise CommAbortedError(f"rank {self.rank}: {op} on an aborted CUDA IPC transport: "
                                   f"{error}") from error

    def failure(self) -> BaseException | None:
        """The error that aborted the transport, if any (reads the barrier's report)."""
        words = self._words
        if self._failure is None and words[1] < 0:
            self._failure = disagreement_error(self.rank, words)
            return self._failure
        if self._failure is None and (words[1] or words[0]):
            op, elapsed = self._timed_out or ("all_reduce", None)
            pending = self._watchdog.pending
            if elapsed is None:
                elapsed = pending[0]._elapsed() if pending else 0.0
            message = timeout_message(self.rank, op, elapsed, self.timeout.total_seconds(),
                                      words[1], words[2])
            self._failure = CommTimeoutError(message)
        return self._failure

    def _barrier_report(self) -> BaseException | None:
        """The watchdog's poll: a barrier that ran out of spins reported missing ranks, or one
        found a peer in another call."""
        return self.failure() if self._words[1] else None

    def _stuck(self, work: EventWork) -> BaseException:
        """The watchdog's verdict on a collective past the timeout: every spinning or later
        barrier gives up, and the spinning one reports which ranks were missing."""
        self._timed_out = (work.op, work._elapsed())
        self._words[0] = 1
        deadline = time.monotonic() + 5.0
        while not work.event.query() and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.failure()

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Waits for the pending collectives, meets the peers, unmaps and frees the workspace.

        Peers must not read this rank's workspace after it is freed: healthy ranks wait at a
        store barrier that every rank reaches on close; an aborted rank only announces itself.
        """
        if self._closed:
            return
        try:
            self.stream.synchronize()
        finally:
            self._closed = True
        regions, self._regions = self._regions, []
        try:
            for region in regions:  # they use the stream, the control block and the store
                region.close()
        finally:  # a region whose peers are gone still leaves the workspace to be released
            self._close_workspace()

    def _close_workspace(self) -> None:
        self._watchdog.close()
        name = "ipc_cuda/closed"
        if self.failure() is None:
            try:
                self.store.barrier(name, self.size, self.timeout)
            finally:
                self._release()
            return
        if self.store.add(f"{name}/arrived", 1) == self.size:
            self.store.set(f"{name}/done", b"1")
        self._release()

    def _release(self) -> None:
        rt = self._rt
        with torch.cuda.device(self.device), self._cupy_device:
            for ptr in self._opened:
                rt.ipcCloseMemHandle(ptr)
            self._opened = []
            if self._base:
                rt.free(self._base)
                self._base = 0


class _CudaOps:
    """`StepOps` on the transport's stream (the current stream while steps run)."""

    __slots__ = ("t", "dtype", "op", "descriptor", "_memcpy", "_stream", "_own", "_signal_args")

    def __init__(self, transport: CudaIpcTransport) -> None:
        t = self.t = transport
        self.dtype = torch.float32
        self.op = "sum"
        self.descriptor = SETUP_DESCRIPTOR  # of the call whose steps run (set per call)
        self._memcpy = t._rt.memcpyAsync
        self._stream = t.stream.cuda_stream
        self._own = t._bases[t.rank : t.rank + 1]
        # the barrier's arguments, checked here once: every barrier then launches unchecked
        check_peer_signal(t._bases, t.layout.flags_offset, t.rank, 1, t._control, t._max_spins,
                          SETUP_DESCRIPTOR)
        self._signal_args = (t._bases, t.layout.flags_offset, t._control.data_ptr(), t.rank)

    def copy(self, dst_addr: int, src_addr: int, nbytes: int) -> None:
        self._memcpy(dst_addr, src_addr, nbytes, 3, self._stream)  # 3: device to device

    def barrier(self, epoch: int) -> None:
        launch_peer_signal(*self._signal_args, epoch, self.t._max_spins, self.descriptor)

    def reduce(self, step: Reduce) -> None:
        reduce_step(step, self.t._bases, self._own, self.dtype, self.op)
