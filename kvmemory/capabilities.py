"""What kvmemory may do with a model's cache rows, decided from its config (and the cache).

Edits are repaired by moving and reusing rows only where that is exact in structure: full
attention layers with a static rotary embedding and a cache of plain K/V tensors. Anything else
is a capability gate: the edit falls back to exact recomputation, and the reason is logged and
reported (``RepairReport.fallback``, ``response_metadata["repair"]["fallback"]``):

- sliding-window layers (Gemma 3 ``layer_types``, Mistral/Qwen2 ``sliding_window``): no Shift, no
  splicing. Replay from the first changed token while the conversation still fits in the
  smallest window (every sliding layer then holds all its rows, so cropping is exact);
  Re-prefill beyond it (the rows a replay would attend to have left the window).
- multimodal rotary positions (mrope, e.g. Qwen2-VL): no Shift, no splicing; Replay from the
  first changed token with the model's own forward (text positions), at any length.
- length-dependent RoPE (``dynamic`` NTK; ``longrope`` across its boundary): no Shift (the
  angles depend on the sequence length), so Replay; ``dynamic`` past ``max_position_embeddings``
  rescales every earlier key, so only Re-prefill is exact there.
- caches whose layers are not plain tensors (transformers ``QuantizedCache``: quanto, hqq, fp8):
  rows cannot be deleted, moved or rewritten, so an edit, a strict erase and a CacheReforge
  maintenance step all re-prefill into a fresh cache of the same kind (the session's
  ``cache_factory``).
- mixture-of-experts: nothing to refuse for rows (experts are token-local), but the packed
  executor does not run them: the sequential executors do (reported as a note).

Every gate lives here: rows (:func:`model_capabilities`, :func:`cache_unsupported_reason`),
Shift (:func:`shift_unsupported_reason`) and the packed executor
(:func:`packed_unsupported_reason`); the Triton backend's availability is the kernels' own
(``kvmemory.kernels.unavailable_reason``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

from .kvcache import PLAIN_LAYERS

_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# rope types whose angle for position i depends only on i (not on the sequence length), so that
# R_{i-d} R_i^{-1} is a fixed rotation by -d. longrope is static only on one side of its
# original_max_position_embeddings (transformers switches factor sets by sequence length).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
PACKED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
PACKED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # angles depend on the position only
_LAYER_MODULES = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
EXACT = "kvmemory recomputes exactly after an edit"


@dataclass(frozen=True)
class Capabilities:
    """``row_reuse_reason``: why old rows may not be kept after an edit (None: they may);
    ``replay_limit``: when rows may not be reused, Replay from the first changed token is still
    exact while the cache holds fewer rows (tokens) than this (0: never, Re-prefill; inf: always);
    ``shift_reason``: why keys may not be rotated to new positions (None: they may);
    ``notes``: facts worth reporting that change no result (e.g. mixture-of-experts)."""

    row_reuse_reason: str | None
    shift_reason: str | None
    notes: tuple[str, ...] = field(default_factory=tuple)
    replay_limit: float = 0

    def replay_exact(self, cached_rows: int) -> bool:
        """Whether Replay from the first changed token is exact for a cache of ``cached_rows`` rows."""
        return cached_rows < self.replay_limit


def model_capabilities(config, max_position: int | None = None) -> Capabilities:
    """Inspect a transformers config (text part for multimodal models).

    Args:
        max_position: largest 0-based position the cache will hold (tokens), for rope types whose
            angles depend on the sequence length (``dynamic``, ``longrope``).

    Returns:
        Capabilities; never raises for an unsupported model (its gates say what falls back).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    reuse, limit = _sliding_gate(text)
    if reuse is None and _rope_section(text):
        reuse = f"multimodal rotary positions (mrope) cannot be shifted or spliced; {EXACT} (Replay from the edit)"
        limit = math.inf
    if reuse is None:
        reuse = _dynamic_rope_gate(text, max_position)
    notes = []
    if any((getattr(text, f, 0) or 0) > 1 for f in _EXPERT_FIELDS):
        notes.append("mixture-of-experts model: repaired with the sequential executors (ordinary forwards), "
                     "not the packed executor")
    shift = shift_unsupported_reason(text, max_position)
    return Capabilities(row_reuse_reason=reuse, shift_reason=shift, notes=tuple(notes), replay_limit=limit)


