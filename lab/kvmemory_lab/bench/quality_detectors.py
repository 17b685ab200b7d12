"""Divergence detectors of ``kvmemory bench quality``: how well the signals a repair can measure
without Re-prefill pick out the repairs whose greedy answer differs from Re-prefill's.

An adaptive budget or an escalation can only beat fixed-budget SUR at equal cost if some cheap
signal separates those repairs from the rest; this table says which signal does, by ROC AUC
(0.5: chance, 1: perfect), for the repairs a user would otherwise keep (Shift and SUR at fixed
budgets).
"""

from __future__ import annotations

import numpy as np

from .common import table_cell

# repairs whose divergence the detectors try to predict, when the run has them
TARGETS = ("shift", "sur@5")
# pre-edit first-token KL thresholds (nats) of the offline escalation table
ESCALATION_THRESHOLDS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05)


def _by_method(record: dict) -> dict[str, dict]:
    return {m["method"]: m for m in record["methods"]}


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


def _detectors(records: list[dict], by: list[dict[str, dict]], target: str) -> dict[str, tuple[list[float], str, bool]]:
    """Detector name -> (per-case scores, higher = more likely divergent; what it costs; yes/no).
    ``by``: each record's methods by label (:func:`_by_method`), indexed once by the caller."""
    rows = [methods[target] for methods in by]
    found: dict[str, tuple[list[float], str, bool]] = {}
    for signal, values in _round_values(records).items():
        if len(values) == len(records):
            found[f"{signal}, round 1"] = ([v[0] for v in values], "the first round", False)
            found[f"{signal}, max over rounds"] = ([max(v) for v in values], "every round to the cap", False)
    for label in [m["method"] for m in records[0]["methods"] if m["method"].startswith(f"{target}:margin=")]:
        fired = [methods.get(label) for methods in by]
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
    by = [_by_method(r) for r in records]
    for target in TARGETS:
        if not records or not all(target in methods for methods in by):
            continue
        diverged = [not methods[target]["agree"] for methods in by]
        for name, (scores, cost, binary) in _detectors(records, by, target).items():
            row = {"target": target, "detector": name, "cost": cost, "diverged": sum(diverged),
                   "agreed": len(diverged) - sum(diverged), "auc": roc_auc(scores, diverged)}
            if binary:
                flagged = [s == 1.0 for s in scores]
                row["tpr"] = sum(f and d for f, d in zip(flagged, diverged)) / max(1, sum(diverged))
                row["fpr"] = sum(f and not d for f, d in zip(flagged, diverged)) / max(1, len(diverged) - sum(diverged))
            out.append(row)
    return out


def fixed_frontier(records: list[dict]) -> tuple[list[float], list[float]]:
    """Fixed SUR's frontier: the upper concave hull of (mean recomputed tokens, agreement) over
    Shift, every ``sur@<b>`` of the run and Replay, sorted by tokens; read it linearly between
    its points (a per-case mix of two budgets reaches every point of the hull)."""
    by = [_by_method(r) for r in records]
    points = []
    for label in by[0]:
        if label in ("shift", "replay") or (label.startswith("sur@") and label[4:].replace(".", "").isdigit()):
            rows = [methods[label] for methods in by]
            points.append((float(np.mean([m["recomputed_tokens"] for m in rows])), float(np.mean([m["agree"] for m in rows]))))
    hull: list[tuple[float, float]] = []
    for p in sorted(points):
        # drop the last hull point while it lies on or under the chord to p (concave from above)
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])) >= 0:
            hull.pop()
        hull.append(p)
    return [p[0] for p in hull], [p[1] for p in hull]


def escalation_table(records: list[dict]) -> list[dict]:
    """Offline escalation on the pre-edit first-token KL: keep the target repair when
    KL(p_pre-edit ‖ p_repair) <= τ, else Replay (the answer agrees, Replay's tokens are added).
    Cost per repair: the target's recomputed tokens + the probe (the query once more, on a
    pre-edit copy: Shift's recomputed tokens) + Replay's when escalated. ``frontier``: fixed SUR
    at the same mean tokens (:func:`fixed_frontier`); None beyond the frontier's last point."""
    by = [_by_method(r) for r in records]
    if not records or not all("shift" in methods and "replay" in methods for methods in by):
        return []
    xs, ys = fixed_frontier(records)
    probe = [methods["shift"]["recomputed_tokens"] for methods in by]
    replays = [methods["replay"]["recomputed_tokens"] for methods in by]
    replay = float(np.mean(replays))
    out = []
    for target in TARGETS:
        rows = [methods.get(target) for methods in by]
        if not all(m is not None and m.get("kl_pre_edit") is not None for m in rows):
            continue
        for tau in ESCALATION_THRESHOLDS:
            escalate = [m["kl_pre_edit"] > tau for m in rows]
            agree = np.mean([1.0 if e else float(m["agree"]) for e, m in zip(escalate, rows)])
            tokens = np.mean([m["recomputed_tokens"] + p + (r if e else 0)
                              for e, m, p, r in zip(escalate, rows, probe, replays)])
            out.append({"target": target, "tau": tau, "escalated": float(np.mean(escalate)), "agreement": float(agree),
                        "recomputed_tokens": float(tokens), "replay_tokens": replay,
                        "frontier": float(np.interp(tokens, xs, ys)) if tokens <= xs[-1] else None})
    return out


def detector_section(rows: list[dict]) -> list[str]:
    """Markdown lines of the detector table (nothing when the run has no detectors)."""
    if not rows:
        return []
    lines = ["", "## Divergence detectors", "",
             "How well each signal a repair can measure without Re-prefill picks out the repairs whose greedy "
             "answer differs from Re-prefill's: ROC AUC (0.5 chance, 1 perfect); TPR/FPR for a yes/no detector. "
             "An adaptive budget beats fixed SUR at equal cost only through a detector well above 0.5.", "",
             "| repair | detector | costs | diverged / agreed | AUC | TPR | FPR |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['detector']} | {r['cost']} | {r['diverged']} / {r['agreed']} | "
                     f"{table_cell(r['auc'])} | {table_cell(r.get('tpr'))} | {table_cell(r.get('fpr'))} |")
    return lines


def escalation_section(rows: list[dict]) -> list[str]:
    """Markdown lines of the offline escalation table (nothing without pre-edit KL)."""
    if not rows:
        return []
    lines = ["", "## Escalation on the pre-edit first-token KL (offline)", "",
             "Keep the repair when KL(p_pre-edit ‖ p_repair) ≤ τ, else Replay; computed from this run's records "
             "(the probe is the query once more on a pre-edit copy). Fixed SUR's frontier: Shift, SUR at this run's "
             "budgets and Replay (their upper concave hull: per-case mixes of two budgets), at the same mean recomputed tokens.", "",
             "| repair | τ nats | escalated | agreement | recomputed (% of Replay) | fixed SUR's frontier there |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['tau']:g} | {r['escalated']:.2f} | {r['agreement']:.2f} | "
                     f"{r['recomputed_tokens']:.0f} ({100 * r['recomputed_tokens'] / r['replay_tokens']:.0f}) | "
                     f"{table_cell(r['frontier'])} |")
    return lines
