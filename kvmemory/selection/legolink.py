"""LegoLink-adapted allocator (paper §4.1; Appendix 7.4, Table 1; Hu et al., 2025).

"Treat the valid prefix as the first chunk and split the suffix into 512-token chunks. Rank
positions by depth from their chunk boundary, then chunk index. Depths beyond the native 32-token
limit are extensions required by the common budget grid." Chunks are cut over the eligible
positions in order; no model forward is needed.
"""

from __future__ import annotations

from .inputs import SelectionInput

CHUNK = 512  # suffix chunk width in tokens (Table 1)


def legolink(inp: SelectionInput, budget: int, signals: object, seed: int) -> list[int]:
    """B positions nearest to the start of their 512-token suffix chunk (Table 1, LegoLink-Adapted)."""
    ranked = sorted(range(len(inp.eligible)), key=lambda k: (k % CHUNK, k // CHUNK))[:budget]
    return sorted(inp.eligible[k] for k in ranked)
