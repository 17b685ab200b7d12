"""kvmemory's execution engine: which code computes a model's new cache rows.

``"transformers"``: the model's own forward (every model; the reference).
``"q4_1"``: :class:`~kvmemory.engine.llama.QuantizedLlama`, a Llama-family forward over the GGUF
blocks the model's weights were dequantized from, writing a pre-allocated cache. Same weights,
1/5 of the bytes per decoded token; results equal to transformers' up to fp32 summation order.
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

The engine is a setting of the loaded model (every session on it shares it), chosen with
:func:`attach` (``kvmemory.load_model(engine="auto")`` does it for the embedded model). Every
forward that appends rows to a plain ``DynamicCache`` (:func:`kvmemory.executors.sequential.forward_rows`)
then runs on it; anything it cannot compute (a LoRA adapter, modified weights, a quantized or
sliding-window cache) runs on transformers instead, and :func:`status` says which and why.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from .. import kvcache
from ..errors import EngineUnsupportedError, InputError
from . import graphs
from .llama import QuantizedLlama, _Layer
from .quantized import KernelUnavailableError, Q4Linear, Q8Linear, kernel, load_gguf_blocks  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

ENGINES = ("auto", "q4_1", "q4_1_int8", "q4_1_bf16", "q4_1_int8_bf16", "cuda_graphs", "transformers")
BLOCK_ENGINES = ("q4_1", "q4_1_int8", "q4_1_bf16", "q4_1_int8_bf16")  # the engines on the GGUF blocks (asked for by name: failures raise)

_attached: "weakref.WeakKeyDictionary[torch.nn.Module, QuantizedLlama | graphs.GraphDecoder]" = weakref.WeakKeyDictionary()
_refused: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class EngineStatus:
    """Which engine computes a model's rows: ``name`` (an engine of :data:`ENGINES` other than ``"auto"``) and,
    for transformers, ``reason`` why the fast engine does not run (None when it was not asked)."""

    name: str
    reason: str | None = None

    def as_dict(self) -> dict:
        return {"name": self.name, "reason": self.reason}


def attach(model, gguf: str | Path | None, engine: str = "auto") -> EngineStatus:
    """Run ``model``'s row computations on the quantized engine built from ``gguf`` (or, with
    ``engine="cuda_graphs"``, on captured CUDA graphs; ``gguf`` is then not read).

    Args:
        model: a transformers ``LlamaForCausalLM`` in fp32 on CPU, whose linear weights are the
            dequantized Q4_1 blocks of ``gguf`` and whose head is its Q8_0 embedding (the embedded
            SmolLM2 is). Checked weight by weight (~1 s for 135 M parameters).
        engine: ``"auto"`` (use ``"q4_1"`` when possible, else transformers, with the reason in
            :func:`status`), ``"q4_1"`` (raise when it cannot run), ``"q4_1_int8"`` (the same
            with int8 activations on the block path; raise when it cannot run, e.g. no AVX-512
            VNNI), ``"q4_1_bf16"`` (bf16 linears for long inputs), ``"q4_1_int8_bf16"`` (both),
            ``"cuda_graphs"`` (a model on CUDA; raise when it cannot run), ``"transformers"`` (detach).

    Returns:
        EngineStatus of the model after the call.

    Raises:
        InputError: unknown ``engine``.
        EngineUnsupportedError: an engine asked for by name (``"q4_1"``, ``"q4_1_int8"``,
            ``"cuda_graphs"``, ...) cannot run this model / file / machine; the model keeps the
            engine it had.
    """
    if engine not in ENGINES:
        raise InputError(f"engine must be one of {', '.join(ENGINES)} (got {engine!r})")
    if engine == "transformers":
        _attached.pop(model, None)
        _refused.pop(model, None)
        return status(model)
    if engine == "cuda_graphs":
        reason = graphs.unsupported_reason(model)
        if reason:  # the engine the model has stays
            raise EngineUnsupportedError(f"engine 'cuda_graphs': {reason} (the model keeps engine {status(model).name!r})")
        built = graphs.GraphDecoder(model)
    else:
        try:
            built = build(model, Path(gguf), int8_activations="int8" in engine, bf16_prefill=engine.endswith("bf16"))
        except EngineUnsupportedError as exc:
            if engine in BLOCK_ENGINES:  # asked for by name: raise, the engine the model has stays
                raise
            _attached.pop(model, None)
            _refused[model] = str(exc)
            log.info("kvmemory: the quantized engine does not run this model: %s", exc)
            return status(model)
    _attached[model] = built
    _refused.pop(model, None)
    return status(model)


def status(model) -> EngineStatus:
    """The engine that computes ``model``'s rows now (see :class:`EngineStatus`)."""
    engine = _attached.get(model)
    if engine is None:
        return EngineStatus("transformers", _refused.get(model))
    reason = unusable_reason(engine)
    return EngineStatus("transformers", reason) if reason else EngineStatus(engine.kind)


