"""Divergence detectors of ``kvmemory bench quality``: how well the signals a repair can measure
without Re-prefill pick out the repairs whose greedy answer differs from Re-prefill's.

An adaptive budget or an escalation can only beat fixed-budget SUR at equal cost if some cheap
signal separates those repairs from the rest; this table says which signal does, by ROC AUC
(0.5: chance, 1: perfect), for the repairs a user would otherwise keep (Shift and SUR at fixed
budgets).
"""

from __future__ import annotations

import numpy as np

# repairs whose divergence the detectors try to predict, when the run has them
TARGETS = ("shift", "sur@5")


def roc_auc(scores: list[float], positive: list[bool]) -> float | None:
    """P(score of a random positive > score of a random negative), ties counted half
    (Mann–Whitney). None when either class is empty."""
    s = np.asarray(scores, dtype=float)
    y = np.asarray(positive, dtype=bool)
    pos, neg = s[y], s[~y]
    if not len(pos) or not len(neg):
        return None
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


def _round_values(records: list[dict]) -> dict[str, list[list[float]]]:
    """Per adaptive signal, each case's round values from the run that went furthest (rounds are
    the same sequence whatever the tolerance; a larger tolerance only stops earlier)."""
    out: dict[str, list[list[float]]] = {}
    for r in records:
        longest: dict[str, list[float]] = {}
        for m in r["methods"]:
            info = m.get("adaptive")
            if info and len(info["rounds"]) > len(longest.get(info["signal"], [])):
                longest[info["signal"]] = [x["value"] for x in info["rounds"]]
        for signal, values in longest.items():
            out.setdefault(signal, []).append(values)
    return out


def _detectors(records: list[dict], target: str) -> dict[str, tuple[list[float], str, bool]]:
    """Detector name -> (per-case scores, higher = more likely divergent; what it costs; yes/no)."""
    rows = [{m["method"]: m for m in r["methods"]}[target] for r in records]
    found: dict[str, tuple[list[float], str, bool]] = {}
    for signal, values in _round_values(records).items():
        if len(values) == len(records):
            found[f"{signal}, round 1"] = ([v[0] for v in values], "the first round", False)
            found[f"{signal}, max over rounds"] = ([max(v) for v in values], "every round to the cap", False)
    for label in [m["method"] for m in records[0]["methods"] if m["method"].startswith(f"{target}:margin=")]:
        fired = [next((m for m in r["methods"] if m["method"] == label), None) for r in records]
        if all(fired):  # identical to the target's answer up to its first pick below the margin
            found[f"a pick below margin {label.split('=')[1]}"] = (
                [float(bool(m.get("decode_replay"))) for m in fired], "watching the answer's picks", True)
    if all(m.get("kl_pre_edit") is not None for m in rows):
        found["pre-edit first-token KL"] = ([m["kl_pre_edit"] for m in rows],
                                            "the query on a pre-edit copy", False)
        found["pre-edit answer differs"] = ([float(not m["pre_edit_agree"]) for m in rows],
                                            "a second answer on a pre-edit copy", True)
    return found


def detector_table(records: list[dict]) -> list[dict]:
    """One row per target repair × detector: divergent / agreeing repairs, ROC AUC, and for the
    binary detector its true- and false-positive rates."""
    out = []
    for target in TARGETS:
        if not records or not all(any(m["method"] == target for m in r["methods"]) for r in records):
            continue
        diverged = [not {m["method"]: m for m in r["methods"]}[target]["agree"] for r in records]
        for name, (scores, cost, binary) in _detectors(records, target).items():
            row = {"target": target, "detector": name, "cost": cost, "diverged": sum(diverged),
                   "agreed": len(diverged) - sum(diverged), "auc": roc_auc(scores, diverged)}
            if binary:
                flagged = [s == 1.0 for s in scores]
                row["tpr"] = sum(f and d for f, d in zip(flagged, diverged)) / max(1, sum(diverged))
                row["fpr"] = sum(f and not d for f, d in zip(flagged, diverged)) / max(1, len(diverged) - sum(diverged))
            out.append(row)
    return out


def detector_section(rows: list[dict]) -> list[str]:
    """Markdown lines of the detector table (nothing when the run has no detectors)."""
    if not rows:
        return []
    fmt = lambda x, spec=".2f": "–" if x is None else format(x, spec)  # noqa: E731
    lines = ["", "## Divergence detectors", "",
             "How well each signal a repair can measure without Re-prefill picks out the repairs whose greedy "
             "answer differs from Re-prefill's: ROC AUC (0.5 chance, 1 perfect); TPR/FPR for a yes/no detector. "
             "An adaptive budget beats fixed SUR at equal cost only through a detector well above 0.5.", "",
             "| repair | detector | costs | diverged / agreed | AUC | TPR | FPR |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['detector']} | {r['cost']} | {r['diverged']} / {r['agreed']} | "
                     f"{fmt(r['auc'])} | {fmt(r.get('tpr'))} | {fmt(r.get('fpr'))} |")
    return lines
