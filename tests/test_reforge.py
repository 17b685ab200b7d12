"""CacheReforge: version identity, restart layers, bounded recovery, calibration, runtime policy,
analysis certificates, online updates and their composition with history edits."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kvmemory.divergence import first_token_kl
from kvmemory.reforge import ReforgeConfig, capture_adapter, decide, restart_layers
from kvmemory_lab.reforge.analysis import certificates, horizon_table, hybrid_executions, tail_influence
from kvmemory_lab.reforge.calibration import (
    WindowScores, build_profile, candidate_windows, condition_result, first_safe_window, lower_tail_statistic,
)
from kvmemory.online_adapter import OnlineAdapter
from kvmemory.reforge.profile import ProfileKey, ReforgeProfile
from kvmemory.reforge.restart import target_boundaries
from kvmemory.reforge.versions import lora_modules
from kvmemory.session import KVSession
from support import QUERY, history, tiny_model

LAYERS = 6


def lora_tiny(targets=("v_proj", "q_proj", "down_proj"), layers=(2, 3), trainable_layer=2, seed=0):
    model = tiny_model("llama", seed=seed, num_hidden_layers=LAYERS)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), layers_to_transform=list(layers)))
    for name, p in pm.named_parameters():
        if "lora" in name and f"layers.{trainable_layer}." not in name:
            p.requires_grad_(False)
    return pm.eval()


def nudge(model, layer: int, module: str, scale: float = 0.5, seed: int = 1):
    """Move the LoRA B of ``module`` at ``layer`` (an adapter update)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and f"layers.{layer}." in name and module in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def calibrated_profile(num_layers: int, **calibration) -> ReforgeProfile:
    """A profile without eq. 9 sensitivities for the policies beyond the paper: pass ``probe=`` or
    ``scheduler=`` (or nothing, for a profile that lacks the policy's calibration)."""
    key = ProfileKey(model="m", update_target="v_proj@2", adapter_config="a", context_regime="c")
    return ReforgeProfile(key=key, num_layers=num_layers, sensitivity=[0.0] * num_layers, delta=[None] * num_layers,
                          drift_threshold=None, thresholds={}, **calibration)


def fresh_logits(model, tokenizer, msgs):
    s = KVSession(model, tokenizer, "reprefill")
    s.prepare(msgs)
    return s


MSGS = history() + [QUERY]


# ------------------------------------------------------------------ versions
def test_digest_is_content_not_name(tokenizer):
    pm = lora_tiny()
    v0 = capture_adapter(pm, LAYERS)
    assert capture_adapter(pm, LAYERS).digest == v0.digest
    nudge(pm, 3, "q_proj")
    v1 = capture_adapter(pm, LAYERS)
    assert v1.digest != v0.digest and v1.layer_digests[:3] == v0.layer_digests[:3]
    assert v1.kv_digests == v0.kv_digests  # a query update writes no cache at its own layer
    for m in lora_modules(pm):  # a scale change under the same name is a new version
        m.module.scaling["default"] *= 2
    assert capture_adapter(pm, LAYERS).digest != v1.digest
    assert v1.distance(v0) > 0


def test_restart_layers_eq_s4():
    assert restart_layers("K", 3, 6) == (3, 3)
    assert restart_layers("V", 0, 6) == (0, 0)
    assert restart_layers("Q", 3, 6) == (4, 3)
    assert restart_layers("MLP", 5, 6) == (6, 6)  # last-layer MLP invalidates no cached layer
    with pytest.raises(ValueError):
        restart_layers("V", 6, 6)
    pm = lora_tiny()
    assert target_boundaries(pm, LAYERS) == (2,)  # trainable modules live at layer 2


# ------------------------------------------------------- recovery (tiny models)
@pytest.mark.parametrize("module,r_kv", [("v_proj", 2), ("q_proj", 3), ("down_proj", 3)])
def test_full_suffix_recovery_equals_fresh_prefill(tokenizer, module, r_kv):
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=ReforgeConfig())
    s.prepare(MSGS)
    assert 2 in s.reforge.boundaries.states and s.reforge.boundary_bytes > 0
    nudge(pm, 2, module)
    report = s.maintain()
    assert (report.r_kv, report.start, report.end, report.action) == (r_kv, 2, LAYERS, "full_suffix")
    assert report.reanchored == list(range(r_kv)) and not report.mixed
    ref = fresh_logits(pm, tokenizer, MSGS)
    assert torch.allclose(s.next_logits, ref.next_logits, atol=1e-4)
    for a, b in zip(s.cache.layers, ref.cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-4) and torch.allclose(a.values, b.values, atol=1e-4)


