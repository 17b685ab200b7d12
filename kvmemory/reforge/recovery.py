"""Bounded recovery: execute decoder layers ``[r, b)`` of the current model over the whole cached
prefix, starting from the retained boundary state, and overwrite those layers' K/V
(CacheReforge §Methodology "Bounded Recovery").

The layers run as ordinary modules with the model's own rotary embedding and causal mask
(``transformers.masking_utils.create_causal_mask``), so the refreshed rows are what a fresh
prefill under the current adapter computes whenever the boundary state is current.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask


def decoder_of(model):
    """The decoder stack (``.layers``, ``.rotary_emb``, ``.embed_tokens``) of a causal LM, peft-wrapped
    or not.

    Raises:
        TypeError: the model exposes no decoder with ``layers`` and ``rotary_emb``.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "rotary_emb"):
        raise TypeError(
            f"{type(model).__name__}: CacheReforge needs a decoder with `.layers` and `.rotary_emb` "
            "(Llama/Qwen-style models); use Re-prefill after adapter updates for this model"
        )
    return decoder


@dataclass
class LayerRun:
    """Result of executing layers ``[start, end)`` over rows ``[0, n)``: ``kv[ℓ]`` = (keys,
    values) ``[1, kv_heads, n, head_dim]`` for each executed layer; ``boundaries[ℓ]`` = hidden
    state entering layer ℓ ``[1, n, H]`` for ℓ in ``(start, end]`` that were asked for."""

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    boundaries: dict[int, torch.Tensor]
    hidden: torch.Tensor


def run_layers(model, hidden: torch.Tensor, start: int, end: int, keep_boundaries=()) -> LayerRun:
    """Execute decoder layers ``[start, end)`` on ``hidden`` (the state entering layer ``start``,
    ``[1, n, H]``, rows at positions ``0..n-1``) with a causal mask and no prefix cache.

    Args:
        keep_boundaries: layer indices ℓ in ``(start, end]`` whose entering state to return.

    Raises:
        ValueError: an empty or out-of-range layer range.
    """
    decoder = decoder_of(model)
    num_layers = len(decoder.layers)
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"layer range [{start}, {end}) outside [0, {num_layers}] or empty")
    n = hidden.shape[1]
    position_ids = torch.arange(n, device=hidden.device)[None]
    scratch = DynamicCache(config=decoder.config)
    mask = create_causal_mask(
        config=decoder.config, inputs_embeds=hidden, attention_mask=None, cache=scratch, position_ids=position_ids
    )
    position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)
    keep = set(keep_boundaries)
    boundaries = {}
    with torch.no_grad():
        for layer in range(start, end):
            hidden = decoder.layers[layer](
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                cache=scratch,
                use_cache=True,
                position_embeddings=position_embeddings,
            )
            if layer + 1 in keep:
                boundaries[layer + 1] = hidden
    kv = {layer: (scratch.layers[layer].keys, scratch.layers[layer].values) for layer in range(start, end)}
    return LayerRun(kv, boundaries, hidden)


def run_rows(model, hidden: torch.Tensor, start: int, end: int, prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Execute decoder layers ``[start, end)`` for the last rows of a cached prefix only:
    ``hidden`` ``[1, m, H]`` enters layer ``start`` for rows ``[p, p + m)``, and those rows attend
    over ``prefix[ℓ − start]`` = layer ℓ's cached (keys, values) of rows ``[0, p)``, shapes
    ``[1, kv_heads, p, head_dim]``. Exact when the prefix K/V of those layers are current (the
    layers below r_kv of a query / MLP update), at m/(p + m) of the layers' linear cost.
    Returns the state entering layer ``end`` for the m rows ``[1, m, H]``.

    Raises:
        ValueError: an empty layer range or one prefix entry per layer missing.
    """
    decoder = decoder_of(model)
    if not 0 <= start < end <= len(decoder.layers) or len(prefix) != end - start:
        raise ValueError(f"layer range [{start}, {end}) needs one cached prefix per layer (got {len(prefix)})")
    p = prefix[0][0].shape[2]
    position_ids = torch.arange(p, p + hidden.shape[1], device=hidden.device)[None]
    cache = DynamicCache(config=decoder.config)
    for layer, (keys, values) in zip(range(start, end), prefix):
        cache.update(keys, values, layer)
    mask = create_causal_mask(config=decoder.config, inputs_embeds=hidden, attention_mask=None, cache=cache,
                              position_ids=position_ids, layer_idx=start)
    position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)
    with torch.no_grad():
        for layer in range(start, end):
            hidden = decoder.layers[layer](hidden, attention_mask=mask, position_ids=position_ids, cache=cache,
                                           use_cache=True, position_embeddings=position_embeddings)
    return hidden


def embed(model, token_ids: torch.Tensor) -> torch.Tensor:
    """The state entering layer 0 for ``token_ids`` ``[n]``: ``[1, n, H]`` (boundary 0)."""
    with torch.no_grad():
        return decoder_of(model).embed_tokens(token_ids[None])


def overwrite_layers(cache: DynamicCache, run: LayerRun, start: int = 0) -> None:
    """Write the executed layers' K/V into rows ``[start, start+n)`` of ``cache``, in place."""
    for layer, (k, v) in run.kv.items():
        n = k.shape[2]
        cache.layers[layer].keys[:, :, start : start + n] = k
        cache.layers[layer].values[:, :, start : start + n] = v
