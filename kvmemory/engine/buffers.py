"""Pre-allocated K/V storage behind a transformers ``DynamicCache``.

``DynamicLayer.update`` appends by ``torch.cat``, which copies the layer's whole history for every
decoded token (94 MB per token at 2 K tokens for SmolLM2: 21 % of a decode step). The engine
instead writes new rows into a buffer with spare capacity and publishes ``layer.keys`` /
``layer.values`` as views of its first ``length`` rows, so everything else in kvmemory (Shift,
row gathers, exports, strict erase) keeps working on plain ``[1, kv_heads, rows, head_dim]``
tensors and writes in place through the views.

A buffer is reused while the layer still holds the views the engine published (object identity)
or a shorter prefix of them (``DynamicLayer.crop`` slices the published view: the crop of the
last answer's rows before the next turn); the rows cut off are zeroed before they are reused.
Any other writer that replaced them (a transformers forward, a repair building a new cache)
makes the next engine call copy the rows into a fresh buffer. So rows beyond a view are never
visible to anyone else, and nothing is shared by accident (forks and exports copy rows).

The memory of a buffer whose cache was dropped (the cache a repair replaced, an ended thread) is
kept for the next buffer of the same size or a little smaller (at most ``SPARE_BUFFERS`` of them,
and only once no tensor anywhere still views it), like the fixed K/V buffer of llama.cpp:
fresh memory is zeroed by the kernel page by page on first write, which took 15-120 ms of a 2 K
repair here, and reused memory is simply overwritten.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
import weakref
from dataclasses import dataclass

import torch

SPARE_BUFFERS = 2  # released buffers kept for reuse per engine (each the size of one cache's K/V)


@dataclass
class _Storage:
    all_keys: torch.Tensor  # [layers, 1, kv_heads, capacity, head_dim]
    all_values: torch.Tensor
    published: list[tuple[torch.Tensor, torch.Tensor]]  # the views handed to the cache layers
    length: int = 0  # rows of the published views
    answer_room: int = 0  # rows past the prompt the caller's last explicit capacity reserved
    requested: int | None = None  # that capacity

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
        self._spares: list[tuple[torch.Tensor, torch.Tensor]] = []  # released memory, newest last
        self._spares_lock = threading.Lock()  # released from finalizers, on whichever thread collects

    def reserve(self, cache, start: int, rows: int, capacity: int | None = None) -> _Storage:
        """Storage whose rows ``[0, start)`` equal the cache's and that has room for ``rows`` more.

        ``capacity``: the rows the caller expects the cache to reach (e.g. prompt + answer limit),
        allocated at once when the storage must grow; without it the storage grows to
        ``start + rows`` plus the answer room the caller reserved last time (an appended turn
        is followed by an answer of the same limit: one copy of the rows, not two), or to the
        capacity this cache's previous storage had (no slack a memory budget did not reserve before).

        Raises:
            ValueError: the cache does not hold exactly ``start`` rows.
        """
        held = cache.get_seq_length()
        if held != start:
            raise ValueError(f"the cache holds {held} rows, the engine was asked to append at row {start}")
        storage = self._storage.get(cache)
        if storage is not None and self._cropped(cache, storage, start):
            self._reclaim(storage, start)
        if storage is None or not self._owns(cache, storage) or storage.capacity < start + rows:
            # a cache whose views were replaced (a crop of the last answer's rows, a repair) gets
            # back the capacity it had reserved before: the next answer then fits without a
            # second copy of every row
            reserved = storage.capacity if storage is not None else 0
            room = storage.answer_room if storage is not None else 0
            wanted = capacity if capacity is not None else start + rows + room
            grown = self._allocate(cache, start, max(start + rows, wanted, reserved))
            grown.answer_room, grown.requested = room, storage.requested if storage is not None else None
            storage = self._storage[cache] = grown
        if capacity is not None and capacity != storage.requested:  # a new answer's reservation
            storage.requested, storage.answer_room = capacity, max(capacity - start, 0)
        return storage

    def owned(self, cache) -> _Storage | None:
        """The storage whose published views ``cache`` holds now (every row of it), or None."""
        storage = self._storage.get(cache)
        if storage is None or storage.length != cache.get_seq_length() or not self._owns(cache, storage):
            return None
        return storage

    def gather(self, source, rows: torch.Tensor, target) -> None:
        """Fill ``target`` (an empty plain cache with as many layers as ``source``) with a copy of
        ``source``'s rows: target row j = source row ``rows[j]``, zero where ``rows[j] < 0`` (a
        placeholder the caller writes before anything reads it). The rows land in a fresh buffer
        with the answer room ``source`` reserved last, so the answer after a repair appends
        without another copy of every row. Contiguous runs of rows are copied as one slice
        (a middle deletion is two copies per tensor, not a row-by-row gather)."""
        old = self._storage.get(source)
        room = old.answer_room if old is not None else 0
        n = rows.shape[0]
        whole = self.owned(source)
        storage = self._empty(len(target.layers), n + room)
        storage.all_keys[:, :, :, n:].zero_()
        storage.all_values[:, :, :, n:].zero_()
        for dst, src, length in _runs(rows.tolist()):
            if src < 0:
                storage.all_keys[:, :, :, dst:dst + length].zero_()
                storage.all_values[:, :, :, dst:dst + length].zero_()
                continue
            if whole is not None:  # every layer in one copy
                storage.all_keys[:, :, :, dst:dst + length] = whole.all_keys[:, :, :, src:src + length]
                storage.all_values[:, :, :, dst:dst + length] = whole.all_values[:, :, :, src:src + length]
                continue
            for i, layer in enumerate(source.layers):
                storage.all_keys[i, :, :, dst:dst + length] = layer.keys[:, :, src:src + length]
                storage.all_values[i, :, :, dst:dst + length] = layer.values[:, :, src:src + length]
        storage.answer_room = room
        self._storage[target] = storage
        self.publish(target, storage, n)

    def publish(self, cache, storage: _Storage, length: int) -> None:
        """Point every layer's ``keys`` / ``values`` at rows ``[0, length)`` of the storage."""
        # one slice and one unbind per tensor (two calls instead of two per layer: this runs per token)
        keys = storage.all_keys[:, :, :, :length].unbind(0)
        values = storage.all_values[:, :, :, :length].unbind(0)
        for layer, k, v in zip(cache.layers, keys, values):
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        storage.published = list(zip(keys, values))
        storage.length = length

    @staticmethod
    def _cropped(cache, storage: _Storage, start: int) -> bool:
        """Every layer holds the first ``start`` (< published) rows of the storage's views: a crop."""
        if not storage.published or start >= storage.length or len(storage.published) != len(cache.layers):
            return False
        return all(_prefix_of(layer.keys, k, start) and _prefix_of(layer.values, v, start)
                   for layer, (k, v) in zip(cache.layers, storage.published))

    def _reclaim(self, storage: _Storage, start: int) -> None:
        """Take a cropped storage back: zero the rows cut off and mark rows ``[0, start)`` owned
        (no copy; the layers are republished by the caller's ``publish``)."""
        storage.all_keys[:, :, :, start:storage.length].zero_()
        storage.all_values[:, :, :, start:storage.length].zero_()
        storage.published = [(k[:, :, :start], v[:, :, :start]) for k, v in storage.published]
        storage.length = start

    @staticmethod
    def _owns(cache, storage: _Storage) -> bool:
        return len(storage.published) == len(cache.layers) and all(
            (layer.keys is k or _prefix_of(layer.keys, k, k.shape[2]))
            and (layer.values is v or _prefix_of(layer.values, v, v.shape[2]))
            for layer, (k, v) in zip(cache.layers, storage.published)
        )

    def _allocate(self, cache, held: int, capacity: int) -> _Storage:
        """A fresh buffer for every layer with ``capacity`` rows, rows ``[0, held)`` copied from the
        cache and the spare rows zeroed (no stale state in memory the cache does not account for)."""
        storage = self._empty(len(cache.layers), capacity)
        for buffers, name in ((storage.all_keys, "keys"), (storage.all_values, "values")):
            for i, layer in enumerate(cache.layers):
                if held:
                    buffers[i, :, :, :held] = getattr(layer, name)
            buffers[:, :, :, held:].zero_()
        return storage

    def _empty(self, layers: int, capacity: int) -> _Storage:
        shape = (layers, 1, self.kv_heads, capacity, self.head_dim)
        numel = layers * self.kv_heads * capacity * self.head_dim
        memory = self._take_spare(numel)
        if memory is None:
            memory = tuple(torch.empty(numel, dtype=self.dtype, device=self.device) for _ in range(2))
            for tensor in memory:
                huge_pages(tensor)
        keys, values = (flat[:numel].view(shape) for flat in memory)
        storage = _Storage(keys, values, [])
        # the storage dropped: the flat memory its views show may serve the next one
        weakref.finalize(storage, self._release, memory)
        return storage

    def _release(self, memory: tuple[torch.Tensor, torch.Tensor]) -> None:
        with self._spares_lock:
            self._spares = (self._spares + [memory])[-SPARE_BUFFERS:]

    def _take_spare(self, numel: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Released memory for ``numel`` values per tensor (at most 1.5x that, so a small cache
        does not pin a large one's memory) that no tensor views any more (a cache's views can
        outlive its storage record, e.g. in a caller's copy of ``layer.keys``), or None."""
        with self._spares_lock:
            for i in range(len(self._spares) - 1, -1, -1):
                memory = self._spares[i]
                if numel <= memory[0].numel() <= numel * 3 // 2 and all(_unshared(t) for t in memory):
                    return self._spares.pop(i)
        return None


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def huge_pages(tensor: torch.Tensor) -> None:
    """Ask Linux to back a fresh CPU tensor (not yet written) with 2 MB pages where it can
    (``madvise(MADV_HUGEPAGE)``; kernels with transparent huge pages in ``madvise`` mode). A
    repair's new cache buffer is then faulted in 2 MB at a time: writing a fresh 47 MB buffer
    took ~12 ms in 4 KB pages and ~3.5 ms in 2 MB pages here. Only a hint: the memory, its
    contents and its size are the same either way; elsewhere (other systems, small tensors,
    no libc) nothing happens."""
    if tensor.device.type != "cpu" or tensor.numel() * tensor.element_size() < 2 * HUGE_PAGE:
        return
    madvise = _libc_madvise()
    if madvise is None:
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned = -(-start // HUGE_PAGE) * HUGE_PAGE
    if end - aligned >= HUGE_PAGE:
        madvise(ctypes.c_void_p(aligned), ctypes.c_size_t((end - aligned) // HUGE_PAGE * HUGE_PAGE), _MADV_HUGEPAGE)


@functools.cache
def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None


def _unshared(tensor: torch.Tensor) -> bool:
    """No tensor but ``tensor`` refers to its memory (no view of it is alive anywhere). False
    when this torch cannot tell (its storage reference count is not exposed): nothing is reused."""
    if not hasattr(torch._C, "_storage_Use_Count"):
        return False
    return _storage_refs(tensor) <= _storage_refs(torch.empty(1))  # as for a tensor nobody else refers to


def _storage_refs(tensor: torch.Tensor) -> int:
    storage = tensor.untyped_storage()  # held while counting (a temporary handle could be freed first)
    return torch._C._storage_Use_Count(storage._cdata)


def _runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """``(target start, source start or -1, length)`` for each run of consecutive source rows."""
    runs: list[tuple[int, int, int]] = []
    for j, src in enumerate(rows):
        if runs:
            dst0, src0, length = runs[-1]
            if (src < 0 and src0 < 0) or (src >= 0 and src0 >= 0 and src == src0 + length):
                runs[-1] = (dst0, src0, length + 1)
                continue
        runs.append((j, src if src >= 0 else -1, 1))
    return runs


def _prefix_of(view: torch.Tensor, published: torch.Tensor, rows: int) -> bool:
    """``view`` is rows ``[0, rows)`` of ``published`` (same memory, same strides)."""
    return (view.data_ptr() == published.data_ptr() and view.stride() == published.stride()
            and view.shape[:2] == published.shape[:2] and view.shape[2] == rows and view.shape[3] == published.shape[3])
