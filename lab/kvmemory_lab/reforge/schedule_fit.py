"""Offline fit of the budgeted scheduler (:mod:`kvmemory.reforge.scheduler`) on calibration
trajectory banks only.

1. Tail weights: every state a replay visited (bank, prompt, version, per-layer anchors) has an
   exact first-token KL. Its per-layer drifts d_ℓ = ‖θ_t − θ_{a_ℓ}‖ are regressed onto 2·√KL
   (eq. 4, KL ≈ T²/4) with non-negative weights: T̂ = Σ_ℓ w_ℓ·d_ℓ.
2. Price and savings cap: the replay runs the scheduler for a grid of λ (KL per recomputed
   layer) and carry values at the given budget and keeps the pair with the lowest calibration KL
   (the budget account caps the recomputed layers whatever λ is).
   The regression is seeded with the states of fixed windows and of eq. 9 at raised sensitivities
   (which refresh deep layers too: without them every deep layer is always stale in the data and
   its weight cannot be told apart from the restart layer's).
3. The states the fitted scheduler visits are added and the weights refitted (``rounds``), so
   the regression sees the mixed-version states the scheduler itself produces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmemory.reforge.profile import ReforgeProfile
from kvmemory.reforge.scheduler import SchedulerCalibration
from .trajectory import PolicyReplay, ReplayPolicy

PRICES = (0.0, 1e-3, 3e-3, 1e-2)  # KL per recomputed layer
CARRIES = (8.0, 16.0)  # updates' deposits a thread may save
SEED_WINDOWS = (1, 2, 4)  # fixed windows whose states seed the regression
SEED_SCALES = (1.0, 2.0, 4.0)  # eq. 9 with the base profile's sensitivities × α: states with deep layers refreshed


def visited_states(replay: PolicyReplay) -> tuple[torch.Tensor, torch.Tensor]:
    """Drift features ``[S, N]`` (d_ℓ per layer, parameter units) and KLs ``[S]`` of every state
    the replay has measured."""
    feats, kls = [], []
    for (b, _, t, anchor), kl in replay._kl.items():
        bank = replay.banks[b]
        row = torch.zeros(bank.num_layers, dtype=torch.float64)
        for j, a in enumerate(anchor):
            row[bank.restart + j] = float(bank.distances[t, a])
        feats.append(row)
        kls.append(kl)
    return torch.stack(feats), torch.tensor(kls, dtype=torch.float64)


def fit_tail_weights(features: torch.Tensor, kls: torch.Tensor) -> list[float]:
    """Non-negative least squares of 2·√KL on the drifts (Lawson-Hanson active set, float64);
    layers whose drift is always 0 get weight 0.

    Raises:
        ValueError: no states.
    """
    if features.shape[0] == 0:
        raise ValueError("no replayed states to fit the scheduler on: evaluate some policies first")
    a = features.double()
    target = 2.0 * kls.double().clamp(min=0).sqrt()
    n = a.shape[1]
    w = torch.zeros(n, dtype=torch.float64)
    passive = torch.zeros(n, dtype=torch.bool)
    usable = a.abs().amax(0) > 0
    for _ in range(3 * n):
        grad = a.T @ (target - a @ w)
        grad[passive | ~usable] = -float("inf")
        if float(grad.max()) <= 1e-10 * float(target.abs().max().clamp(min=1e-30)):
            break
        passive[int(grad.argmax())] = True
        while True:
            z = torch.zeros(n, dtype=torch.float64)
            z[passive] = torch.linalg.lstsq(a[:, passive], target[:, None]).solution[:, 0]
            if bool((z[passive] > 0).all()):
                w = z
                break
            blocked = passive & (z <= 0)
            alpha = float((w[blocked] / (w[blocked] - z[blocked])).min())
            w = w + alpha * (z - w)
            passive &= w > 1e-15
    return w.clamp(min=0).tolist()


@dataclass
class ScheduleFit:
    """The fitted calibration, its calibration KL / recompute %, the stale KL, and the grid."""

    calibration: SchedulerCalibration
    kl: float
    recompute_pct: float
    top1: float
    stale_kl: float
    grid: list[dict]

    @property
    def kl_reduction_pct(self) -> float:
        return 100.0 * (1.0 - self.kl / self.stale_kl) if self.stale_kl > 0 else 0.0


def fit_scheduler(replay: PolicyReplay, base: ReforgeProfile, budget_pct: float, *, prices=PRICES,
                  carries=CARRIES, rounds: int = 2, rule: str = "ratio", progress=None) -> tuple[ReforgeProfile, ScheduleFit]:
    """Fit weights, price and carry on the replay's (calibration) banks for ``budget_pct``, for
    one decision ``rule`` (ratio or lagrangian, see :mod:`kvmemory.reforge.scheduler`).

    Returns:
        ``base`` with ``scheduler`` set, and the fit record.

    Raises:
        ValueError: ``budget_pct`` outside (0, 100].
    """
    if not 0 < budget_pct <= 100:
        raise ValueError(f"recompute budget must be in (0, 100] % of layers (got {budget_pct})")
    seeds = [ReplayPolicy("fixed_window", window=w) for w in SEED_WINDOWS]
    if any(x > 0 for x in base.sensitivity):
        seeds += [base.scaled(a) for a in SEED_SCALES]
    stale = replay.evaluate([None, *seeds])[0]
    best = None
    for _ in range(rounds):
        weights = fit_tail_weights(*visited_states(replay))
        candidates = [(price, carry) for price in prices for carry in carries]
        profiles = [base.model_copy(update={"scheduler": SchedulerCalibration(weights=weights, price=p, carry=c,
                                                                                   rule=rule)})
                    for p, c in candidates]
        results = replay.evaluate([ReplayPolicy("scheduled", prof, budget_pct) for prof in profiles])
        grid = [{"price": p, "carry": c, "kl": r.kl, "recompute_pct": r.recompute_pct, "top1": r.top1}
                for (p, c), r in zip(candidates, results)]
        j = min(range(len(results)), key=lambda k: results[k].kl)
        if best is None or results[j].kl < best.kl:
            best = ScheduleFit(profiles[j].scheduler, results[j].kl, results[j].recompute_pct, results[j].top1,
                               stale.kl, grid)
        if progress is not None:
            progress.update(1)
    best.calibration = best.calibration.model_copy(update={"fit": {
        "budget_pct": budget_pct, "rule": rule, "calibration_kl": best.kl, "calibration_recompute_pct": best.recompute_pct,
        "calibration_top1": best.top1, "stale_kl": best.stale_kl, "calibration_kl_reduction_pct": best.kl_reduction_pct,
        "states": len(replay._kl), "grid": best.grid}})
    return base.model_copy(update={"scheduler": best.calibration}), best
