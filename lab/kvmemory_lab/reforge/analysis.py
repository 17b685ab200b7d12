"""Offline analysis (CacheReforge §Theoretical Analysis, S1.2-S2.2): hybrid executions z^(b),
tail influence T_b (eq. 2), the KL certificate KL ≤ T_b²/4 (eq. 4), the top-1 certificate
T_b < γ/2 (eq. 5) and the empirical recomputation-horizon table (RQ2, Table S2).

Hybrid execution z^(b): refreshed K/V before layer b, historical K/V at ``[b, N)``, and the last
row (the request) computed through every layer under the current adapter. z^(N) = z*, a fresh
prefill under the current adapter whenever the restart boundary state is valid.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from kvmemory import kvcache
from kvmemory.engine import forward_rows
from kvmemory.reforge.recovery import embed, run_layers
from kvmemory.reforge.versions import AdapterState

from ..metrics import first_token_kl


@dataclass
class HybridRun:
    """``logits[b]``: z^(b) fp32 ``[vocab]`` for every b in ``[start, N]``; ``r_kv``: first
    invalidated cache layer; ``start``: executable restart r."""

    start: int
    r_kv: int
    num_layers: int
    logits: dict[int, torch.Tensor]
    fresh_kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    stale_cache: object  # DynamicCache with rows [0, n-1), historical at every layer

    def hybrid_cache(self, boundary: int):
        """A new cache (rows [0, n-1)) with layers ``[r, boundary)`` refreshed, the rest historical."""
        cache = kvcache.clone_cache(self.stale_cache)
        for layer in range(self.start, min(boundary, self.num_layers)):
            k, v = self.fresh_kv[layer]
            cache.layers[layer].keys[:, :, : k.shape[2]] = k
            cache.layers[layer].values[:, :, : v.shape[2]] = v
        return cache

    @property
    def fresh(self) -> torch.Tensor:
        """z* = z^(N)."""
        return self.logits[self.num_layers]

    def window(self, h: int) -> torch.Tensor:
        """Logits after executing ``h`` layers from r (h = 0: stale reuse), clipped to the suffix."""
        return self.logits[min(self.start + h, self.num_layers)]


def hybrid_executions(session, current: AdapterState | None = None, windows=None) -> HybridRun:
    """Hybrid executions z^(b) for ``session``'s (stale) cache under the active adapter: every
    b = r..N, or only b = r + h for h in ``windows`` (plus N). The session is not modified.
    Cost: one layer run of ``[r, N)`` over the prefix + one one-token forward per boundary.

    Raises:
        ValueError: the session has no cache, or nothing is stale (no update since prefill).
    """
    state = session.reforge
    current = current if current is not None else state.current()
    rows = len(session.token_ids)
    if current is None or rows < 2 or state.anchors.empty:
        raise ValueError("hybrid executions need a prepared session on a LoRA model (at least 2 cached rows)")
    n = state.num_layers
    invalid = [x for x in range(n) if not current.same_cache_layer(state.anchors.anchor(x), x)]
    r_kv = invalid[0] if invalid else n
    start = state.boundaries.valid_start(r_kv, current, rows) if invalid else n
    ids = torch.tensor(session.token_ids, dtype=torch.long)
    stale = kvcache.clone_cache(session.cache)
    kvcache.crop_to(stale, rows - 1)
    hybrid = kvcache.clone_cache(stale)
    fresh_kv = {}
    if start < n:
        hidden = embed(session.model, ids[:-1]) if start == 0 else state.boundaries.states[start].hidden[:, : rows - 1]
        fresh_kv = run_layers(session.model, hidden, start, n).kv
    wanted = set(range(start, n + 1)) if windows is None else {min(start + h, n) for h in windows} | {n}
    logits = {}
    for b in range(start, n + 1):
        if b > start:
            k, v = fresh_kv[b - 1]
            hybrid.layers[b - 1].keys[:, :, : rows - 1] = k
            hybrid.layers[b - 1].values[:, :, : rows - 1] = v
        if b in wanted:
            logits[b] = forward_rows(session.model, hybrid, ids[-1:], rows - 1)
            kvcache.crop_to(hybrid, rows - 1)
    return HybridRun(start, r_kv, n, logits, fresh_kv, stale)


def tail_influence(run: HybridRun) -> dict[int, float]:
    """T_b = Σ_{ℓ=b}^{N−1} ‖z^(ℓ) − z^(ℓ+1)‖₂ (eq. 2) for every b in ``[r, N]`` (T_N = 0).

    Raises:
        ValueError: ``run`` holds only some boundaries (pass ``windows=None``).
    """
    if len(run.logits) != run.num_layers - run.start + 1:
        raise ValueError("tail influence needs every hybrid execution: call hybrid_executions(..., windows=None)")
    out = {run.num_layers: 0.0}
    total = 0.0
    for layer in range(run.num_layers - 1, run.start - 1, -1):
        total += float(torch.linalg.vector_norm(run.logits[layer] - run.logits[layer + 1]))
        out[layer] = total
    return out


@dataclass
class Certificate:
    """Checks at boundary b: observed KL(p*‖p^(b)) vs the bound T_b²/4 (eq. 4); the fresh
    margin γ* and whether T_b < γ*/2 (eq. 5) and whether top-1 agrees."""

    boundary: int
    tail: float
    kl: float
    kl_bound: float
    margin: float
    top1_certified: bool
    top1_agrees: bool

    @property
    def kl_holds(self) -> bool:
        return self.kl <= self.kl_bound + 1e-6

    @property
    def top1_holds(self) -> bool:
        """The certificate is sufficient: certified ⇒ agreement."""
        return self.top1_agrees or not self.top1_certified


def certificates(run: HybridRun) -> list[Certificate]:
    """KL and top-1 certificates at every boundary b of ``run``."""
    tails = tail_influence(run)
    fresh = run.fresh
    top2 = torch.topk(fresh, 2).values
    margin = float(top2[0] - top2[1])
    out = []
    for b in range(run.start, run.num_layers + 1):
        t = tails[b]
        out.append(Certificate(
            boundary=b, tail=t, kl=first_token_kl(fresh, run.logits[b]), kl_bound=t * t / 4.0,
            margin=margin, top1_certified=t < margin / 2.0,
            top1_agrees=int(torch.argmax(run.logits[b])) == int(torch.argmax(fresh)),
        ))
    return out


def outcome(first_safe: int | None, suffix: int) -> str:
    """RQ2 outcome of a condition: direct (h* = 0), bounded (0 < h* < N − r) or full."""
    if first_safe == 0:
        return "direct"
    if first_safe is None or first_safe >= suffix:
        return "full"
    return "bounded"


def horizon_table(conditions, num_layers: int) -> dict[str, dict]:
    """The empirical recomputation-horizon table (Table S2) from calibration conditions
    (objects with ``first_safe``, ``restart`` and ``gap``; grouped by gap):
    ``{group: {"suffix_depth", "direct", "bounded", "full", "horizons"}}`` (counts, layers)."""
    rows: dict[str, dict] = {}
    for c in conditions:
        group = f"gap {c.gap}"
        suffix = num_layers - c.restart
        row = rows.setdefault(group, {"suffix_depth": suffix, "direct": 0, "bounded": 0, "full": 0, "horizons": Counter()})
        kind = outcome(c.first_safe, suffix)
        row[kind] += 1
        row["horizons"][suffix if c.first_safe is None else min(c.first_safe, suffix)] += 1
    for row in rows.values():
        row["horizons"] = sorted(row["horizons"])
    return rows
