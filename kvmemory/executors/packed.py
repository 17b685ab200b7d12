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

Supported: dense Llama, Mistral, Qwen2 and Qwen3 decoders in eval mode, full attention, a static
RoPE, batch 1, one device. :func:`packed_unsupported_reason` says why anything else is refused;
callers then use the sequential executor (see ``executors/__init__.py``).
"""

from __future__ import annotations

import bisect
import sys

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .. import kvcache
from ..engine import block_linears
from ..engine import refresh_rows as engine_refresh_rows
from ..errors import PackedUnsupportedError
from ..capabilities import packed_unsupported_reason
from .sequential import ForwardResult, check_positions, grow_to

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

    Returns:
        ``(cache, result)``: the refreshed cache (``cache`` itself when in place) holding N rows,
        bit-identical to the input outside U, and a ForwardResult whose fp32 logits ``[vocab]``
        predict the token after position N-1 when N-1 is selected (else None).

    Raises:
        PackedUnsupportedError: the model is not supported (reason in the message).
        ValueError: bad positions or backend.
        ImportError / kvmemory.kernels.TritonUnavailableError: backend "triton" without triton,
            or without a GPU and without the interpreter (the message names the fix).
    """
    reason = packed_unsupported_reason(model)
    if reason:
        raise PackedUnsupportedError(reason)
    if backend not in BACKENDS:
        raise ValueError(f"unknown packed backend {backend!r}: use one of {', '.join(BACKENDS)}")
    n = token_ids.shape[0]
    positions = check_positions(positions, kvcache.cache_length(cache), n)
    weight = next(model.parameters())
    attend, write = _backend(backend, positions, weight.device, weight.dtype, fused_scatter)
    target = cache if in_place else kvcache.from_tensors(kvcache.layer_tensors(cache))
    grow_to(target, n)
    pos = positions.to(weight.device)
    # a few rows: the engine's blocks (1/5 of the dense weights' bytes, which bound such a refresh),
    # all layers in one engine call when its storage backs the cache
    blocks = block_linears(model, target, int(positions.numel())) if backend == "sdpa" else None
    if blocks is not None:
        logits = engine_refresh_rows(model, target, token_ids[positions], positions)
        if logits is not None:
            last = int(positions[-1]) == n - 1
            return target, ForwardResult(next_logits=logits if last else None, forwarded_tokens=int(positions.numel()))
    hidden = packed_hidden_states(model, target, token_ids.to(weight.device)[pos][None], pos, attend, write, blocks)
    logits = None
    if int(positions[-1]) == n - 1:
        decoder = model.get_decoder()
        with torch.no_grad():  # an autograd graph here would also leak into callers' logits
            last = decoder.norm(hidden[:, -1:])
            if blocks is not None:
                logits = blocks.head(last[0])[-1]
            else:
                logits = model.get_output_embeddings()(last)[0, -1].float()
    return target, ForwardResult(next_logits=logits, forwarded_tokens=int(positions.numel()))


def packed_hidden_states(model, cache, ids: torch.Tensor, pos: torch.Tensor, attend, write, blocks=None):
    """The packed traversal (eqs. 21-22): the B-row hidden-state buffer ``[1, B, hidden]`` after
    the last layer (before the final norm) for tokens ``ids`` ``[1, B]`` at positions ``pos``
    ``[B]``. At each layer ``write(keys, values, k, v)`` stores the rows' fresh K/V in
    ``cache.layers[i]`` (anything with ``keys`` / ``values`` tensors ``[1, kv_heads, rows,
    head_dim]``), then ``attend(q, keys, values, scale)`` returns their attention output
    ``[1, heads, B, head_dim]``. ``blocks``: the engine's block linears
    (:func:`kvmemory.engine.block_linears`) used instead of the modules' dense weights. Also
    the ``"cuda_graphs"`` engine's decode step (:mod:`kvmemory.engine.graphs`)."""
    decoder = model.get_decoder()
    plain_mlps = [is_plain_mlp(layer.mlp) for layer in decoder.layers]  # checked once, not per layer call
    with torch.no_grad():
        hidden = model.get_input_embeddings()(ids)
        cos, sin = decoder.rotary_emb(hidden, position_ids=pos[None])
        for i, (layer, cache_layer, plain_mlp) in enumerate(zip(decoder.layers, cache.layers, plain_mlps)):
            linears = blocks.layers[i] if blocks is not None else None
            attn = layer.self_attn
            q, k, v = _fresh_qkv(attn, layer.input_layernorm(hidden), cos, sin, linears[0] if linears else None)
            write(cache_layer.keys, cache_layer.values, k, v)
            out = attend(q, cache_layer.keys, cache_layer.values, _scaling(attn, q.shape[-1]))
            out = out.transpose(1, 2).reshape(*hidden.shape[:2], -1)
            hidden = hidden + (linears[1](out[0])[None] if linears else attn.o_proj(out))
            mlp_in = layer.post_attention_layernorm(hidden)
            if linears:
                hidden = hidden + _gated_mlp_on_blocks(layer.mlp, linears[2], linears[3], mlp_in)
            else:
                hidden = hidden + (_gated_mlp_by_columns(layer.mlp, mlp_in) if plain_mlp else layer.mlp(mlp_in))
    return hidden


