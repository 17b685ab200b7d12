"""Controls against SUR: the prior-work-derived allocators and the clean-state oracle (paper §4.1;
Appendix 7.4, Table 1).

These are not SUR. Eight adapt another paper's selection method to the common repair operator
(the allowance B of eq. 3, the stale eligible positions, sparse refresh) so that it serves as a
baseline at every budget; the oracle is a privileged reference. The quoted rules are Table 1's.
All but LegoLink read model probes of the repair in progress through :class:`RepairSignals`;
each returns B sorted positions from ``inp.eligible``.

- :func:`prophetkv` (ProphetKV, Wang et al. 2026): mean query attention over the Shift cache;
- :func:`infoflow` (InfoFlow, Teng et al. 2026; motivated only): L2 norm of that query attention;
- :func:`cachecraft` (Cache-Craft, Agarwal et al. 2025): attention mass on the deleted keys;
- :func:`cacheblend` (CacheBlend, Yao et al. 2025): layer-1 K/V deviation of a shallow prefill;
- :func:`a3` (A3, Zhou et al. 2025): layer-1 query attention after a shallow prefill;
- :func:`legolink` (LegoLink, Hu et al. 2025): depth from the start of a 512-token chunk (no model);
- :func:`cachetune` (CacheTune, Li et al. 2026a): low-frequency K/V magnitude;
- :func:`speccache` (SpecCache, Wen et al. 2026): hidden-state-norm spans of an auxiliary model;
- :func:`oracle` (adapts nothing; PRIVILEGED, a localisation reference): all-layer K/V deviation
  from a clean Re-prefill.

Top-B rankings take the earlier position first on ties (:func:`top_b`).
"""

from __future__ import annotations

import torch

from .inputs import SelectionInput
from .signals import RepairSignals, decoder_layers, top_b

CACHECRAFT_CHUNK = 64  # tokens per replayed chunk of the dirty suffix (Table 1, Cache-Craft)
LEGOLINK_CHUNK = 512  # suffix chunk width in tokens (Table 1, LegoLink)
SPAN_THRESHOLD = 0.4  # SpecCache: smoothed normalised score that starts / continues a span
MAX_SPAN = 16  # SpecCache: tokens per span at most
SPAN_COVERAGE = 0.7  # SpecCache: spans are admitted while the selection covers less than 0.7·B


