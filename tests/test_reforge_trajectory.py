"""Trajectory fit of CacheReforge sensitivities (kvmemory_lab.reforge.trajectory): the replay must
reproduce what a maintained session does (KL and recomputed layers), and the fit must respect
its budget."""

from __future__ import annotations

import pytest
import torch

from kvmemory.divergence import first_token_kl
from kvmemory.reforge import ReforgeConfig
from kvmemory.reforge.profile import ProfileKey, ReforgeProfile
from kvmemory.reforge.probe import ProbeCalibration
from kvmemory_lab.reforge.probe_fit import fit_probe
from kvmemory_lab.reforge.trajectory import (PolicyReplay, ReplayPolicy, build_bank, fit_to_budget, parse_groups,
                                             window_groups)
from kvmemory_lab.reforge.workload import load_snapshot, trainable_snapshot
from kvmemory.session import KVSession
from support import QUERY, history
from test_reforge import LAYERS, lora_tiny, nudge

PROMPTS = [history() + [QUERY], history()[:4] + [QUERY]]  # two lengths: the replay pads its batch


def trajectory(model, steps: int, layer: int, scale: float = 0.3) -> list[dict]:
    versions = [trainable_snapshot(model)]
    for step in range(steps):
        nudge(model, layer, "v_proj", scale, seed=10 + step)
        versions.append(trainable_snapshot(model))
    load_snapshot(model, versions[0])
    return versions


def profile_for(num_layers: int, delta: dict[int, float]) -> ReforgeProfile:
    key = ProfileKey(model="tiny", update_target="v_proj", adapter_config="lora r=4", context_regime="test")
    return ReforgeProfile(key=key, num_layers=num_layers, drift_threshold=None, thresholds={},
                          delta=[delta.get(i) for i in range(num_layers)],
                          sensitivity=[1.0 / delta[i] if i in delta else 0.0 for i in range(num_layers)])


def session_trajectory(model, tokenizer, msgs, versions, profile, config=None):
    """KL to fresh and recomputed-layer % of a real session maintained at every version."""
    load_snapshot(model, versions[0])
    config = config or ReforgeConfig(policy="cachereforge", profile=profile)
    s = KVSession(model, tokenizer, "replay", reforge=config)
    s.prepare(msgs)
    kls, recs = [], []
    for v in versions[1:]:
        load_snapshot(model, v)
        report = s.maintain()
        fresh = KVSession(model, tokenizer, "reprefill")
        fresh.prepare(msgs)
        kls.append(first_token_kl(fresh.next_logits, s.next_logits))
        recs.append(report.recompute_pct)
    load_snapshot(model, versions[0])
    return kls, recs


def prompt_ids(model, tokenizer, msgs) -> list[int]:
    s = KVSession(model, tokenizer, "replay")
    s.prepare(msgs)
    return list(s.token_ids)


def test_window_groups_follow_the_candidate_windows():
    assert window_groups(15, 30) == [(15,), (16,), (17, 18), (19, 20, 21, 22), tuple(range(23, 30))]
    assert window_groups(2, 6) == [(2,), (3,), (4, 5)]
    assert window_groups(5, 6) == [(5,)]


def test_replay_reproduces_maintained_sessions(tokenizer):
    model = lora_tiny(targets=("v_proj",), layers=(2,), trainable_layer=2)
    versions = trajectory(model, 5, layer=2)
    bank = build_bank(model, [prompt_ids(model, tokenizer, m) for m in PROMPTS], versions, load_snapshot)
    assert (bank.restart, bank.invalid) == (2, [2, 3, 4, 5])
    step = float(bank.distances[1, 0])
    profile = profile_for(LAYERS, {2: 1.5 * step, 3: 1.5 * step, 4: 3.5 * step, 5: 3.5 * step})
    replay = PolicyReplay(model, [bank], load_snapshot, max_batch=3)  # several chunks per version
    result, stale = replay.evaluate([profile, None])
    expected_kl, expected_rec = [], []
    for msgs in PROMPTS:
        kls, recs = session_trajectory(model, tokenizer, msgs, versions, profile)
        expected_kl += kls
        expected_rec += recs
    assert result.actions["reuse"] > 0 and result.actions["bounded"] + result.actions["full_suffix"] > 0
    assert result.recompute_pct == pytest.approx(sum(expected_rec) / len(expected_rec), abs=1e-9)
    assert result.kl == pytest.approx(sum(expected_kl) / len(expected_kl), rel=1e-3, abs=1e-7)
    assert stale.recompute_pct == 0 and stale.kl > result.kl > 0
    forwards = replay.forwards
    assert replay.evaluate([profile])[0].kl == result.kl and replay.forwards == forwards  # memoised


def test_fit_stays_within_its_budget(tokenizer):
    model = lora_tiny(targets=("v_proj",), layers=(2,), trainable_layer=2)
    versions = trajectory(model, 6, layer=2)
    bank = build_bank(model, [prompt_ids(model, tokenizer, PROMPTS[1])], versions, load_snapshot)
    step = float(bank.distances[1, 0])
    start = profile_for(LAYERS, {2: 2.5 * step, 3: 2.5 * step, 4: 2.5 * step, 5: 2.5 * step})
    replay = PolicyReplay(model, [bank], load_snapshot)
    start_result = replay.evaluate([start])[0]
    budget = 20.0
    fitted, fit = fit_to_budget(replay, start, budget, rounds=2, max_steps=3)
    check = replay.evaluate([fitted])[0]
    assert check.recompute_pct == pytest.approx(fit.recompute_pct) and check.recompute_pct <= budget
    assert check.kl == pytest.approx(fit.kl)
    if start_result.recompute_pct <= budget:  # the start is a candidate: the fit can only improve on it
        assert fit.kl <= start_result.kl
    assert fitted.sensitivity[:2] == [0.0, 0.0] and all(s > 0 for s in fitted.sensitivity[2:])
    with pytest.raises(ValueError, match="budget"):
        fit_to_budget(replay, start, 0.0)


