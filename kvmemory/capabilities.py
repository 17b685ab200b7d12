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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .kvcache import PLAIN_LAYERS
from .shift import shift_unsupported_reason

_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
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
