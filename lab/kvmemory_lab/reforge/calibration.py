"""Offline calibration (CacheReforge §Methodology "Offline calibration", eqs. 6-7, S2.1).

For every calibration condition i (a cache prefilled at adapter v_a, evaluated at v_t), the
candidate windows H_i = {min(h, N − r_i) : h ∈ {0,1,2,4,8,16}} ∪ {N − r_i} are scored against a
fresh prefill: first-token KL, top-1 agreement and the task-score drop of the greedy answer.
The first safe window h*_i labels layers ``[r_i, r_i + h*_i)``; δ_ℓ is the first distance past
the 5 % lower tail of the distances that labelled layer ℓ, and s_ℓ = 1/δ_ℓ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvmemory.engine import forward_rows
from kvmemory.reforge.profile import ConditionResult, ProfileKey, ReforgeProfile

from ..metrics import first_token_kl, token_f1
from .analysis import HybridRun, hybrid_executions, horizon_table

WINDOWS = (0, 1, 2, 4, 8, 16)
THRESHOLDS = {"kl": 0.05, "top1": 0.99, "score_drop": 0.01}
DELTA_FLOOR = 1e-12


def candidate_windows(restart: int, num_layers: int, windows=WINDOWS) -> list[int]:
    """H_i = {min(h, N − r)} ∪ {N − r}, sorted (layers executed from r)."""
    suffix = num_layers - restart
    return sorted({min(h, suffix) for h in windows} | {suffix})


def greedy_answer(model, cache, token_ids: list[int], max_tokens: int, stop_ids: set[int]) -> list[int]:
    """Greedy answer (token ids, at most ``max_tokens``) decoded on ``cache`` (rows for
    ``token_ids[:-1]``; the last prompt token is forwarded first). Appends to ``cache``."""
    pos = len(token_ids) - 1
    logits = forward_rows(model, cache, torch.tensor(token_ids[-1:]), pos)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(torch.argmax(logits))
        if token in stop_ids:
            break
        out.append(token)
        pos += 1
        logits = forward_rows(model, cache, torch.tensor([token]), pos)
    return out


@dataclass
class WindowScores:
    """Per candidate window h: KL to fresh, top-1 agreement (0/1) and task-score drop."""

    kl: dict[int, float]
    top1: dict[int, float]
    score_drop: dict[int, float]


def score_windows(session, run: HybridRun, windows: list[int], gold: str | None, answer_tokens: int,
                  tokenizer=None) -> WindowScores:
    """Score every window of ``run`` (one sample). ``answer_tokens`` = 0 or no ``gold`` skips the
    task score (its drop is then 0)."""
    fresh = run.fresh
    kl = {h: first_token_kl(fresh, run.window(h)) for h in windows}
    top1 = {h: float(int(torch.argmax(run.window(h))) == int(torch.argmax(fresh))) for h in windows}
    drop = {h: 0.0 for h in windows}
    if gold and answer_tokens > 0 and tokenizer is not None:
        stop = session.stop_token_ids()

        def score(boundary: int) -> float:
            ids = greedy_answer(session.model, run.hybrid_cache(boundary), session.token_ids, answer_tokens, stop)
            return token_f1(tokenizer.decode(ids, skip_special_tokens=True), gold)

        fresh_score = score(run.num_layers)
        for h in windows:
            b = min(run.start + h, run.num_layers)
            drop[h] = 0.0 if b >= run.num_layers else fresh_score - score(b)
    return WindowScores(kl, top1, drop)


def window_is_safe(samples: list[WindowScores], h: int, thresholds=THRESHOLDS) -> bool:
    """S2.1: aggregate KL ≤ 0.05, top-1 ≥ 0.99, score drop ≤ 0.01, and no sample violating any."""
    if not samples:
        return False
    kls = [s.kl[h] for s in samples]
    tops = [s.top1[h] for s in samples]
    drops = [s.score_drop[h] for s in samples]
    aggregate = (sum(kls) / len(kls) <= thresholds["kl"] and sum(tops) / len(tops) >= thresholds["top1"]
                 and sum(drops) / len(drops) <= thresholds["score_drop"])
    per_sample = all(k <= thresholds["kl"] and t >= thresholds["top1"] and d <= thresholds["score_drop"]
                     for k, t, d in zip(kls, tops, drops))
    return aggregate and per_sample


def first_safe_window(samples: list[WindowScores], windows: list[int], thresholds=THRESHOLDS) -> int | None:
    """h*_i = min{h ∈ H_i : safe} (first hit; larger windows need not stay safe); None if none is."""
    for h in windows:
        if window_is_safe(samples, h, thresholds):
            return h
    return None


def condition_result(samples: list[WindowScores], windows: list[int], restart: int, distance: float, gap: int,
                     num_layers: int, thresholds=THRESHOLDS) -> ConditionResult:
    """Aggregate one condition: window means, h*_i and labels y_{i,ℓ} (eq. 6; no safe window
    labels the complete suffix)."""
    h_star = first_safe_window(samples, windows, thresholds)
    covered = (num_layers - restart) if h_star is None else h_star
    labels = [int(restart <= layer < restart + covered) for layer in range(num_layers)]
    means = {
        str(h): {
            "kl": sum(s.kl[h] for s in samples) / len(samples),
            "top1": sum(s.top1[h] for s in samples) / len(samples),
            "score_drop": sum(s.score_drop[h] for s in samples) / len(samples),
        }
        for h in windows
    }
    return ConditionResult(restart=restart, distance=distance, gap=gap, windows=means, first_safe=h_star, labels=labels)


def lower_tail_statistic(values: list[float], quantile: float = 0.05) -> float:
    """d_(⌊q·n⌋+1): the first order statistic past the allowed lower tail, floored at 1e-12.

    Raises:
        ValueError: empty ``values``.
    """
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    return max(ordered[math.floor(quantile * len(ordered))], DELTA_FLOOR)


def build_profile(key: ProfileKey, num_layers: int, conditions: list[ConditionResult], *,
                  quantile: float = 0.05, thresholds=THRESHOLDS) -> ReforgeProfile:
    """Sensitivities s_ℓ = 1/δ_ℓ (eq. 7; 0 for never-labelled layers) and the drift-only
    threshold τ (the same statistic over the distances of conditions that needed recovery)."""
    delta: list[float | None] = []
    for layer in range(num_layers):
        positives = [c.distance for c in conditions if c.labels[layer]]
        delta.append(lower_tail_statistic(positives, quantile) if positives else None)
    sensitivity = [0.0 if d is None else 1.0 / d for d in delta]
    needing = [c.distance for c in conditions if c.first_safe != 0]
    tau = lower_tail_statistic(needing, quantile) if needing else None
    return ReforgeProfile(key=key, num_layers=num_layers, sensitivity=sensitivity, delta=delta, drift_threshold=tau,
                          thresholds=dict(thresholds), tail_quantile=quantile, conditions=conditions)


def calibrate(model, tokenizer, samples, versions, key: ProfileKey, *, gaps=(1, 4, 16), starts=(0,),
              answer_tokens: int = 8, progress=None, load_version=None, make_session=None) -> ReforgeProfile:
    """Run the calibration conditions (every start version a in ``starts`` × gap Δ in ``gaps``
    with a + Δ inside the trajectory) over ``samples`` and freeze the profile.

    Args:
        samples: QASample-like objects (``messages``, ``answer``).
        versions: adapter snapshots v_0..v_T (see ``workload.update_trajectory``).
        load_version: ``f(model, snapshot)`` that activates a version.
        make_session: ``f() -> KVSession`` on ``model`` (retaining the restart boundaries).
        progress: a tqdm bar advanced once per (condition, sample).

    Raises:
        ValueError: no condition fits the trajectory.
    """
    from kvmemory.reforge.versions import capture_adapter

    num_layers = model.config.get_text_config().num_hidden_layers
    pairs = [(a, a + g, g) for a in starts for g in gaps if a + g < len(versions)]
    if not pairs:
        raise ValueError(f"no (start, gap) pair fits a trajectory of {len(versions) - 1} updates")
    scores: dict[tuple[int, int, int], list[WindowScores]] = {p: [] for p in pairs}
    restarts: dict[tuple[int, int, int], int] = {}
    distances: dict[tuple[int, int, int], float] = {}
    for sample in samples:
        for a in sorted({p[0] for p in pairs}):
            load_version(model, versions[a])
            session = make_session()
            session.prepare(list(sample.messages))  # the stale cache: prefilled once at v_a
            before = capture_adapter(model, num_layers)
            for pair in (p for p in pairs if p[0] == a):
                load_version(model, versions[pair[1]])
                after = capture_adapter(model, num_layers)
                run = hybrid_executions(session, after, windows=WINDOWS)  # leaves the session untouched
                restarts[pair], distances[pair] = run.start, after.distance(before)
                windows = candidate_windows(run.start, num_layers)
                scores[pair].append(score_windows(session, run, windows, sample.answer, answer_tokens, tokenizer))
                if progress is not None:
                    progress.update(1)
    results = [
        condition_result(scores[p], candidate_windows(restarts[p], num_layers), restarts[p], distances[p], p[2], num_layers)
        for p in pairs
    ]
    load_version(model, versions[0])
    return build_profile(key, num_layers, results)


def horizons(profile: ReforgeProfile) -> dict[str, dict]:
    """The RQ2-style recomputation-horizon table of a profile's conditions (by gap)."""
    return horizon_table(profile.conditions, profile.num_layers)
