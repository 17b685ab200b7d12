"""A budgeted maintenance scheduler for CacheReforge (beyond the paper's eq. 9; eq. 9 stays the
reference policy ``cachereforge``).

Eq. 9 refreshes ``[r, b_t)`` with b_t = 1 + the deepest layer whose risk q_ℓ = s_ℓ·d_ℓ reaches 1:
each layer is judged alone against its own threshold. On the embedded model the deep layers'
share of the stale KL grows over consecutive updates while each of them stays below its
threshold, so they are refreshed too rarely. The scheduler instead

1. predicts the tail influence (eq. 2) of the whole stale suffix from the per-layer drift since
   each layer's anchor, T̂ = Σ_ℓ w_ℓ·d_ℓ(t) (d_ℓ as in eq. 8, w_ℓ ≥ 0 fitted offline on calibration
   trajectories to 2·√KL, the eq. 4 relation KL ≈ T²/4), so KL̂ = T̂²/4;
2. ranks every executable range ``[r, b)`` by its predicted stale-KL reduction per recomputed
   layer, (KL̂ − KL̂_b)/(b − r) (``rule="ratio"``): the best range runs when that reduction is worth
   at least λ per layer and the balance covers it; when it is worth it but not yet affordable the
   thread saves for it instead of spending on a shallower range (so deep layers get their turn).
   ``rule="lagrangian"`` instead takes the affordable b minimising KL̂_b + λ·(b − r). λ, the
   price of one recomputed layer in KL units, and the rule are fitted on calibration trajectories;
3. spends from a running budget: each adapter update deposits ``budget_pct``·N/100 layers, a range
   is affordable only when the balance covers it, and savings are capped at ``carry`` updates'
   deposits. A thread saves on quiet updates and spends when drift accumulates; the recomputed
   layers never exceed the budget at any point of a trajectory (exact-recompute fallbacks for
   incomparable anchors are charged too and may leave the balance negative).

No probe runs: every input is already known when the update lands (anchors, θ distances).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SchedulerCalibration(BaseModel):
    """Offline statistics of the scheduler, fitted on calibration trajectories only
    (``kvmemory.reforge.schedule_fit``).

    ``weights[ℓ]``: w_ℓ ≥ 0, predicted tail influence per unit of drift at layer ℓ (logit units
    per parameter unit); ``price``: λ, KL per recomputed layer; ``carry``: how many updates'
    deposits a thread may save; ``rule``: ratio (best reduction per layer, saving for it) or
    lagrangian (best affordable KL̂ + λ·layers); ``fit``: what the fit saw (seeds, prompts,
    calibration KL).
    """

    model_config = ConfigDict(extra="forbid")

    weights: list[float]
    price: float = Field(ge=0)
    carry: float = Field(default=16.0, gt=0)
    rule: Literal["ratio", "lagrangian"] = "ratio"
    fit: dict | None = None

    def predicted_kl(self, distances: list[float]) -> float:
        """KL̂ = (Σ_ℓ w_ℓ·d_ℓ)² / 4 (eq. 4 with the predicted tail influence); ``inf`` when a
        weighted layer has no comparable distance."""
        tail = 0.0
        for w, d in zip(self.weights, distances):
            if w > 0 and d > 0:
                tail += w * d
        return tail * tail / 4.0


@dataclass
class BudgetAccount:
    """The running recompute budget of one cache, in layers.

    ``budget_pct``: allowance per adapter update (% of the N layers); ``cap``: most layers a
    thread may save; ``balance``: layers available now; ``deposits`` / ``spent``: totals.
    """

    budget_pct: float
    num_layers: int
    cap: float
    balance: float = 0.0
    deposits: float = 0.0
    spent: float = 0.0
    last_version: str | None = None  # the adapter version whose allowance was deposited last

    @classmethod
    def open(cls, budget_pct: float, num_layers: int, carry: float) -> "BudgetAccount":
        """Raises:
            ValueError: ``budget_pct`` not in (0, 100] or ``carry`` not positive.
        """
        if not 0 < budget_pct <= 100:
            raise ValueError(f"scheduled CacheReforge needs budget_pct in (0, 100] % of layers per update "
                             f"(got {budget_pct})")
        if not carry > 0:
            raise ValueError(f"carry must be positive (updates' deposits a thread may save; got {carry})")
        per_update = budget_pct * num_layers / 100.0
        return cls(budget_pct, num_layers, cap=max(per_update * carry, per_update))

    @property
    def per_update(self) -> float:
        """Layers one adapter update deposits."""
        return self.budget_pct * self.num_layers / 100.0

    def deposit(self, version: str | None = None) -> None:
        """One adapter update's allowance (budget_pct·N/100 layers), up to the cap; with
        ``version``, at most once per adapter version (repeated maintenance calls add nothing)."""
        if version is not None:
            if version == self.last_version:
                return
            self.last_version = version
        amount = self.budget_pct * self.num_layers / 100.0
        self.deposits += amount
        self.balance = min(self.balance + amount, self.cap)

    def charge(self, layers: int) -> None:
        self.spent += layers
        self.balance -= layers

    def as_dict(self) -> dict:
        return {"budget_pct": self.budget_pct, "balance": self.balance, "cap": self.cap,
                "deposits": self.deposits, "spent": self.spent}


@dataclass
class Schedule:
    """The chosen end b (None: reuse), the predicted KL before and after, the layers that must be
    recomputed whatever the budget (incomparable anchors) and the per-layer predicted tail terms."""

    end: int | None
    predicted_before: float
    predicted_after: float
    forced_end: int | None
    terms: list[float]


def schedule(distances: list[float], invalid: list[int], start: int, calibration: SchedulerCalibration,
             account: BudgetAccount) -> Schedule:
    """Choose ``[start, b)`` for one adapter update (the caller deposits the update's allowance
    first, once per adapter version, and charges what it executes).

    Args:
        distances: d_ℓ(t) per layer (eq. 8; ``inf`` where an anchor is incomparable).
        invalid: cache layers the update changed (ascending).
        start: executable restart r.
        calibration: weights w_ℓ and price λ.
        account: the cache's budget (read only).

    Returns:
        The b minimising KL̂([r, b) refreshed) + λ·(b − r) over the affordable b (b − r ≤ balance),
        never below the end that covers incomparable anchors.

    Raises:
        ValueError: ``calibration.weights`` has another length than ``distances``.
    """
    n = len(distances)
    if len(calibration.weights) != n:
        raise ValueError(f"scheduler calibration has {len(calibration.weights)} layer weights, the model {n} layers: "
                         "fit it for this model (`kvmemory calibrate --schedule`)")
    terms = [w * d if d > 0 and w > 0 else 0.0 for w, d in zip(calibration.weights, distances)]
    if not invalid:
        return Schedule(None, 0.0, 0.0, None, terms)
    infinite = [layer for layer in invalid if math.isinf(distances[layer])]
    forced = 1 + max(infinite) if infinite else None
    finite = [0.0 if math.isinf(t) else t for t in terms]
    suffix = [0.0] * (n + 1)  # suffix[b] = Σ_{ℓ ≥ b} term_ℓ
    for layer in range(n - 1, -1, -1):
        suffix[layer] = suffix[layer + 1] + finite[layer]
    before = suffix[start] ** 2 / 4.0
    lowest = forced if forced is not None else start
    pick = _ratio_end if calibration.rule == "ratio" else _lagrangian_end
    best_end = pick(suffix, start, lowest, n, calibration.price, account)
    chosen = None if best_end <= start else best_end
    return Schedule(chosen, before, suffix[best_end] ** 2 / 4.0, forced, terms)


def _lagrangian_end(suffix, start, lowest, n, price, account) -> int:
    """The affordable b ≥ ``lowest`` minimising KL̂_b + λ·(b − r)."""
    best_end, best_score = lowest, suffix[lowest] ** 2 / 4.0 + price * (lowest - start)
    for end in range(lowest + 1, n + 1):
        if end - start > account.balance + 1e-9:
            break
        score = suffix[end] ** 2 / 4.0 + price * (end - start)
        if score < best_score - 1e-15:
            best_end, best_score = end, score
    return best_end


def _ratio_end(suffix, start, lowest, n, price, account) -> int:
    """The b with the largest KL̂ reduction per layer among those the cap can ever afford; run it
    when worth λ per layer and affordable now, else keep ``lowest`` (save for it) unless the next
    deposit would overflow the cap: then the best affordable range runs (savings are not wasted)."""
    before = suffix[start] ** 2 / 4.0
    best = affordable = None  # (ratio, end)
    for end in range(max(lowest, start + 1), n + 1):
        cost = end - start
        if cost > account.cap + 1e-9 and end > lowest:
            break
        ratio = (before - suffix[end] ** 2 / 4.0) / cost
        if best is None or ratio > best[0] + 1e-15:
            best = (ratio, end)
        if cost <= account.balance + 1e-9 and (affordable is None or ratio > affordable[0] + 1e-15):
            affordable = (ratio, end)
    if best is None or best[0] < price:
        return lowest
    if best[1] - start <= account.balance + 1e-9:
        return max(best[1], lowest)
    overflowing = account.balance + account.per_update > account.cap + 1e-9
    if overflowing and affordable is not None and affordable[0] >= price:
        return max(affordable[1], lowest)
    return lowest
