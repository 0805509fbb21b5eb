"""Fused bucket kernels (Triton on CUDA, pure-torch reference on CPU)."""
