"""The divergence-detector table of ``kvmemory bench quality``: ROC AUC and the yes/no rates on
records whose answer is known, so the table can tell a useful signal from chance."""

from __future__ import annotations

import pytest

from kvmemory_lab.bench.quality_detectors import (detector_section, detector_table, escalation_section,
                                                  escalation_table, fixed_frontier, roc_auc)


def test_roc_auc_counts_pairs_and_ties():
    assert roc_auc([0.9, 0.8, 0.1, 0.2], [True, True, False, False]) == 1.0
    assert roc_auc([0.1, 0.2, 0.9, 0.8], [True, True, False, False]) == 0.0
    assert roc_auc([0.5, 0.5], [True, False]) == 0.5
    assert roc_auc([0.3, 0.6, 0.4], [True, False, True]) == pytest.approx(0.0)  # both positives below the negative
    assert roc_auc([0.1, 0.2], [True, True]) is None  # no negative: undefined


def _record(agree: bool, kl_pre_edit: float, pre_edit_agree: bool, rounds: list[float], thin_pick: bool) -> dict:
    adaptive = {"signal": "kv_change", "rounds": [{"value": v} for v in rounds]}
    methods = [{"method": "reprefill", "agree": True, "kl_pre_edit": None, "pre_edit_agree": None},
               {"method": "shift", "agree": agree, "kl_pre_edit": kl_pre_edit, "pre_edit_agree": pre_edit_agree},
               {"method": "sur@auto:kv_change:0.1", "agree": agree, "adaptive": adaptive},
               {"method": "shift:margin=0.1", "agree": True, "decode_replay": {"at_token": 3} if thin_pick else None}]
    return {"methods": methods}


def test_detectors_separate_a_perfect_signal_from_a_useless_one():
    records = [_record(False, 0.5, False, [0.1, 0.2], True), _record(False, 0.4, True, [0.3], True),
               _record(True, 0.01, True, [0.2, 0.1], True), _record(True, 0.02, False, [0.3, 0.05], False)]
    rows = {r["detector"]: r for r in detector_table(records)}
    assert {r["target"] for r in rows.values()} == {"shift"}  # sur@5 is not in these records
    assert rows["pre-edit first-token KL"]["auc"] == 1.0
    assert rows["kv_change, round 1"]["auc"] == pytest.approx(0.375)  # (0 + 0 + 1 + 0.5) / 4 pairs
    assert rows["kv_change, max over rounds"]["auc"] == 0.5  # the same values on both sides: chance
    binary = rows["pre-edit answer differs"]
    assert (binary["diverged"], binary["agreed"], binary["tpr"], binary["fpr"]) == (2, 2, 0.5, 0.5)
    assert "tpr" not in rows["pre-edit first-token KL"]
    thin = rows["a pick below margin 0.1"]  # the margin run replayed on both divergent answers, one agreeing
    assert (thin["tpr"], thin["fpr"], thin["auc"]) == (1.0, 0.5, 0.75)
    table = "\n".join(detector_section(list(rows.values())))
    assert "| shift | pre-edit first-token KL | the query on a pre-edit copy | 2 / 2 | 1.00 | – | – |" in table


def test_no_detectors_no_section():
    records = [{"methods": [{"method": "reprefill", "agree": True}]}]
    assert detector_table(records) == [] and detector_section([]) == []


def _costed(shift_agree: bool, kl_pre_edit: float, sur_agree: bool) -> dict:
    return {"methods": [
        {"method": "reprefill", "agree": True, "recomputed_tokens": 300},
        {"method": "shift", "agree": shift_agree, "recomputed_tokens": 40, "kl_pre_edit": kl_pre_edit},
        {"method": "replay", "agree": True, "recomputed_tokens": 200},
        {"method": "sur@40", "agree": sur_agree, "recomputed_tokens": 100, "kl_pre_edit": kl_pre_edit}]}


def test_escalation_keeps_cheap_repairs_and_replays_the_sensitive_ones():
    records = [_costed(False, 0.08, False), _costed(False, 0.04, True), _costed(True, 0.015, True),
               _costed(True, 0.001, True)]
    assert fixed_frontier(records) == ([40.0, 100.0, 200.0], [0.5, 0.75, 1.0])
    worse = [dict(r, methods=r["methods"] + [{"method": "sur@60", "agree": False, "recomputed_tokens": 150}])
             for r in records]
    assert fixed_frontier(worse) == ([40.0, 100.0, 200.0], [0.5, 0.75, 1.0])  # a budget under the hull is not on it
    rows = {r["tau"]: r for r in escalation_table(records)}  # shift only: no sur@5 in these records
    # τ = 0.03: the two divergent repairs escalate; cost 40 + 40 probe + 200 on two of four
    assert rows[0.03]["escalated"] == 0.5 and rows[0.03]["agreement"] == 1.0
    assert rows[0.03]["recomputed_tokens"] == 180.0 and rows[0.03]["frontier"] == pytest.approx(0.95)
    assert rows[0.05]["agreement"] == 0.75 and rows[0.05]["recomputed_tokens"] == 130.0
    assert rows[0.01]["recomputed_tokens"] == 230.0 and rows[0.01]["frontier"] is None  # beyond Replay's tokens
    assert "| shift | 0.03 | 0.50 | 1.00 | 180 (90) | 0.95 |" in "\n".join(escalation_section(list(rows.values())))
