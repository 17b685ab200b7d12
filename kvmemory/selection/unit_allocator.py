"""Spending an allowance on ranked semantic units, with an exact-width partial window (paper §7.3, eq. 8, Algorithm 1)."""

from __future__ import annotations

import math
from typing import Callable, Sequence

from .units import Unit

TOP_K = 4  # a unit's score is the mean of its four best token scores
DECAY = math.exp(-1 / 16)  # per-token decay of the forward envelope (eq. 8)


def unit_score(token_scores: Sequence[float]) -> float:
    """Mean of the TOP_K largest token scores (all of them when fewer). Source: paper §7.3."""
    best = sorted(token_scores, reverse=True)[:TOP_K]
    return math.fsum(best) / len(best)


def forward_envelope(token_scores: Sequence[float]) -> list[float]:
    """u_t = max(exp(r_t − r_max), e^{−1/16}·u_{t−1}), u_0 = 0, r_max over the unit (paper eq. 8).

    A high score thus lends decaying weight to the tokens that follow it.
    """
    r_max = max(token_scores)
    envelope, u = [], 0.0
    for r in token_scores:
        u = max(math.exp(r - r_max), DECAY * u)
        envelope.append(u)
    return envelope


def best_envelope_window(token_scores: Sequence[float], width: int) -> int:
    """Offset of the width-``width`` window with the largest envelope sum; the earliest on ties.

    Args:
        token_scores: the unit's n token scores r_t, in position order.
        width: w, 1 <= w <= n (tokens).

    Source: paper §7.3 eq. (8) and "the earliest maximizer breaking ties".
    """
    u = forward_envelope(token_scores)
    # fsum is exactly rounded, so windows holding the same values compare equal.
    sums = [math.fsum(u[s : s + width]) for s in range(len(u) - width + 1)]
    return sums.index(max(sums))


def admit_units(units: Sequence[Unit], order: Sequence[int], budget: int, window_start: Callable[[int, int], int]) -> list[int]:
    """Admit whole units in ``order`` while they fit; the first that does not fit gets one window of the remaining width.

    Args:
        units: the semantic units.
        order: unit indices, best first.
        budget: B, the positions to fill (tokens).
        window_start: (unit index, remaining width w) -> offset of the w-token window inside it.

    Returns:
        Exactly min(B, total unit size) positions, sorted.

    Source: paper Algorithm 1 lines 6-8.
    """
    chosen: list[int] = []
    for j in order:
        w = budget - len(chosen)
        if w == 0:
            break
        u = units[j]
        if len(u) <= w:
            chosen.extend(u.positions)
        else:
            start = window_start(j, w)
            chosen.extend(u.positions[start : start + w])
            break
    return sorted(chosen)


def allocate_units(units: Sequence[Unit], token_scores: Sequence[float], budget: int, ties: str = "earliest") -> list[int]:
    """SUR's unit allocator: rank units by their top-4 mean score and fill exactly ``budget`` positions.

    Args:
        units: units partitioning the S eligible positions, in prompt order.
        token_scores: S scores aligned with the eligible positions (i.e. with the concatenated
            unit positions).
        budget: B in [0, S] (tokens).
        ties: ``earliest`` (the paper's rule: an earlier unit wins a score tie) or ``latest``
            (our option: the unit nearer the query wins).

    Returns:
        B sorted prompt positions: the best units whole, then the best forward-envelope window
        of width w = remaining allowance in the first unit that does not fit.

    Source: paper §3.2, §7.3 (ranking with earlier position breaking ties; eq. 8), Algorithm 1 lines 5-8.
    """
    bounds, lo = [], 0
    for u in units:
        bounds.append((lo, lo + len(u)))
        lo += len(u)
    scores = [unit_score(token_scores[a:b]) for a, b in bounds]
    sign = 1 if ties == "earliest" else -1
    order = sorted(range(len(units)), key=lambda j: (-scores[j], sign * units[j].positions[0]))
    return admit_units(units, order, budget, lambda j, w: best_envelope_window(token_scores[slice(*bounds[j])], w))
