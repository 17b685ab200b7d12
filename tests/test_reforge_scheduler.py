"""The budgeted CacheReforge scheduler (policy ``scheduled``): the running budget, the range
choice, and its composition with history edits, strict erase and exported / imported caches
(tiny LoRA model and the embedded SmolLM2). Fidelity is checked against Re-prefill."""

from __future__ import annotations

import pytest
import torch

from kvmemory import kvcache
from kvmemory.divergence import first_token_kl
from kvmemory.reforge import ReforgeConfig, decide
from kvmemory.reforge.profile import ReforgeProfile
from kvmemory_lab.reforge.schedule_fit import fit_tail_weights
from kvmemory.reforge.scheduler import BudgetAccount, SchedulerCalibration, schedule
from kvmemory.session import KVSession
from kvmemory.persistence import CacheState, export_state, import_state
from support import QUERY, history
from test_reforge import LAYERS, MSGS, calibrated_profile, fresh_logits, lora_tiny, nudge

ATOL = 1e-4  # fp32: a maintained cache equals Re-prefill to rounding


def _profile(num_layers: int, weights, price: float = 0.0, carry: float = 16.0, rule: str = "lagrangian") -> ReforgeProfile:
    return calibrated_profile(num_layers, scheduler=SchedulerCalibration(weights=list(weights), price=price, carry=carry, rule=rule))


def _scheduled(budget_pct: float, price: float = 0.0, weights=(0, 0, 1, 1, 1, 1)) -> ReforgeConfig:
    """λ = 0 with the lagrangian rule: refresh as deep as the balance allows."""
    return ReforgeConfig(policy="scheduled", profile=_profile(LAYERS, weights, price), budget_pct=budget_pct)


# ------------------------------------------------------------------ the rule
@pytest.mark.parametrize("rule", ["ratio", "lagrangian"])
def test_budget_is_never_exceeded_and_savings_are_spent_deep(rule):
    """N = 10, 10 % per update = 1 layer deposited; the deep layer 9 carries most of the tail."""
    calib = SchedulerCalibration(weights=[0, 0, 0, 0, 0.1, 0.1, 0.1, 0.1, 0.1, 1.0], price=0.05, carry=8, rule=rule)
    account = BudgetAccount.open(10, 10, calib.carry)
    invalid = list(range(4, 10))
    ends = []
    for t in range(1, 9):
        account.deposit(f"v{t}")
        account.deposit(f"v{t}")  # a second maintenance call of the same version adds nothing
        plan = schedule([0.0] * 4 + [0.2 * t] * 6, invalid, 4, calib, account)
        layers = 0 if plan.end is None else plan.end - 4
        assert layers <= account.balance + 1e-9
        account.charge(layers)
        ends.append(plan.end)
        assert account.spent <= account.deposits + 1e-9 and plan.predicted_after <= plan.predicted_before
    assert ends[0] is None and account.deposits == 8  # a one-layer refresh is not worth λ: saved
    if rule == "ratio":  # saves until the whole suffix (the best reduction per layer) is affordable
        assert ends[:5] == [None] * 5 and ends[5] == 10
    else:  # spends on the best affordable range as soon as it pays, so layer 9 waits longer
        assert ends[:4] == [None] * 4 and ends[4] == 9


def test_scheduler_without_savings_or_weights_reuses_and_incomparable_layers_are_forced():
    calib = SchedulerCalibration(weights=[0, 0, 1, 1], price=0.0)
    empty = BudgetAccount.open(5, 4, 16)
    assert schedule([0, 0, 1.0, 1.0], [2, 3], 2, calib, empty).end is None  # balance 0 < 1 layer
    forced = schedule([0, 0, 1.0, float("inf")], [2, 3], 2, calib, empty)
    assert forced.end == 4 and forced.forced_end == 4  # never reused, whatever the budget
    with pytest.raises(ValueError, match="layer weights"):
        schedule([0, 1.0], [1], 1, calib, empty)
    with pytest.raises(ValueError, match="budget_pct"):
        BudgetAccount.open(0, 4, 16)
    with pytest.raises(ValueError, match="BudgetAccount"):
        decide("scheduled", [0, 0, 1.0, 1.0], [2, 3], 2, _profile(4, [0, 0, 1, 1]))
    with pytest.raises(ValueError, match="scheduler calibration"):
        decide("scheduled", [0, 0, 1.0, 1.0], [2, 3], 2, None, account=empty)


