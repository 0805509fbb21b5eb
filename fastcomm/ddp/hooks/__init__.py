"""Comm hooks for :meth:`fastcomm.ddp.DDP.register_comm_hook` (torch's contract)."""

from .default import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .powersgd import PowerSGDState, powersgd_hook
from .quantized import QuantizeState, fp8_compress_hook, int8_compress_hook

__all__ = [
    "PowerSGDState",
    "QuantizeState",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "fp8_compress_hook",
    "int8_compress_hook",
    "powersgd_hook",
]
