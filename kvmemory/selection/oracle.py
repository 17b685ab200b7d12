"""Clean-state oracle (paper §4.1; Appendix 7.4): PRIVILEGED, a localisation reference only.

"The clean-state oracle ranks positions by all-layer KV L2 deviation between Shift and a fully
recomputed edited cache. It then applies ordinary sparse refresh. It requires clean recomputation
to obtain its signal and is neither an optimal-support oracle nor a task-accuracy upper bound."
"""

from __future__ import annotations

import torch

from .inputs import SelectionInput
from .signals import RepairSignals, top_b


def oracle(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions whose Shift K/V deviate most (L2 over all layers) from a clean Re-prefill."""
    rows = torch.as_tensor(list(inp.eligible))
    squares = torch.zeros(len(rows))
    for clean, shifted in zip(signals.clean_cache().layers, signals.shift_cache().layers):
        for a, b in ((clean.keys, shifted.keys), (clean.values, shifted.values)):
            squares += (a[0][:, rows].float() - b[0][:, rows].float()).square().sum(dim=(0, 2))
    return top_b(squares.sqrt().tolist(), inp.eligible, budget)
