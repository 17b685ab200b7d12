"""Adaptive budget (budget="auto"): schedule, rounds in priority order, stop signals, the cap and
its Replay escalation, labels and bad input."""

import math

import pytest
import torch

from kvmemory import adaptive
from kvmemory.divergence import first_token_kl
from kvmemory.policy import RepairPolicy
from kvmemory.selection import allowance
from support import QUERY, history, prepared, without

EDIT = without(history(), "a2", "t2") + [QUERY]


def test_schedule_doubles_up_to_the_cap():
    assert adaptive.schedule(1000, 2.0, 32.0) == [20, 40, 80, 160, 320]
    assert adaptive.schedule(1000, 2.0, 50.0) == [20, 40, 80, 160, 320, 500]
    assert adaptive.schedule(10, 2.0, 50.0) == [1, 2, 4, 5]  # duplicates of tiny allowances dropped
    with pytest.raises(ValueError, match="start"):
        adaptive.schedule(10, 60.0, 50.0)


def test_labels_round_trip_and_bad_input():
    for label in ("sur@auto:query_kl:0.001", "sur@auto:kv_change:0.05", "sur+idf+tail16@auto:kv_change:0.01",
                  "sur+latest@5"):
        assert RepairPolicy.coerce(label).label == label
    assert RepairPolicy.coerce("sur@auto").tolerance == RepairPolicy().tolerance
    assert RepairPolicy.coerce("sur@auto:0.1").label == f"sur@auto:{RepairPolicy().signal}:0.1"
    assert RepairPolicy(budget="auto").effective_budget == RepairPolicy().max_budget
    for bad in ("sur@autox", "sur@auto:abc", "sur+nope@5"):
        with pytest.raises(ValueError):
            RepairPolicy.coerce(bad)
    with pytest.raises(ValueError, match="max_budget"):
        RepairPolicy(budget="auto", start=40.0, max_budget=20.0)
    with pytest.raises(ValueError):
        RepairPolicy(budget="auto", tolerance=-1.0)


@pytest.mark.parametrize("signal", ["query_kl", "kv_change"])
def test_zero_tolerance_runs_every_round_to_the_cap(tiny, tokenizer, signal):
    _, model = tiny
    base = prepared(model, tokenizer, history())
    s = base.fork()
    policy = RepairPolicy(budget="auto", tolerance=0.0, signal=signal, max_budget=40.0, on_cap="keep")
    report = s.prepare(EDIT, policy=policy)
    info = report.adaptive
    assert info["stopped_by"] == "cap" and not info["escalated"]
    allowances = [r["allowance"] for r in info["rounds"]]
    S = report.stale_tokens
    assert allowances == adaptive.schedule(S, 2.0, 40.0)
    # every round adds the rows the allocator adds; nothing is refreshed twice
    assert sum(r["new_rows"] for r in info["rounds"]) == info["rounds"][-1]["refreshed"] == report.refreshed_tokens
    assert report.refreshed_tokens >= allowance(S - 1, 40.0)
    assert report.budget == pytest.approx(100.0 * report.refreshed_tokens / S)
    query_rows = base.fork().prepare(EDIT, policy="shift").recomputed_tokens
    probes = info["probe_tokens"]
    assert probes == (len(info["rounds"]) * query_rows if signal == "query_kl" else 0)
    assert report.recomputed_tokens == report.refreshed_tokens + query_rows + probes
    s.check_invariants()


def test_large_tolerance_stops_after_the_first_round(tiny, tokenizer):
    _, model = tiny
    base = prepared(model, tokenizer, history())
    for signal in ("query_kl", "kv_change"):
        report = base.fork().prepare(EDIT, policy=RepairPolicy(budget="auto", tolerance=math.inf, signal=signal))
        assert report.adaptive["stopped_by"] == "signal" and len(report.adaptive["rounds"]) == 1
        assert report.fallback is None


def test_query_kl_values_are_the_change_between_rounds(tiny, tokenizer):
    """Round k's value is KL(p_k ‖ p_{k-1}) of the query's next-token distribution; round 0 is
    Shift, so the first value equals KL(p_1 ‖ p_shift) and the last p is the session's."""
    _, model = tiny
    base = prepared(model, tokenizer, history())
    seen = []
    policy = RepairPolicy(budget="auto", tolerance=0.0, signal="query_kl", max_budget=20.0, on_cap="keep")
    with adaptive.observe_rounds(lambda info, cache: seen.append(info)):
        s = base.fork()
        report = s.prepare(EDIT, policy=policy)
    assert [r["value"] for r in seen] == [r["value"] for r in report.adaptive["rounds"]]
    shift = base.fork()
    shift.prepare(EDIT, policy="shift")
    one_round = base.fork()
    one_round.prepare(EDIT, policy=policy.model_copy(update={"max_budget": 2.0}))
    assert report.adaptive["rounds"][0]["value"] == pytest.approx(first_token_kl(shift.next_logits, one_round.next_logits),
                                                                  rel=1e-4, abs=1e-9)


def test_unsettled_signal_escalates_to_replay(tiny, tokenizer):
    """Tolerance 0 never settles: with on_cap="replay" (default) the repair ends exactly as Replay,
    says so, and counts the rounds' work too."""
    _, model = tiny
    base = prepared(model, tokenizer, history())
    s = base.fork()
    report = s.prepare(EDIT, policy=RepairPolicy(budget="auto", tolerance=0.0, max_budget=20.0))
    replay = base.fork()
    replay_report = replay.prepare(EDIT, policy="replay")
    assert report.adaptive["escalated"] and report.fallback and "Replay" in report.fallback
    assert report.budget == 100.0 and s.exact_rows == len(s.token_ids)
    assert report.recomputed_tokens > replay_report.recomputed_tokens
    torch.testing.assert_close(s.next_logits, replay.next_logits, atol=1e-4, rtol=0)


@pytest.mark.real_model
def test_one_round_equals_the_fixed_budget_and_escalation_is_exact_real(real):
    """On the real model: an adaptive repair stopped after its first round computes the same cache
    as the paper's fixed budget at ``start`` (same rows, query after them), and an unsettled one
    escalates to a cache equal to Re-prefill's."""
    base = prepared(real.model, real.tokenizer, history())
    logits = {}
    for name, policy in {"reprefill": "reprefill", "shift": "shift", "sur@2": RepairPolicy(budget=2.0),
                         "one_round": RepairPolicy(budget="auto", tolerance=math.inf, signal="kv_change"),
                         "escalated": RepairPolicy(budget="auto", tolerance=0.0)}.items():
        s = base.fork()
        report = s.prepare(EDIT, policy=policy)
        logits[name] = s.next_logits
        if name == "one_round":
            assert report.refreshed_tokens == allowance(report.stale_tokens, 2.0)
    kl = {k: first_token_kl(logits["reprefill"], v) for k, v in logits.items()}
    assert kl["shift"] > 1e-4 and kl["sur@2"] > 1e-5  # the repairs are approximate here
    torch.testing.assert_close(logits["one_round"], logits["sur@2"], atol=1e-4, rtol=0)
    # Replay equals Re-prefill up to fp32 summation order (the suffix's rows in one engine call, the
    # whole prompt on the dense path: measured KL 7e-8, logits within the engine's 1e-3)
    assert kl["escalated"] < 1e-6
    torch.testing.assert_close(logits["escalated"], logits["reprefill"], atol=1e-3, rtol=0)