def test_stale_and_bounded_leave_a_mixed_version_cache(tokenizer):
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=ReforgeConfig(policy="fixed_window"))
    s.prepare(MSGS)
    old = s.adapter_versions.current
    nudge(pm, 2, "v_proj", scale=2.0)
    ref = fresh_logits(pm, tokenizer, MSGS)
    stale = s.fork()
    stale.maintain(policy="stale")
    report = s.maintain()
    assert (report.action, report.start, report.end) == ("bounded", 2, 4)
    versions = s.adapter_versions
    assert versions.mixed and versions.stale_layers == [4, 5]
    assert set(versions.layer_versions) == {old, versions.current}
    stale_kl = first_token_kl(ref.next_logits, stale.next_logits)
    assert stale_kl > 1e-6  # the update matters, and the stale cache is reported stale
    assert stale.adapter_versions.stale_layers == [2, 3, 4, 5]
    # a later exact-suffix pass recovers the rest from the (refreshed) boundary
    s.reforge.config = ReforgeConfig(policy="exact_suffix")
    s.maintain()
    assert torch.allclose(s.next_logits, ref.next_logits, atol=1e-4) and not s.adapter_versions.mixed


def test_without_boundary_recovery_starts_at_the_embedding(tokenizer):
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=ReforgeConfig(boundary_layers=()))
    s.prepare(MSGS)
    nudge(pm, 2, "v_proj")
    report = s.maintain()
    assert report.start == 0 and report.note and s.reforge.boundary_bytes == 0
    assert torch.allclose(s.next_logits, fresh_logits(pm, tokenizer, MSGS).next_logits, atol=1e-4)


@pytest.mark.parametrize("order", ["edit_then_update", "update_then_edit"])
def test_edits_and_updates_compose(tokenizer, order):
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=ReforgeConfig())
    s.prepare(MSGS)
    edited = [m for m in MSGS if m["id"] != "t2"]
    if order == "edit_then_update":
        s.prepare(edited)
        nudge(pm, 2, "v_proj")
        got = s.generate(1).first_logits  # the update is noticed and repaired before decoding
    else:
        nudge(pm, 2, "v_proj")
        s.prepare(edited)  # maintenance first, then the edit repair (boundary rows follow the edit)
        got = s.next_logits
    assert torch.allclose(got, fresh_logits(pm, tokenizer, edited).next_logits, atol=1e-4)
    s.check_invariants()
    assert not s.adapter_versions.mixed and s.reforge.last_report.action == "full_suffix"


def test_generate_after_update_matches_fresh(tokenizer):
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=ReforgeConfig())
    s.prepare(MSGS)
    nudge(pm, 2, "q_proj")
    got = s.generate(4)
    ref = fresh_logits(pm, tokenizer, MSGS).generate(4)
    assert got.token_ids == ref.token_ids
    assert torch.allclose(got.first_logits, ref.first_logits, atol=1e-4)


def test_sliding_window_model_recovers_by_reprefill(tokenizer, caplog):
    """A sliding-window layer cannot run layer-range recovery with a full causal mask: the cache is
    re-prefilled under the new adapter instead (exact), and the log says why."""
    model = tiny_model("qwen2", num_hidden_layers=LAYERS, use_sliding_window=True, sliding_window=16,
                       max_window_layers=0)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"], layers_to_transform=[2])).eval()
    s = KVSession(pm, tokenizer, "replay", reforge=ReforgeConfig())
    s.prepare(MSGS)
    nudge(pm, 2, "v_proj")
    with caplog.at_level("WARNING"):
        report = s.maintain()
    assert report.action != "reuse" and "re-prefills" in caplog.text
    assert torch.allclose(s.next_logits, fresh_logits(pm, tokenizer, MSGS).next_logits, atol=1e-4)
    assert not s.adapter_versions.mixed


