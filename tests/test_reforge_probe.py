"""The probed CacheReforge policy (``probed``): the extension rule and its budget, the probe's
K/V against a fresh prefill, and its composition with history edits, strict erase and exported /
imported caches (tiny LoRA model and the embedded SmolLM2). Fidelity is checked against
Re-prefill."""

from __future__ import annotations

import math

import pytest
import torch

from kvmemory import kvcache
from kvmemory.divergence import first_token_kl
from kvmemory.reforge import ReforgeConfig, decide
from kvmemory.reforge.probe import ProbeCalibration, extend_while_stale, layer_kv, probe_cost, relative_deviation
from kvmemory.reforge.profile import ReforgeProfile
from kvmemory.reforge.recovery import embed, run_layers
from kvmemory.reforge.scheduler import BudgetAccount
from kvmemory.session import KVSession
from kvmemory.persistence import CacheState, export_state, import_state
from support import QUERY, history
from test_reforge import LAYERS, MSGS, calibrated_profile, fresh_logits, lora_tiny, nudge

ATOL = 1e-4  # fp32: a maintained cache equals Re-prefill to rounding


def _profile(num_layers: int, thresholds, rows: int = 8, carry: float = 8.0, projection: bool = False) -> ReforgeProfile:
    return calibrated_profile(num_layers, probe=ProbeCalibration(thresholds=list(thresholds), rows=rows, carry=carry,
                                                                 restart_projection=projection))


def _probed(budget_pct: float, tau: float = 0.0, rows: int = 8, projection: bool = False) -> ReforgeConfig:
    """τ = 0: every probed layer is stale enough, so the range grows as far as the budget allows."""
    thresholds = [None, None] + [tau] * (LAYERS - 2)
    return ReforgeConfig(policy="probed", profile=_profile(LAYERS, thresholds, rows, projection=projection),
                         budget_pct=budget_pct)


def _fresh_kv(model, tokenizer, msgs, layer: int, lo: int, hi: int):
    keys, values = kvcache.layer_tensors(fresh_logits(model, tokenizer, msgs).cache)[layer]
    return keys[:, :, lo:hi], values[:, :, lo:hi]


# ------------------------------------------------------------------ the rule
def test_the_range_grows_while_probes_find_stale_layers_within_the_budget():
    """N = 10, restart 4; probes charged 0.1 layer each; deviations planted per layer."""
    calib = ProbeCalibration(thresholds=[None] * 4 + [0.1] * 6, rows=4)
    devs = {4: 0.5, 5: 0.3, 6: 0.05, 7: 0.9, 8: 0.9, 9: 0.9}
    probed = []

    def probe(layer, reach):
        probed.append(layer)
        return devs[layer]

    account = BudgetAccount.open(50, 10, calib.carry)  # 5 layers per update
    account.deposit("v1")
    plan = extend_while_stale(4, 10, probe, calib, account, 0.1)
    assert (plan.end, probed, plan.probes) == (6, [4, 5, 6], 3)  # stops at the first fresh-enough layer
    assert plan.executed == 2 and plan.charged == pytest.approx(2.3)
    poor = BudgetAccount.open(15, 10, calib.carry)  # 1.5 layers: one layer + probes fit, two do not
    poor.deposit("v1")
    probed.clear()
    plan = extend_while_stale(4, 10, probe, calib, poor, 0.1)
    assert (plan.end, probed) == (5, [4]) and plan.charged <= poor.balance
    forced = extend_while_stale(4, 10, probe, calib, BudgetAccount.open(5, 10, 8), 0.1, forced_end=8)
    assert forced.end == 8 and forced.probes == 0  # incomparable anchors: recomputed whatever the balance
    # a query update at 4 leaves layer 4's K/V valid: the first probe is at r_kv = 5, after running
    # layer 4 for the probed rows (a quarter of them: 0.25 layer)
    probed.clear()
    devs[5] = 0.01
    plan = extend_while_stale(4, 10, probe, calib, account, 0.1, r_kv=5, row_share=0.25)
    assert (plan.end, probed, plan.executed) == (None, [5], 0) and plan.charged == pytest.approx(0.35)
    devs[5] = 0.3  # stale: layers 4 and 5 are executed over every row, then 6 is probed
    probed.clear()
    plan = extend_while_stale(4, 10, probe, calib, account, 0.1, r_kv=5, row_share=0.25)
    assert (plan.end, probed, plan.executed) == (6, [5, 6], 2) and plan.charged == pytest.approx(2.45)
    tight = BudgetAccount.open(15, 10, calib.carry)  # 1.5 layers: the probe at 5 could buy nothing
    tight.deposit("v1")
    assert extend_while_stale(4, 10, probe, calib, tight, 0.1, r_kv=5, row_share=0.25).probes == 0
    with pytest.raises(ValueError, match="layer thresholds"):
        extend_while_stale(4, 6, probe, calib, account, 0.1)
    with pytest.raises(ValueError, match="ReforgeState.maintain"):
        decide("probed", [0.0] * 10, [4], 4, None)


