"""Cache-Craft-adapted allocator (paper §4.1; Appendix 7.4, Table 1; Agarwal et al., 2025).

"Replay the dirty suffix in 64-token chunks with deleted keys still visible. Score each retained
token by its attention mass on deleted keys, averaged over heads and layers." The top-B retained
positions by that exposure are refreshed. Selection cost: a full eager replay of the dirty suffix.
"""

from __future__ import annotations

from .inputs import SelectionInput
from .signals import RepairSignals, top_b

CHUNK = 64  # tokens per replayed chunk (Table 1)


def cachecraft(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions most exposed to the deleted keys (Table 1, Cache-Craft-Adapted)."""
    return top_b(signals.deleted_key_attention(CHUNK).tolist(), inp.eligible, budget)
