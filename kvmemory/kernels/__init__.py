"""Triton kernels for kvmemory, importable as ``kvmemory.kernels``.

The indexed packed-attention kernel and the fused K/V scatter live here (packed executor,
paper Appendix 13). This folder is mapped under ``kvmemory.kernels`` so that it never shadows
the ``kernels`` package transformers probes for.

Triton is optional (``pip install 'kvmemory[triton]'``). Kernels launch on a CUDA GPU, or on CPU
tensors in Triton's interpreter when ``TRITON_INTERPRET=1`` is set before this package is imported.
"""

try:
    import triton  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the Triton backend needs the optional dependency triton: pip install 'kvmemory[triton]' "
        "(or use the default backend='sdpa')"
    ) from exc

from .packed_attention import (
    BLOCK_M,
    BLOCK_N,
    AttentionPlan,
    TritonUnavailableError,
    build_plan,
    check_available,
    packed_attention,
    scatter_kv,
    unavailable_reason,
)

__all__ = [
    "BLOCK_M", "BLOCK_N", "AttentionPlan", "TritonUnavailableError", "build_plan", "check_available",
    "packed_attention", "scatter_kv", "unavailable_reason",
]