def test_restart_projection_refreshes_the_restart_layer_and_probes_one_layer_deeper():
    """N = 10, restart 4 = r_kv (a value update): the projection (0.06 layer) refreshes layer 4 and
    gives dev_4; τ_4 gates the probe at 5, reached through layer 4 for the probed rows only."""
    calib = ProbeCalibration(thresholds=[None] * 4 + [0.1] * 6, rows=4, restart_projection=True)
    devs = {4: 0.05, 5: 0.3, 6: 0.05}
    probed, projected = [], []

    def probe(layer, reach):
        probed.append((layer, reach))
        return devs[layer]

    def project(layer):
        projected.append(layer)
        return devs[layer]

    account = BudgetAccount.open(50, 10, calib.carry)
    account.deposit("v1")
    quiet = extend_while_stale(4, 10, probe, calib, account, 0.1, row_share=0.25, project=project, projection_cost=0.06)
    assert (quiet.end, quiet.projected, quiet.executed, probed, projected) == (None, 4, 0, [], [4])
    assert quiet.charged == pytest.approx(0.06) and quiet.deviations == {4: 0.05}
    devs[4] = 0.5  # stale restart layer: probe 5 through layer 4 (0.25 + 0.1), stale → execute [4, 6), probe 6
    projected.clear()
    plan = extend_while_stale(4, 10, probe, calib, account, 0.1, row_share=0.25, project=project, projection_cost=0.06)
    assert (plan.end, plan.projected, plan.executed, probed, projected) == (6, None, 2, [(5, 4), (6, 6)], [4])
    assert plan.charged == pytest.approx(0.06 + 0.35 + 0.1 + 2)
    devs[5] = 0.01  # layer 5 fresh enough: only the projection and the probe through layer 4 are spent
    probed.clear()
    plan = extend_while_stale(4, 10, probe, calib, account, 0.1, row_share=0.25, project=project, projection_cost=0.06)
    assert (plan.end, plan.projected, probed) == (None, 4, [(5, 4)]) and plan.charged == pytest.approx(0.41)
    # a query update (r_kv = 5 > r) or a calibration without the option never projects
    projected.clear()
    extend_while_stale(4, 10, probe, calib, account, 0.1, r_kv=5, row_share=0.25, project=project, projection_cost=0.06)
    extend_while_stale(4, 10, probe, calib.model_copy(update={"restart_projection": False}), account, 0.1,
                       project=project, projection_cost=0.06)
    assert projected == []
    empty = BudgetAccount.open(0.1, 10, calib.carry)  # 0.01 layer: the projection is not affordable
    empty.deposit("v1")
    assert extend_while_stale(4, 10, probe, calib, empty, 0.1, project=project, projection_cost=0.06).projected is None


def test_probe_cost_is_the_kv_projection_share_of_a_layer(real):
    cfg = real.model.config
    full = probe_cost(cfg, 300, 300)
    assert full == pytest.approx(2 * 576 * 192 / (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536))  # SmolLM2
    assert probe_cost(cfg, 16, 320) == pytest.approx(full / 20) and probe_cost(cfg, 400, 300) == pytest.approx(full)


