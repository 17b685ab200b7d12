"""Row-level operations on a transformers 5.x ``DynamicCache`` through its public layer tensors.

Every layer holds ``keys`` / ``values`` of shape ``[batch, kv_heads, seq, head_dim]``
(``cache.layers[i].keys``). kvmemory only ever uses batch 1 and full-attention layers.

Caches whose layers are not plain tensor layers (``QuantizedCache``: its rows live packed in a
backend-specific payload that ``keys`` does not show) are never spliced (see
``capabilities.cache_unsupported_reason``); only the whole-cache helpers here accept them:
:func:`cache_length`, :func:`clone_cache`, :func:`cache_nbytes`, :func:`overwrite_rows_from`
and a no-op :func:`crop_to`.
"""

from __future__ import annotations

import copy

from typing import Any, Iterator

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

PLAIN_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)  # every row a plain row of keys / values


def new_cache(config) -> DynamicCache:
    """An empty cache laid out for ``config`` (sliding layers become sliding cache layers)."""
    return DynamicCache(config=config)


def cache_length(cache: DynamicCache) -> int:
    """Number of cached rows (tokens)."""
    return cache.get_seq_length()


def layer_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(keys, values), ...]`` per layer, each ``[1, kv_heads, seq, head_dim]`` (no copy)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def from_tensors(tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """Build a cache holding exactly ``tensors`` (one copy, made by the cache's own update)."""
    return DynamicCache(ddp_cache_data=tensors)


def clone_cache(cache: DynamicCache) -> DynamicCache:
    """Deep copy: later writes to either cache never reach the other. A cache with layers other
    than plain full-attention ``DynamicLayer`` s (sliding windows, quantized) is copied whole, so
    that the copy keeps their kind and bookkeeping (rebuilding it from ``keys`` would lose rows)."""
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return copy.deepcopy(cache)
    return from_tensors([(k.clone(), v.clone()) for k, v in layer_tensors(cache)])


def prefix_copy(cache: DynamicCache, length: int) -> DynamicCache:
    """A new cache with copies of rows ``[0, length)`` (the sequential executor's prefix copy)."""
    return from_tensors([(k[:, :, :length], v[:, :, :length]) for k, v in layer_tensors(cache)])


def crop_to(cache: DynamicCache, length: int) -> None:
    """Drop rows ``[length, seq)`` in place (public ``crop`` takes a negative count).

    Raises:
        ValueError: rows would be dropped from a layer transformers marks not croppable (a
            quantized layer would crop only its residual buffer and keep the rows counted):
            recompute into a fresh cache instead.
    """
    extra = cache_length(cache) - length
    if extra <= 0:
        return
    stuck = sorted({type(layer).__name__ for layer in cache.layers if not getattr(layer, "is_croppable", True)})
    if stuck:
        raise ValueError(f"cannot drop {extra} rows from a cache with {', '.join(stuck)} layers (not croppable): "
                         "re-prefill into a fresh cache of the same kind instead")
    cache.crop(-extra)


def plain_layers(cache) -> bool:
    """True when every layer is a plain full-attention ``DynamicLayer``: what the engine writes,
    and a cache whose appended rows can always be dropped again with :func:`crop_to` (a
    sliding-window layer past its window has discarded the rows a crop would need, a quantized
    layer cannot crop its packed rows)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def gather_rows(cache: DynamicCache, rows: torch.Tensor) -> DynamicCache:
    """A new cache whose row j is a copy of old row ``rows[j]``; ``rows[j] < 0`` gives a zero
    placeholder row (to be written before anything reads it).

    Args:
        rows: LongTensor ``[n]`` of old row indices or -1.
    """
    placeholder = rows < 0
    index = rows.clamp(min=0)
    out = []
    for k, v in layer_tensors(cache):
        k2, v2 = k.index_select(2, index.to(k.device)), v.index_select(2, index.to(v.device))
        if placeholder.any():
            k2[:, :, placeholder] = 0
            v2[:, :, placeholder] = 0
        out.append((k2, v2))
    return from_tensors(out)


def write_rows(cache: DynamicCache, start: int, source: DynamicCache, source_start: int, length: int) -> None:
    """Copy rows ``[source_start, source_start+length)`` of ``source`` into rows
    ``[start, start+length)`` of ``cache`` at every layer, in place."""
    for dst, src in zip(cache.layers, source.layers):
        dst.keys[:, :, start : start + length] = src.keys[:, :, source_start : source_start + length]
        dst.values[:, :, start : start + length] = src.values[:, :, source_start : source_start + length]


def held_tensors(layer) -> list[torch.Tensor]:
    """The tensors a cache layer holds: ``keys`` / ``values`` for a plain layer; for any other
    layer (quantized: packed payload, scales, zero points, residual buffer) every tensor reachable
    from its attributes, tensor subclasses (e.g. quanto's) opened through the public
    ``__tensor_flatten__`` protocol, each storage once. Layers not written yet hold none."""
    if type(layer) in PLAIN_LAYERS:
        return [t for t in (layer.keys, layer.values) if t is not None]
    seen: set[int] = set()
    return [t for t in _tensors_in(vars(layer)) if not (id(t) in seen or seen.add(id(t)))]


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from _tensors_in(getattr(value, name))
        else:
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def cache_nbytes(cache: DynamicCache) -> int:
    """Bytes the cache's layers hold: the distinct storages behind :func:`held_tensors` (a view
    holds its whole storage, e.g. the engine's pre-allocated rows beyond the cached ones).

    Plain layers: their K/V storages. Quantized layers (``QuantizedCache``): the storage they
    really hold, counted from their tensors rather than from ``keys`` (which shows only the
    full-precision residual buffer, or nothing for fp8): the packed payload, its scales / zero
    points and the residual buffer. Layers not written yet (a new cache, or one a forward pass in
    another thread is filling right now) hold none.
    """
    seen, total = set(), 0
    for layer in cache.layers:
        for t in held_tensors(layer):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def overwrite_rows_from(cache: DynamicCache, start: int) -> int:
    """Zero the cache's rows ``[start, N)`` in place, in the storage itself (strict erase: no copy
    of a state derived from erased text may stay in memory), and return the rows overwritten.

    A plain layer has rows ``[start, N)`` of its keys / values zeroed. A layer whose rows are not
    plain tensors (quantized: rows packed together) cannot be zeroed row by row, so every tensor
    it holds is zeroed, i.e. all N rows: the caller must recompute the cache from row 0 (the
    repair's cache gate re-prefills such a cache into a fresh one anyway).
    """
    rows = cache_length(cache)
    whole = any(type(layer) not in PLAIN_LAYERS for layer in cache.layers)
    with torch.no_grad():
        for layer in cache.layers:
            if type(layer) in PLAIN_LAYERS:
                for t in held_tensors(layer):
                    t[:, :, start:].zero_()
            else:
                for t in held_tensors(layer):
                    t.zero_()
    return rows if whole else max(0, rows - start)
