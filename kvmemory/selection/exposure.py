"""Exposure to the removed rows, estimated from the cache alone (our extension beyond the paper).

Why: a stale row's K/V is wrong by as much as that row attended to what the edit removed.
Cache-Craft's signal (Table 1, Cache-Craft-Adapted) measures that attention by replaying the
dirty suffix, which costs more than Replay. On Qwen2.5-0.5B Erasing-NIAH the rows it ranks first
hold most of the clean-state oracle's K/V deviation, where SUR's do not
(``benchmarks/results/oracle_row_overlap/``).

This module estimates the same attention without a forward and without retained state. A
row's key and value at layer l are linear in its normalised hidden state x
(``k = R_p (W_k x + b_k)``, ``v = W_v x + b_v``), so the cached K/V pin down x's component in
the row space of ``[W_k; W_v]``. The query estimated from that component,
``q̂ = W_q x̂ + b_q`` with ``x̂ = pinv([W_k; W_v]) ([R_p⁻¹ k; v] − b)``, attends over the dirty
cache's keys of that layer, and the score is the mass on the removed rows, averaged over heads
and the probed layers. Cost: per probed layer, one least-squares solve on the projection weights
and ``S × N`` attention logits per head; no decoder layer runs.

It is a selector: it chooses which rows the exact refresh recomputes; a poor estimate costs
fidelity, never exactness of the rows refreshed.
"""

from __future__ import annotations

from typing import Sequence

import torch

ROW_BLOCK = 256  # stale rows per attention block (bounds the [heads, block, N] logits)


def probe_layers(num_layers: int) -> tuple[int, ...]:
    """The layers probed by default: a quarter, half and three quarters of the depth (the exposure
    of the first layers misses rows that attend to the removed text only in the middle layers)."""
    return tuple(sorted({min(num_layers - 1, (num_layers * k) // 4) for k in (1, 2, 3)}))


def _affine(linear: torch.nn.Module, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W ``[out, width]``, b ``[out]``) of an affine module, read by calling it (works for LoRA
    wrappers and for engines that keep the weight in their own blocks)."""
    with torch.no_grad():
        param = next(linear.parameters(), None)
        dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
        probe = torch.cat([torch.zeros(1, width), torch.eye(width)]).to(dtype)
        out = linear(probe).float()
    return (out[1:] - out[:1]).T, out[0]


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def query_estimator(attention: torch.nn.Module, config) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The map from a row's un-rotated ``[k; v]`` (``[2·KVH·D]``) to its estimated pre-rotary
    query (``[H·D]``): ``q̂ = M [k; v] + c``. Returns ``(M, c, uses_keys)``; keys are left out
    (``uses_keys`` False) when the layer normalises them (``k_norm``: not linear in x)."""
    width = config.hidden_size
    wq, bq = _affine(attention.q_proj, width)
    wk, bk = _affine(attention.k_proj, width)
    wv, bv = _affine(attention.v_proj, width)
    uses_keys = getattr(attention, "k_norm", None) is None
    w = torch.cat([wk, wv]) if uses_keys else wv
    b = torch.cat([bk, bv]) if uses_keys else bv
    pinv = torch.linalg.pinv(w)  # [width, rows of w]
    M = wq @ pinv
    return M, bq - M @ b, uses_keys


def removed_exposure(model, cache, old_rows: Sequence[int], removed: Sequence[int], shifter,
                     layers: Sequence[int] | None = None) -> torch.Tensor:
    """Estimated attention mass of each stale row on the removed rows, ``[S]`` fp32 in [0, 1].

    Args:
        model: the causal LM (transformers 5.x decoder with ``q_proj``/``k_proj``/``v_proj``).
        cache: the dirty (pre-edit) cache; its row r was computed at position r.
        old_rows: the dirty row of each stale row, ``S`` strictly increasing ints.
        removed: dirty rows the edit removed (not kept in the new prompt).
        shifter: the model's :class:`kvmemory.shift.RotaryShifter` (rotates keys and queries).
        layers: decoder layers to probe (default :func:`probe_layers`).

    Raises:
        ValueError: a model whose keys cannot be rotated (``shifter`` None); use another allocator.
    """
    if shifter is None:
        raise ValueError("the exposure allocator rotates keys and needs a rotary model; use sur")
    S = len(old_rows)
    if not len(removed) or not S:
        return torch.zeros(S)
    config = model.config.get_text_config()
    decoder = model.get_decoder().layers
    layers = probe_layers(len(decoder)) if layers is None else layers
    rows = torch.as_tensor(list(old_rows), dtype=torch.long)
    gone = torch.as_tensor(list(removed), dtype=torch.long)
    total = torch.zeros(S)
    for layer in layers:
        total += _layer_exposure(decoder[layer].self_attn, config, cache.layers[layer], rows, gone, shifter,
                                 shifter.layer_type(layer))
    return total / len(layers)


def _layer_exposure(attention, config, cached, rows, gone, shifter, kind) -> torch.Tensor:
    H, KVH, D = config.num_attention_heads, config.num_key_value_heads, _head_dim(config)
    last = int(rows[-1]) + 1
    keys = cached.keys[0, :, :last].float()  # [KVH, last, D], rotated at their rows
    M, c, uses_keys = query_estimator(attention, config)
    zeros = torch.zeros_like(rows)
    values = cached.values[0][:, rows].float().transpose(0, 1).reshape(len(rows), -1)
    if uses_keys:
        unrotated = shifter.apply(keys[None][:, :, rows], shifter.coefficients(rows, zeros, kind))[0]
        values = torch.cat([unrotated.transpose(0, 1).reshape(len(rows), -1), values], dim=1)
    q = (values @ M.T + c).reshape(len(rows), H, D).transpose(0, 1)  # [H, S, D]
    q_norm = getattr(attention, "q_norm", None)
    if q_norm is not None:
        with torch.no_grad():
            q = q_norm(q.to(next(q_norm.parameters()).dtype)).float()
    q = shifter.apply(q[None], shifter.coefficients(zeros, rows, kind))[0]
    scale = getattr(attention, "scaling", D**-0.5)
    keys = keys.repeat_interleave(H // KVH, dim=0)  # head h reads kv head h // (H / KVH)
    out = torch.empty(len(rows))
    for a in range(0, len(rows), ROW_BLOCK):
        block = rows[a : a + ROW_BLOCK]
        logits = (q[:, a : a + ROW_BLOCK] @ keys.transpose(1, 2)) * scale  # [H, b, last]
        visible = torch.arange(last)[None] <= block[:, None]
        weights = logits.masked_fill_(~visible[None], float("-inf")).softmax(dim=-1)
        out[a : a + ROW_BLOCK] = weights[..., gone].sum(dim=-1).mean(dim=0)
    return out
