"""Coalescing selected positions into execution intervals (paper §7.1, Algorithm 1 line 9)."""

from __future__ import annotations

from typing import Sequence


def to_intervals(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Merge sorted positions into maximal half-open intervals [start, end).

    Args:
        positions: strictly increasing prompt positions (tokens).

    Returns:
        Intervals in order, e.g. [3, 4, 8, 9, 10] -> [(3, 5), (8, 11)]; [] for no positions.

    Raises:
        ValueError: positions not strictly increasing.

    Source: paper §7.1 ("consecutive selected positions form execution intervals"), Algorithm 1 line 9.
    """
    intervals: list[list[int]] = []
    for p in positions:
        if intervals and p <= intervals[-1][1] - 1:
            raise ValueError(f"positions must be strictly increasing (sort and deduplicate them first), got {p} after {intervals[-1][1] - 1}")
        if intervals and p == intervals[-1][1]:
            intervals[-1][1] += 1
        else:
            intervals.append([p, p + 1])
    return [(a, b) for a, b in intervals]
