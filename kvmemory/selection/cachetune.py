"""CacheTune-adapted allocator (paper §4.1; Appendix 7.4, Table 1; Li et al., 2026a).

"Invert compacted-position RoPE; low-pass each layer's suffix K/V in FP32, retaining the lowest
⌊0.5(⌊S/2⌋+1)⌋ rFFT bins. Score the reconstructed K/V by their mean unsquared L2 norm;
sum-normalize each layer's scores and average across layers." The suffix is the Shift cache's
stale rows in position order; keys are rotated back to position 0 before filtering.
"""

from __future__ import annotations

import torch

from .inputs import SelectionInput
from .signals import RepairSignals, top_b


def low_pass(x: torch.Tensor) -> torch.Tensor:
    """Keep the lowest ⌊0.5(⌊S/2⌋+1)⌋ rFFT bins of ``x`` ``[..., S, D]`` along S (fp32)."""
    S = x.shape[-2]
    spectrum = torch.fft.rfft(x.float(), dim=-2)
    keep = max(1, int(0.5 * (S // 2 + 1)))
    spectrum[..., keep:, :] = 0
    return torch.fft.irfft(spectrum, n=S, dim=-2)


def cachetune(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions with the largest low-frequency K/V magnitude (Table 1, CacheTune-Adapted).

    Raises:
        ValueError: the model's keys cannot be rotated (no RotaryShifter).
    """
    if signals.shifter is None:
        raise ValueError("cachetune inverts RoPE and needs a rotary model; use another allocator")
    rows = torch.as_tensor(list(inp.eligible))
    zeros = torch.zeros_like(rows)
    total = torch.zeros(len(rows))
    cache = signals.shift_cache()
    for i, layer in enumerate(cache.layers):
        coeffs = signals.shifter.coefficients(rows, zeros, signals.shifter.layer_type(i))
        keys = signals.shifter.apply(layer.keys[:, :, rows].float(), coeffs)[0]  # [heads, S, D]
        values = layer.values[0][:, rows].float()
        norms = torch.cat([low_pass(keys).norm(dim=-1), low_pass(values).norm(dim=-1)])  # [2·heads, S]
        score = norms.mean(dim=0)
        total += score / score.sum().clamp(min=torch.finfo(torch.float32).tiny)
    return top_b((total / len(cache.layers)).tolist(), inp.eligible, budget)
