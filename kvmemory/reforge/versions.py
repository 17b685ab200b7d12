"""Adapter version identity: per-layer content digests of what every active peft adapter adds to
the model (weights + scaling), the flattened adapter anchor θ, the per-layer version table of a
(possibly mixed-version) cache, and the digest of the base weights (model identity).

A version is named by the function the adapters compute, never by an adapter's name: reloading
new weights under the same name, changing a LoRA scale, switching the active adapter
(``set_adapter``), disabling the adapters (``with model.disable_adapter():``) or merging them all
give a new digest (CacheReforge §Methodology, "Each cached layer stores a per-layer adapter
anchor"). Adapters that are loaded but inactive compute nothing and are not part of the version;
with every adapter disabled the version equals that of the model without adapters (``base``).
"""

from __future__ import annotations

import functools
import hashlib
import re
import weakref
from dataclasses import dataclass, field

import torch

from ..engine.dense import parameter_value

_LAYER_RE = re.compile(r"layers\.(\d+)\.")
# Module kind by projection name (eq. S4): K/V write the cache of their own layer; Q, O and MLP
# only change what later layers see.
MODULE_KINDS = {
    "k_proj": "K", "v_proj": "V", "q_proj": "Q", "o_proj": "O",
    "gate_proj": "MLP", "up_proj": "MLP", "down_proj": "MLP",
}
NO_ADAPTER = "base"
_SCALAR = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class LoraModule:
    """One peft adapter layer (a LoRA-wrapped linear, embedding, or any other peft tuner layer):
    ``name`` (dotted path in the model), decoder ``layer`` (None: outside the decoder stack, e.g.
    embeddings), ``kind`` (K, V, Q, O, MLP or other)."""

    name: str
    layer: int | None
    kind: str
    module: torch.nn.Module = field(repr=False, compare=False)
    containers: tuple = field(default=(), repr=False, compare=False)  # (name, ModuleDict | ParameterDict)

    @classmethod
    def of(cls, name: str, module: torch.nn.Module) -> "LoraModule":
        match = _LAYER_RE.search(name)
        return cls(name, int(match.group(1)) if match else None, MODULE_KINDS.get(name.rsplit(".", 1)[-1], "other"),
                   module, tuple(_containers(module)))

    def adapters(self) -> list[str]:
        """Names of the adapters loaded on this module (active or not)."""
        return sorted({a for _, container in self.containers for a in container.keys()})

    def computing(self) -> list[str]:
        """Adapters whose weights this module adds to its output now, in application order: none
        while adapters are disabled; the merged ones while merged (peft then runs the base layer
        alone); else the active adapters loaded here."""
        mod = self.module
        if getattr(mod, "disable_adapters", False):
            return []
        merged = list(getattr(mod, "merged_adapters", []) or [])
        if merged:
            return merged
        return [a for a in getattr(mod, "active_adapters", []) if any(a in c for _, c in self.containers)]

    def tensors(self, adapter: str) -> list[tuple[str, torch.Tensor]]:
        """``(container.name, tensor)`` of ``adapter`` on this module (LoRA: ``lora_A.weight``
        ``[r, in]``, ``lora_B.weight`` ``[out, r]``, embedding / DoRA / bias tensors where present)."""
        out = []
        for cname, container in self.containers:
            if adapter not in container:
                continue
            entry = container[adapter]
            if isinstance(entry, torch.Tensor):
                out.append((cname, entry))
            else:
                out += [(f"{cname}.{n}", t) for n, t in sorted(entry.state_dict(keep_vars=True).items())]
        return out

    def settings(self, adapter: str) -> list[str]:
        """Per-adapter settings held in plain dicts (r, alpha, scaling, use_rslora, lora_bias, the
        LoRA variant...) as text. Dropout modules are left out: they act only in training mode."""
        out = []
        attrs = vars(self.module)  # plain attributes only: no nn.Module __getattr__ walk
        for pname in getattr(self.module, "other_param_names", ()):
            values = attrs.get(pname)
            if isinstance(values, dict) and adapter in values:
                value = values[adapter]
                out.append(f"{pname}={value!r}" if isinstance(value, _SCALAR) else f"{pname}:{type(value).__name__}")
        variant = attrs.get("lora_variant", {}).get(adapter)
        if variant is not None:
            out.append(f"variant={type(variant).__name__}")
        return out

    def scaling(self, adapter: str) -> float:
        """LoRA scale of ``adapter`` (1.0 for tuners without one)."""
        scaling = getattr(self.module, "scaling", None)
        return float(scaling[adapter]) if isinstance(scaling, dict) and adapter in scaling else 1.0

    def trainable(self, adapter: str | None = None) -> bool:
        """Whether a parameter of ``adapter`` (None: of any adapter) on this module requires grad."""
        names = self.adapters() if adapter is None else [adapter]
        return any(t.requires_grad for a in names for _, t in self.tensors(a))


