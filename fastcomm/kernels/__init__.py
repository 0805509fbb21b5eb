"""Fused bucket kernels (Triton on CUDA, pure-torch reference on CPU).

- ``pack``/``unpack``: tensors <-> one flat buffer, scaled and cast, one launch per dtype;
  ``PackPlan``: the same for one bucket, planned once; ``unpack_with_stats``: ``unpack`` that
  also sums the squares and counts the non-finite values it wrote; ``RelocatablePlan``: a
  bucket's pack and unpack for a captured CUDA graph, its addresses read on the device.
- ``quantize``/``dequantize``: block-wise symmetric int8/fp8, with fused error feedback.
- ``peer_reduce``/``peer_reduce_table`` and ``peer_signal``: the data step and the barrier of
  the kernel collectives, over peers' buffers mapped into this process.
- ``*_reference``: the pure-torch versions (what CPU tensors run; the test oracles);
  ``kernel_backend(tensor)``: ``"triton"`` or ``"torch"``.

``FASTCOMM_KERNELS=triton|torch`` forces an implementation (Triton on CPU needs
``TRITON_INTERPRET=1`` before triton's first import). Signatures, protocols: docs/kernels.md.
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
from ._relocate import RelocatablePlan
from ._unpack_stats import unpack_with_stats, unpack_with_stats_reference

__all__ = [
    "DEFAULT_BLOCK",
    "PackPlan",
    "RelocatablePlan",
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
