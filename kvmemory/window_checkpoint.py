"""A checkpoint of a sliding-window cache at the end of a prompt, so that the next request can
drop the answer's rows again (what llama.cpp keeps its sliding-window checkpoints for).

A sliding-window layer holds only its last ``window - 1`` rows: decoding an answer past the
window evicts prompt rows that dropping the answer would need back, so without a checkpoint an
identical repeated request (or a turn whose rendering of the answer differs from the decoded
tokens) re-prefills the whole prompt. The checkpoint keeps, at the prompt's end, a copy of every
sliding layer's held rows (``window - 1`` rows per layer: full-attention layers keep all their
rows anyway and are cropped) and the logits after the prompt's last row. Restoring it gives
exactly the cache the prompt's prefill left, so every result after it is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer


@dataclass(frozen=True)
class WindowCheckpoint:
    """The cache of a ``rows``-token prompt (ids ``token_ids``) as far as sliding layers need it."""

    rows: int
    token_ids: tuple[int, ...]
    sliding: dict[int, tuple[torch.Tensor, torch.Tensor, int]]  # layer -> (keys, values, cumulative_length)
    logits: torch.Tensor | None  # fp32 [vocab] after row rows - 1
    exact_rows: int
    rendered: Any  # the session's RenderedPrompt of the prompt
    versions: tuple  # the adapter versions the rows were computed under (KVSession._rows_key()[1:])

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v, _ in self.sliding.values())


def sliding_layers(cache) -> list[int]:
    """Indices of the cache's sliding-window layers (those that evict rows)."""
    return [i for i, layer in enumerate(getattr(cache, "layers", ())) if isinstance(layer, DynamicSlidingWindowLayer)]


def take(cache, token_ids, logits: torch.Tensor | None, exact_rows: int, rendered,
         versions: tuple) -> WindowCheckpoint | None:
    """A checkpoint of ``cache`` (rows for ``token_ids``), or None when no layer slides."""
    layers = sliding_layers(cache)
    if not layers or logits is None:
        return None
    saved = {}
    for i in layers:
        layer = cache.layers[i]
        if not layer.is_initialized:
            return None
        saved[i] = (layer.keys.clone(), layer.values.clone(), int(layer.cumulative_length))
    return WindowCheckpoint(len(token_ids), tuple(token_ids), saved, logits.clone(), exact_rows, rendered, versions)


def restorable(checkpoint: WindowCheckpoint | None, held_ids, new_ids) -> bool:
    """True when ``checkpoint`` serves a request for ``new_ids`` on a cache holding ``held_ids``:
    both start with the checkpoint's prompt and the request does not keep every held row (it
    drops rows after the checkpoint, which a sliding layer past its window could not give back)."""
    if checkpoint is None or len(held_ids) <= checkpoint.rows:
        return False
    n = checkpoint.rows
    if tuple(held_ids[:n]) != checkpoint.token_ids or tuple(new_ids[:n]) != checkpoint.token_ids:
        return False
    return tuple(new_ids[:len(held_ids)]) != tuple(held_ids)


def restore(cache, checkpoint: WindowCheckpoint) -> None:
    """Put ``cache`` back to the checkpoint's prompt in place: full-attention layers cropped to
    its rows, sliding layers given copies of the rows they held then."""
    for i, layer in enumerate(cache.layers):
        if i in checkpoint.sliding:
            keys, values, cumulative = checkpoint.sliding[i]
            layer.keys, layer.values, layer.cumulative_length = keys.clone(), values.clone(), cumulative
        elif layer.get_seq_length() > checkpoint.rows:
            layer.crop(checkpoint.rows - layer.get_seq_length())
