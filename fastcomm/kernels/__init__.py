"""Fused bucket kernels (Triton on CUDA, pure-torch reference on CPU).

- ``pack(tensors, out=None, *, scale=1.0, dtype=None)``: tensors -> one flat buffer, scaled
  and cast, one launch (per dtype of a mixed list).
- ``unpack(flat, tensors, *, scale=1.0, accumulate=False)``: the inverse, e.g. with
  ``scale=1/world`` to average.
- ``quantize(x, *, dtype=int8|float8_e4m3fn, block=256, error=None, out=None)`` and
  ``dequantize(q, scales, *, out=None, accumulate=False, block=None)``: block-wise symmetric
  quantization of flat buffers, with fused error feedback.
- ``unpack_with_stats(flat, tensors, *, scale=1.0, stats=None)``: ``unpack`` that also adds
  the sum of squares and the non-finite count of the values it wrote into ``stats``.
- ``*_reference``: the pure-torch versions (what CPU tensors run; the test oracles).
- ``peer_reduce(srcs, dsts, *, op, scale)``: reduce peers' buffers (mapped into this process)
  elementwise and write the result into one or more buffers, one launch: the data step of
  the kernel collectives. ``peer_reduce_table(src_table, dst_table, *, numel, dtype, ...)``:
  the same over address tables a transport keeps, with byte offsets per round.
- ``peer_signal(base_table, *, flags_offset, rank, epoch, control, max_spins, descriptor)``: a
  barrier through flags in the peers' memory, bounded and reporting the ranks that never
  arrived, and those whose call ``descriptor`` differs from this rank's
  (``peer_signal_reference`` runs the protocol over tensors; ``missing_ranks`` decodes it).
- ``PackPlan(tensors)``: a bucket's pack/unpack planned once (views, block tables, the
  implementation); its ``pack``/``unpack`` give the same bits at a fraction of the host cost.
- ``kernel_backend(tensor)``: ``"triton"`` or ``"torch"``, what the ops above use for it.

Environment: ``FASTCOMM_KERNELS=triton|torch`` forces an implementation; Triton kernels run
on CPU tensors in Triton's interpreter when ``FASTCOMM_KERNELS=triton`` and
``TRITON_INTERPRET=1`` was set before triton was first imported.
"""

from ._launch import clear_table_cache, kernel_backend
from ._pack import pack, pack_reference, unpack, unpack_reference
from ._peer_reduce import (
    PEER_REDUCE_OPS,
    peer_reduce,
    peer_reduce_reference,
    peer_reduce_table,
)
from ._peer_signal import missing_ranks, peer_signal, peer_signal_reference
from ._plan import PackPlan
from ._quantize import (
    DEFAULT_BLOCK,
    dequantize,
    dequantize_reference,
    quantize,
    quantize_reference,
)
from ._unpack_stats import unpack_with_stats, unpack_with_stats_reference

__all__ = [
    "DEFAULT_BLOCK",
    "PackPlan",
    "clear_table_cache",
    "dequantize",
    "dequantize_reference",
    "kernel_backend",
    "pack",
    "pack_reference",
    "PEER_REDUCE_OPS",
    "peer_reduce",
    "peer_reduce_reference",
    "peer_reduce_table",
    "peer_signal",
    "peer_signal_reference",
    "missing_ranks",
    "quantize",
    "quantize_reference",
    "unpack",
    "unpack_reference",
    "unpack_with_stats",
    "unpack_with_stats_reference",
]
