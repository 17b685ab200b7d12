"""Adapter version identity: per-layer content digests of LoRA weights + scaling, the flattened
adapter anchor θ, and the per-layer version table of a (possibly mixed-version) cache.

A version is named by what the adapter computes, never by its name: reloading new weights under
the same adapter name, or changing a LoRA scale, gives a new digest (CacheReforge §Methodology,
"Each cached layer stores a per-layer adapter anchor").
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import torch

_LAYER_RE = re.compile(r"layers\.(\d+)\.")
# Module kind by projection name (eq. S4): K/V write the cache of their own layer; Q, O and MLP
# only change what later layers see.
MODULE_KINDS = {
    "k_proj": "K", "v_proj": "V", "q_proj": "Q", "o_proj": "O",
    "gate_proj": "MLP", "up_proj": "MLP", "down_proj": "MLP",
}
NO_ADAPTER = "base"


@dataclass(frozen=True)
class LoraModule:
    """One LoRA-wrapped linear layer: ``name`` (dotted path in the model), decoder ``layer``
    (None: outside the decoder stack, e.g. embeddings), ``kind`` (K, V, Q, O, MLP or other)."""

    name: str
    layer: int | None
    kind: str
    module: torch.nn.Module = field(repr=False, compare=False)


def lora_modules(model, adapter: str = "default") -> list[LoraModule]:
    """The LoRA layers of a peft-wrapped model that carry ``adapter``, in name order.

    Raises:
        ValueError: a module uses DoRA (its magnitude vector is not covered by the digest).
    """
    if not any(hasattr(m, "lora_A") for m in model.modules()):
        return []  # no LoRA anywhere: do not import peft for plain models
    from peft.tuners.lora import LoraLayer

    found = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        if getattr(module, "use_dora", {}).get(adapter, False):
            raise ValueError(f"{name} uses DoRA; CacheReforge versions plain LoRA only (set use_dora=False)")
        match = _LAYER_RE.search(name)
        kind = MODULE_KINDS.get(name.rsplit(".", 1)[-1], "other")
        found.append(LoraModule(name, int(match.group(1)) if match else None, kind, module))
    return sorted(found, key=lambda m: m.name)


def _lora_tensors(m: LoraModule, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A ``[r, in]``, B ``[out, r]`` and the scale; a disabled / inactive adapter computes
    nothing, which is recorded as scale 0."""
    mod = m.module
    active = not getattr(mod, "disable_adapters", False) and adapter in getattr(mod, "active_adapters", [adapter])
    return mod.lora_A[adapter].weight, mod.lora_B[adapter].weight, float(mod.scaling[adapter]) if active else 0.0


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()[:20]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


@dataclass(frozen=True)
class AdapterState:
    """A snapshot of the adapter: ``digest`` names the version; ``layer_digests[ℓ]`` covers
    every LoRA module of decoder layer ℓ and ``kv_digests[ℓ]`` only its K/V projections
    (``"base"``: none there); ``outer_digest`` covers modules outside the decoder stack;
    ``vector`` is θ, the flattened fp32 LoRA parameters ``[P]`` (A, then scaling·B, per module)."""

    digest: str
    layer_digests: tuple[str, ...]
    kv_digests: tuple[str, ...]
    outer_digest: str
    vector: torch.Tensor = field(repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layer_digests)

    def same_layers_below(self, other: "AdapterState", layer: int) -> bool:
        """Whether layers ``[0, layer)`` (and the embedding side) compute the same function in
        both versions: then hidden states entering ``layer`` agree (a boundary stays valid)."""
        return self.outer_digest == other.outer_digest and self.layer_digests[:layer] == other.layer_digests[:layer]

    def same_cache_layer(self, other: "AdapterState", layer: int) -> bool:
        """Whether cache layer ``layer`` (its K/V) is identical under both versions (eq. S4: it
        depends on layers below it and on its own K/V projections)."""
        return self.same_layers_below(other, layer) and self.kv_digests[layer] == other.kv_digests[layer]

    def distance(self, other: "AdapterState") -> float:
        """d = ‖θ_self − θ_other‖₂ (eq. 8), in parameter units."""
        if self.vector.shape != other.vector.shape:
            raise ValueError("adapter layouts differ (a different LoRA config): recompute the cache (reset the session)")
        return float(torch.linalg.vector_norm(self.vector - other.vector))


