"""Triton kernels for kvmemory, importable as ``kvmemory.kernels``.

The indexed packed-attention kernel and the fused K/V scatter live here (packed executor,
paper Appendix 13). This folder is mapped under ``kvmemory.kernels`` so that it never shadows
the ``kernels`` package transformers probes for.
"""