def test_stale_layers_clear_exact_rows(tokenizer):
    """After stale reuse, no row equals a fresh prefill: a budget-100 repair must start at row 0."""
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=ReforgeConfig())
    s.prepare(MSGS)
    assert s.exact_rows == len(s.token_ids)
    nudge(pm, 2, "v_proj")
    s.maintain(policy="stale")
    assert s.exact_rows == 0
    edited = [m for m in MSGS if m["id"] != "t2"]
    s.prepare(edited)  # replay = budget 100: every row recomputed under the current adapter
    assert torch.allclose(s.next_logits, fresh_logits(pm, tokenizer, edited).next_logits, atol=1e-4)


# ------------------------------------------------------------- runtime policy
def _profile(sens, tau=None):
    key = ProfileKey(model="m", update_target="v_proj@2", adapter_config="a", context_regime="c")
    return ReforgeProfile(key=key, num_layers=len(sens), sensitivity=sens, delta=[None] * len(sens),
                          drift_threshold=tau, thresholds={})


def test_runtime_trigger_and_ablations():
    d = [0.0, 0.0, 0.5, 0.5, 0.5, 2.0]
    invalid = [2, 3, 4, 5]
    prof = _profile([0, 0, 4.0, 1.0, 0.0, 0.4], tau=1.0)
    cr = decide("cachereforge", d, invalid, 2, prof)
    assert cr.triggered == [2] and cr.end == 3 and cr.action == "bounded"  # q = 2.0, 0.5, 0, 0.8
    d2 = [0.0, 0.0, 0.5, 0.5, 0.5, 3.0]
    assert decide("cachereforge", d2, invalid, 2, prof).end == 6  # layer 5: q = 1.2 -> b_t = N
    assert decide("cachereforge", [0.0] * 6, [], 6, prof).action == "reuse"
    assert decide("drift_only", d, invalid, 2, prof).triggered == [5]
    assert (decide("fixed_window", d, invalid, 2).end, decide("exact_suffix", d, invalid, 2).end) == (4, 6)
    with pytest.raises(ValueError, match="calibrate"):
        decide("cachereforge", d, invalid, 2, None)
    with pytest.raises(ValueError, match="unknown"):
        decide("magic", d, invalid, 2)


# ---------------------------------------------------------------- calibration
def _scores(kls, tops, drops):
    ws = list(range(len(kls)))
    return WindowScores(dict(zip(ws, kls)), dict(zip(ws, tops)), dict(zip(ws, drops)))


def test_first_safe_window_is_first_hit_with_no_violating_sample():
    a = _scores([0.2, 0.01, 0.3, 0.0], [0, 1, 1, 1], [0, 0, 0, 0])
    b = _scores([0.2, 0.06, 0.01, 0.0], [1, 1, 1, 1], [0, 0, 0, 0])
    assert first_safe_window([a], [0, 1, 2, 3]) == 1
    assert first_safe_window([a, b], [0, 1, 2, 3]) == 3  # b violates at 1, a at 2 (a reversal)
    assert candidate_windows(15, 30) == [0, 1, 2, 4, 8, 15]
    assert candidate_windows(2, 30) == [0, 1, 2, 4, 8, 16, 28]


def test_profile_sensitivity_is_inverse_lower_tail_distance(tmp_path):
    n = 6
    conds = []
    for d, h in [(0.1, 0), (0.2, 1), (0.3, 1), (0.4, 2), (0.8, 4)]:
        s = _scores([0.0] * 5, [1] * 5, [0] * 5)
        for w in range(5):  # windows below h are unsafe
            s.kl[w] = 1.0 if w < h else 0.0
        conds.append(condition_result([s], list(range(5)), 2, d, 1, n))
    assert [c.first_safe for c in conds] == [0, 1, 1, 2, 4]
    key = ProfileKey(model="m", update_target="v_proj@2", adapter_config="a", context_regime="c")
    prof = build_profile(key, n, conds)
    assert prof.delta[2] == pytest.approx(0.2) and prof.sensitivity[2] == pytest.approx(5.0)
    assert prof.delta[3] == pytest.approx(0.4) and prof.delta[5] == pytest.approx(0.8)
    assert prof.sensitivity[0] == 0 and prof.delta[0] is None and prof.drift_threshold == pytest.approx(0.2)
    assert lower_tail_statistic(list(range(1, 41))) == 3  # floor(0.05*40)+1 = 3rd order statistic
    path = prof.save(tmp_path / "p.json")
    assert ReforgeProfile.load(path, expect=key).sensitivity == prof.sensitivity
    with pytest.raises(ValueError, match="kvmemory calibrate"):
        ReforgeProfile.load(path, expect=key.model_copy(update={"model": "other"}))
    table = horizon_table(conds, n)
    assert table["gap 1"]["direct"] == 1 and table["gap 1"]["bounded"] == 3 and table["gap 1"]["full"] == 1