def _containers(module) -> list[tuple[str, torch.nn.ModuleDict | torch.nn.ParameterDict]]:
    """The per-adapter containers of a peft tuner layer (``adapter_layer_names``, dotted paths
    resolved), e.g. ``lora_A`` / ``lora_B`` / ``lora_embedding_A`` / ``lora_magnitude_vector``."""
    out = []
    children = dict(module.named_children())  # one pass: cheaper than nn.Module.__getattr__ per name
    for cname in module.adapter_layer_names:
        head, *rest = cname.split(".")
        container = children.get(head)
        for part in rest:
            container = getattr(container, part, None)
        if isinstance(container, (torch.nn.ModuleDict, torch.nn.ParameterDict)):
            out.append((cname, container))
    return out


def _is_tuner_layer(module) -> bool:
    """A peft tuner layer (LoRA and the others): duck-typed so plain models never import peft."""
    return bool(getattr(type(module), "adapter_layer_names", None)) and hasattr(module, "active_adapters")


def lora_modules(model, adapter: str | None = None) -> list[LoraModule]:
    """The peft adapter layers of ``model`` that carry ``adapter`` (None: any adapter), in name order.

    Raises:
        ValueError: an adapter computing on a module uses DoRA (CacheReforge versions plain LoRA).
    """
    found = []
    # named from the transformers model peft wraps: a PeftModel and the model it wraps give one version
    root = model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model
    for name, module in root.named_modules():
        if not _is_tuner_layer(module):
            continue
        m = LoraModule.of(name, module)
        if adapter is not None and adapter not in m.adapters():
            continue
        if any(vars(module).get("use_dora", {}).values()) and any(module.use_dora.get(a) for a in m.computing()):
            raise ValueError(f"{name} uses DoRA; CacheReforge versions plain LoRA only (set use_dora=False)")
        found.append(m)
    return sorted(found, key=lambda m: m.name)