def engine_for(model, cache) -> QuantizedLlama | graphs.GraphDecoder | None:
    """The engine to append rows of ``cache`` with, or None (use transformers)."""
    engine = _attached.get(model)
    if engine is None or not kvcache.plain_layers(cache) or unusable_reason(engine):
        return None
    return engine


def gather_rows(model, cache, rows: torch.Tensor):
    """:func:`kvmemory.kvcache.gather_rows` (a new cache whose row j copies ``cache``'s row
    ``rows[j]``, LongTensor ``[n]``, -1 = zero placeholder), written into the attached engine's
    capacity-backed storage when the engine computes ``model``'s rows: the answer after a repair
    then appends without copying every row again. Same rows either way."""
    engine = engine_for(model, cache)
    if engine is None:
        return kvcache.gather_rows(cache, rows)
    target = DynamicCache(config=model.config)
    engine.buffers.gather(cache, rows, target)
    return target


def block_linears(model, cache, rows: int):
    """The attached engine's linears on its GGUF blocks (:meth:`QuantizedLlama.block_linears`) for
    a computation of ``rows`` new rows over ``cache``, when the engine computes ``model``'s rows
    and would run such an input on its blocks (fewer than its ``dense_from_rows``: weight bytes
    bound it, and the blocks are 1/5 of the dense weights' bytes); None otherwise (use the model's
    own modules). Same products as the dense weights up to fp32 summation order."""
    engine = engine_for(model, cache)
    if not isinstance(engine, QuantizedLlama) or rows >= engine.dense_from_rows:
        return None
    return engine.block_linears()


