"""Building the GGUF-block engine for a model: read the file's blocks and verify, weight by
weight, that they are what the model's weights were dequantized from (exactness by
construction: the engine multiplies by the same values)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import EngineUnsupportedError
from .llama import QuantizedLlama, _Layer
from .quantized import KernelUnavailableError, Q4Linear, Q8Linear, kernel, load_gguf_blocks
from .watch import has_lora


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
    if has_lora(model):
        return "a LoRA adapter is attached"
    if getattr(text, "attention_bias", False) or getattr(text, "mlp_bias", False):
        return "biased linears"
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
