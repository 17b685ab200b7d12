"""kvmemory's execution engine: which code computes a model's new cache rows.

``"transformers"``: the model's own forward (every model; the reference).
``"q4_1"``: :class:`~kvmemory.engine.llama.QuantizedLlama`, a Llama / Qwen2 forward over the GGUF
blocks the model's weights were dequantized from, writing a pre-allocated cache. Same weights,
1/5 of the bytes per decoded token; results equal to transformers' up to fp32 summation order.
Named after the embedded model's blocks, it reads Q4_0 / Q4_1 / Q4_K / Q5_0 / Q6_K / Q8_0
tensors (:mod:`.gguf_blocks`).
``"q4_1_int8"``: the same engine with int8 activations on its block path (decoded tokens and short
appends, as llama.cpp does): each linear's input is rounded to int8 per 32 values and multiplied
with VNNI integer dot products. Same weights, lossy activations (see docs/engine.md for the
measured tolerances); long inputs (prefill) still run the exact dense fp32 path. Needs AVX-512 VNNI.
``"q4_1_bf16"``: ``"q4_1"`` whose long inputs (>= 24 rows: prefill, long appends, Replay)
multiply bf16 copies of the weights in bf16 (oneDNN, AVX512-BF16), ~2.5x the fp32 GEMM speed for
~212 MB more weights (SmolLM2); lossy like the model's bf16 dtype; decoding stays exact fp32.
``"q4_1_int8_bf16"``: both (int8 activations on the block path, bf16 long inputs).
``"cuda_graphs"``: for any model on a CUDA GPU the packed executor can run (Llama, Mistral,
Qwen2/3): each decoded token replays one captured CUDA graph (:mod:`kvmemory.engine.graphs`);
same weights and dtype. Asked for by name after moving the model (not part of ``"auto"``).

Every engine is an :class:`Engine` (:mod:`.interface`): it computes rows at positions for a
cache (:meth:`~Engine.forward_rows`), refreshes selected rows (:meth:`~Engine.refresh_rows`),
gathers rows into its storage and says what it cannot run and why. Executors and sessions choose
*which* rows; the engine computes them. The transformers forward is one implementation
(:mod:`.reference`), the GGUF-block engine (:mod:`.llama`, built by :mod:`.build`) and the CUDA
graph decoder (:mod:`.graphs`) are others; the packed traversal they share is :mod:`.traversal`.

The engine is a setting of the loaded model (every session on it shares it), chosen with
:func:`attach` (``kvmemory.load_model(engine="auto")`` does it for the embedded model). Every
forward that appends rows (:func:`forward_rows`) then runs on it; anything it cannot compute (a
LoRA adapter, modified weights, a quantized or sliding-window cache) runs on transformers
instead (:func:`engine_for`), and :func:`status` says which and why. Each call runs with the
threads the cores other processes and concurrent calls leave free (:mod:`.cores`).
"""

from __future__ import annotations

from .batching import DecodeBatcher, decode_batcher
from .cores import CORES, share_cores
from .interface import BlockLinears, Engine, EngineStatus, ForwardResult
from .gguf_blocks import load_gguf_blocks
from .quantized import F16Linear, FusedBlocks, KernelUnavailableError, Q4Linear, Q8Linear, kernel, kernel_isa
from .registry import BLOCK_ENGINES, ENGINES, attach, engine_for, forward_rows, release_dense, restore_dense, status

__all__ = [
    "BLOCK_ENGINES", "CORES", "DecodeBatcher", "ENGINES", "BlockLinears", "Engine", "EngineStatus", "ForwardResult", "FusedBlocks",
    "F16Linear", "KernelUnavailableError", "Q4Linear", "Q8Linear", "attach", "decode_batcher", "engine_for", "forward_rows", "kernel", "kernel_isa", "load_gguf_blocks", "release_dense", "restore_dense", "share_cores", "status",
]