def _gated_mlp_on_blocks(mlp, gate_up, down, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP of ``x`` ``[1, B, hidden]`` with the engine's fused gate/up and down block
    linears and the module's activation."""
    gate, up = gate_up(x[0]).split(mlp.gate_proj.out_features, dim=-1)
    return down(mlp.act_fn(gate) * up)[None]


def is_plain_mlp(mlp) -> bool:
    """Whether ``mlp`` is transformers' own gated MLP ``down(act(gate(x)) * up(x))`` over plain
    bias-free ``nn.Linear`` s, whose weights :func:`_gated_mlp_by_columns` may use directly. A wrapped
    projection (a PEFT LoRA layer, a quantised linear) keeps the module call."""
    projections = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (
        type(mlp).__module__.startswith("transformers.models.")
        and hasattr(mlp, "act_fn")
        and all(type(p) is torch.nn.Linear and p.bias is None for p in projections)
    )


def _gated_mlp_by_columns(mlp, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP of the B packed rows ``x`` ``[1, B, hidden]`` with the module's weights. From
    ``COLUMNS_FROM_ROWS`` rows on it is computed as ``W @ x^T`` (rows as columns), the same products
    as the module's ``x @ W^T`` in another order: with wide weights this orientation ran ~15 %
    faster at B = 128 on a single CPU thread (MKL, SmolLM2-135M), about the same at B = 64, and
    1.7x slower at B = 14, where ``x @ W^T`` is kept. Returns ``[1, B, hidden]``."""
    if x.shape[1] < COLUMNS_FROM_ROWS:
        gate = F.linear(x, mlp.gate_proj.weight)
        return F.linear(mlp.act_fn(gate).mul_(F.linear(x, mlp.up_proj.weight)), mlp.down_proj.weight)
    columns = x[0].t()
    gate = mlp.gate_proj.weight @ columns
    hidden = mlp.act_fn(gate).mul_(mlp.up_proj.weight @ columns)
    return (mlp.down_proj.weight @ hidden).t()[None]


COLUMNS_FROM_ROWS = 64  # packed rows from which the MLP runs as W @ x^T (measured, SmolLM2-135M, MKL)


def _fresh_qkv(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qkv=None):
    """Fresh Q ``[1, H_q, B, d]`` and K/V ``[1, H_kv, B, d]`` of the packed rows with the attention
    module's own projections (or ``qkv``, the engine's fused block linear), optional q/k norms
    (Qwen3) and its family's apply_rotary_pos_emb."""
    shape = (*x.shape[:2], -1, attn.head_dim)
    if qkv is not None:
        sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        q, k, v = (t[None].view(shape) for t in qkv(x[0]).split(sizes, dim=-1))
    else:
        q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    v = v.transpose(1, 2)
    rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v


def _scaling(attn, head_dim: int) -> float:
    """The module's softmax scale (``head_dim ** -0.5`` unless the config sets another)."""
    return float(getattr(attn, "scaling", head_dim**-0.5))


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
