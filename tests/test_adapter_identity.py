"""Adapter identity: the cache's version covers every computing adapter (any name, which ones are
active, disabled or not). Fidelity is checked against Re-prefill."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kvmemory.reforge import ReforgeConfig
from kvmemory.reforge.profile import ProfileKey, ReforgeProfile
from kvmemory.session import KVSession
from support import QUERY, history, tiny_model

LAYERS = 6
MSGS = history() + [QUERY]
ATOL = 1e-4  # fp32 tiny models: a maintained cache equals Re-prefill to rounding (~3e-7 seen)


def lora(layer: int, target: str = "v_proj") -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=[target], layers_to_transform=[layer])


def nudge(model, adapter: str, scale: float = 1.0, seed: int = 1) -> None:
    """Move every LoRA B of ``adapter`` (new weights under the same adapter name)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f"lora_B.{adapter}." in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def peft_tiny(adapters: dict[str, LoraConfig], seed: int = 0):
    """A 6-layer tiny Llama with the named LoRA adapters (B moved off zero, so each one matters)."""
    (first, config), *rest = adapters.items()
    pm = get_peft_model(tiny_model("llama", seed=seed, num_hidden_layers=LAYERS), config, adapter_name=first)
    for name, cfg in rest:
        pm.add_adapter(name, cfg)
    for i, name in enumerate(adapters):
        nudge(pm, name, seed=10 + i)
    return pm.eval()


def reprefill_logits(model, tokenizer, msgs=MSGS) -> torch.Tensor:
    s = KVSession(model, tokenizer, "reprefill")
    s.prepare(msgs)
    return s.next_logits


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# ----------------------------------------------------------------- item 1: identity
def test_adapter_under_another_name_is_tracked_and_maintained(tokenizer):
    pm = peft_tiny({"tuned": lora(2)})
    s = KVSession(pm, tokenizer, "replay")
    s.prepare(MSGS)
    nudge(pm, "tuned", seed=3)  # an update of the only adapter, which is not called "default"
    s.prepare(MSGS)
    assert max_diff(s.next_logits, reprefill_logits(pm, tokenizer)) < ATOL
    report = s.reforge.last_report
    assert (report.action, report.r_kv, report.start) == ("full_suffix", 2, 2)  # a comparable update: bounded by eq. S4
    assert report.incomparable == [] and not s.adapter_versions.stale_layers


def test_two_adapters_alternating_match_a_fresh_prefill(tokenizer):
    """'default' on layer 4, 'b' on layer 1: switching changes layer 1 too, which a version of
    'default' alone never saw (max |Δlogits| ~0.9 before)."""
    pm = peft_tiny({"default": lora(4), "b": lora(1)})
    s = KVSession(pm, tokenizer, "replay")
    s.prepare(MSGS)
    versions = {s.adapter_versions.current}
    for active in ("b", "default", "b"):
        pm.set_adapter(active)
        s.prepare(MSGS)
        assert max_diff(s.next_logits, reprefill_logits(pm, tokenizer)) < ATOL, active
        report = s.reforge.last_report
        assert report.action != "reuse" and report.start <= 1 and report.incomparable  # other adapters: no distance
        assert "layout" in report.note and not s.adapter_versions.stale_layers
        versions.add(s.adapter_versions.current)
    assert len(versions) == 2  # the version is the function: the same adapter again, the same version


@pytest.mark.parametrize("name", ["default", "tuned"])
def test_disable_adapter_is_a_version_never_judged_by_distance(tokenizer, name):
    """A calibrated rule with zero sensitivity would reuse any comparable update; disabling the
    adapter is not comparable (a different layout), so the layers are recomputed anyway."""
    pm = peft_tiny({name: lora(2)})
    key = ProfileKey(model="m", update_target="v_proj@2", adapter_config="a", context_regime="c")
    profile = ReforgeProfile(key=key, num_layers=LAYERS, sensitivity=[0.0] * LAYERS, delta=[None] * LAYERS,
                             drift_threshold=None, thresholds={})
    s = KVSession(pm, tokenizer, "replay", reforge=ReforgeConfig(profile=profile))
    s.prepare(MSGS)
    on = s.adapter_versions.current
    with pm.disable_adapter():
        s.prepare(MSGS)
        assert max_diff(s.next_logits, reprefill_logits(pm, tokenizer)) < ATOL
        assert s.reforge.last_report.incomparable == [2, 3, 4, 5]
        assert s.adapter_versions.current == "base"  # disabled computes what the plain model computes
    s.prepare(MSGS)
    assert max_diff(s.next_logits, reprefill_logits(pm, tokenizer)) < ATOL
    assert s.adapter_versions.current == on


def test_lora_attached_after_the_session_was_created(tokenizer):
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    s = KVSession(model, tokenizer, "replay")
    s.prepare(MSGS)
    assert s.reforge.boundary_bytes == 0  # inert without adapters: no boundary states, no hooks
    base = s.adapter_versions.current
    pm = get_peft_model(model, lora(3), adapter_name="late")  # wraps `model` in place
    nudge(pm, "late")
    s.prepare(MSGS)
    assert max_diff(s.next_logits, reprefill_logits(pm, tokenizer)) < ATOL
    assert base == "base" != s.adapter_versions.current
    report = s.reforge.last_report
    assert report.incomparable == [3, 4, 5] and report.start == 0 and "embedding" in report.note


def test_config_adapter_only_chooses_the_restart_layers(tokenizer):
    pm = peft_tiny({"default": lora(4), "b": lora(1)})
    for name, p in pm.named_parameters():
        p.requires_grad_("lora_" in name)  # both adapters trainable
    assert KVSession(pm, tokenizer).reforge.boundaries.layers == (1, 4)
    assert KVSession(pm, tokenizer, reforge=ReforgeConfig(adapter="b")).reforge.boundaries.layers == (1,)
    with pytest.raises(ValueError, match="names no adapter"):
        KVSession(pm, tokenizer, reforge=ReforgeConfig(adapter="missing"))