def _sliding_gate(text) -> tuple[str | None, float]:
    layer_types = list(getattr(text, "layer_types", None) or [])
    window = getattr(text, "sliding_window", None)
    other = sorted(set(layer_types) - {"full_attention"})
    if other:
        kinds = ", ".join(other)
    elif not layer_types and window and getattr(text, "use_sliding_window", True):
        kinds = "sliding-window attention"
    else:
        return None, 0
    if set(other) <= {"sliding_attention"} and window:
        return (
            f"the model has {kinds} layers (window {window} tokens), whose cached rows cannot be shifted or "
            f"spliced; {EXACT}: Replay from the edit while the conversation is under {window} tokens, "
            "Re-prefill beyond", int(window),
        )
    return f"the model has {kinds} layers, whose cached rows cannot be shifted or spliced; {EXACT} (Re-prefill)", 0


def _dynamic_rope_gate(text, max_position: int | None) -> str | None:
    params = getattr(text, "rope_parameters", None) or {}
    dynamic = isinstance(params, dict) and params.get("rope_type", params.get("type")) == "dynamic"
    limit = getattr(text, "max_position_embeddings", None)
    if dynamic and max_position is not None and limit and max_position + 1 > limit:
        return (
            f"rope_type 'dynamic' rescales every key's angle once the sequence passes max_position_embeddings={limit} "
            f"(this cache reaches position {max_position}), so no cached row matches a Re-prefill; {EXACT} (Re-prefill)"
        )
    return None


def cache_unsupported_reason(cache) -> str | None:
    """Why the rows of ``cache`` cannot be deleted, moved or rewritten in place (None: they can).

    kvmemory's row operations need every layer to hold its rows as plain ``keys`` / ``values``
    tensors ``[batch, kv_heads, seq, head_dim]`` (``DynamicLayer`` or ``DynamicSlidingWindowLayer``).
    A quantized layer (``QuantizedCache`` with the quanto, hqq or fp8 backend) keeps most rows
    in a packed form that ``keys`` does not show, so splicing ``keys`` would silently lose them.
    """
    odd = sorted({type(layer).__name__ for layer in getattr(cache, "layers", []) if type(layer) not in PLAIN_LAYERS})
    if not odd:
        return None
    return (
        f"the cache has {', '.join(odd)} layers, whose rows are not plain K/V tensors (e.g. quantized), so they "
        "cannot be deleted, shifted or rewritten in place; kvmemory recomputes them exactly after an edit, a strict "
        "erase or an adapter update (Re-prefill into a fresh cache of the same kind)"
    )


def _rope_section(text_config) -> bool:
    params = getattr(text_config, "rope_parameters", None) or {}
    return bool(params.get("mrope_section")) if isinstance(params, dict) else False


# ------------------------------------------------------------------ Shift (paper §7.1)
def rope_parameter_sets(config) -> dict[str | None, dict]:
    """RoPE parameter dicts keyed by layer type (``{None: params}`` when one set serves all layers).

    Models such as Gemma 3 nest one dict per attention layer type in ``config.rope_parameters``.
    """
    params = getattr(config, "rope_parameters", None) or {}
    nested_keys = getattr(config, "nested_rope_parameter_keys", None)  # transformers 5.x config mixin
    nested = nested_keys(params) if params and nested_keys else []
    if nested:
        return {key: params[key] for key in nested if params[key] is not None}
    return {None: params} if params else {}


def longrope_boundary(params: dict) -> int:
    return int(params["original_max_position_embeddings"])