def capture_adapter(model, num_layers: int, adapter: str = "default") -> AdapterState | None:
    """Snapshot the LoRA adapter of ``model`` (None when the model has no LoRA layers).

    Args:
        num_layers: decoder layers N (``config.num_hidden_layers``).
    Cost: one pass over the LoRA weights (sha256; ~20 ms per 2.4 M parameters on CPU).
    """
    modules = lora_modules(model, adapter)
    if not modules:
        return None
    per_layer: list[list[bytes]] = [[] for _ in range(num_layers)]
    per_kv: list[list[bytes]] = [[] for _ in range(num_layers)]
    outer: list[bytes] = []
    flat = []
    for m in modules:
        a, b, scale = _lora_tensors(m, adapter)
        module_digest = _digest([m.name.encode(), _tensor_bytes(a), _tensor_bytes(b), repr(scale).encode()]).encode()
        if m.layer is None or m.layer >= num_layers:
            outer.append(module_digest)
        else:
            per_layer[m.layer].append(module_digest)
            if m.kind in ("K", "V", "other"):  # unknown kinds are treated as cache-writing (conservative)
                per_kv[m.layer].append(module_digest)
        flat += [a.detach().float().flatten(), (scale * b.detach().float()).flatten()]
    layer_digests = tuple(_digest(p) if p else NO_ADAPTER for p in per_layer)
    kv_digests = tuple(_digest(p) if p else NO_ADAPTER for p in per_kv)
    outer_digest = _digest(outer) if outer else NO_ADAPTER
    digest = _digest([d.encode() for d in (outer_digest, *layer_digests)])
    return AdapterState(digest, layer_digests, kv_digests, outer_digest, torch.cat(flat).cpu())


@dataclass
class VersionReport:
    """Which adapter version produced each cache layer. ``layer_versions[ℓ]``: digest;
    ``current``: the active adapter's digest; ``stale_layers``: layers not produced by it;
    ``mixed``: layers differ among themselves."""

    layer_versions: list[str]
    current: str | None
    stale_layers: list[int]
    mixed: bool

    def as_dict(self) -> dict:
        return {"current": self.current, "mixed": self.mixed, "stale_layers": self.stale_layers,
                "versions": sorted(set(self.layer_versions))}


class LayerAnchors:
    """Per-layer adapter anchors θ_ℓ^anchor of one cache (CacheReforge "Cache and anchor updates").

    Each cache layer names the AdapterState that produced it; snapshots are shared between
    layers of the same version, and dropped once no layer refers to them.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.layer_versions: list[str | None] = [None] * num_layers
        self._states: dict[str, AdapterState] = {}

    def clone(self) -> "LayerAnchors":
        other = LayerAnchors(self.num_layers)
        other.layer_versions = list(self.layer_versions)
        other._states = dict(self._states)  # snapshots are immutable
        return other

    @property
    def empty(self) -> bool:
        return all(v is None for v in self.layer_versions)

    def anchor(self, layer: int) -> AdapterState | None:
        """θ_ℓ^anchor: the adapter state that produced cache layer ``layer`` (None: no cache)."""
        v = self.layer_versions[layer]
        return None if v is None else self._states[v]

    def set(self, layers, state: AdapterState) -> None:
        """Anchor ``layers`` (iterable of layer indices) to ``state`` (they were just recomputed)."""
        self._states[state.digest] = state
        for layer in layers:
            self.layer_versions[layer] = state.digest
        live = set(self.layer_versions)
        self._states = {k: s for k, s in self._states.items() if k in live}

    def clear(self) -> None:
        self.layer_versions = [None] * self.num_layers
        self._states = {}

    def distances(self, current: AdapterState) -> list[float]:
        """d_ℓ(t) = ‖θ_t − θ_ℓ^anchor‖₂ per layer (eq. 8); 0 for layers without a cache."""
        cache: dict[str, float] = {}
        out = []
        for v in self.layer_versions:
            if v is None:
                out.append(0.0)
                continue
            if v not in cache:
                cache[v] = current.distance(self._states[v])
            out.append(cache[v])
        return out

    def report(self, current: AdapterState | None) -> VersionReport:
        versions = [v or NO_ADAPTER for v in self.layer_versions]
        cur = current.digest if current else None
        stale = [i for i, v in enumerate(self.layer_versions) if v is not None and v != cur]
        return VersionReport(versions, cur, stale, len(set(versions)) > 1)
