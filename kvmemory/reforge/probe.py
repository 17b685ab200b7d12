"""The probed maintenance policy for CacheReforge (``probed``; beyond the paper's eq. 9, which
stays the reference policy ``cachereforge``).

Eq. 9 and the drift scheduler (:mod:`kvmemory.reforge.scheduler`) judge staleness from the
adapter's parameter drift alone, which is the same for every prompt and every layer that shares
an anchor. The probed policy measures it on the cache itself: bounded recovery of ``[r, b)``
leaves the fresh hidden states entering layer b, so layer b's would-be fresh K/V are its
``input_layernorm`` + ``k_proj`` / ``v_proj`` (+ RoPE) of those states. Their relative deviation
from the cached K/V of layer b over the last ``rows`` cache rows,

    dev_b = ‖KV_b(fresh) − KV_b(cached)‖ / ‖KV_b(fresh)‖,

is how stale layer b is under this prompt. The rule extends the range one layer at a time:
probe b, recompute b when dev_b ≥ τ_b and the budget account covers it, then probe b + 1 (its
entering states are now fresh). The first probe (layer r) runs from the retained boundary state.

Restart projection (``ProbeCalibration.restart_projection``; beyond the paper): when the update
changed the restart layer's own K/V (a k_proj / v_proj adapter at r, so r = r_kv), those K/V are
``input_layernorm`` + ``k_proj`` / ``v_proj`` of the retained boundary state, which the update
cannot reach. Projecting every row refreshes layer r exactly at ~6 % of a layer (instead of
executing it), and its probed rows' deviation comes with it. The update then looks like a query
update one layer deeper: layer r+1 is probed through layer r for the probed rows only, and the
range grows from there (τ_r gates that probe).
Every probe is charged to the running budget (:class:`~kvmemory.reforge.scheduler.BudgetAccount`)
at its FLOP share of a layer, so recomputed layers + probes never exceed the allowance. τ_ℓ are
fitted offline on calibration trajectories only (``kvmemory_lab.reforge.probe_fit``).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field

from .recovery import decoder_of
from .scheduler import BudgetAccount


class ProbeCalibration(BaseModel):
    """Offline thresholds of the probed policy.

    ``thresholds[ℓ]``: τ_ℓ, the relative K/V deviation (unitless) at which layer ℓ is
    recomputed (None: never extend through ℓ unless forced); ``rows``: probed cache rows (the
    last ``rows``; 0: all); ``carry``: updates' allowances a thread may save; ``pacing``: κ in
    [0, 1], the thresholds applied are τ_ℓ·(1 − κ·balance/cap), so a thread whose savings pile
    up (quiet prompts, small deviations) lowers its bar and spends them instead of losing them
    at the cap; ``restart_projection``: refresh the restart layer's K/V from its boundary state
    by projection when the update changed them (see the module docstring); ``fit``: what the fit
    saw (seeds, prompts, calibration KL).
    """

    model_config = ConfigDict(extra="forbid")

    thresholds: list[float | None]
    rows: int = Field(default=64, ge=0)
    carry: float = Field(default=8.0, gt=0)
    pacing: float = Field(default=0.0, ge=0, le=1)
    restart_projection: bool = False
    fit: dict | None = None

    def scale(self, account: BudgetAccount) -> float:
        """The factor 1 − κ·balance/cap applied to every τ_ℓ now (1 without pacing)."""
        if self.pacing == 0.0 or account.cap <= 0:
            return 1.0
        return 1.0 - self.pacing * min(max(account.balance / account.cap, 0.0), 1.0)


def probe_cost(config, probed_rows: int, total_rows: int) -> float:
    """FLOPs of one probe (``probed_rows`` through input_layernorm + k_proj + v_proj) as a share
    of one decoder layer over ``total_rows`` rows (projections and MLP; attention scores left
    out, so the share is an upper bound). Layer units, in [0, 1)."""
    text = config.get_text_config()
    hidden = text.hidden_size
    head_dim = getattr(text, "head_dim", None) or hidden // text.num_attention_heads
    q_dim = text.num_attention_heads * head_dim
    kv_dim = text.num_key_value_heads * head_dim
    probe = hidden * 2 * kv_dim
    layer = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * text.intermediate_size
    return probe / layer * min(probed_rows, total_rows) / max(total_rows, 1)


def layer_kv(model, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s K/V for the rows ``hidden`` ``[1, m, H]`` (the states entering that layer)
    at ``positions`` ``[m]``: input_layernorm, k_proj / v_proj (adapters included), the optional
    k_norm and RoPE, exactly as the attention module computes them. Shapes ``[1, kv_heads, m, d]``.

    Raises:
        TypeError: the layer is not a Llama-style decoder layer (``input_layernorm`` and
            ``self_attn.k_proj`` / ``v_proj``, a module-level ``apply_rotary_pos_emb``): use
            another maintenance policy for this model.
    """
    decoder = decoder_of(model)
    block = decoder.layers[layer]
    attn = getattr(block, "self_attn", None)
    rope = getattr(importlib.import_module(type(attn).__module__), "apply_rotary_pos_emb", None) if attn else None
    if rope is None or not all(hasattr(x, n) for x, n in ((block, "input_layernorm"), (attn, "k_proj"),
                                                         (attn, "v_proj"), (attn, "head_dim"))):
        raise TypeError(f"{type(block).__name__}: the probed CacheReforge policy needs a Llama-style decoder layer "
                        "(input_layernorm, self_attn.k_proj / v_proj, apply_rotary_pos_emb); use policy "
                        "'cachereforge' or 'scheduled' for this model")
    with torch.no_grad():
        x = block.input_layernorm(hidden)
        shape = (*x.shape[:-1], -1, attn.head_dim)
        k = attn.k_proj(x).view(shape)
        if getattr(attn, "k_norm", None) is not None:
            k = attn.k_norm(k)
        k = k.transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = decoder.rotary_emb(x, position_ids=positions[None])
        _, k = rope(k, k, cos, sin)
    return k, v


