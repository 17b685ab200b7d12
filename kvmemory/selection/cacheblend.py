"""CacheBlend-adapted allocator (paper §4.1; Appendix 7.4, Table 1; Yao et al., 2025).

"Fresh two-layer edited prefill; score layer-1 KV deviation from Shift by ||ΔK_1,i||² + ||ΔV_1,i||².
One selected support is reused across layers." Top-B positions by the deviation, earlier first on ties.
"""

from __future__ import annotations

import torch

from .inputs import SelectionInput
from .signals import RepairSignals, decoder_layers, top_b


def cacheblend(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions whose layer-1 K/V deviate most from Shift (Table 1, CacheBlend-Adapted)."""
    layer = min(1, len(decoder_layers(signals.model)) - 1)
    rows = torch.as_tensor(list(inp.eligible))
    fresh, shifted = signals.shallow_cache().layers[layer], signals.shift_cache().layers[layer]
    dk = (fresh.keys[0][:, rows].float() - shifted.keys[0][:, rows].float()).square().sum(dim=(0, 2))
    dv = (fresh.values[0][:, rows].float() - shifted.values[0][:, rows].float()).square().sum(dim=(0, 2))
    return top_b((dk + dv).tolist(), inp.eligible, budget)
