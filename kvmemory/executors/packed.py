"""Packed layer-major refresh executor (paper §3.3, Appendix 13.2).

The interval-wise executors traverse the model once per selected interval. The packed executor
traverses it once for all of them: the selected token ids are gathered once and their
embeddings start a compact B-row hidden-state buffer that advances through every layer
together. At each layer, the layer's own modules (input norm, q/k/v projections, Qwen3 q/k
norms, the model's rotary embedding at the rows' positions) give fresh K/V, which are written
into the cache first (eq. 21); then each packed query attends to its whole causal prefix in the
updated cache (eq. 22): fresh rows where refreshed, reused rows in the gaps, future rows masked.
o-proj, residual, post-attention norm and MLP produce the next layer's buffer (the gated MLP of
transformers' own plain linears is computed as ``W @ x^T`` from the modules' weights, the same
products; wrapped projections such as LoRA layers are called as modules). With fixed
positions and token-local operations outside attention this is the interval-wise recurrence in
another order (Appendix 13.2), equal up to floating-point reduction order.

This executor chooses the rows and builds their attention (row tiles and causal masks for SDPA,
the tile plan for Triton); the traversal itself is the engine's
(:func:`kvmemory.engine.traversal.packed_hidden_states`), and a few rows on the GGUF-block engine
run in one engine call (:meth:`kvmemory.engine.Engine.refresh_rows`).

Supported: dense Llama, Mistral, Qwen2 and Qwen3 decoders in eval mode, full attention, a static
RoPE, batch 1, one device. :func:`packed_unsupported_reason` says why anything else is refused;
callers then use the sequential executor (see ``executors/__init__.py``).
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .. import kvcache
from ..capabilities import packed_unsupported_reason
from ..engine import ForwardResult, engine_for
from ..engine.traversal import packed_hidden_states
from ..errors import PackedUnsupportedError
from .sequential import check_positions, grow_to

BACKENDS = ("sdpa", "triton")


def run_packed(
    model,
    cache: DynamicCache,
    token_ids: torch.Tensor,
    positions,
    *,
    backend: str = "sdpa",
    in_place: bool = False,
    fused_scatter: bool = False,
    lower_rows=None,
    lower_layers: int = 0,
) -> tuple[DynamicCache, ForwardResult]:
    """Refresh the rows at ``positions`` through every layer in one layer-major traversal
    (paper §3.3, Appendix 13.2, eqs. 21–22).

    Args:
        cache: rows for positions ``[0, M)`` (rows at selected positions may be placeholders);
            every position ``>= M`` must be selected. Not modified unless ``in_place``.
        token_ids: LongTensor ``[N]``, the full prompt.
        positions: LongTensor ``[B]`` (or list), strictly increasing positions in ``[0, N)``.
        backend: ``"sdpa"`` (PyTorch SDPA with grouped-query heads over the row tiles of
            :func:`row_tiles`, each with its own key range and additive causal mask; default) or ``"triton"``
            (the indexed kernel in ``kvmemory.kernels``; needs a CUDA GPU or ``TRITON_INTERPRET=1``).
        in_place: write into ``cache`` itself instead of one complete output copy.
        fused_scatter: with ``backend="triton"``, write fresh K/V with the one-launch Triton
            scatter instead of torch indexed writes (the default, as in the paper's measurements).
        lower_rows / lower_layers: a two-dimensional budget (our extension beyond the paper): the
            rows at ``lower_rows`` (LongTensor ``[R]``, strictly increasing, a superset of
            ``positions``) are recomputed in the first ``lower_layers`` layers, and only
            ``positions`` in the layers above (default 0: every layer computes ``positions``).

    Returns:
        ``(cache, result)``: the refreshed cache (``cache`` itself when in place) holding N rows,
        bit-identical to the input outside U, and a ForwardResult whose fp32 logits ``[vocab]``
        predict the token after position N-1 when N-1 is selected (else None). Its
        ``forwarded_tokens`` is B, plus with a lower stage the extra rows' share of the layers,
        (R - B) · lower_layers / layers (rounded): tokens of whole-model compute.

    Raises:
        PackedUnsupportedError: the model is not supported (reason in the message).
        ValueError: bad positions or backend; ``positions`` not within ``lower_rows``;
            ``lower_layers`` outside [0, layers].
        ImportError / kvmemory.kernels.TritonUnavailableError: backend "triton" without triton,
            or without a GPU and without the interpreter (the message names the fix).
    """
    reason = packed_unsupported_reason(model)
    if reason:
        raise PackedUnsupportedError(reason)
    if backend not in BACKENDS:
        raise ValueError(f"unknown packed backend {backend!r}: use one of {', '.join(BACKENDS)}")
    n, held = token_ids.shape[0], kvcache.cache_length(cache)
    positions = check_positions(positions, held, n)
    layers = len(model.get_decoder().layers)
    lower = _lower_stage(positions, lower_rows, lower_layers, layers, held, n)
    weight = next(model.parameters())
    attend, write = _backend(backend, positions, weight.device, weight.dtype, fused_scatter)
    target = cache if in_place else kvcache.from_tensors(kvcache.layer_tensors(cache))
    grow_to(target, n)
    pos = positions.to(weight.device)
    # a few rows: the engine's blocks (1/5 of the dense weights' bytes, which bound such a refresh),
    # all layers in one engine call when its storage backs the cache
    engine = engine_for(model, target)
    blocks = engine.block_linears(int(positions.numel())) if backend == "sdpa" else None
    if blocks is not None and lower is None:
        logits = engine.refresh_rows(target, token_ids[positions], positions)
        if logits is not None:
            last = int(positions[-1]) == n - 1
            return target, ForwardResult(next_logits=logits if last else None, forwarded_tokens=int(positions.numel()))
    hidden, forwarded = None, int(positions.numel())
    if lower is not None:
        hidden = _lower_hidden(model, target, token_ids, lower, lower_layers, positions, backend, fused_scatter)
        forwarded += (int(lower.numel()) - forwarded) * lower_layers / layers
    hidden = packed_hidden_states(model, target, token_ids.to(weight.device)[pos][None], pos, attend, write, blocks,
                                  layers=range(lower_layers, layers), hidden=hidden)
    logits = None
    if int(positions[-1]) == n - 1:
        decoder = model.get_decoder()
        with torch.no_grad():  # an autograd graph here would also leak into callers' logits
            last = decoder.norm(hidden[:, -1:])
            if blocks is not None:
                logits = blocks.head(last[0])[-1]
            else:
                logits = model.get_output_embeddings()(last)[0, -1].float()
    return target, ForwardResult(next_logits=logits, forwarded_tokens=round(forwarded))


def _lower_stage(positions: torch.Tensor, lower_rows, lower_layers: int, layers: int, held: int, n: int):
    """The checked rows of the lower stage of a two-dimensional budget (None when there is none)."""
    if isinstance(lower_layers, bool) or not isinstance(lower_layers, int) or not 0 <= lower_layers <= layers:
        raise ValueError(f"lower_layers must be an int in [0, {layers}] (the model's layers), got {lower_layers!r}")
    if not lower_layers:
        return None
    if lower_rows is None:
        raise ValueError(f"lower_layers={lower_layers} needs lower_rows: the positions those layers recompute")
    lower = check_positions(lower_rows, held, n)
    if not set(positions.tolist()) <= set(lower.tolist()):
        raise ValueError("every refreshed position must also be in lower_rows (the lower layers' rows are a superset)")
    return lower


def _lower_hidden(model, cache, token_ids, lower, lower_layers, positions, backend, fused_scatter) -> torch.Tensor:
    """Layers ``[0, lower_layers)`` for every row of ``lower``, in place on ``cache``; returns the
    hidden states of ``positions`` (a subset) at the input of layer ``lower_layers``."""
    weight = next(model.parameters())
    attend, write = _backend(backend, lower, weight.device, weight.dtype, fused_scatter)
    pos = lower.to(weight.device)
    blocks = engine_for(model, cache).block_linears(int(lower.numel())) if backend == "sdpa" else None
    hidden = packed_hidden_states(model, cache, token_ids.to(weight.device)[pos][None], pos, attend, write, blocks,
                                  layers=range(lower_layers))
    keep = torch.searchsorted(lower, positions).to(weight.device)
    return hidden[:, keep]


def _backend(name: str, positions: torch.Tensor, device: torch.device, dtype: torch.dtype, fused_scatter: bool):
    """``(attend, write)`` closures over metadata built once per refresh and reused by every layer:
    the row tiles and their additive causal masks for SDPA (:func:`row_tiles`), the tile plan
    (eqs. 23–24) for Triton."""
    pos = positions.to(device)

    def write_torch(keys, values, k, v):
        keys.index_copy_(2, pos, k)
        values.index_copy_(2, pos, v)

    if name == "triton":
        from .. import kernels  # ImportError names `pip install 'kvmemory[triton]'`

        kernels.check_available(device)
        plan = kernels.build_plan(positions, device)

        def attend_triton(q, keys, values, scale):
            return kernels.packed_attention(q, keys, values, plan, scale)

        def write_fused(keys, values, k, v):
            kernels.scatter_kv(keys, values, k, v, plan)

        return attend_triton, write_fused if fused_scatter else write_torch
    bounds = [(a, b, int(positions[b - 1]) + 1) for a, b in row_tiles(positions)]
    if sum((b - a) * keys for a, b, keys in bounds) > ADDITIVE_MASK_LIMIT:
        dtype = torch.bool  # huge refreshes: 1-byte masks (SDPA converts them per call)
    tiles = [(a, b, _causal_mask(pos[a:b], keys, dtype)) for a, b, keys in bounds]

    def attend_sdpa(q, keys, values, scale):
        q = q.contiguous()
        outs = [
            F.scaled_dot_product_attention(q[:, :, a:b], keys[:, :, : mask.shape[-1]], values[:, :, : mask.shape[-1]],
                                           attn_mask=mask if mask.dtype == torch.bool else mask.to(q.dtype), scale=scale, enable_gqa=True)
            for a, b, mask in tiles
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    return attend_sdpa, write_torch


ADDITIVE_MASK_LIMIT = 1 << 24  # mask elements per refresh kept additive (64 MiB in fp32)


def _causal_mask(pos: torch.Tensor, kv_length: int, dtype: torch.dtype) -> torch.Tensor:
    """``[1, 1, rows, kv_length]``: additive (0 where key j <= the row's position, -inf after it),
    built once per refresh because SDPA would convert a boolean mask to this at every layer; with
    ``dtype=torch.bool`` the boolean "may attend" mask instead."""
    future = torch.arange(kv_length, device=pos.device)[None] > pos[:, None]
    if dtype == torch.bool:
        return ~future[None, None]
    return torch.zeros(future.shape, dtype=dtype, device=pos.device).masked_fill_(future, float("-inf"))[None, None]


TILE_ROW_STEP = 16  # tile boundaries: interval starts and every 16th packed row
TILE_MAX_ROWS = 64  # bounds the per-tile mask and SDPA's score blocks
TILE_EXTRA_ROWS = 4.0  # per-tile K/V streaming, in rows × keys (measured, CPU SDPA, SmolLM2-135M)
TILE_FIXED_COST = 600.0  # per-tile call overhead, in rows × keys


def row_tiles(positions: torch.Tensor) -> list[tuple[int, int]]:
    """Split the B packed rows (sorted positions ``[B]``) into consecutive tiles ``[a, b)``, each
    attending to keys ``[0, positions[b-1]]`` only (the causal skip of eqs. 23–24 for SDPA).

    A dynamic program minimises Σ_tiles ((b - a) + TILE_EXTRA_ROWS) · (positions[b-1] + 1) +
    TILE_FIXED_COST over boundaries at every TILE_ROW_STEP-th row and at interval starts (unless
    there are over 4× more starts than row steps), with at most TILE_MAX_ROWS rows per tile: one tile for a single short interval, a few for spread intervals
    (R = 16 at 2 K: 3 tiles instead of one 64 × 1506 block). Cost model fitted by A/B timing.
    """
    pos = positions.tolist()
    n = len(pos)
    steps = {0, n} | set(range(0, n, TILE_ROW_STEP))
    starts = {i for i in range(1, n) if pos[i] != pos[i - 1] + 1}
    cuts = sorted(steps | starts if len(starts) <= 4 * len(steps) else steps)  # many tiny intervals: row steps only
    best = {0: (0.0, 0)}  # boundary -> (cost of rows before it, previous boundary)
    for idx, j in enumerate(cuts[1:], start=1):
        window = cuts[bisect.bisect_left(cuts, j - TILE_MAX_ROWS, 0, idx) : idx]  # O(TILE_MAX_ROWS) per cut
        best[j] = min((best[i][0] + (j - i + TILE_EXTRA_ROWS) * (pos[j - 1] + 1) + TILE_FIXED_COST, i) for i in window)
    tiles, j = [], n
    while j:
        tiles.append((best[j][1], j))
        j = best[j][1]
    return tiles[::-1]
