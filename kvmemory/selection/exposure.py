"""Exposure to the removed rows, estimated from the cache alone (our extension beyond the paper).

Why: a stale row's K/V is wrong by as much as that row attended to what the edit removed.
Cache-Craft's signal (Table 1, Cache-Craft-Adapted) measures that attention by replaying the
dirty suffix, which costs more than Replay. On Qwen2.5-0.5B Erasing-NIAH the rows it ranks first
hold most of the clean-state oracle's K/V deviation, where SUR's do not
(``benchmarks/results/oracle_row_overlap/``).

This module estimates the same attention without a forward over the prompt. A row's cached key
and value at layer l are functions of its normalised hidden state, and so is its query: the
query is predicted from ``[k; v]`` (key un-rotated) by a linear map fitted once per model and
layer (ridge regression on a fixed calibration text, :data:`CALIBRATION_TEXT`, a forward of
about 550 tokens through the probed layers). The predicted query, rotated to the row's
position, attends over the cache's keys of that layer; the score is the mass on the target
rows (the removed ones), averaged over heads and the probed layers (every other layer,
:func:`probe_layers`). Per repair: ``S × N`` attention logits per head and probed layer; no
decoder layer runs. (Scoring the inserted text as well, in the edited prompt, was measured and
changed no answer: ``benchmarks/results/fidelity_qwen/README.md``.)

It is a selector: it chooses which rows the exact refresh recomputes; a poor estimate costs
fidelity, never exactness of the rows refreshed.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Sequence

import torch

ROW_BLOCK = 256  # stale rows per attention block (bounds the [heads, block, N] logits)
RIDGE = 0.1  # ridge penalty, relative to the mean squared feature (~550 calibration rows, 250-400 features)

# Neutral text of the kinds an agent's history holds (prose, a tool result, numbers, code); its
# only use is to fit the query predictor, so it must be fixed (the same fit on every run).
CALIBRATION_TEXT = """The committee met on Tuesday to review the quarterly report. Revenue rose by 4.2 percent,
while costs fell slightly after the new supplier contract took effect in March. Several members
asked why the northern office had missed its hiring target, and the manager explained that two
candidates had declined offers at the last minute. The discussion then turned to the budget for
next year, which will include a modest increase for training and a new line for cloud services.
<tool_response>
{"city": "Lisbon", "temperature_c": 18, "humidity": 0.71, "forecast": ["rain", "clouds", "sun"]}
</tool_response>
Question: which of the two rivers is longer, and by how many kilometres? Answer briefly.
The Douro is about 897 km long and the Tagus about 1,007 km, so the Tagus is longer by 110 km.
def mean(values):
    total = sum(values)
    return total / len(values) if values else 0.0
In the spring the garden fills with tulips, and the old apple tree at the far end of the lawn
blossoms for a week before the petals cover the path. My grandmother kept bees there for thirty
years; she said they were calmer than people and far better at keeping accounts. The special code
for the archive room is 7342, written on a card taped inside the first drawer of the desk.
<tool_response>
Search results for "battery recycling": 1. A 2023 survey found that fewer than half of used
lithium cells are collected. 2. Smelting recovers cobalt and nickel but loses most lithium.
3. Direct recycling keeps the cathode structure intact and uses far less energy.
</tool_response>
User: Summarise the three results in one sentence, then list two open questions.
Assistant: Most used cells are never collected, and of the two recovery routes, smelting wastes
lithium while direct recycling saves energy. Open questions: how to raise collection rates, and
whether direct recycling scales to mixed chemistries.
SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON orders.customer_id = customers.id
GROUP BY name ORDER BY orders DESC LIMIT 10;
The ship left the harbour at dawn. By noon the wind had turned, and the captain ordered the crew
to reef the mainsail; the passengers, who had been promised a calm crossing, gathered below and
played cards until the lights of the island appeared on the horizon shortly after nine."""

class _Captured(Exception):
    """Ends the calibration forward once the last probed layer's input is kept."""


_FITS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def probe_layers(num_layers: int) -> tuple[int, ...]:
    """The layers probed by default: every other layer (1, 3, 5, ...; layer 0 for a one-layer model).

    Why so many: rows read the removed text at different depths, and the average over many layers
    ranks them as the true attention does. On 4 Erasing-NIAH 2 K cases of a seed that no result
    reports (Qwen2.5-Coder-0.5B, ``benchmarks/results/oracle_row_overlap/niah2k_seed1``) the top
    10 % by this estimate held 0.94 of the clean-state oracle's deviation mass, the true attention
    averaged over the same layers 0.94; a quarter, half and three quarters of the depth held 0.75."""
    return tuple(range(1, num_layers, 2)) or (0,)