def _squared_deviation(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Σ over heads and head dims of (a − b)² at ``rows`` of two K (or V) tensors
    ``[1, heads, T, D]``, fp32 ``[len(rows)]``."""
    return (a[0][:, rows].float() - b[0][:, rows].float()).square().sum(dim=(0, 2))


def prophetkv(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions with the highest mean query attention (Table 1, ProphetKV-Adapted).

    "Query-only forward against the Shift cache; suffix score is attention averaged uniformly over
    query tokens, heads, and layers." Selection cost: one eager query forward over the Shift cache.
    """
    mean, _ = signals.query_attention()
    return top_b(mean.tolist(), inp.eligible, budget)


def infoflow(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions with the largest L2 norm of query attention (Table 1, InfoFlow-Motivated).

    "L2 norm of the same query-to-suffix attention tensor over query tokens, heads, and all layers."
    Motivated, not adapted: the original attention-mass formula, selected-layer scope and chunk
    reordering are not reproduced.
    """
    _, l2 = signals.query_attention()
    return top_b(l2.tolist(), inp.eligible, budget)


def cachecraft(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions most exposed to the deleted keys (Table 1, Cache-Craft-Adapted).

    "Replay the dirty suffix in 64-token chunks with deleted keys still visible. Score each retained
    token by its attention mass on deleted keys, averaged over heads and layers." Selection cost: a
    full eager replay of the dirty suffix.
    """
    return top_b(signals.deleted_key_attention(CACHECRAFT_CHUNK).tolist(), inp.eligible, budget)


def cacheblend(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions whose layer-1 K/V deviate most from Shift (Table 1, CacheBlend-Adapted).

    "Fresh two-layer edited prefill; score layer-1 KV deviation from Shift by ||ΔK_1,i||² + ||ΔV_1,i||².
    One selected support is reused across layers."
    """
    layer = min(1, len(decoder_layers(signals.model)) - 1)
    rows = torch.as_tensor(list(inp.eligible))
    fresh, shifted = signals.shallow_cache().layers[layer], signals.shift_cache().layers[layer]
    dk = _squared_deviation(fresh.keys, shifted.keys, rows)
    dv = _squared_deviation(fresh.values, shifted.values, rows)
    return top_b((dk + dv).tolist(), inp.eligible, budget)


def a3(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions with the most shallow query attention (Table 1, A3-Adapted).

    "Fresh two-layer edited prefill followed by a shallow query forward; sum layer-1
    query-to-context attention over heads and query positions."
    """
    return top_b(signals.shallow_query_attention().tolist(), inp.eligible, budget)


def legolink(inp: SelectionInput, budget: int, signals: object, seed: int) -> list[int]:
    """B positions nearest to the start of their 512-token suffix chunk (Table 1, LegoLink-Adapted).

    "Treat the valid prefix as the first chunk and split the suffix into 512-token chunks. Rank
    positions by depth from their chunk boundary, then chunk index. Depths beyond the native
    32-token limit are extensions required by the common budget grid." Chunks are cut over the
    eligible positions in order; no model forward is needed (``signals`` is unused).
    """
    ranked = sorted(range(len(inp.eligible)), key=lambda k: (k % LEGOLINK_CHUNK, k // LEGOLINK_CHUNK))[:budget]
    return sorted(inp.eligible[k] for k in ranked)


def low_pass(x: torch.Tensor) -> torch.Tensor:
    """Keep the lowest ⌊0.5(⌊S/2⌋+1)⌋ rFFT bins of ``x`` ``[..., S, D]`` along S (fp32)."""
    S = x.shape[-2]
    spectrum = torch.fft.rfft(x.float(), dim=-2)
    keep = max(1, int(0.5 * (S // 2 + 1)))
    spectrum[..., keep:, :] = 0
    return torch.fft.irfft(spectrum, n=S, dim=-2)


def cachetune(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions with the largest low-frequency K/V magnitude (Table 1, CacheTune-Adapted).

    "Invert compacted-position RoPE; low-pass each layer's suffix K/V in FP32, retaining the lowest
    ⌊0.5(⌊S/2⌋+1)⌋ rFFT bins. Score the reconstructed K/V by their mean unsquared L2 norm;
    sum-normalize each layer's scores and average across layers." The suffix is the Shift cache's
    stale rows in position order; keys are rotated back to position 0 before filtering.

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


def smooth_spans(z: list[float]) -> list[range]:
    """Index ranges where the 3-token mean of ``z`` is >= SPAN_THRESHOLD, cut to <= MAX_SPAN tokens."""
    n = len(z)
    smoothed = [sum(z[max(0, k - 1) : k + 2]) / len(z[max(0, k - 1) : k + 2]) for k in range(n)]
    spans, k = [], 0
    while k < n:
        if smoothed[k] < SPAN_THRESHOLD:
            k += 1
            continue
        end = k
        while end < n and smoothed[end] >= SPAN_THRESHOLD:
            end += 1
        spans += [range(a, min(a + MAX_SPAN, end)) for a in range(k, end, MAX_SPAN)]
        k = end
    return spans


def span_support(scores: list[float], budget: int) -> list[int]:
    """Exactly ``budget`` indices into ``scores`` chosen by SpecCache's span rules (sorted).

    Our reading of the rules, stated because the paper gives only the parameters:

    1. min-max normalise the scores over the suffix, smooth them with a centred 3-token mean;
    2. spans are maximal runs with smoothed score >= 0.4, cut into pieces of at most 16 tokens;
    3. spans are admitted by mean normalised score (earliest first on ties) while the selection
       covers less than 0.7·B; a span that does not fit is truncated to its first tokens;
    4. completion fills the rest of B with the highest-scoring unselected tokens (earliest on ties).
    """
    lo, hi = min(scores), max(scores)
    z = [(s - lo) / (hi - lo) if hi > lo else 0.0 for s in scores]
    spans = sorted(smooth_spans(z), key=lambda r: (-sum(z[k] for k in r) / len(r), r.start))
    chosen: set[int] = set()
    for span in spans:
        if len(chosen) >= SPAN_COVERAGE * budget:
            break
        chosen.update(list(span)[: budget - len(chosen)])
    rest = sorted((k for k in range(len(z)) if k not in chosen), key=lambda k: (-z[k], k))
    chosen.update(rest[: budget - len(chosen)])
    return sorted(chosen)


def speccache(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions from hidden-state-norm spans of the auxiliary (= embedded) model (Table 1, SpecCache-Adapted).

    Table 1: "A fixed Llama-3.2-1B-Instruct auxiliary model scores tokens by mean hidden-state L2
    norm over its last third of layers. Apply smooth-span segmentation (threshold 0.4, maximum 16
    tokens) and completion at 0.7 coverage; map source-text intervals to target tokens and
    deterministically truncate/fill to the exact budget." Here the auxiliary model is the embedded
    model itself (no second model is shipped), so source and target tokens coincide and the
    interval mapping is the identity; :func:`span_support` applies the span rules.
    """
    scores: torch.Tensor = signals.hidden_norms()
    return [inp.eligible[k] for k in span_support(scores.tolist(), budget)]


def oracle(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions whose Shift K/V deviate most (L2 over all layers) from a clean Re-prefill.

    PRIVILEGED, a localisation reference only: "The clean-state oracle ranks positions by all-layer
    KV L2 deviation between Shift and a fully recomputed edited cache. It then applies ordinary
    sparse refresh. It requires clean recomputation to obtain its signal and is neither an
    optimal-support oracle nor a task-accuracy upper bound."
    """
    rows = torch.as_tensor(list(inp.eligible))
    squares = torch.zeros(len(rows))
    for clean, shifted in zip(signals.clean_cache().layers, signals.shift_cache().layers):
        for a, b in ((clean.keys, shifted.keys), (clean.values, shifted.values)):
            squares += _squared_deviation(a, b, rows)
    return top_b(squares.sqrt().tolist(), inp.eligible, budget)