def refresh_rows(model, cache, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """The packed refresh of the rows at ``positions`` (LongTensor ``[B]``, strictly increasing;
    ``token_ids`` ``[B]`` their tokens) in one engine call, in place on ``cache``
    (:meth:`QuantizedLlama.refresh_rows`), when the engine computes ``model``'s rows, its storage
    backs ``cache`` (``gather_rows`` made it) and B < its ``dense_from_rows``. Returns the fp32 logits
    ``[vocab]`` after the last position, or None when it did not run (nothing written)."""
    engine = engine_for(model, cache)
    if not isinstance(engine, QuantizedLlama) or positions.numel() >= engine.dense_from_rows:
        return None
    return engine.refresh_rows(cache, token_ids, positions)


def unusable_reason(engine: QuantizedLlama | graphs.GraphDecoder) -> str | None:
    """Why an attached engine cannot compute rows right now (None: it can)."""
    reason = engine.stale_reason()
    if reason and _has_lora(engine.model):
        return "a LoRA adapter is attached (the engine runs base weights only; transformers computes adapters)"
    return reason


def build(model, gguf: Path, int8_activations: bool = False, bf16_prefill: bool = False) -> QuantizedLlama:
    """Read ``gguf``'s blocks and check them against ``model``'s weights (see :func:`attach`).
    ``int8_activations``: the ``"q4_1_int8"`` engine (needs the kernel's VNNI build);
    ``bf16_prefill``: bf16 linears on the dense path (``"q4_1_bf16"``, ``"q4_1_int8_bf16"``).

    Raises:
        EngineUnsupportedError: architecture, dtype, device, adapters, or weights that are not the
            file's blocks. KernelUnavailableError: the kernel cannot be compiled here.
    """
    reason = _architecture_reason(model)
    if reason:
        raise EngineUnsupportedError(reason)
    if not gguf.is_file():
        raise EngineUnsupportedError(f"no GGUF file at {gguf}")
    if not kernel().has_vnni() and int8_activations:  # compile (or fail) before reading 100 MB of blocks
        raise KernelUnavailableError("int8 activations need AVX-512 VNNI, which this CPU / build lacks (use engine='q4_1')")
    blocks = load_gguf_blocks(gguf)
    layers = [_verified_layer(model, i, blocks) for i in range(len(model.model.layers))]
    head = blocks.get("output.weight", blocks.get("token_embd.weight"))
    _check_equal(head, model.lm_head.weight, "lm_head")
    return QuantizedLlama(model, layers, head, int8_activations, bf16_prefill)


def _architecture_reason(model) -> str | None:
    config = model.config
    text = config.get_text_config()
    if getattr(config, "model_type", None) != "llama" or not hasattr(model, "model"):
        return f"architecture {getattr(config, 'model_type', type(model).__name__)!r} (the engine runs Llama decoders)"
    params = list(model.parameters())
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in params):
        return ("the model is not fp32 on CPU (the engine runs the fp32 weights' GGUF blocks: load with dtype='fp32', "
                "or engine='auto', which runs other dtypes and devices on transformers)")
    if _has_lora(model):
        return "a LoRA adapter is attached"
    if getattr(text, "attention_bias", False) or getattr(text, "mlp_bias", False):
        return "biased linears"
    if getattr(text, "pretraining_tp", 1) not in (1, None) or getattr(text, "hidden_act", "silu") != "silu":
        return "tensor-parallel or non-SiLU MLP"
    rope = (getattr(text, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope != "default":
        return f"rope_type {rope!r}"
    return None


def _has_lora(model) -> bool:
    return any(hasattr(m, "lora_A") for m in model.modules())


def _verified_layer(model, i: int, blocks: dict) -> _Layer:
    module = model.model.layers[i]
    attn, mlp = module.self_attn, module.mlp
    text = model.config.get_text_config()

    def get(name: str, target, heads: int | None = None) -> Q4Linear:
        found = blocks.get(f"blk.{i}.{name}.weight")
        if not isinstance(found, Q4Linear):
            raise EngineUnsupportedError(f"layer {i} {name}: not a Q4_1 tensor in the GGUF file")
        if heads is not None:  # llama.cpp stores q / k rows interleaved for its rotary layout
            found = found.rows(_unpermute(found.shape[0], heads))
        _check_equal(found, target.weight, f"layer {i} {name}")
        return found

    q = get("attn_q", attn.q_proj, text.num_attention_heads)
    k = get("attn_k", attn.k_proj, text.num_key_value_heads)
    v = get("attn_v", attn.v_proj)
    gate, up = get("ffn_gate", mlp.gate_proj), get("ffn_up", mlp.up_proj)
    return _Layer(Q4Linear.concat([q, k, v]), get("attn_output", attn.o_proj), Q4Linear.concat([gate, up]),
                  get("ffn_down", mlp.down_proj), module)


def _unpermute(rows: int, heads: int) -> torch.Tensor:
    """Row order of transformers' weight in terms of llama.cpp's (its q/k permutation inverted)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def _check_equal(blocks, weight: torch.Tensor, name: str) -> None:
    if not isinstance(blocks, (Q4Linear, Q8Linear)) or tuple(blocks.shape) != tuple(weight.shape):
        raise EngineUnsupportedError(f"{name}: no block tensor of shape {tuple(weight.shape)} in the GGUF file")
    if not torch.equal(blocks.dequantize(), weight.detach()):
        raise EngineUnsupportedError(
            f"{name}: the model's weights are not the GGUF file's blocks (fine-tuned, merged or another model)"
        )
