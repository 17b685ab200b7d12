"""Shift position correction (paper §7.1 eq. 2) against re-prefilled keys on tiny random models.

RoPE attention depends only on relative positions, so prefilling the same ids at positions
offset by d yields, at every layer, keys that differ only by their rotation. Shifting the keys
prefilled at p + d by −d must therefore reproduce the keys prefilled at p.

Tolerance: fp32 angles φ = position · inv_freq carry a rounding error ≈ φ · 6e-8, which perturbs
attention (and thus keys of layers ≥ 1) in proportion to position and key magnitude. We use
    atol = (1e-5 + 4e-8 · max_position) · max|K|
(max|K| ≈ 0.6 for the Llama/Qwen2 configs, ≈ 3.5 for Qwen3 with its k_norm). Observed worst case
at max_position 3963: 8.8e-5 absolute (Qwen3 layer 1) against a bound of ≈ 6e-4; layer 0 errors are
≤ 5e-7 since the rotation cancels the model's own angles. Unshifted keys differ by O(1).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvmemory.shift import RotaryShifter, ShiftUnsupportedError, shift_unsupported_reason

HEAD_DIM = 16
N_TOKENS = 64
LONGROPE_BOUNDARY = 2048

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 1024,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
    # attention_factor (mscale) != 1 here, so the test also checks that it cancels
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048},
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": LONGROPE_BOUNDARY,
        "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)],
    },
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
# (prefill start p, deleted width d); the largest position used is p + d + N_TOKENS − 1 = 3963
SPANS = [(5, 40), (200, 1800), (0, 3900)]
REGIMES = {  # rope case -> (rope type, spans)
    "default": ("default", SPANS),
    "linear": ("linear", SPANS),
    "llama3": ("llama3", SPANS),
    "yarn": ("yarn", SPANS),
    "longrope-short": ("longrope", [(5, 40), (200, 1700)]),  # all positions < 2048
    "longrope-long": ("longrope", [(2100, 1800), (2049, 5)]),  # all positions >= 2049
}


def make_model(family: str, rope: str, **overrides) -> torch.nn.Module:
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=8192,
        rope_parameters=dict(ROPES[rope]),
        **overrides,
    )
    return model_cls(config).to(torch.float32).eval()


def prefill_keys(model, ids: torch.Tensor, start: int) -> list[torch.Tensor]:
    """Keys of every layer, [1, kv_heads, n, head_dim], for ids placed at positions start.."""
    positions = torch.arange(ids.shape[1])[None] + start
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=positions, cache=DynamicCache(config=model.config), use_cache=True)
    return [layer.keys for layer in out.cache.layers]


def tolerance(max_position: int, keys: torch.Tensor) -> float:
    return (1e-5 + 4e-8 * max_position) * keys.abs().max().item()


def random_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, N_TOKENS), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", REGIMES)
def test_shift_matches_reprefill_at_every_layer(family, case):
    rope, spans = REGIMES[case]
    model = make_model(family, rope)
    shifter = RotaryShifter(model)
    ids = random_ids()
    for p, d in spans:
        moved, fresh = prefill_keys(model, ids, p + d), prefill_keys(model, ids, p)
        old = torch.arange(N_TOKENS) + p + d
        coeffs = shifter.coefficients(old, old - d)  # once per edit, reused by every layer
        tol = tolerance(int(old.max()), torch.stack(fresh))
        for layer, (k_moved, k_fresh) in enumerate(zip(moved, fresh)):
            # the check can fail: without the shift the keys are far apart
            assert (k_moved - k_fresh).abs().max() > 100 * tol, (layer, p, d)
            shifted = shifter.apply(k_moved, coeffs)
            err = (shifted - k_fresh).abs().max().item()
            assert err <= tol, f"layer {layer} p={p} d={d}: err {err:.2e} > tol {tol:.2e}"
        assert torch.equal(shifter.shift(moved[0], old, old - d), shifter.apply(moved[0], coeffs))


@pytest.mark.parametrize("rope", ["default", "llama3", "yarn"])
def test_three_shifts_equal_one_net_shift(rope):
    model = make_model("qwen3", rope)
    shifter = RotaryShifter(model)
    start, (d1, d2, d3) = 3800, (700, 1, 2500)
    keys = prefill_keys(model, random_ids(), start)
    pos = torch.arange(N_TOKENS) + start
    for k in keys:
        stepwise = k
        for a, b in ((0, d1), (d1, d1 + d2), (d1 + d2, d1 + d2 + d3)):
            stepwise = shifter.shift(stepwise, pos - a, pos - b)
        net = shifter.shift(k, pos, pos - (d1 + d2 + d3))
        tol = tolerance(int(pos.max()), k)
        assert (stepwise - net).abs().max().item() <= tol
        assert (net - k).abs().max().item() > 100 * tol


def test_shift_with_another_models_scaling_fails():
    """The angles must come from the model's own rotary module: default-RoPE angles on llama3 keys are wrong."""
    model = make_model("llama", "llama3")
    wrong = RotaryShifter(make_model("llama", "default", rope_theta=500000.0))
    ids, p, d = random_ids(), 0, 3000
    moved, fresh = prefill_keys(model, ids, p + d), prefill_keys(model, ids, p)
    old = torch.arange(N_TOKENS) + p + d
    err = (wrong.shift(moved[0], old, old - d) - fresh[0]).abs().max().item()
    assert err > 100 * tolerance(int(old.max()), fresh[0])


