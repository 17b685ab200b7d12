"""Shared fixtures: the real embedded model (converted once, cached) and tiny random-weight
Llama / Qwen2 / Qwen3 models that share its tokenizer (so chat templates are real)."""

from __future__ import annotations

import os

# Triton reads this when @triton.jit decorates, so it must be set before anything imports
# kvmemory.kernels (the Triton tests run in the interpreter on a machine without a GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")
# a fixed thread count per call: the engine's attention splits its rows per thread, so a count
# that follows the machine's load could change the last bits between two calls a test compares
# (tests/test_cores.py turns the sharing on where it tests it)
os.environ.setdefault("KVMEMORY_SHARE_CORES", "0")

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


@pytest.fixture(scope="module")
def real_lora(real):
    """The embedded model with a rank-8 LoRA on v_proj of layer 15 (the RQ4 workload's adapter),
    unloaded after the module so the shared model is plain again."""
    from kvmemory_lab.reforge.workload import attach_lora

    model, _, _ = attach_lora(real.model, "v_proj", 15, 8, 16)
    yield model
    model.unload()


@pytest.fixture(scope="session")
def tokenizer(real):
    return real.tokenizer


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny(request):
    """(family, model) for each tiny family."""
    return request.param, tiny_model(request.param)