def _rope_params_reason(params: dict, config, max_position: int | None) -> str | None:
    """Reason one RoPE parameter dict cannot be shifted exactly, or None."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "dynamic":
        return (
            "rope_type 'dynamic' rescales angles with the sequence length, "
            "so cached keys cannot be rotated exactly"
        )
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} is not a supported static RoPE ({', '.join(STATIC_ROPE_TYPES)})"
    if params.get("mrope_section") is not None:
        return "multimodal RoPE (mrope_section) uses 3-D position ids, which Shift does not handle"
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None and float(partial) < 1.0:
        return (
            f"partial rotary embeddings (partial_rotary_factor={partial}) rotate only part of each head "
            "with a model-specific layout"
        )
    if rope_type == "longrope" and max_position is not None and max_position >= longrope_boundary(params):
        return (
            f"rope_type 'longrope' switches from short to long factors once the sequence passes "
            f"original_max_position_embeddings={longrope_boundary(params)}; a cache reaching position "
            f"{max_position} may hold keys from both factor sets"
        )
    return None


def shift_unsupported_reason(config, max_position: int | None = None) -> str | None:
    """Why cached keys of a model with this config cannot be rotated exactly (paper §7.1 eq. 2).

    Args:
        config: a transformers ``PretrainedConfig`` (a multimodal one is reduced to its text
            config). RoPE settings are read from ``config.rope_parameters`` (transformers 5.x).
        max_position: optional largest 0-based token position the cache has held. Matters only
            for ``longrope``: transformers picks its short or long factor set per forward call from
            that call's largest position, so a cache whose positions 0..max_position reach
            ``original_max_position_embeddings`` may mix both sets and cannot be shifted exactly.

    Returns:
        None when Shift is exact for this config (rope_type default, linear, llama3, yarn, or
        longrope below its boundary, full rotary); otherwise a one-line reason. Never raises for
        an unsupported model; :class:`kvmemory.shift.RotaryShifter` raises
        :class:`kvmemory.errors.ShiftUnsupportedError` with it.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    sets = rope_parameter_sets(config)
    if not sets:
        return "the model config has no rope_parameters, so its keys carry no rotary position to correct"
    for params in sets.values():
        reason = _rope_params_reason(params, config, max_position)
        if reason is not None:
            return reason
    return None


# ------------------------------------------------ the packed executor (Appendix 13)
def packed_unsupported_reason(model) -> str | None:
    """Why the packed executor cannot run ``model`` (None: it can). Checked from the config and
    the module structure, like :func:`model_capabilities`."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in PACKED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of the packed executor's families ({', '.join(PACKED_MODEL_TYPES)})"
    if any((getattr(config, f, 0) or 0) > 1 for f in _EXPERT_FIELDS):
        return "mixture-of-experts layers are not supported by the packed executor"
    reuse = model_capabilities(config).row_reuse_reason
    if reuse:
        return f"not full attention everywhere ({reuse.split(';')[0]})"
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "nested"
    if rope_type not in PACKED_ROPE_TYPES:
        return f"rope_type {rope_type!r} is not a static RoPE the packed executor supports ({', '.join(PACKED_ROPE_TYPES)})"
    if model.training:
        return "the model is in training mode (dropout); call model.eval() to use the packed executor"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return f"the model is spread over several devices ({', '.join(sorted(map(str, devices)))})"
    return _packed_structure_reason(model)


def _packed_structure_reason(model) -> str | None:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if decoder is None or not all(hasattr(decoder, p) for p in parts) or model.get_output_embeddings() is None:
        return "the model does not expose the decoder modules the packed executor calls (custom model forward)"
    if not type(decoder).__module__.startswith("transformers.models."):
        return f"custom decoder class {type(decoder).__name__} (the packed executor calls transformers' own modules)"
    for layer in decoder.layers:
        if not all(hasattr(layer, m) for m in _LAYER_MODULES) or not all(hasattr(layer.self_attn, m) for m in _ATTN_MODULES):
            return f"decoder layer {type(layer).__name__} lacks the norms/projections the packed executor calls"
        if not hasattr(sys.modules[type(layer.self_attn).__module__], "apply_rotary_pos_emb"):
            return f"{type(layer.self_attn).__name__}'s module has no apply_rotary_pos_emb"
    return None
