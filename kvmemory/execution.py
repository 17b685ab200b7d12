"""Executors that (re)compute cache rows through every layer.

The sequential-interval executor is the paper's reference (§7.1): each maximal interval
``[a, b)`` of positions to compute is forwarded, in order, against a copy of the current cache
prefix ``[0, a)``; the resulting K/V rows replace rows ``[a, b)`` at every layer and all other
rows are kept. Earlier refreshed intervals are therefore visible to later ones, future rows are
not. An interval that starts at the end of the cache is forwarded directly (no copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from . import kvcache


@dataclass
class ForwardResult:
    """Logits ``[vocab]`` (fp32) predicting the token after the last computed position, when the
    last interval ends at the end of the prompt; None otherwise."""

    next_logits: torch.Tensor | None
    forwarded_tokens: int


def forward_rows(model, cache: DynamicCache, token_ids: torch.Tensor, start: int) -> torch.Tensor:
    """Forward ``token_ids`` (LongTensor ``[n]``) at positions ``[start, start+n)`` against
    ``cache``, which must hold exactly ``start`` rows; appends n rows to it.

    Returns:
        fp32 logits ``[vocab]`` for the token after the last input position.
    """
    n = token_ids.shape[0]
    positions = torch.arange(start, start + n, device=token_ids.device)[None]
    with torch.no_grad():
        out = model(
            input_ids=token_ids[None],
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    return out.logits[0, -1].float()


def run_sequential(
    model, cache: DynamicCache, token_ids: torch.Tensor, intervals: list[tuple[int, int]]
) -> ForwardResult:
    """Sequential-interval executor (paper §7.1), in place on ``cache``.

    Args:
        cache: rows for positions ``[0, M)``; rows inside the intervals may be placeholders.
        token_ids: LongTensor ``[N]``, the full edited prompt (N >= M).
        intervals: sorted disjoint half-open ``[a, b)`` position intervals; every position
            ``>= M`` must be covered, so the cache ends with exactly N rows.

    Returns:
        ForwardResult with the next-token logits when the last interval ends at N.

    Raises:
        ValueError: intervals unsorted/overlapping, or leaving a gap after the cache end.
    """
    _check_intervals(intervals, kvcache.cache_length(cache), token_ids.shape[0])
    logits, forwarded = None, 0
    for a, b in intervals:
        length = kvcache.cache_length(cache)
        if a == length:  # appending: forward straight into the cache
            logits = forward_rows(model, cache, token_ids[a:b], a)
        else:
            scratch = kvcache.prefix_copy(cache, a)
            logits = forward_rows(model, scratch, token_ids[a:b], a)
            overlap = min(b, length) - a
            kvcache.write_rows(cache, a, scratch, a, overlap)
            if b > length:  # the interval runs past the cache end: append the rest
                for dst, (k, v) in zip(cache.layers, kvcache.layer_tensors(scratch)):
                    dst.update(k[:, :, length:b], v[:, :, length:b])
        forwarded += b - a
    ends_at_prompt_end = bool(intervals) and intervals[-1][1] == token_ids.shape[0]
    return ForwardResult(next_logits=logits if ends_at_prompt_end else None, forwarded_tokens=forwarded)


def _check_intervals(intervals, cache_len: int, n: int) -> None:
    prev = 0
    for a, b in intervals:
        if not (prev <= a < b <= n):
            raise ValueError(f"intervals must be sorted, disjoint and inside [0, {n}): got {intervals}")
        prev = b
    covered_to = cache_len
    for a, b in intervals:
        if b > covered_to:
            if a > covered_to:
                raise ValueError(f"positions [{covered_to}, {a}) have no cache rows and are not computed")
            covered_to = b
    if covered_to < n:
        raise ValueError(f"positions [{covered_to}, {n}) have no cache rows and are not computed")
