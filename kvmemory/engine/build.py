"""Building the GGUF-block engine for a model: read the file's blocks and verify, weight by
weight, that they are what the model's weights were dequantized from (exactness by
construction: the engine multiplies by the same values)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import EngineUnsupportedError
from .gguf_blocks import READ_TYPES, load_gguf_blocks
from .llama import QuantizedLlama, _Layer
from .quantized import F16Linear, FusedBlocks, KernelUnavailableError, Q4Linear, Q8Linear, kernel
from .watch import has_lora

LINEAR_FORMS = (Q4Linear, Q8Linear, F16Linear)


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
    head = FusedBlocks.of([_verified_head(model, blocks)])
    if int8_activations and (head.has_halves or any(f.has_halves for l in layers for f in (l.qkv, l.o, l.gate_up, l.down))):
        raise EngineUnsupportedError("int8 activations: the file has Q6_K tensors (16-value blocks), which the "
                                     "int8 kernels do not run (use engine='q4_1')")
    return QuantizedLlama(model, layers, head, int8_activations, bf16_prefill)


def _verified_head(model, blocks: dict):
    """The output head's blocks: the file's ``output.weight``, or its token embedding when the model
    ties them (a file may carry both, differently quantized: the one the model's head equals)."""
    reasons = []
    for name in ("output.weight", "token_embd.weight"):
        try:
            found = blocks.get(name)
            _check_equal(found, model.lm_head.weight, f"lm_head ({name})")
            return found
        except EngineUnsupportedError as exc:
            reasons.append(str(exc))
    raise EngineUnsupportedError("; ".join(reasons))


def _architecture_reason(model) -> str | None:
    config = model.config
    text = config.get_text_config()
    kind = getattr(config, "model_type", None)
    if kind not in ("llama", "qwen2") or not hasattr(model, "model"):
        return f"architecture {getattr(config, 'model_type', type(model).__name__)!r} (the engine runs Llama and Qwen2 decoders)"
    params = list(model.parameters())
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in params):
        return ("the model is not fp32 on CPU (the engine runs the fp32 weights' GGUF blocks: load with dtype='fp32', "
                "or engine='auto', which runs other dtypes and devices on transformers)")
    if has_lora(model):
        return "a LoRA adapter is attached"
    if (kind == "llama" and getattr(text, "attention_bias", False)) or getattr(text, "mlp_bias", False):
        return "biased linears (beyond Qwen2's q/k/v biases)"
    if getattr(text, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(text, "pretraining_tp", 1) not in (1, None) or getattr(text, "hidden_act", "silu") != "silu":
        return "tensor-parallel or non-SiLU MLP"
    rope = (getattr(text, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope != "default":
        return f"rope_type {rope!r}"
    return None


def _verified_layer(model, i: int, blocks: dict) -> _Layer:
    module = model.model.layers[i]
    attn, mlp = module.self_attn, module.mlp
    text = model.config.get_text_config()
    permuted = model.config.model_type == "llama"  # llama.cpp's converter permutes Llama's q / k rows only

    def get(name: str, target, heads: int | None = None) -> Q4Linear | Q8Linear | F16Linear:
        found = blocks.get(f"blk.{i}.{name}.weight")
        if not isinstance(found, LINEAR_FORMS):
            raise EngineUnsupportedError(
                f"layer {i} {name}: its GGUF tensor is not of a type the engine reads ({', '.join(READ_TYPES)})")
        if heads is not None and permuted:  # stored interleaved for llama.cpp's rotary layout
            found = found.rows(_unpermute(found.shape[0], heads))
        _check_equal(found, target.weight, f"layer {i} {name}")
        return found

    q = get("attn_q", attn.q_proj, text.num_attention_heads)
    k = get("attn_k", attn.k_proj, text.num_key_value_heads)
    v = get("attn_v", attn.v_proj)
    biases = [p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    if any(b is None for b in biases) != all(b is None for b in biases) or attn.o_proj.bias is not None:
        raise EngineUnsupportedError(f"layer {i}: biases other than on all of q, k and v (the engine adds Qwen2's)")
    qkv_bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    gate, up = get("ffn_gate", mlp.gate_proj), get("ffn_up", mlp.up_proj)
    return _Layer(FusedBlocks.of([q, k, v], qkv_bias), FusedBlocks.of([get("attn_output", attn.o_proj)]),
                  FusedBlocks.of([gate, up]), FusedBlocks.of([get("ffn_down", mlp.down_proj)]), module)


def _unpermute(rows: int, heads: int) -> torch.Tensor:
    """Row order of transformers' weight in terms of llama.cpp's (its q/k permutation inverted)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def _check_equal(blocks, weight: torch.Tensor, name: str) -> None:
    if not isinstance(blocks, LINEAR_FORMS) or tuple(blocks.shape) != tuple(weight.shape):
        raise EngineUnsupportedError(f"{name}: no block tensor of shape {tuple(weight.shape)} in the GGUF file")
    if not torch.equal(blocks.dequantize(), weight.detach()):
        raise EngineUnsupportedError(
            f"{name}: the model's weights are not the GGUF file's blocks (fine-tuned, merged or another model)"
        )
