"""Row-level operations on a transformers 5.x ``DynamicCache`` through its public layer tensors.

Every layer holds ``keys`` / ``values`` of shape ``[batch, kv_heads, seq, head_dim]``
(``cache.layers[i].keys``). kvmemory only ever uses batch 1 and full-attention layers.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


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
    """Drop rows ``[length, seq)`` in place (public ``crop`` takes a negative count)."""
    extra = cache_length(cache) - length
    if extra > 0:
        cache.crop(-extra)


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


def cache_nbytes(cache: DynamicCache) -> int:
    """Bytes held by the cache's K/V tensors. Layers not written yet (a new cache, or one a forward
    pass in another thread is filling right now) hold none."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
               for k, v in layer_tensors(cache) if k is not None and v is not None)
