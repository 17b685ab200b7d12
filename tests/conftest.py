"""Shared fixtures: the real embedded model (converted once, cached) and tiny random-weight
Llama / Qwen2 / Qwen3 models that share its tokenizer (so chat templates are real)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from kvmemory.models import load_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def real():
    """The embedded SmolLM2-135M-Instruct (fp32)."""
    return load_model()


@pytest.fixture(scope="session")
def tokenizer(real):
    return real.tokenizer


def tiny_config(family: str, **overrides):
    """A 2-layer random-weight config of ``family`` with the embedded tokenizer's vocabulary."""
    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    common.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    return cls(**common)


def tiny_model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny(request):
    """(family, model) for each tiny family."""
    return request.param, tiny_model(request.param)