def _dims(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads, config.num_key_value_heads, head_dim


def _projections(attention, x: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pre-rotary q ``[n, H·D]``, k ``[n, KVH·D]`` (after q_norm / k_norm where the layer has
    them, as cached) and v ``[n, KVH·D]`` of normalised hidden states ``x`` ``[n, hidden]``."""
    H, KVH, D = _dims(config)
    n = x.shape[0]
    q = attention.q_proj(x).view(n, H, D)
    k = attention.k_proj(x).view(n, KVH, D)
    if getattr(attention, "q_norm", None) is not None:
        q, k = attention.q_norm(q), attention.k_norm(k)
    return q.reshape(n, -1).float(), k.reshape(n, -1).float(), attention.v_proj(x).reshape(n, -1).float()


def fit_query_predictors(model, token_ids: Sequence[int], layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """Per layer, ``A`` ``[2·KVH·D + 1, H·D]`` with ``q ≈ [k; v; 1] A`` (ridge regression over the
    rows of one forward of ``token_ids``, stopped after the last probed layer). Memoised per model,
    layers and ids; an adapter update keeps the old fit (a selection estimate only)."""
    key = (tuple(layers), tuple(token_ids))
    fits = _FITS.setdefault(model, {})
    if key in fits:
        return fits[key]
    decoder, states = model.get_decoder().layers, {}

    def keep(module, args, kwargs, layer):
        states[layer] = (args[0] if args else kwargs["hidden_states"])[0]
        if layer == max(layers):
            raise _Captured  # the layers above are not needed

    handles = [decoder[l].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs, l=l: keep(module, args, kwargs, l), with_kwargs=True) for l in layers]
    try:
        device = model.get_input_embeddings().weight.device
        with torch.no_grad(), contextlib.suppress(_Captured):
            model(input_ids=torch.as_tensor([list(token_ids)], device=device), use_cache=False)
        config = model.config.get_text_config()
        out = {}
        for l in layers:
            with torch.no_grad():
                q, k, v = (t.cpu() for t in _projections(decoder[l].self_attn, states[l], config))
            features = torch.cat([k, v, torch.ones(len(k), 1)], dim=1)
            gram = features.T @ features
            gram += RIDGE * features.square().mean() * torch.eye(len(gram))
            out[l] = torch.linalg.solve(gram, features.T @ q)
    finally:
        for h in handles:
            h.remove()
    fits[key] = out
    return out


def estimated_exposure(model, cache, rows: Sequence[int], targets: Sequence[int], shifter,
                       calibration_ids: Sequence[int], layers: Sequence[int] | None = None) -> torch.Tensor:
    """Estimated attention mass of each stale row on the target rows, ``[S]`` fp32 in [0, 1].

    Args:
        model: the causal LM (transformers 5.x decoder with ``q_proj``/``k_proj``/``v_proj``).
        cache: its row r was computed (or rotated) at position r: the dirty (pre-edit) cache, or
            the Shift cache with the inserted rows computed.
        rows: the row of each stale row in ``cache``, ``S`` strictly increasing ints.
        targets: rows of ``cache`` whose attention mass is scored (the removed rows of the dirty
            cache, or the inserted rows of the edited prompt).
        shifter: the model's :class:`kvmemory.shift.RotaryShifter` (rotates keys and queries).
        calibration_ids: the tokens the query predictor is fitted on (:data:`CALIBRATION_TEXT`
            tokenized by the model's tokenizer; :func:`fit_query_predictors`).
        layers: decoder layers to probe (default :func:`probe_layers`).

    Raises:
        ValueError: a model whose keys cannot be rotated (``shifter`` None); use another allocator.
    """
    if shifter is None:
        raise ValueError("the exposure allocator rotates keys and needs a rotary model; use sur")
    S = len(rows)
    if not len(targets) or not S:
        return torch.zeros(S)
    decoder = model.get_decoder().layers
    layers = probe_layers(len(decoder)) if layers is None else tuple(layers)
    fits = fit_query_predictors(model, calibration_ids, layers)
    config = model.config.get_text_config()
    queries = torch.as_tensor(list(rows), dtype=torch.long)
    scored = torch.as_tensor(list(targets), dtype=torch.long)
    zeros = torch.zeros_like(queries)
    rotations = {}  # per rope kind: (to position 0, back to the rows), shared by its layers
    total = torch.zeros(S)
    for layer in layers:
        kind = shifter.layer_type(layer)
        if kind not in rotations:
            rotations[kind] = (shifter.coefficients(queries, zeros, kind), shifter.coefficients(zeros, queries, kind))
        scale = getattr(decoder[layer].self_attn, "scaling", None)
        total += _layer_exposure(fits[layer], config, cache.layers[layer], queries, scored, shifter, rotations[kind],
                                 scale)
    return total / len(layers)


def _layer_exposure(predictor, config, cached, rows, targets, shifter, rotations, scale) -> torch.Tensor:
    H, KVH, D = _dims(config)
    to_zero, back = rotations
    last = int(rows[-1]) + 1
    keys = cached.keys[0, :, :last].float().cpu()  # [KVH, last, D], rotated at their rows
    unrotated = shifter.apply(keys[None][:, :, rows], to_zero)[0]
    values = cached.values[0][:, rows].float().cpu()
    features = torch.cat([unrotated.transpose(0, 1).reshape(len(rows), -1),
                          values.transpose(0, 1).reshape(len(rows), -1), torch.ones(len(rows), 1)], dim=1)
    q = (features @ predictor).reshape(len(rows), H, D).transpose(0, 1)  # [H, S, D]
    q = shifter.apply(q[None], back)[0].view(KVH, H // KVH, len(rows), D)  # head h reads kv head h // (H / KVH)
    keys_t = keys.transpose(1, 2)[:, None]  # [KVH, 1, D, last]
    scale = D**-0.5 if scale is None else scale
    out = torch.empty(len(rows))
    for a in range(0, len(rows), ROW_BLOCK):
        block = rows[a : a + ROW_BLOCK]
        first, end = int(block[0]), int(block[-1]) + 1  # keys before `first` are visible to the whole block
        logits = (q[:, :, a : a + ROW_BLOCK] @ keys_t[..., :end]) * scale  # [KVH, H / KVH, b, end]
        future = torch.arange(first, end)[None] > block[:, None]
        logits[..., first:end].masked_fill_(future, float("-inf"))
        weights = logits.softmax(dim=-1)
        out[a : a + ROW_BLOCK] = weights[..., targets[targets < end]].sum(dim=-1).mean(dim=(0, 1))
    return out
