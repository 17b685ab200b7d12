"""The packed layer-major traversal (paper §3.3, eqs. 21-22): B rows at arbitrary positions
advance through every layer together, each layer writing their fresh K/V into the cache before
they attend to it.

It is the computation shared by the packed refresh executor
(:func:`kvmemory.executors.packed.run_packed`, which chooses the rows and builds the attention
over row tiles) and the ``"cuda_graphs"`` engine's decode step (:mod:`kvmemory.engine.graphs`).
The layer's own modules compute everything outside attention (input norm, q/k/v projections,
Qwen3 q/k norms, the model's rotary embedding, o-proj, MLP), or the engine's block linears when
given; the gated MLP of transformers' own plain linears is computed from the modules' weights.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F


def packed_hidden_states(model, cache, ids: torch.Tensor, pos: torch.Tensor, attend, write, blocks=None, *,
                         layers: range | None = None, hidden: torch.Tensor | None = None):
    """The packed traversal (eqs. 21-22): the B-row hidden-state buffer ``[1, B, hidden]`` after
    the last layer (before the final norm) for tokens ``ids`` ``[1, B]`` at positions ``pos``
    ``[B]``. At each layer ``write(keys, values, k, v)`` stores the rows' fresh K/V in
    ``cache.layers[i]`` (anything with ``keys`` / ``values`` tensors ``[1, kv_heads, rows,
    head_dim]``), then ``attend(q, keys, values, scale)`` returns their attention output
    ``[1, heads, B, head_dim]``. ``layers`` / ``hidden``: traverse only these consecutive layers,
    from the rows' hidden states ``[1, B, hidden]`` at the input of the first (default: every
    layer, from the token embeddings); the output is the hidden states after the last of them. ``blocks``: the engine's block linears
    (:meth:`kvmemory.engine.Engine.block_linears`) used instead of the modules' dense weights. Also
    the ``"cuda_graphs"`` engine's decode step (:mod:`kvmemory.engine.graphs`)."""
    decoder = model.get_decoder()
    plain_mlps = [is_plain_mlp(layer.mlp) for layer in decoder.layers]  # checked once, not per layer call
    layers = layers if layers is not None else range(len(decoder.layers))
    with torch.no_grad():
        if hidden is None:
            hidden = model.get_input_embeddings()(ids)
        cos, sin = decoder.rotary_emb(hidden, position_ids=pos[None])
        for i in layers:
            layer, cache_layer, plain_mlp = decoder.layers[i], cache.layers[i], plain_mlps[i]
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
    projection (a PEFT LoRA layer, a quantised linear) keeps the module call, and so does a weight
    the block engine released (empty until its module's call dequantizes it, see ``dense.py``)."""
    projections = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (
        type(mlp).__module__.startswith("transformers.models.")
        and hasattr(mlp, "act_fn")
        and all(type(p) is torch.nn.Linear and p.bias is None and p.weight.numel() for p in projections)
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
