"""Restart layers (eq. S4) and the boundary hidden states retained during prefill.

Bounded recovery re-executes layers ``[r, b)`` from the hidden state entering layer r. That
state is retained while the session prefills (forward pre-hooks on the decoder layers, a public
``nn.Module`` API), follows the same row surgery as the K/V after an edit, and carries the
adapter version that produced it: it is valid for a later adapter only when layers below r are
unchanged. Boundary 0 is the token embedding and is never stored (recomputed from the ids).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .versions import AdapterState, lora_modules


def restart_layers(kind: str, layer: int, num_layers: int) -> tuple[int, int]:
    """Eq. S4 for an update to module ``kind`` (K, V, Q, O, MLP) at layer ``layer`` = s.

    Returns:
        ``(r_kv, r_exec)``: the earliest cache layer that can change (s for K/V, min(s+1, N)
        otherwise; N means no cached layer changes) and the layer execution restarts at (s,
        or N when nothing is invalidated).

    Raises:
        ValueError: ``layer`` outside ``[0, N)``.
    """
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} outside [0, {num_layers})")
    r_kv = layer if kind in ("K", "V", "other") else min(layer + 1, num_layers)
    return r_kv, (layer if r_kv < num_layers else num_layers)


def target_boundaries(model, num_layers: int, adapter: str | None = None) -> tuple[int, ...]:
    """Boundaries the configured update targets need: the execution restart r (eq. S4) of every
    module where ``adapter`` (None: any adapter) has a trainable tensor (``requires_grad``),
    excluding 0 (free) and N (nothing to restart)."""
    out = set()
    for m in lora_modules(model, adapter):
        if m.layer is None or not m.trainable(adapter):
            continue
        _, r = restart_layers(m.kind, m.layer, num_layers)
        if 0 < r < num_layers:
            out.add(r)
    return tuple(sorted(out))


@dataclass
class Boundary:
    """Retained hidden states entering one layer: ``hidden`` ``[1, rows, hidden]`` (model dtype)
    and the adapter version that produced them (the oldest one, when rows mix versions)."""

    hidden: torch.Tensor
    version: AdapterState | None


@dataclass
class BoundaryStore:
    """Hidden states entering the ``layers`` listed, for every cached row (CacheReforge
    "Executable restart")."""

    layers: tuple[int, ...]
    states: dict[int, Boundary] = field(default_factory=dict)

    def clone(self) -> "BoundaryStore":
        return BoundaryStore(self.layers, {k: Boundary(b.hidden.clone(), b.version) for k, b in self.states.items()})

    @property
    def nbytes(self) -> int:
        """Bytes held by the retained states."""
        return sum(b.hidden.numel() * b.hidden.element_size() for b in self.states.values())

    def clear(self) -> None:
        self.states = {}

    def valid_start(self, layer: int, current: AdapterState, rows: int) -> int:
        """The largest boundary ``r' <= layer`` whose state is valid under ``current`` for the
        first ``rows`` rows (0, the embedding, always is)."""
        for r in sorted((x for x in self.states if x <= layer), reverse=True):
            b = self.states[r]
            if b.hidden.shape[1] >= rows and b.version is not None and current.same_layers_below(b.version, r):
                return r
        return 0

    @contextlib.contextmanager
    def recording(self, decoder_layers):
        """Capture the hidden states entering each retained layer during the forwards inside
        the block. Yields the capture list ``[(layer, positions [n], hidden [1, n, H])]``."""
        captures: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        handles = []
        for r in self.layers:
            def hook(module, args, kwargs, r=r):
                hidden = args[0] if args else kwargs["hidden_states"]
                positions = kwargs.get("position_ids")
                if positions is None:  # every kvmemory forward passes position_ids
                    raise RuntimeError("a forward without position_ids: boundary states cannot be placed")
                captures.append((r, positions[0].detach().clone(), hidden.detach().clone()))
            handles.append(decoder_layers[r].register_forward_pre_hook(hook, with_kwargs=True))
        try:
            yield captures
        finally:
            for h in handles:
                h.remove()

    def commit(self, captures, *, source_rows: torch.Tensor | None, rows: int, current: AdapterState | None) -> None:
        """Bring the states to the new cache layout after a forward/repair.

        Args:
            captures: from :meth:`recording` (later captures overwrite earlier ones).
            source_rows: LongTensor ``[m]``, the old row of each new row (-1: computed anew);
                None keeps rows ``[0, min(old, rows))`` in place.
            rows: number of cache rows now.
            current: the adapter version the captured rows were computed under.
        A boundary whose rows are not all covered afterwards is dropped (recovery then starts
        from an earlier boundary or the embedding: slower, still exact).
        """
        for r in self.layers:
            old = self.states.get(r)
            new_caps = [(p, h) for layer, p, h in captures if layer == r]
            if old is None and not new_caps:
                continue
            ref = old.hidden if old is not None else new_caps[0][1]
            hidden = ref.new_zeros((1, rows, ref.shape[-1]))
            filled = torch.zeros(rows, dtype=torch.bool)
            from_old = torch.zeros(rows, dtype=torch.bool)
            if old is not None:
                if source_rows is None:
                    src = torch.arange(min(old.hidden.shape[1], rows))
                else:
                    src = source_rows[:rows]
                    src = torch.where(src < old.hidden.shape[1], src, torch.full_like(src, -1))
                keep = torch.nonzero(src >= 0, as_tuple=True)[0]
                if keep.numel():
                    hidden[:, keep] = old.hidden[:, src[keep]]
                    filled[keep] = True
                    from_old[keep] = True
            for positions, h in new_caps:
                inside = positions < rows
                hidden[:, positions[inside]] = h[:, inside]
                filled[positions[inside]] = True
                from_old[positions[inside]] = False
            if not bool(filled.all()):
                self.states.pop(r, None)
                continue
            # rows still from the old state keep the boundary labelled with the older version
            version = old.version if (old is not None and bool(from_old.any())) else current
            self.states[r] = Boundary(hidden, version)

    def write(self, layer: int, hidden: torch.Tensor, version: AdapterState) -> None:
        """Overwrite the first ``hidden.shape[1]`` rows of boundary ``layer`` (after recovery);
        the boundary takes ``version`` only if every row is now covered by it."""
        if layer not in self.layers:
            return
        old = self.states.get(layer)
        n = hidden.shape[1]
        if old is None or old.hidden.shape[1] <= n:
            self.states[layer] = Boundary(hidden.detach().clone(), version)
            return
        old.hidden[:, :n] = hidden
        # rows past n keep their older version; the boundary stays labelled by the older one