# ------------------------------------------------------------------ analysis
def test_hybrid_executions_certificates_on_tiny(tokenizer):
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=ReforgeConfig())
    s.prepare(MSGS)
    nudge(pm, 2, "v_proj", scale=2.0)
    run = hybrid_executions(s)
    ref = fresh_logits(pm, tokenizer, MSGS).next_logits
    assert torch.allclose(run.fresh, ref, atol=1e-4)
    assert torch.equal(run.window(0), run.logits[2])
    tails = tail_influence(run)
    assert tails[LAYERS] == 0 and tails[2] >= tails[3] >= tails[4]
    certs = certificates(run)
    assert all(c.kl_holds and c.top1_holds for c in certs)
    assert certs[0].kl > 0


# ------------------------------------------------------------ online updates
def test_online_update_maintains_every_registered_session(tokenizer):
    pm = lora_tiny(targets=("v_proj",), layers=(2,))
    a = KVSession(pm, tokenizer, "replay", reforge=ReforgeConfig())
    b = KVSession(pm, tokenizer, "replay", reforge=ReforgeConfig())
    a.prepare(MSGS)
    b.prepare(history()[:4] + [QUERY])
    online = OnlineAdapter(pm, tokenizer, {"a": a, "b": b}, lr=5e-2)
    report = online.update(history()[:2], "Helmsford")
    assert report.version_before != report.version_after and set(report.sessions) == {"a", "b"}
    assert all(r.action == "full_suffix" for r in report.sessions.values())
    assert torch.allclose(a.next_logits, fresh_logits(pm, tokenizer, MSGS).next_logits, atol=1e-4)
    with pytest.raises(ValueError, match="empty"):
        online.update(history()[:2], " ")


# --------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def real_lora(real):
    from kvmemory_lab.reforge.workload import attach_lora

    model, target, _ = attach_lora(real.model, "v_proj", 15, 8, 16)
    yield model, target
    model.unload()  # give the shared fixture its plain model back


@pytest.mark.real_model
def test_real_model_suffix_recovery_bounded_and_certificates(real_lora, tokenizer):
    """SmolLM2 + rank-8 LoRA on v_proj@15: one online step, then the analysis certificates,
    a bounded window (mixed versions) and the exact suffix [15, 30) equal to a fresh prefill."""
    model, target = real_lora
    msgs = history()[:4] + [QUERY]
    assert target == "v_proj@15"
    s = KVSession(model, tokenizer, "replay", reforge=ReforgeConfig())
    s.prepare(msgs)
    assert tuple(s.reforge.boundaries.states) == (15,)
    stale = s.fork()
    OnlineAdapter(model, tokenizer, {}, lr=5e-2).update(history()[:2], "Helmsford")
    run = hybrid_executions(stale)
    certs = certificates(run)
    assert run.start == 15 and all(c.kl_holds and c.top1_holds for c in certs) and certs[0].kl > 0
    bounded = s.fork()
    bounded.reforge.config = ReforgeConfig(policy="fixed_window")
    assert bounded.maintain().end == 17 and bounded.adapter_versions.mixed
    report = s.maintain()
    ref = fresh_logits(model, tokenizer, msgs)
    assert (report.start, report.end) == (15, 30)
    assert torch.allclose(s.next_logits, ref.next_logits, atol=1e-4)
    assert torch.allclose(run.fresh, ref.next_logits, atol=1e-4)
    stale.maintain(policy="stale")
    assert first_token_kl(ref.next_logits, stale.next_logits) > first_token_kl(ref.next_logits, bounded.next_logits)
