"""Pre-allocated K/V storage behind a transformers ``DynamicCache``.

``DynamicLayer.update`` appends by ``torch.cat``, which copies the layer's whole history for every
decoded token (94 MB per token at 2 K tokens for SmolLM2: 21 % of a decode step). The engine
instead writes new rows into a buffer with spare capacity and publishes ``layer.keys`` /
``layer.values`` as views of its first ``length`` rows, so everything else in kvmemory (Shift,
row gathers, exports, strict erase) keeps working on plain ``[1, kv_heads, rows, head_dim]``
tensors and writes in place through the views.

A buffer is reused only while the layer still holds exactly the views the engine published
(object identity): any other writer that replaced them (a transformers forward, a crop, a
repair building a new cache) makes the next engine call copy the rows into a fresh buffer. So
rows beyond a view are never visible to anyone else, and nothing is shared by accident.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

@dataclass
class _Storage:
    all_keys: torch.Tensor  # [layers, 1, kv_heads, capacity, head_dim]
    all_values: torch.Tensor
    published: list[tuple[torch.Tensor, torch.Tensor]]  # the views handed to the cache layers

    @property
    def keys(self) -> torch.Tensor:
        """Per-layer ``[1, kv_heads, capacity, head_dim]`` (index the first dimension)."""
        return self.all_keys

    @property
    def values(self) -> torch.Tensor:
        return self.all_values

    @property
    def capacity(self) -> int:
        return self.all_keys.shape[3]


class CacheBuffers:
    """Capacity-backed rows for the plain ``DynamicLayer`` caches one engine writes to."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device
        self._storage: "weakref.WeakKeyDictionary[object, _Storage]" = weakref.WeakKeyDictionary()

    def reserve(self, cache, start: int, rows: int, capacity: int | None = None) -> _Storage:
        """Storage whose rows ``[0, start)`` equal the cache's and that has room for ``rows`` more.

        ``capacity``: the rows the caller expects the cache to reach (e.g. prompt + answer limit),
        allocated at once when the storage must grow; without it the storage grows to exactly
        ``start + rows``, or to the capacity this cache's previous storage had (no slack a
        memory budget did not reserve before).

        Raises:
            ValueError: the cache does not hold exactly ``start`` rows.
        """
        held = cache.get_seq_length()
        if held != start:
            raise ValueError(f"the cache holds {held} rows, the engine was asked to append at row {start}")
        storage = self._storage.get(cache)
        if storage is None or not self._owns(cache, storage) or storage.capacity < start + rows:
            # a cache whose views were replaced (a crop of the last answer's rows, a repair) gets
            # back the capacity it had reserved before: the next answer then fits without a
            # second copy of every row
            reserved = storage.capacity if storage is not None else 0
            storage = self._allocate(cache, start, max(start + rows, capacity or 0, reserved))
            self._storage[cache] = storage
        return storage

    def publish(self, cache, storage: _Storage, length: int) -> None:
        """Point every layer's ``keys`` / ``values`` at rows ``[0, length)`` of the storage."""
        storage.published = []
        for layer, k, v in zip(cache.layers, storage.keys, storage.values):
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.keys, layer.values = k[:, :, :length], v[:, :, :length]
            storage.published.append((layer.keys, layer.values))

    @staticmethod
    def _owns(cache, storage: _Storage) -> bool:
        return len(storage.published) == len(cache.layers) and all(
            layer.keys is k and layer.values is v for layer, (k, v) in zip(cache.layers, storage.published)
        )

    def _allocate(self, cache, held: int, capacity: int) -> _Storage:
        """A fresh buffer for every layer with ``capacity`` rows, rows ``[0, held)`` copied from the
        cache and the spare rows zeroed (no stale state in memory the cache does not account for)."""
        shape = (len(cache.layers), 1, self.kv_heads, capacity, self.head_dim)
        keys = torch.empty(shape, dtype=self.dtype, device=self.device)
        values = torch.empty(shape, dtype=self.dtype, device=self.device)
        for buffers, name in ((keys, "keys"), (values, "values")):
            for i, layer in enumerate(cache.layers):
                if held:
                    buffers[i, :, :, :held] = getattr(layer, name)
            buffers[:, :, :, held:].zero_()
        return _Storage(keys, values, [])


def plain_layers(cache) -> bool:
    """True when every layer is a plain full-attention ``DynamicLayer`` (what the engine writes)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
