"""SpecCache-adapted allocator (paper §4.1; Appendix 7.4, Table 1; Wen et al., 2026).

Table 1: "A fixed Llama-3.2-1B-Instruct auxiliary model scores tokens by mean hidden-state L2 norm
over its last third of layers. Apply smooth-span segmentation (threshold 0.4, maximum 16 tokens)
and completion at 0.7 coverage; map source-text intervals to target tokens and deterministically
truncate/fill to the exact budget."

Here the auxiliary model is the embedded model itself (no second model is shipped), so source
and target tokens coincide and the interval mapping is the identity. Our reading of the span
rules, stated because the paper gives only the parameters:

1. min-max normalise the scores over the suffix, smooth them with a centred 3-token mean;
2. spans are maximal runs with smoothed score >= 0.4, cut into pieces of at most 16 tokens;
3. spans are admitted by mean normalised score (earliest first on ties) while the selection
   covers less than 0.7·B; a span that does not fit is truncated to its first tokens;
4. completion fills the rest of B with the highest-scoring unselected tokens (earliest on ties).
"""

from __future__ import annotations

import torch

from .inputs import SelectionInput
from .signals import RepairSignals

THRESHOLD = 0.4
MAX_SPAN = 16
COVERAGE = 0.7


def smooth_spans(z: list[float]) -> list[range]:
    """Index ranges where the 3-token mean of ``z`` is >= THRESHOLD, cut to <= MAX_SPAN tokens."""
    n = len(z)
    smoothed = [sum(z[max(0, k - 1) : k + 2]) / len(z[max(0, k - 1) : k + 2]) for k in range(n)]
    spans, k = [], 0
    while k < n:
        if smoothed[k] < THRESHOLD:
            k += 1
            continue
        end = k
        while end < n and smoothed[end] >= THRESHOLD:
            end += 1
        spans += [range(a, min(a + MAX_SPAN, end)) for a in range(k, end, MAX_SPAN)]
        k = end
    return spans


def span_support(scores: list[float], budget: int) -> list[int]:
    """Exactly ``budget`` indices into ``scores`` chosen by the span rules above (sorted)."""
    lo, hi = min(scores), max(scores)
    z = [(s - lo) / (hi - lo) if hi > lo else 0.0 for s in scores]
    spans = sorted(smooth_spans(z), key=lambda r: (-sum(z[k] for k in r) / len(r), r.start))
    chosen: set[int] = set()
    for span in spans:
        if len(chosen) >= COVERAGE * budget:
            break
        chosen.update(list(span)[: budget - len(chosen)])
    rest = sorted((k for k in range(len(z)) if k not in chosen), key=lambda k: (-z[k], k))
    chosen.update(rest[: budget - len(chosen)])
    return sorted(chosen)


def speccache(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions from hidden-state-norm spans of the auxiliary (= embedded) model (Table 1)."""
    scores: torch.Tensor = signals.hidden_norms()
    return [inp.eligible[k] for k in span_support(scores.tolist(), budget)]
