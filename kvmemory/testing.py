"""A tiny random-weight model for tests: a fast stand-in for the embedded model.

It uses the embedded tokenizer's vocabulary (49152), so SmolLM2's chat template and tokenizer
drive it; weights are random, so only cache equalities (never answers) are meaningful.

Nothing in the runtime imports this module. It lives in the runtime package because both kvmemory's
tests and the lab (fuzzing, reliability harnesses) use it and neither should depend on the other;
a user's tests may use it too.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3Config

from .models import LoadedModel, embedded_model_dir

FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def tiny_config(family: str = "llama", layers: int = 2, **overrides):
    """A ``layers``-layer config of ``family`` (llama | qwen2 | qwen3): hidden 64, 4 query heads,
    2 KV heads, head_dim 16, 8192 positions; ``overrides`` replace any field."""
    fields = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    fields.update(overrides)
    return FAMILIES[family](**fields)


def tiny_model(family: str = "llama", seed: int = 0, layers: int = 2, **overrides):
    """The model of :func:`tiny_config`, fp32, eval mode, weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, layers, **overrides), dtype=torch.float32).eval()


def tiny_loaded(name: str, seed: int = 0) -> LoadedModel:
    """A 2-layer tiny Llama with the embedded tokenizer, as :func:`kvmemory.load_model` returns
    models. ``name`` tells same-layout models apart (its folder is ``<embedded>/<name>``)."""
    folder = embedded_model_dir()
    return LoadedModel(tiny_model("llama", seed), AutoTokenizer.from_pretrained(folder), name, folder / name,
                       torch.float32)
