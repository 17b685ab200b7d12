"""A3-adapted allocator (paper §4.1; Appendix 7.4, Table 1; Zhou et al., 2025).

"Fresh two-layer edited prefill followed by a shallow query forward; sum layer-1 query-to-context
attention over heads and query positions." Top-B positions by that attention, earlier first on ties.
"""

from __future__ import annotations

from .inputs import SelectionInput
from .signals import RepairSignals, top_b


def a3(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions with the most shallow query attention (Table 1, A3-Adapted)."""
    return top_b(signals.shallow_query_attention().tolist(), inp.eligible, budget)