def test_tail_weights_recover_a_planted_linear_tail():
    g = torch.Generator().manual_seed(0)
    d = torch.rand(200, 5, generator=g, dtype=torch.float64)
    w = torch.tensor([0.0, 0.5, 2.0, 0.0, 1.0], dtype=torch.float64)
    kl = (d @ w) ** 2 / 4.0  # KL = T²/4 exactly
    got = torch.tensor(fit_tail_weights(d, kl), dtype=torch.float64)
    assert torch.allclose(got, w, atol=1e-3)


# ------------------------------------------------------------- on a session
def test_scheduled_session_spends_its_budget_and_reports_what_stays_stale(tokenizer):
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=_scheduled(budget_pct=20))  # 1.2 layers per update
    s.prepare(MSGS)
    nudge(pm, 2, "v_proj", scale=2.0)
    first = s.maintain()
    assert (first.policy, first.start, first.end) == ("scheduled", 2, 3)  # only one layer affordable
    assert first.budget["spent"] == 1 and first.budget["balance"] == pytest.approx(0.2)
    assert s.adapter_versions.mixed and s.adapter_versions.stale_layers == [3, 4, 5]
    assert s.exact_rows == 0  # rows of a mixed cache never count as exact for a later edit repair
    again = s.maintain()  # same version: no second deposit, nothing affordable
    assert again.action == "reuse" and again.budget["deposits"] == pytest.approx(1.2)
    rich = KVSession(pm, tokenizer, "replay", reforge=_scheduled(budget_pct=100))
    rich.prepare(MSGS)
    nudge(pm, 2, "v_proj", scale=1.0, seed=3)
    report = rich.maintain()
    assert (report.start, report.end) == (2, 6) and not rich.adapter_versions.mixed
    assert torch.allclose(rich.next_logits, fresh_logits(pm, tokenizer, MSGS).next_logits, atol=ATOL)
    forked = rich.fork()
    assert forked.reforge.account is not rich.reforge.account and forked.reforge.account == rich.reforge.account


@pytest.mark.parametrize("order", ["edit_then_update", "update_then_edit"])
def test_scheduled_updates_and_edits_compose_exactly(tokenizer, order):
    """Whatever the scheduler leaves stale, an edit repaired with Replay (budget 100) recomputes
    every row under the current adapter; with a budget that affords the suffix the update itself
    is exact."""
    pm = lora_tiny()
    edited = [m for m in MSGS if m["id"] != "t2"]
    s = KVSession(pm, tokenizer, "replay", reforge=_scheduled(budget_pct=100 if order == "edit_then_update" else 10))
    s.prepare(MSGS)
    if order == "edit_then_update":
        s.prepare(edited)
        nudge(pm, 2, "v_proj")
        got = s.generate(1).first_logits  # maintained before decoding: the suffix is affordable
        assert s.reforge.last_report.action == "full_suffix"
    else:
        nudge(pm, 2, "v_proj")
        s.prepare(edited)  # the scheduler reuses (balance 0.6 layer), then the edit repair recomputes all rows
        assert s.reforge.last_report.action == "reuse"
        got = s.next_logits
    assert torch.allclose(got, fresh_logits(pm, tokenizer, edited).next_logits, atol=ATOL)
    s.check_invariants()


def test_strict_erase_after_a_scheduled_update(tokenizer):
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=_scheduled(budget_pct=20))
    s.prepare(MSGS)
    nudge(pm, 2, "v_proj", scale=2.0)
    s.maintain()
    assert s.adapter_versions.mixed
    report = s.delete_message("t2", erase="strict")
    edited = [m for m in MSGS if m["id"] != "t2"]
    fresh = KVSession(pm, tokenizer, "reprefill", reforge=ReforgeConfig())
    fresh.prepare(edited)
    assert report.erased["mode"] == "strict" and not s.adapter_versions.mixed
    assert torch.allclose(s.next_logits, fresh.next_logits, atol=ATOL)
    for layer, boundary in s.reforge.boundaries.states.items():
        torch.testing.assert_close(boundary.hidden, fresh.reforge.boundaries.states[layer].hidden, rtol=0, atol=1e-5)


