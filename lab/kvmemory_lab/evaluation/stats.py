"""Source-paired bootstrap confidence intervals for method differences (paper §4.3, Appendix 8.3)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

REPLICATES = 10_000
SEED = 20260928  # the paper's bootstrap seed (Appendix 8.3)


def paired_bootstrap(
    diff: Sequence[float],
    groups: Sequence[str],
    strata: Sequence[str] | None = None,
    *,
    replicates: int = REPLICATES,
    seed: int = SEED,
    level: float = 95.0,
) -> tuple[float, float, float]:
    """Mean paired difference with a source-paired, stratified bootstrap interval.

    Each replicate draws, within every stratum (dataset), as many source groups as the stratum
    has, with replacement, keeping all cases of a drawn group (its placements) together; the
    statistic is the pooled mean of the drawn cases' differences. The interval takes the
    linearly interpolated (100-level)/2 and 100-(100-level)/2 percentiles.

    Args:
        diff: per-case differences (method − reference), e.g. EM difference in percentage points
            (100·(em_a − em_b)) or agreement difference.
        groups: per-case pairing unit (source question id).
        strata: per-case stratum (dataset); None = one stratum.
        replicates: bootstrap replicates (paper: 10,000).
        seed: numpy Generator seed (paper: 20260928).
        level: interval coverage in % (95).

    Returns:
        (estimate, low, high) in the units of ``diff``.

    Raises:
        ValueError: empty input or lengths that differ.

    Source: paper Appendix 8.3 (dataset-stratified, source-paired bootstrap, 10,000 replicates).
    """
    d = np.asarray(diff, dtype=np.float64)
    if d.size == 0 or len(groups) != d.size or (strata is not None and len(strata) != d.size):
        raise ValueError(f"diff, groups and strata must be non-empty and of equal length ({d.size}, {len(groups)})")
    strata = list(strata) if strata is not None else [""] * d.size
    rng = np.random.default_rng(seed)
    total = np.zeros(replicates)
    count = np.zeros(replicates)
    for stratum in dict.fromkeys(strata):
        keys = list(dict.fromkeys(g for g, s in zip(groups, strata) if s == stratum))
        index = {g: k for k, g in enumerate(keys)}
        sums, sizes = np.zeros(len(keys)), np.zeros(len(keys))
        for value, g, s in zip(d, groups, strata):
            if s == stratum:
                sums[index[g]] += value
                sizes[index[g]] += 1
        draws = rng.integers(0, len(keys), size=(replicates, len(keys)))
        total += sums[draws].sum(axis=1)
        count += sizes[draws].sum(axis=1)
    stats = total / count
    tail = (100.0 - level) / 2
    low, high = np.percentile(stats, [tail, 100.0 - tail])
    return float(d.mean()), float(low), float(high)