def relative_deviation(fresh: tuple[torch.Tensor, torch.Tensor], cached: tuple[torch.Tensor, torch.Tensor]) -> float:
    """‖(K, V)_fresh − (K, V)_cached‖ / ‖(K, V)_fresh‖ over equally shaped ``[1, kv_heads, m, d]``
    tensors (0 when the fresh K/V are all zero and equal to the cached ones)."""
    num = sum(float((f.double() - c.double()).square().sum()) for f, c in zip(fresh, cached))
    den = sum(float(f.double().square().sum()) for f in fresh)
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


@dataclass
class ProbePlan:
    """The chosen end b (None: reuse), the probed deviations per layer, the probes run, their
    cost (layer units; it includes the valid layers below r_kv run for the probed rows only to
    reach the first probe), the layers executed over every row (b − r), the end forced by
    incomparable anchors, and the restart layer refreshed by projection (None: not projected)
    with the projection's cost (layers)."""

    end: int | None
    deviations: dict[int, float] = field(default_factory=dict)
    probes: int = 0
    probe_layers: float = 0.0
    executed: int = 0
    forced_end: int | None = None
    projected: int | None = None
    projection_layers: float = 0.0

    @property
    def charged(self) -> float:
        """What the budget account is charged: executed layers + probes + projection (layers)."""
        return self.executed + self.probe_layers + self.projection_layers


def extend_while_stale(start: int, num_layers: int, probe: Callable[[int, int], float], calibration: ProbeCalibration,
                       account: BudgetAccount, cost: float, *, r_kv: int | None = None,
                       forced_end: int | None = None, row_share: float = 1.0,
                       project: Callable[[int], float] | None = None, projection_cost: float = 0.0) -> ProbePlan:
    """Grow ``[start, b)`` one layer at a time while the probed layer is stale enough and affordable.

    Args:
        start: executable restart r.
        num_layers: N.
        probe: ``probe(b, reach)`` → dev_b; called once layers ``[start, reach)`` are to be
            executed over every row (the caller executes them first, or replays them) and the
            valid layers ``[reach, b)`` (only below r_kv) run for the probed rows alone.
        calibration: τ_ℓ and the pacing κ.
        account: the cache's budget (read only: the caller charges ``plan.charged``).
        cost: one probe's cost in layers (:func:`probe_cost`).
        r_kv: first cache layer the update changed (default ``start``); layers ``[start, r_kv)``
            keep valid K/V, so the first probe is at r_kv (a query / MLP update at r changes
            layer r's output, not its K/V). Those layers run for the probed rows only (their
            queries over the layer's valid cached K/V), charged at ``row_share`` of a layer each.
        forced_end: layers ``[start, forced_end)`` are recomputed whatever the budget
            (incomparable anchors); not probed.
        row_share: probed rows / cached rows, in (0, 1].
        project: ``project(r)`` → dev_r: refresh layer r's K/V from its boundary state over
            every row (restart projection) and return the probed rows' deviation; used only when
            ``calibration.restart_projection``, r = r_kv, nothing is forced and the balance
            covers ``projection_cost`` (layers).

    Returns:
        The plan; ``end`` is never below ``forced_end`` and every probe and executed layer fits
        the balance (beyond the forced layers).

    Raises:
        ValueError: ``calibration.thresholds`` has another length than ``num_layers``.
    """
    if len(calibration.thresholds) != num_layers:
        raise ValueError(f"probe calibration has {len(calibration.thresholds)} layer thresholds, the model "
                         f"{num_layers} layers: fit it for this model (kvmemory_lab.reforge.probe_fit)")
    plan = ProbePlan(None, forced_end=forced_end)
    end = max(start, forced_end or start)  # recomputed whatever the probes say
    reach = end  # layers [start, reach) executed so far
    layer = max(end, r_kv if r_kv is not None else start)  # the next layer to probe
    balance = account.balance - (end - start)
    scale = calibration.scale(account)
    if (project is not None and calibration.restart_projection and layer == end == start
            and balance >= projection_cost - 1e-9):
        balance -= projection_cost
        plan.projected, plan.projection_layers = start, projection_cost
        dev = plan.deviations[start] = project(start)
        tau = calibration.thresholds[start]
        if tau is None or dev < tau * scale:  # τ_r gates the probe through layer r
            return plan
        layer += 1  # layer r is now current: the next probe runs through it for the probed rows only
    while layer < num_layers:
        tau = calibration.thresholds[layer]
        below = layer - reach  # valid layers between the executed range and the probe
        reach_cost = below * row_share  # run for the probed rows only, to reach the probe
        if tau is None or balance < reach_cost + cost + below + 1.0 - 1e-9:  # probe only what it could buy
            break
        tau *= scale
        dev = probe(layer, reach)
        plan.deviations[layer] = dev
        plan.probes += 1
        plan.probe_layers += cost + reach_cost
        balance -= reach_cost + cost
        if dev < tau:
            break
        balance -= below + 1.0  # a stale probe: [reach, layer] is executed over every row
        end = reach = layer = layer + 1
        plan.projected = None  # the executed range rewrites the projected layer
    plan.end = end if end > start else None
    plan.executed = end - start
    return plan
