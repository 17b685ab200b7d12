"""InfoFlow-motivated allocator (paper §4.1; Appendix 7.4, Table 1; Teng et al., 2026).

"L2 norm of the same query-to-suffix attention tensor over query tokens, heads, and all layers."
Motivated, not adapted: the original attention-mass formula, selected-layer scope and chunk
reordering are not reproduced. Top-B positions by the norm, earlier position first on ties.
"""

from __future__ import annotations

from .inputs import SelectionInput
from .signals import RepairSignals, top_b


def infoflow(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions with the largest L2 norm of query attention (Table 1, InfoFlow-Motivated)."""
    _, l2 = signals.query_attention()
    return top_b(l2.tolist(), inp.eligible, budget)