def test_dynamic_rope_is_refused_with_fallback():
    model = make_model("llama", "dynamic")
    reason = shift_unsupported_reason(model.config)
    assert reason is not None and "dynamic" in reason
    with pytest.raises(ShiftUnsupportedError, match="Replay") as info:
        RotaryShifter(model)
    assert isinstance(info.value, ValueError) and "dynamic" in str(info.value)


def test_other_unsupported_configs_give_reasons():
    partial = LlamaConfig(head_dim=HEAD_DIM, rope_parameters={**ROPES["default"], "partial_rotary_factor": 0.5})
    assert "partial" in shift_unsupported_reason(partial)
    for rope in ("default", "linear", "llama3", "yarn", "longrope"):
        assert shift_unsupported_reason(make_model("llama", rope).config) is None


def test_longrope_regime_boundary():
    model = make_model("llama", "longrope")
    last_short = LONGROPE_BOUNDARY - 1  # transformers switches when max position + 1 > boundary
    assert shift_unsupported_reason(model.config, max_position=last_short) is None
    assert "longrope" in shift_unsupported_reason(model.config, max_position=last_short + 1)
    old = torch.arange(N_TOKENS) + LONGROPE_BOUNDARY
    with pytest.raises(ShiftUnsupportedError, match="longrope"):
        RotaryShifter(model).coefficients(old, old - 100)


def test_bf16_keys_stay_bf16():
    model = make_model("qwen3", "yarn")
    shifter = RotaryShifter(model)
    ids, p, d = random_ids(), 100, 2000
    moved, fresh = prefill_keys(model, ids, p + d), prefill_keys(model, ids, p)
    old = torch.arange(N_TOKENS) + p + d
    for k_moved, k_fresh in zip(moved, fresh):
        shifted = shifter.shift(k_moved.to(torch.bfloat16), old, old - d)
        assert shifted.dtype == torch.bfloat16
        # bf16 keeps 8 significant bits: input and output rounding each cost <= 2^-9 relative
        tol = 1e-2 * k_fresh.abs().max().item()
        assert (shifted.float() - k_fresh).abs().max().item() <= tol
        assert (k_moved - k_fresh).abs().max().item() > 10 * tol


def test_per_layer_type_rope_gemma3():
    """Gemma 3 nests one RoPE per layer type (different theta); each layer needs its own coefficients."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=8192, sliding_window=32,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    model = Gemma3ForCausalLM(config).eval()
    shifter = RotaryShifter(model)
    assert shifter.layer_types == ("sliding_attention", "full_attention")
    ids, p, d = random_ids(), 100, 1000
    moved, fresh = prefill_keys(model, ids, p + d), prefill_keys(model, ids, p)
    for layer, (k_moved, k_fresh) in enumerate(zip(moved, fresh)):
        old = torch.arange(N_TOKENS)[-k_moved.shape[2] :] + p + d  # sliding layers keep only the window
        shifted = shifter.shift(k_moved, old, old - d, layer_type=shifter.layer_type(layer))
        assert (shifted - k_fresh).abs().max().item() <= tolerance(int(old.max()), k_fresh)
    with pytest.raises(ValueError, match="layer_type"):
        shifter.coefficients(old, old - d)


def test_interleaved_rotary_layout_is_refused():
    class Interleaved(torch.nn.Module):  # GPT-J style layout: each frequency repeated on adjacent dims
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, position_ids):
            cos, sin = self.inner(x, position_ids)
            half = cos.shape[-1] // 2
            return cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)

    model = make_model("llama", "default")
    model.get_decoder().rotary_emb = Interleaved(model.get_decoder().rotary_emb)
    with pytest.raises(ShiftUnsupportedError, match="rotate_half"):
        RotaryShifter(model)


def test_bad_inputs_raise_value_error_and_empty_is_fine():
    shifter = RotaryShifter(make_model("llama", "default"))
    pos = torch.arange(8)
    with pytest.raises(ValueError, match="equal length"):
        shifter.coefficients(pos, pos[:4])
    with pytest.raises(ValueError, match=">= 0"):
        shifter.coefficients(pos, pos - 1)
    with pytest.raises(ValueError, match="head_dim"):
        shifter.apply(torch.zeros(1, 2, 7, HEAD_DIM), shifter.coefficients(pos, pos))
    empty = torch.arange(0)
    assert shifter.shift(torch.zeros(1, 2, 0, HEAD_DIM), empty, empty).shape == (1, 2, 0, HEAD_DIM)
    longrope = RotaryShifter(make_model("llama", "longrope"))  # its regime switch needs max(positions)
    assert longrope.coefficients(empty, empty).cos_delta.shape == (0, HEAD_DIM // 2)
