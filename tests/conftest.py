"""Shared fixtures: the real embedded model (converted once, cached) and tiny random-weight
Llama / Qwen2 / Qwen3 models that share its tokenizer (so chat templates are real)."""

from __future__ import annotations

import os

# Triton reads this when @triton.jit decorates, so it must be set before anything imports
# kvmemory.kernels (the Triton tests run in the interpreter on a machine without a GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvmemory.models import load_model
from support import tiny_model

# 2 threads by default; OMP_NUM_THREADS=1 wins on a shared, oversubscribed machine (spin-waits)
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 2))


@pytest.fixture(scope="session")
def real():
    """The embedded SmolLM2-135M-Instruct (fp32)."""
    return load_model()


@pytest.fixture(scope="session")
def tokenizer(real):
    return real.tokenizer


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny(request):
    """(family, model) for each tiny family."""
    return request.param, tiny_model(request.param)