# ------------------------------------------------------------- on a session
def test_probe_reads_the_fresh_kv_of_the_next_layer(tokenizer):
    """layer_kv over rows entering layer ℓ equals a fresh prefill's K/V of ℓ; the deviation the
    session reports at the restart layer is the one of the fresh and the stale cached rows."""
    pm = lora_tiny()
    ids = torch.tensor(fresh_logits(pm, tokenizer, MSGS).token_ids)
    hidden = run_layers(pm, embed(pm, ids), 0, 3).hidden
    fresh = _fresh_kv(pm, tokenizer, MSGS, 3, 0, ids.shape[0])
    got = layer_kv(pm, 3, hidden[:, 5:], torch.arange(5, ids.shape[0]))
    torch.testing.assert_close(got[0], fresh[0][:, :, 5:], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], fresh[1][:, :, 5:], rtol=0, atol=1e-5)
    s = KVSession(pm, tokenizer, "replay", reforge=_probed(budget_pct=100, tau=math.inf, rows=8))
    s.prepare(MSGS)
    stale = kvcache.layer_tensors(s.cache)[2]
    n = len(s.token_ids)
    stale = (stale[0][:, :, n - 9:n - 1].clone(), stale[1][:, :, n - 9:n - 1].clone())
    nudge(pm, 2, "v_proj", scale=2.0)
    report = s.maintain()
    expected = relative_deviation(_fresh_kv(pm, tokenizer, MSGS, 2, n - 9, n - 1), stale)
    assert expected > 0.05 and report.probes["deviations"] == {2: pytest.approx(expected, rel=1e-4)}
    assert report.action == "reuse" and report.probes["count"] == 1  # τ = ∞: nothing stale enough
    assert report.probes["layers"] > 0  # the probe is charged
    assert report.recompute_pct == pytest.approx(100 * report.probes["layers"] / LAYERS)


def test_probed_session_spends_its_budget_and_reports_what_stays_stale(tokenizer):
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=_probed(budget_pct=20))  # 1.2 layers per update
    s.prepare(MSGS)
    nudge(pm, 2, "v_proj", scale=2.0)
    first = s.maintain()
    assert (first.policy, first.start, first.end) == ("probed", 2, 3)  # one layer and its probes affordable
    assert first.budget["spent"] == pytest.approx(1 + first.probes["layers"])
    assert first.budget["spent"] <= first.budget["deposits"]
    assert s.adapter_versions.stale_layers == [3, 4, 5] and s.exact_rows == 0
    rich = KVSession(pm, tokenizer, "replay", reforge=_probed(budget_pct=100))
    rich.prepare(MSGS)
    nudge(pm, 2, "v_proj", scale=1.0, seed=3)
    report = rich.maintain()
    assert (report.start, report.end) == (2, 6) and not rich.adapter_versions.mixed
    assert sorted(report.probes["deviations"]) == [2, 3, 4, 5]
    assert torch.allclose(rich.next_logits, fresh_logits(pm, tokenizer, MSGS).next_logits, atol=ATOL)
    forked = rich.fork()
    assert forked.reforge.account is not rich.reforge.account and forked.reforge.account == rich.reforge.account


