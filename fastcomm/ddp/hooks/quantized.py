"""int8 / fp8 gradient compression with error feedback.

Per bucket: pack with the averaging folded in and quantize with the last step's residual
(fused); ``all_to_all`` of codes and scales (the reduce-scatter); dequantize and sum the
chunks in fp32, re-quantize; ``all_gather`` the re-quantized chunks and dequantize into the
result. Each rank sends about a quarter of a ring all-reduce's fp32 bytes.

Invariants: the residual is this rank's alone and is updated in the quantize pass; the
all-gather's rounding is not fed back (every rank shares it); every buffer of the pipeline is
allocated once per bucket and reused each step (`_Buffers`).

The steps, the byte counts and the error bound: docs/ddp.md.
"""

from __future__ import annotations

import torch

from fastcomm import kernels

from ..bucket import GradBucket
from ._two_phase import ErrorFeedback, PhaseComms, new_future
from .default import average_scale, hook_comm

__all__ = ["QuantizeState", "fp8_compress_hook", "int8_compress_hook"]

# Code dtypes as they travel: fp8 is not a communicator dtype, its bytes are.
_WIRE = {torch.int8: torch.int8, torch.float8_e4m3fn: torch.uint8}


class _Buffers:
    """One bucket's preallocated pipeline buffers (`padded` elements over `world` ranks)."""

    __slots__ = ("key", "q", "scales", "recv_q", "recv_s", "parts", "chunk_sum", "q2", "s2")

    def __init__(self, key, padded: int, world: int, block: int, qdtype, device) -> None:
        self.key = key
        chunk, n_scales = padded // world, padded // block
        self.q = torch.empty(padded, dtype=qdtype, device=device)
        self.scales = torch.empty(n_scales, dtype=torch.float32, device=device)
        self.recv_q = torch.empty(padded, dtype=qdtype, device=device)
        self.recv_s = torch.empty(n_scales, dtype=torch.float32, device=device)
        self.parts = torch.empty(padded, dtype=torch.float32, device=device)
        self.chunk_sum = torch.empty(chunk, dtype=torch.float32, device=device)
        self.q2 = torch.empty(chunk, dtype=qdtype, device=device)
        self.s2 = torch.empty(chunk // block, dtype=torch.float32, device=device)


class QuantizeState:
    """State of `int8_compress_hook` / `fp8_compress_hook`: residuals and the second comm.

    Args:
        comm: communicator (or torch ``ProcessGroup``) to reduce over; ``None``: the DDP's.
        block: elements per fp32 scale (a power of two, default 256: 1.6 % overhead on int8).
        error_feedback: keep each parameter's rounding residual and add it to the next step.

    ``state_dict()`` / ``load_state_dict()`` save and restore the residuals, keyed by
    parameter name, so they survive bucket rebuilds and checkpoints.
    """

    def __init__(
        self, comm: object = None, *, block: int = kernels.DEFAULT_BLOCK, error_feedback=True
    ) -> None:
        if not isinstance(block, int) or block < 16 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 16, got {block!r}")
        self.comm = comm
        self.block = block
        self.error_feedback = bool(error_feedback)
        self.feedback = ErrorFeedback()
        self.phases = PhaseComms()
        self._buffers: dict[int, _Buffers] = {}

    def buffers(self, index: int, padded: int, world: int, qdtype, device) -> _Buffers:
        """Bucket `index`'s pipeline buffers, made on first use and when its shape changes."""
        key = (padded, world, self.block, qdtype, device)
        bufs = self._buffers.get(index)
        if bufs is None or bufs.key != key:
            bufs = self._buffers[index] = _Buffers(key, padded, world, self.block, qdtype, device)
        return bufs

    @property
    def errors(self) -> dict[str, torch.Tensor]:
        """Residuals by parameter name (views into the live buffers)."""
        return self.feedback.errors

    def state_dict(self) -> dict:
        """The block size and error feedback, for a checkpoint."""
        return {"block": self.block, "errors": self.feedback.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.block = state["block"]
        self.feedback.load_state_dict(state["errors"])


def _quantized_allreduce(
    state: QuantizeState, bucket: GradBucket, qdtype: torch.dtype
) -> torch.futures.Future:
    if not isinstance(state, QuantizeState):
        raise TypeError(
            f"{qdtype} compression needs a QuantizeState as hook state, got "
            f"{type(state).__name__}: register_comm_hook(QuantizeState(), hook)"
        )
    comm, comm2 = state.phases.get(hook_comm(state.comm, bucket))
    world, block, n = comm.size, state.block, bucket.numel()
    chunk = -(-n // (world * block)) * block
    padded = chunk * world
    x = bucket.packed(torch.float32, average_scale(comm, bucket), numel=padded)
    device = x.device
    error = None
    if state.error_feedback:
        error = state.feedback.flat(
            bucket.index(), bucket.parameter_names(),
            lambda: [p.numel() for p in bucket.parameters()], padded, device,
        )
    bufs = state.buffers(bucket.index(), padded, world, qdtype, device)
    q, scales = kernels.quantize(x, dtype=qdtype, block=block, error=error,
                                 out=(bufs.q, bufs.scales))
    wire = _WIRE[qdtype]
    recv_q, recv_s = bufs.recv_q, bufs.recv_s
    ticket = state.phases.issuer.ticket()
    futures = [
        comm.all_to_all(recv_q.view(wire), q.view(wire), async_op=True).get_future(),
        comm.all_to_all(recv_s, scales, async_op=True).get_future(),
    ]
    result = new_future(device)

    def reduce_chunk(done: torch.futures.Future) -> None:
        try:
            for f in done.value():
                f.value()
            # Sum every rank's copy of my chunk in fp32, re-quantize it.
            parts = kernels.dequantize(recv_q, recv_s, block=block, out=bufs.parts)
            summed = torch.sum(parts.view(world, chunk), 0, out=bufs.chunk_sum)
            q2, s2 = kernels.quantize(summed, dtype=qdtype, block=block,
                                      out=(bufs.q2, bufs.s2))
        except BaseException as exc:
            state.phases.issuer.run(ticket, None)  # pass the turn to the next bucket
            result.set_exception(exc)
            return

        def issue():  # recv_q/recv_s were consumed above: they take the gathered chunks
            return [
                comm2.all_gather(recv_q.view(wire), q2.view(wire), async_op=True),
                comm2.all_gather(recv_s, s2, async_op=True),
            ]

        try:
            works = state.phases.issuer.run(ticket, issue)
        except BaseException as exc:
            result.set_exception(exc)
            return
        torch.futures.collect_all([w.get_future() for w in works]).then(finish)

    def finish(done: torch.futures.Future) -> None:
        try:
            for f in done.value():
                f.value()
            out = kernels.dequantize(recv_q, recv_s, out=x, block=block)
            result.set_result(out[:n])
        except BaseException as exc:
            result.set_exception(exc)

    torch.futures.collect_all(futures).then(reduce_chunk)
    return result


def int8_compress_hook(state: QuantizeState, bucket: GradBucket) -> torch.futures.Future:
    """Averages the bucket exchanging int8 codes (block-wise scales, error feedback)."""
    return _quantized_allreduce(state, bucket, torch.int8)


def fp8_compress_hook(state: QuantizeState, bucket: GradBucket) -> torch.futures.Future:
    """Averages the bucket exchanging float8_e4m3fn codes (block-wise scales, error feedback)."""
    return _quantized_allreduce(state, bucket, torch.float8_e4m3fn)
