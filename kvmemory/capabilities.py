"""What kvmemory may do with a model's cache rows, decided from its config.

Edits are repaired by moving and reusing rows only where that is exact in structure: full
attention layers with a static rotary embedding. Anything else falls back to exact
recomputation (Replay from the first changed token, or Re-prefill) with the reason reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .positions import shift_unsupported_reason

_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class Capabilities:
    """``row_reuse_reason``: why old rows may not be kept after an edit (None: they may);
    ``shift_reason``: why keys may not be rotated to new positions (None: they may);
    ``notes``: facts worth reporting that change nothing (e.g. mixture-of-experts)."""

    row_reuse_reason: str | None
    shift_reason: str | None
    notes: tuple[str, ...] = field(default_factory=tuple)


def model_capabilities(config, max_position: int | None = None) -> Capabilities:
    """Inspect a transformers config (text part for multimodal models).

    Args:
        max_position: largest position the cache will hold (tokens), for rope types whose
            angles depend on the sequence length.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = set(getattr(text, "layer_types", None) or [])
    reuse = None
    if layer_types - {"full_attention"}:
        kinds = ", ".join(sorted(layer_types - {"full_attention"}))
        reuse = (
            f"the model has {kinds} layers, whose cached rows cannot be moved or spliced; "
            "kvmemory re-prefills after an edit (exact)"
        )
    elif not layer_types and getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        reuse = "the model uses sliding-window attention; kvmemory re-prefills after an edit (exact)"
    if _rope_section(text):
        reuse = reuse or "multimodal rotary positions (mrope) cannot be shifted; kvmemory re-prefills after an edit (exact)"
    notes = []
    if any((getattr(text, f, 0) or 0) > 1 for f in _EXPERT_FIELDS):
        notes.append("mixture-of-experts model: repaired with the sequential executor (ordinary forwards)")
    return Capabilities(row_reuse_reason=reuse, shift_reason=shift_unsupported_reason(text, max_position), notes=tuple(notes))


def _rope_section(text_config) -> bool:
    params = getattr(text_config, "rope_parameters", None) or {}
    return bool(params.get("mrope_section")) if isinstance(params, dict) else False