def test_a_query_update_probes_from_the_first_changed_cache_layer(tokenizer):
    """q_proj at layer 2 changes layer 2's output, not its K/V: recovery restarts at 2 but the
    first probe is at r_kv = 3, reached by running layer 2 for the probed rows only (over the
    layer's valid cached prefix), charged at their share of the rows."""
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=_probed(budget_pct=100))
    s.prepare(MSGS)
    nudge(pm, 2, "q_proj", scale=2.0)
    report = s.maintain()
    assert (report.r_kv, report.start, report.end) == (3, 2, 6) and sorted(report.probes["deviations"]) == [3, 4, 5]
    assert report.budget["spent"] == pytest.approx(4 + report.probes["layers"])
    assert torch.allclose(s.next_logits, fresh_logits(pm, tokenizer, MSGS).next_logits, atol=ATOL)
    quiet = KVSession(pm, tokenizer, "replay", reforge=_probed(budget_pct=100, tau=math.inf))
    quiet.prepare(MSGS)
    n = len(quiet.token_ids)
    keys, values = kvcache.layer_tensors(quiet.cache)[3]
    stale = (keys[:, :, n - 9:n - 1].clone(), values[:, :, n - 9:n - 1].clone())
    nudge(pm, 2, "q_proj", scale=2.0, seed=5)
    report = quiet.maintain()
    assert report.action == "reuse" and list(report.probes["deviations"]) == [3]
    expected = relative_deviation(_fresh_kv(pm, tokenizer, MSGS, 3, n - 9, n - 1), stale)
    assert expected > 0.01 and report.probes["deviations"][3] == pytest.approx(expected, rel=1e-4)
    # layer 2 ran for the 8 probed rows only to reach the probe at 3: charged with the probe's cost
    rows = len(quiet.token_ids) - 1
    share = 8 / rows
    assert report.probes["layers"] == pytest.approx(share + probe_cost(pm.config, 8, rows))
    assert report.budget["spent"] == pytest.approx(report.probes["layers"])
    assert report.recompute_pct == pytest.approx(100 * report.budget["spent"] / LAYERS)


def _projecting(budget_pct: float, restart_tau: float, tau: float = 0.0) -> ReforgeConfig:
    thresholds = [None, None, restart_tau] + [tau] * (LAYERS - 3)
    probe = ProbeCalibration(thresholds=thresholds, rows=8, restart_projection=True)
    return ReforgeConfig(policy="probed", profile=calibrated_profile(LAYERS, probe=probe), budget_pct=budget_pct)


