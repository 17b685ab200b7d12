"""ProphetKV-adapted allocator (paper §4.1; Appendix 7.4, Table 1; Wang et al., 2026).

"Query-only forward against the Shift cache; suffix score is attention averaged uniformly over
query tokens, heads, and layers." The top-B stale positions by that score are refreshed
(earlier position first on ties). Selection cost: one eager query forward over the Shift cache.
"""

from __future__ import annotations

from .inputs import SelectionInput
from .signals import RepairSignals, top_b


def prophetkv(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions with the highest mean query attention (Table 1, ProphetKV-Adapted)."""
    mean, _ = signals.query_attention()
    return top_b(mean.tolist(), inp.eligible, budget)