def _digest(parts: list) -> str:
    """sha256 (20 hex chars) of length-prefixed byte strings / buffers."""
    h = hashlib.sha256()
    for p in parts:
        h.update(memoryview(p).nbytes.to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()[:20]


def _tensor_bytes(t: torch.Tensor):
    """The fp32 values of ``t`` as a buffer (no copy for contiguous fp32 CPU tensors)."""
    return t.detach().to("cpu", torch.float32).contiguous().numpy()


@dataclass(frozen=True)
class AdapterState:
    """A snapshot of what the adapters compute: ``digest`` names the version; ``layer_digests[ℓ]``
    covers every adapter module of decoder layer ℓ and ``kv_digests[ℓ]`` only its K/V projections
    (``"base"``: no adapter computes there); ``outer_digest`` covers modules outside the decoder
    stack; ``vector`` is θ, the flattened fp32 adapter parameters ``[P]`` (per module and computing
    adapter: A, then scaling·B, then any other adapter tensor), and ``layout`` names its
    parametrisation (module, adapter and tensor names, shapes): two versions are compared by the
    distance ‖θ − θ'‖ only when their layouts are equal. ``vector`` and ``layout`` are None for a
    version restored from a stored state (digests only: it compares with nothing). ``active``:
    the computing adapters' names; ``disabled``: adapters are loaded but disabled."""

    digest: str
    layer_digests: tuple[str, ...]
    kv_digests: tuple[str, ...]
    outer_digest: str
    vector: torch.Tensor | None = field(default=None, repr=False, compare=False)
    layout: str | None = field(default=None, compare=False)
    active: tuple[str, ...] = field(default=(), compare=False)
    disabled: bool = field(default=False, compare=False)

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

    def comparable(self, other: "AdapterState") -> bool:
        """Whether d = ‖θ_self − θ_other‖ means something: both θ known, same layout (the same
        adapters computing on the same modules with the same shapes)."""
        return self.layout is not None and self.layout == other.layout and \
            self.vector is not None and other.vector is not None

    def distance(self, other: "AdapterState") -> float:
        """d = ‖θ_self − θ_other‖₂ (eq. 8), in parameter units.

        Raises:
            ValueError: the versions are not :meth:`comparable` (different adapters computing,
                or a restored version without θ): recompute the affected layers instead.
        """
        if not self.comparable(other):
            raise ValueError("adapter layouts differ (other adapters active or disabled, another LoRA config, or a "
                             "version restored without θ): no distance; recompute the affected cache layers")
        return float(torch.linalg.vector_norm(self.vector - other.vector))

    def record(self) -> dict:
        """The digests as JSON-able data (what a stored cache state keeps; θ is not stored)."""
        return {"layers": list(self.layer_digests), "kv": list(self.kv_digests), "outer": self.outer_digest}

    @classmethod
    def from_record(cls, digest: str, record: dict, num_layers: int) -> "AdapterState":
        """Inverse of :meth:`record` (no θ: the result is comparable with no other version).

        Raises:
            ValueError: malformed record, wrong layer count, or digests that do not make ``digest``.
        """
        try:
            layers, kv, outer = tuple(map(str, record["layers"])), tuple(map(str, record["kv"])), str(record["outer"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed adapter version record {record!r}") from exc
        if len(layers) != num_layers or len(kv) != num_layers:
            raise ValueError(f"adapter version {digest} describes {len(layers)} layers, the model has {num_layers}")
        if _version_digest(outer, layers) != digest:
            raise ValueError(f"adapter version {digest} does not match its per-layer digests")
        return cls(digest, layers, kv, outer)


def _version_digest(outer: str, layer_digests: tuple[str, ...]) -> str:
    if outer == NO_ADAPTER and all(d == NO_ADAPTER for d in layer_digests):
        return NO_ADAPTER  # nothing computes: the version of the model without adapters
    return _digest([d.encode() for d in (outer, *layer_digests)])


@functools.lru_cache(maxsize=8)
def base_state(num_layers: int) -> AdapterState:
    """The version of a model with no adapter computing (plain, or every adapter disabled)."""
    base = (NO_ADAPTER,) * num_layers
    return AdapterState(NO_ADAPTER, base, base, NO_ADAPTER, torch.zeros(0), _digest([]))


def unknown_state(num_layers: int) -> AdapterState:
    """A version no model computes (rows of unknown provenance): every layer compares unequal."""
    unknown = ("unknown",) * num_layers
    return AdapterState("unknown", unknown, unknown, "unknown")


def capture_adapter(model, num_layers: int) -> AdapterState | None:
    """Snapshot every computing adapter of ``model`` (None when the model has no peft adapter
    layers at all; :func:`base_state` when it has some but none computes).

    Args:
        num_layers: decoder layers N (``config.num_hidden_layers``).
    Cost: one pass over the computing adapters' weights (sha256 + θ copy; ~30-50 ms for LoRA
    r=8 on the 210 projections of SmolLM2-135M, 2.4 M parameters, on one CPU core).

    Raises:
        ValueError: a computing adapter uses DoRA.
    """
    modules = lora_modules(model)
    if not modules:
        return None
    per_layer: list[list[bytes]] = [[] for _ in range(num_layers)]
    per_kv: list[list[bytes]] = [[] for _ in range(num_layers)]
    outer: list[bytes] = []
    flat, layout, active = [], [], set()
    for m in modules:
        computing = m.computing()
        if not computing:
            continue  # the base layer alone: the same function as without adapters
        active.update(computing)
        module_digest = _module_digest(m, computing, flat, layout).encode()
        if m.layer is None or m.layer >= num_layers:
            outer.append(module_digest)
        else:
            per_layer[m.layer].append(module_digest)
            if m.kind in ("K", "V", "other"):  # unknown kinds are treated as cache-writing (conservative)
                per_kv[m.layer].append(module_digest)
    if not flat:
        return base_state(num_layers)
    layer_digests = tuple(_digest(p) if p else NO_ADAPTER for p in per_layer)
    kv_digests = tuple(_digest(p) if p else NO_ADAPTER for p in per_kv)
    outer_digest = _digest(outer) if outer else NO_ADAPTER
    disabled = any(getattr(m.module, "disable_adapters", False) for m in modules)
    return AdapterState(_version_digest(outer_digest, layer_digests), layer_digests, kv_digests, outer_digest,
                        torch.cat(flat).cpu(), _digest(layout), tuple(sorted(active)), disabled)


def _module_digest(m: LoraModule, computing: list[str], flat: list, layout: list) -> str:
    """Digest of what ``computing`` adapters add on module ``m`` (settings, tensor names, shapes
    and values; adapter names left out: a version is the function). Appends θ's pieces (A,
    scaling·B, other tensors, fp32 flat) to ``flat`` and their names to ``layout``."""
    header = [m.name, "merged" if getattr(m.module, "merged_adapters", None) else ""]
    values = []
    for adapter in computing:
        scale = m.scaling(adapter)
        header += m.settings(adapter)
        for tname, t in m.tensors(adapter):
            shaped = f"{tname}{tuple(t.shape)}"
            header.append(shaped)
            values.append(_tensor_bytes(t))
            weight = scale * t.detach().float() if tname == "lora_B.weight" else t.detach().float()
            flat.append(weight.flatten())
            layout.append(f"{m.name}/{adapter}/{shaped}".encode())
    return _digest(["|".join(header).encode(), *values])


_WEIGHTS_DIGESTS: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


def base_weights_digest(model) -> str:
    """sha256 (hex, 20 chars) of the model's base weights: every parameter that is not an adapter
    tensor, in registration order, with its dtype and shape (names are left out, so the digest
    is the same before and after peft wraps the model).

    Computed once per model object and cached (weakly): ~0.5 s per GB of weights on CPU (538 MB
    for SmolLM2-135M fp32), plus a device-to-host copy for accelerator weights. In-place edits of
    base weights after the first call are not seen (merging adapters is tracked by the adapter
    version instead).
    """
    cached = _WEIGHTS_DIGESTS.get(model)
    if cached is not None:
        return cached
    adapter_tensors = {id(t) for m in lora_modules(model) for a in m.adapters() for _, t in m.tensors(a)}
    h = hashlib.sha256()
    for p in model.parameters():
        if id(p) in adapter_tensors:
            continue
        t = parameter_value(p).to("cpu").contiguous()  # a weight the engine released, dequantized
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    digest = h.hexdigest()[:20]
    _WEIGHTS_DIGESTS[model] = digest
    return digest


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

    def adopt(self, state: AdapterState) -> None:
        """Use ``state`` (with θ) for layers anchored to a snapshot of the same digest (e.g. one
        restored without θ), so later updates compare by distance again."""
        if state.digest in self._states:
            self._states[state.digest] = state

    def clear(self) -> None:
        self.layer_versions = [None] * self.num_layers
        self._states = {}

    def distances(self, current: AdapterState) -> list[float]:
        """d_ℓ(t) = ‖θ_t − θ_ℓ^anchor‖₂ per layer (eq. 8); 0 for layers without a cache and
        ``inf`` where the anchor is not comparable with ``current`` (see :meth:`incomparable`)."""
        cache: dict[str, float] = {}
        out = []
        for v in self.layer_versions:
            if v is None:
                out.append(0.0)
                continue
            if v not in cache:
                state = self._states[v]
                cache[v] = current.distance(state) if current.comparable(state) else float("inf")
            out.append(cache[v])
        return out

    def incomparable(self, current: AdapterState, layers) -> list[int]:
        """Those of ``layers`` whose anchor cannot be compared with ``current`` by a distance
        (other adapters computing, or restored without θ): they must be recomputed."""
        return [x for x in layers if (a := self.anchor(x)) is not None and a.digest != current.digest
                and not current.comparable(a)]

    def records(self) -> dict | None:
        """``{"layer_versions": [digest per layer], "versions": {digest: record}}`` for a stored
        state, or None when a layer has no anchor."""
        if any(v is None for v in self.layer_versions):
            return None
        return {"layer_versions": list(self.layer_versions),
                "versions": {d: s.record() for d, s in self._states.items()}}

    def restore(self, records: dict) -> None:
        """Inverse of :meth:`records`: the anchors of a restored cache (digests only, no θ).

        Raises:
            ValueError: malformed records or a layer count that is not this model's.
        """
        try:
            layer_versions = [str(v) for v in records["layer_versions"]]
            states = {str(d): AdapterState.from_record(str(d), r, self.num_layers)
                      for d, r in records["versions"].items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed adapter versions ({exc!r})") from exc
        if len(layer_versions) != self.num_layers or any(v not in states for v in layer_versions):
            raise ValueError(f"adapter versions name {len(layer_versions)} layers (model: {self.num_layers}) "
                             "or a version they do not describe")
        self.layer_versions, self._states = layer_versions, states

    def report(self, current: AdapterState | None) -> VersionReport:
        versions = [v or NO_ADAPTER for v in self.layer_versions]
        cur = current.digest if current else None
        stale = [i for i, v in enumerate(self.layer_versions) if v is not None and v != cur]
        return VersionReport(versions, cur, stale, len(set(versions)) > 1)