def test_group_text_parses_and_is_checked(tokenizer):
    assert parse_groups("window") is None
    assert parse_groups("2-2,3-5") == [(2,), (3, 4, 5)]
    for bad in ("2-x", "5-3", "2"):
        with pytest.raises(ValueError, match="groups"):
            parse_groups(bad)
    model = lora_tiny(targets=("v_proj",), layers=(2,), trainable_layer=2)
    bank = build_bank(model, [prompt_ids(model, tokenizer, PROMPTS[1])], trajectory(model, 3, layer=2), load_snapshot)
    step = float(bank.distances[1, 0])
    start = profile_for(LAYERS, {layer: 2.5 * step for layer in range(2, 6)})
    replay = PolicyReplay(model, [bank], load_snapshot)
    fitted, fit = fit_to_budget(replay, start, 50.0, rounds=1, max_steps=2, groups=[(2,), (3,), (4, 5)])
    assert fit.groups == [(2,), (3,), (4, 5)] and fitted.delta[4] == fitted.delta[5] == fit.group_delta[2]
    for bad, match in (([(1, 2)], "outside"), ([(2, 3), (3,)], "overlap")):
        with pytest.raises(ValueError, match=match):
            fit_to_budget(replay, start, 50.0, groups=bad)


def test_bank_refuses_a_model_without_lora(tokenizer):
    from support import tiny_model

    model = tiny_model("llama", num_hidden_layers=LAYERS)
    with pytest.raises(ValueError, match="LoRA"):
        build_bank(model, [[1, 2, 3]], [{}, {}], lambda m, s: None)


@pytest.mark.real_model
def test_replay_matches_sessions_on_the_real_model(real, tokenizer):
    from kvmemory_lab.reforge.workload import attach_lora

    model, _, _ = attach_lora(real.model, "v_proj", 15, 8, 16)
    try:
        versions = [trainable_snapshot(model)]
        for step in range(3):
            with torch.no_grad():
                g = torch.Generator().manual_seed(step)
                for name, p in model.named_parameters():
                    if p.requires_grad:
                        p.add_(torch.randn(p.shape, generator=g) * 2e-2)
            versions.append(trainable_snapshot(model))
        msgs = history()[:4] + [QUERY]
        bank = build_bank(model, [prompt_ids(model, tokenizer, msgs)], versions, load_snapshot)
        assert bank.restart == 15 and bank.invalid == list(range(15, 30))
        step = float(bank.distances[1, 0])
        profile = profile_for(30, {**{i: 1.2 * step for i in (15, 16)}, **{i: 2.5 * step for i in range(17, 30)}})
        result = PolicyReplay(model, [bank], load_snapshot).evaluate([profile])[0]
        kls, recs = session_trajectory(model, tokenizer, msgs, versions, profile)
        assert result.recompute_pct == pytest.approx(sum(recs) / len(recs))
        assert result.kl == pytest.approx(sum(kls) / len(kls), rel=1e-3, abs=1e-7)
        assert result.actions["reuse"] and result.actions["bounded"] + result.actions["full_suffix"]
    finally:
        model.unload()


@pytest.mark.parametrize("projection", [False, True])
def test_probed_replay_reproduces_probed_sessions(tokenizer, projection):
    """The bank's probe values are what a session's probe measures: replayed decisions, probes
    charged and KLs equal a maintained probed session's at every version, with and without the
    restart projection; the fit stays within its budget."""
    model = lora_tiny(targets=("v_proj",), layers=(2,), trainable_layer=2)
    versions = trajectory(model, 6, layer=2, scale=0.6)
    bank = build_bank(model, [prompt_ids(model, tokenizer, m) for m in PROMPTS], versions, load_snapshot)
    replay = PolicyReplay(model, [bank], load_snapshot, max_batch=3)
    devs = replay.probe_values(0, 4)
    tau = float(devs[:, 1:, 1:, 0].median())  # deep layers against v0: some probes pass, some stop
    gate = 0.0 if projection else tau  # projected: τ_r only gates the probe through layer r
    calibration = ProbeCalibration(thresholds=[None, None, gate] + [tau] * 3, rows=4, carry=4.0, pacing=0.5,
                                   restart_projection=projection)
    profile = profile_for(LAYERS, {}).model_copy(update={"probe": calibration})
    result, = replay.evaluate([ReplayPolicy("probed", budget_pct=40, probe=calibration)])
    expected_kl, expected_rec = [], []
    for msgs in PROMPTS:
        config = ReforgeConfig(policy="probed", profile=profile, budget_pct=40)
        kls, recs = session_trajectory(model, tokenizer, msgs, versions, profile, config)
        expected_kl += kls
        expected_rec += recs
    assert result.actions["reuse"] > 0 and result.actions["bounded"] + result.actions["full_suffix"] > 0
    assert result.probe_pct > 0
    assert result.recompute_pct == pytest.approx(sum(expected_rec) / len(expected_rec), rel=1e-6)
    assert result.kl == pytest.approx(sum(expected_kl) / len(expected_kl), rel=1e-3, abs=1e-7)
    fit = fit_probe(replay, 30, rows_grid=(4,), carries=(4.0,), start_taus=(tau, 2 * tau), pacings=(0.0,),
                    max_steps=1, restart_projection=projection)
    assert fit.recompute_pct <= 30 + 1e-9 and fit.kl <= fit.stale_kl
    assert fit.calibration.restart_projection is projection
    assert fit.calibration.fit["budget_pct"] == 30 and len(fit.calibration.thresholds) == LAYERS