def test_restart_projection_on_a_session_equals_the_fresh_kv_of_the_restart_layer(tokenizer):
    """A value update at layer 2: the projection rewrites layer 2's K/V as a fresh prefill's
    (every row), charges only its projection share, and leaves layers 3.. stale and reported."""
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=_projecting(budget_pct=100, restart_tau=math.inf))
    s.prepare(MSGS)
    n = len(s.token_ids)
    before = [t.clone() for t in kvcache.layer_tensors(s.cache)[3]]
    nudge(pm, 2, "v_proj", scale=2.0)
    report = s.maintain()
    assert (report.action, report.projected, list(report.probes["deviations"])) == ("reuse", 2, [2])
    keys, values = kvcache.layer_tensors(s.cache)[2]
    fresh = _fresh_kv(pm, tokenizer, MSGS, 2, 0, n - 1)
    torch.testing.assert_close(keys[:, :, :n - 1], fresh[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(values[:, :, :n - 1], fresh[1], rtol=0, atol=1e-5)
    assert torch.equal(kvcache.layer_tensors(s.cache)[3][1][:, :, :n - 1], before[1][:, :, :n - 1])  # not executed
    assert s.adapter_versions.stale_layers == [3, 4, 5] and s.exact_rows == 0
    assert report.recompute_pct == pytest.approx(100 * probe_cost(pm.config, n - 1, n - 1) / LAYERS)
    assert report.budget["spent"] == pytest.approx(probe_cost(pm.config, n - 1, n - 1))


def test_restart_projection_extends_to_a_fresh_prefill_when_every_layer_is_stale(tokenizer):
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=_projecting(budget_pct=100, restart_tau=0.0))
    s.prepare(MSGS)
    nudge(pm, 2, "v_proj", scale=2.0, seed=4)
    report = s.maintain()
    assert (report.start, report.end, report.projected) == (2, 6, None) and not s.adapter_versions.mixed
    assert sorted(report.probes["deviations"]) == [2, 3, 4, 5]
    assert torch.allclose(s.next_logits, fresh_logits(pm, tokenizer, MSGS).next_logits, atol=ATOL)


@pytest.mark.parametrize("projection", [False, True])
@pytest.mark.parametrize("order", ["edit_then_update", "update_then_edit"])
def test_probed_updates_and_edits_compose_exactly(tokenizer, order, projection):
    pm = lora_tiny()
    edited = [m for m in MSGS if m["id"] != "t2"]
    budget = 100 if order == "edit_then_update" else 20
    s = KVSession(pm, tokenizer, "replay", reforge=_probed(budget_pct=budget, projection=projection))
    s.prepare(MSGS)
    if order == "edit_then_update":
        s.prepare(edited)
        nudge(pm, 2, "v_proj")
        got = s.generate(1).first_logits  # maintained before decoding: the suffix is affordable
        assert s.reforge.last_report.action == "full_suffix"
    else:
        nudge(pm, 2, "v_proj", scale=2.0)
        s.prepare(edited)  # one layer refreshed, then the edit repair recomputes every row
        got = s.next_logits
    assert torch.allclose(got, fresh_logits(pm, tokenizer, edited).next_logits, atol=ATOL)
    s.check_invariants()


@pytest.mark.parametrize("projection", [False, True])
def test_strict_erase_and_import_after_a_probed_update(tokenizer, projection):
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=_probed(budget_pct=20, projection=projection))
    s.prepare(MSGS)
    nudge(pm, 2, "v_proj", scale=2.0)
    s.maintain()
    assert s.adapter_versions.mixed
    state = export_state(s, "tiny")
    state = CacheState.from_parts(state.tensors(), state.metadata())
    restored = KVSession(pm, tokenizer, "replay", reforge=_probed(budget_pct=20, projection=projection))
    import_state(restored, state)
    restored.prepare(MSGS)
    report = restored.reforge.last_report
    assert report.incomparable == [3, 4, 5] and (report.start, report.end) == (0, 6)  # exact, over the budget
    assert report.budget["balance"] < 0
    assert torch.allclose(restored.next_logits, fresh_logits(pm, tokenizer, MSGS).next_logits, atol=ATOL)
    report = s.delete_message("t2", erase="strict")
    edited = [m for m in MSGS if m["id"] != "t2"]
    assert report.erased["mode"] == "strict" and not s.adapter_versions.mixed
    assert torch.allclose(s.next_logits, fresh_logits(pm, tokenizer, edited).next_logits, atol=ATOL)


def test_probed_needs_a_probe_calibration(tokenizer):
    pm = lora_tiny()
    bare = calibrated_profile(LAYERS)
    with pytest.raises(ValueError, match="probe calibration"):
        KVSession(pm, tokenizer, reforge=ReforgeConfig(policy="probed", profile=bare))
    with pytest.raises(ValueError, match="calibration profile"):
        KVSession(pm, tokenizer, reforge=ReforgeConfig(policy="probed"))


