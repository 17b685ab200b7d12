"""Executors that recompute cache rows interval by interval, each interval one engine call
(:func:`kvmemory.engine.forward_rows`: the attached engine, or the model's own forward).

The sequential-interval executor is the paper's reference (§7.1): each maximal interval
``[a, b)`` of positions to compute is forwarded, in order, against a copy of the current cache
prefix ``[0, a)``; the resulting K/V rows replace rows ``[a, b)`` at every layer and all other
rows are kept. Earlier refreshed intervals are therefore visible to later ones, future rows are
not. An interval that starts at the end of the cache is forwarded directly (no copy).

The direct sequential executor (Appendix 13.3, "direct seq.") runs the same recurrence without
prefix copies: each interval writes its fresh rows straight into the cache tensors and attends
to a view of rows ``[0, b)``. The one-shot sparse forward (Appendix 13.2, a control) forwards all
selected positions in one native call with a 4-D mask. The packed executor is in ``packed.py``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from .. import kvcache
from ..engine import ForwardResult, forward_rows
from ..errors import InputTypeError


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


def run_direct(
    model, cache: DynamicCache, token_ids: torch.Tensor, intervals: list[tuple[int, int]]
) -> ForwardResult:
    """Direct sequential executor (Appendix 13.3): the sequential-interval recurrence written in
    place, without prefix copies. Same arguments, result and errors as :func:`run_sequential`.

    The cache is first grown to N rows (zero placeholders, one copy) if shorter; each interval
    ``[a, b)`` then writes its fresh K/V into rows ``[a, b)`` of the cache tensors at every layer
    and attends to the view ``[0, b)``: earlier refreshed rows are visible, future rows are not.

    Raises:
        ValueError: intervals unsorted/overlapping, or leaving a gap after the cache end;
            cache layers that are not plain full-attention ``DynamicLayer`` s.
    """
    n = token_ids.shape[0]
    _check_intervals(intervals, kvcache.cache_length(cache), n)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise ValueError("the direct executor needs full-attention DynamicLayer cache layers; use run_sequential")
    grow_to(cache, n)
    logits, forwarded = None, 0
    for a, b in intervals:
        view = Cache(layers=[_IntervalWriteLayer(layer.keys, layer.values, a) for layer in cache.layers])
        logits = forward_rows(model, view, token_ids[a:b], a)
        forwarded += b - a
    ends_at_prompt_end = bool(intervals) and intervals[-1][1] == n
    return ForwardResult(next_logits=logits if ends_at_prompt_end else None, forwarded_tokens=forwarded)


class _IntervalWriteLayer(DynamicLayer):
    """One layer of a full-length cache seen by the forward of interval ``[start, start+n)``: it
    reports ``start`` cached rows, writes the n fresh rows in place and returns the view
    ``[0, start+n)`` (no copy)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, start: int):
        super().__init__()
        self.keys, self.values, self.start = keys, values, start
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.start + key_states.shape[-2]
        self.keys[:, :, self.start : end] = key_states
        self.values[:, :, self.start : end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.start


def run_oneshot(model, cache: DynamicCache, token_ids: torch.Tensor, positions: torch.Tensor) -> ForwardResult:
    """One-shot sparse forward (Appendix 13.2, a control): every selected position in a single
    native forward, in place on ``cache``.

    The B selected tokens are forwarded at their positions against all N cached rows with a 4-D
    additive mask ``[1, 1, B, N+B]``: query r sees cached row j iff ``j <= u_r`` and j is not
    selected, and the fresh row s iff ``u_s <= u_r``. The B fresh rows the forward appends are
    then scattered into rows U and the cache is cropped back to N rows. The model's attention
    implementation must honour 4-D masks (``sdpa`` / ``eager``, the CPU defaults).

    Args:
        cache: rows for positions ``[0, M)``; every position ``>= M`` must be selected.
        token_ids: LongTensor ``[N]``, the full prompt.
        positions: LongTensor ``[B]``, strictly increasing positions in ``[0, N)``.

    Returns:
        ForwardResult with fp32 logits ``[vocab]`` when the last selected position is N-1.

    Raises:
        ValueError: positions unsorted, out of range, or missing a row after the cache end.
    """
    n = token_ids.shape[0]
    positions = check_positions(positions, kvcache.cache_length(cache), n)
    grow_to(cache, n)
    b = positions.shape[0]
    device = cache.layers[0].keys.device
    pos = positions.to(device)
    dtype = cache.layers[0].keys.dtype
    selected = torch.zeros(n, dtype=torch.bool, device=device)
    selected[pos] = True
    old = (torch.arange(n, device=device)[None] <= pos[:, None]) & ~selected[None]
    fresh = pos[None, :] <= pos[:, None]
    allowed = torch.cat([old, fresh], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    with torch.no_grad():
        out = model(input_ids=token_ids.to(device)[pos][None], position_ids=pos[None], attention_mask=mask[None, None],
                    cache=cache, use_cache=True, logits_to_keep=1)
    for layer in cache.layers:
        layer.keys[:, :, pos] = layer.keys[:, :, n:]
        layer.values[:, :, pos] = layer.values[:, :, n:]
    kvcache.crop_to(cache, n)
    logits = out.logits[0, -1].float() if int(positions[-1]) == n - 1 else None
    return ForwardResult(next_logits=logits, forwarded_tokens=b)


def grow_to(cache: DynamicCache, length: int) -> None:
    """Append zero placeholder rows so that the cache holds ``length`` rows (no-op if it does)."""
    missing = length - kvcache.cache_length(cache)
    if missing <= 0:
        return
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        layer.update(k.new_zeros(*k.shape[:2], missing, k.shape[3]), v.new_zeros(*v.shape[:2], missing, v.shape[3]))


def check_positions(positions, cache_len: int, n: int) -> torch.Tensor:
    """Validate positions to compute: LongTensor ``[B]`` (or a list), strictly increasing, inside
    ``[0, n)``, and covering every position ``>= cache_len``. Returns them as a CPU LongTensor.

    Raises:
        ValueError: naming the problem. InputTypeError (TypeError): a float or bool tensor.
    """
    if isinstance(positions, torch.Tensor) and (positions.dtype.is_floating_point or positions.dtype == torch.bool):
        raise InputTypeError(f"positions must be integer token positions (got a {positions.dtype} tensor)")
    pos = torch.as_tensor(positions, dtype=torch.long).flatten().cpu()
    if pos.numel() == 0:
        raise ValueError("no positions to compute")
    if int(pos[0]) < 0 or int(pos[-1]) >= n or (pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all())):
        raise ValueError(f"positions must be strictly increasing and inside [0, {n}) (sort and deduplicate them)")
    tail = n - cache_len
    if tail > 0 and (pos.numel() < tail or not torch.equal(pos[-tail:], torch.arange(cache_len, n))):
        raise ValueError(f"positions [{cache_len}, {n}) have no cache rows and must all be computed")
    return pos


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