def test_exported_mixed_cache_is_imported_with_its_layer_versions_and_recomputed_exactly(tokenizer):
    pm = lora_tiny()
    s = KVSession(pm, tokenizer, "replay", reforge=_scheduled(budget_pct=20))
    s.prepare(MSGS)
    nudge(pm, 2, "v_proj", scale=2.0)
    s.maintain()
    versions = s.adapter_versions
    state = export_state(s, "tiny")
    state = CacheState.from_parts(state.tensors(), state.metadata())  # what a stored blob holds
    assert state.adapter_versions["layer_versions"] == versions.layer_versions  # per-layer versions kept
    restored = KVSession(pm, tokenizer, "replay", reforge=_scheduled(budget_pct=20))
    import_state(restored, state)
    assert restored.adapter_versions.stale_layers == [3, 4, 5]
    restored.prepare(MSGS)
    report = restored.reforge.last_report
    # restored anchors carry no θ and no boundary state: the stale layers are recomputed exactly
    # from the embedding, over the budget (charged: the balance goes negative and is paid back)
    assert report.incomparable == [3, 4, 5] and (report.start, report.end) == (0, 6)
    assert report.budget["spent"] == 6 and report.budget["balance"] < 0
    assert torch.allclose(restored.next_logits, fresh_logits(pm, tokenizer, MSGS).next_logits, atol=ATOL)
    for (k, v), (fk, fv) in zip(kvcache.layer_tensors(restored.cache),
                                kvcache.layer_tensors(fresh_logits(pm, tokenizer, MSGS).cache)):
        assert torch.allclose(k, fk, atol=ATOL) and torch.allclose(v, fv, atol=ATOL)


def test_scheduled_needs_a_scheduler_calibration(tokenizer):
    pm = lora_tiny()
    bare = calibrated_profile(LAYERS)
    with pytest.raises(ValueError, match="scheduler calibration"):
        KVSession(pm, tokenizer, reforge=ReforgeConfig(policy="scheduled", profile=bare))
    with pytest.raises(ValueError, match="calibration profile"):
        KVSession(pm, tokenizer, reforge=ReforgeConfig(policy="scheduled"))


# --------------------------------------------------------------- real model
@pytest.mark.real_model
def test_real_model_scheduled_budget_mixed_cache_edit_and_import(real_lora, tokenizer):
    """SmolLM2 + rank-8 LoRA on v_proj@15 (restart 15 of 30 layers): at 5 % one update deposits
    1.5 layers, so the scheduler refreshes at most layer 15 and says the rest is stale; an edit
    (Replay) and an exported / imported cache are then exact against Re-prefill; at 50 % the
    suffix [15, 30) is affordable and the update itself is exact."""
    from kvmemory.online_adapter import OnlineAdapter

    model = real_lora
    msgs = history()[:4] + [QUERY]
    weights = [0.0] * 15 + [1.0] * 15
    cheap = ReforgeConfig(policy="scheduled", profile=_profile(30, weights), budget_pct=5)
    s = KVSession(model, tokenizer, "replay", reforge=cheap)
    s.prepare(msgs)
    rich = s.fork()
    rich.reforge.config = ReforgeConfig(policy="scheduled", profile=_profile(30, weights), budget_pct=50)
    rich.reforge.account = None  # opened for the new budget on first use
    stale = s.fork()
    OnlineAdapter(model, tokenizer, {}, lr=5e-2).update(history()[:2], "Helmsford")
    ref = fresh_logits(model, tokenizer, msgs)
    report = s.maintain()
    assert (report.start, report.end) == (15, 16) and s.adapter_versions.stale_layers == list(range(16, 30))
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