# --------------------------------------------------------------- real model
@pytest.mark.real_model
def test_real_model_probed_budget_probe_edit_and_import(real_lora, tokenizer):
    """SmolLM2 + rank-8 LoRA on v_proj@15 (restart 15 of 30 layers): at 5 % one update deposits
    1.5 layers, so the probed policy refreshes layer 15 after probing it and keeps the rest stale
    (the probe at 15 equals the fresh-vs-stale deviation of a Re-prefill); at 60 % the probes
    find every layer stale (τ = 0) and the update is exact; an edit and an imported cache are
    exact against Re-prefill."""
    from kvmemory.online_adapter import OnlineAdapter

    model = real_lora
    msgs = history()[:4] + [QUERY]
    thresholds = [None] * 15 + [0.0] * 15
    cheap = ReforgeConfig(policy="probed", profile=_profile(30, thresholds, rows=16), budget_pct=5)
    s = KVSession(model, tokenizer, "replay", reforge=cheap)
    s.prepare(msgs)
    n = len(s.token_ids)
    keys, values = kvcache.layer_tensors(s.cache)[15]
    stale_rows = (keys[:, :, n - 17:n - 1].clone(), values[:, :, n - 17:n - 1].clone())
    rich = s.fork()
    rich.reforge.config = ReforgeConfig(policy="probed", profile=_profile(30, thresholds, rows=16), budget_pct=60)
    rich.reforge.account = None  # opened for the new budget on first use
    stale = s.fork()
    OnlineAdapter(model, tokenizer, {}, lr=5e-2).update(history()[:2], "Helmsford")
    ref = fresh_logits(model, tokenizer, msgs)
    report = s.maintain()
    assert (report.start, report.end) == (15, 16) and s.adapter_versions.stale_layers == list(range(16, 30))
    expected = relative_deviation(_fresh_kv(model, tokenizer, msgs, 15, n - 17, n - 1), stale_rows)
    assert report.probes["deviations"][15] == pytest.approx(expected, rel=1e-3) and expected > 0
    assert report.recompute_pct <= 5.0 + 1e-9 and report.budget["balance"] >= 0
    stale.maintain(policy="stale")
    assert 0 < first_token_kl(ref.next_logits, s.next_logits) < first_token_kl(ref.next_logits, stale.next_logits)
    assert rich.maintain().end == 30
    assert torch.allclose(rich.next_logits, ref.next_logits, atol=ATOL)
    state = CacheState.from_parts(*(lambda st: (st.tensors(), st.metadata()))(export_state(s, "smollm2")))
    restored = KVSession(model, tokenizer, "replay", reforge=cheap)
    import_state(restored, state)
    restored.prepare(msgs)
    assert restored.reforge.last_report.incomparable == list(range(16, 30))
    assert torch.allclose(restored.next_logits, ref.next_logits, atol=ATOL)
    edited = [m for m in msgs if m["id"] != "t2"]
    s.prepare(edited)
    assert torch.allclose(s.next_logits, fresh_logits(model, tokenizer, edited).next_logits, atol=ATOL)


@pytest.mark.real_model
def test_real_model_restart_projection_refreshes_layer_15_exactly(real_lora, tokenizer):
    """SmolLM2 + rank-8 LoRA on v_proj@15 at 5 %: the projection rewrites layer 15's K/V as a
    Re-prefill's (every row but the request row), costs 6.25 % of a layer, leaves 16–29 stale
    and lowers the KL to fresh below stale reuse; an edit afterwards is exact."""
    from kvmemory.online_adapter import OnlineAdapter

    model = real_lora
    msgs = history()[:4] + [QUERY]
    thresholds = [None] * 15 + [math.inf] + [0.0] * 14  # the gate never opens: projection only
    config = ReforgeConfig(policy="probed", profile=_profile(30, thresholds, rows=16, projection=True), budget_pct=5)
    s = KVSession(model, tokenizer, "replay", reforge=config)
    s.prepare(msgs)
    stale = s.fork()
    OnlineAdapter(model, tokenizer, {}, lr=5e-2).update(history()[:2], "Helmsford")
    ref = fresh_logits(model, tokenizer, msgs)
    report = s.maintain()
    n = len(s.token_ids)
    assert (report.action, report.projected) == ("reuse", 15)
    assert s.adapter_versions.stale_layers == list(range(16, 30))
    assert report.recompute_pct == pytest.approx(100 * probe_cost(model.config, n - 1, n - 1) / 30)
    keys, values = kvcache.layer_tensors(s.cache)[15]
    for got, want in zip((keys, values), _fresh_kv(model, tokenizer, msgs, 15, 0, n - 1)):
        torch.testing.assert_close(got[:, :, :n - 1], want, rtol=0, atol=max(1e-4, 1e-5 * float(want.abs().max())))
    stale.maintain(policy="stale")
    assert 0 < first_token_kl(ref.next_logits, s.next_logits) < first_token_kl(ref.next_logits, stale.next_logits)
    edited = [m for m in msgs if m["id"] != "t2"]
    s.prepare(edited)
    assert torch.allclose(s.next_logits, fresh_logits(model, tokenizer, edited).next_logits, atol=ATOL)
