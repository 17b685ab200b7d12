"""Offline side of the probed CacheReforge scheduler (:mod:`kvmemory.reforge.probe`): the probe
values a replay needs, read exactly from a trajectory bank, and the fit of the probe thresholds
on calibration trajectories.

A bank holds every version's fresh K/V of every affected layer. When layers ``[r, b)`` have just
been recomputed at version t, the rows entering layer b are fresh at t, so layer b's would-be
fresh K/V are the bank's ``kv[t][b]``; the cache holds ``kv[a_b][b]`` (a_b: layer b's anchor).
The probe value is their relative deviation over the probed rows (the last ``rows`` cache rows),
exactly what the runtime probe measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmemory.reforge.probe import ProbeCalibration

from .trajectory import PolicyReplay, ReplayPolicy, ReplayResult, TrajectoryBank


def probe_table(bank: TrajectoryBank, rows: int | None = 64) -> torch.Tensor:
    """Relative K/V deviation ``dev[i, j, t, a]`` = ‖KV(t) − KV(a)‖ / ‖KV(t)‖ of affected layer
    r + j for prompt i over its last ``rows`` cache rows (None: all), K and V concatenated
    (post-RoPE keys, as cached). Shape ``[P, N − r, T + 1, T + 1]``, float32, unitless.
    """
    out = []
    for p in bank.prompts:
        per_layer = []
        for j in range(len(p.kv[0])):
            flat = []
            for version in p.kv:
                k, v = version[j]
                n = k.shape[2]
                lo = 0 if rows is None else max(0, n - rows)
                flat.append(torch.cat([k[:, :, lo:].reshape(-1), v[:, :, lo:].reshape(-1)]).double())
            x = torch.stack(flat)
            dist = torch.cdist(x[None], x[None])[0]
            per_layer.append((dist / x.norm(dim=1)[:, None].clamp(min=1e-30)).float())
        out.append(torch.stack(per_layer))
    return torch.stack(out)


ROWS = (16, 32, 64)  # probed rows (the last ones of the cache)
CARRIES = (8.0, 16.0)  # updates' allowances a thread may save
START_TAUS = (0.03, 0.04, 0.05, 0.06, 0.08)  # uniform τ grid the descent starts from
PACINGS = (0.0, 0.5, 0.9)  # κ: how far full savings lower the thresholds
FACTORS = (0.7, 0.85, 1.18, 1.4)  # multiplicative moves of one group's τ


def default_groups(restart: int, num_layers: int) -> list[tuple[int, ...]]:
    """τ groups: the restart layer, the next one, then blocks of 2, 4 and the rest of the suffix."""
    edges = [restart, restart + 1, restart + 2, restart + 4, restart + 8, num_layers]
    edges = sorted({min(e, num_layers) for e in edges})
    return [tuple(range(lo, hi)) for lo, hi in zip(edges, edges[1:]) if hi > lo]


def calibration_with(groups, group_tau, num_layers: int, rows: int, carry: float, pacing: float = 0.0,
                     restart_projection: bool = False) -> ProbeCalibration:
    """τ_ℓ = the τ of ℓ's group (layers outside every group: None, never extended through)."""
    thresholds: list[float | None] = [None] * num_layers
    for group, tau in zip(groups, group_tau):
        for layer in group:
            thresholds[layer] = tau
    return ProbeCalibration(thresholds=thresholds, rows=rows, carry=carry, pacing=pacing,
                            restart_projection=restart_projection)


@dataclass
class ProbeFit:
    """The chosen calibration with its calibration KL / recompute % (probes included), the stale
    KL of the same banks and every evaluated candidate."""

    calibration: ProbeCalibration
    kl: float
    recompute_pct: float
    probe_pct: float
    top1: float
    stale_kl: float
    evaluated: list[dict] = field(default_factory=list)

    @property
    def kl_reduction_pct(self) -> float:
        return 100.0 * (1.0 - self.kl / self.stale_kl) if self.stale_kl > 0 else 0.0


def fit_probe(replay: PolicyReplay, budget_pct: float, *, rows_grid=ROWS, carries=CARRIES, start_taus=START_TAUS,
              pacings=PACINGS, factors=FACTORS, max_steps: int = 6, groups=None, restart_projection: bool = False,
              progress=None) -> ProbeFit:
    """Fit the probed policy on the replay's (calibration) banks for ``budget_pct`` (% of the N
    layers per update, probes included; the budget account enforces it, so every candidate
    stays within it).

    1. Grid over a uniform τ × probed rows × carry × pacing κ; the lowest calibration KL wins.
    2. Best-improvement coordinate descent on one τ per group (``default_groups``), moves
       τ_g × f for f in ``factors``, at most ``max_steps`` moves, on KL + 1e-4·KL_stale·recompute %
       (ties go to the cheaper candidate).

    ``restart_projection``: fit the policy that refreshes the restart layer by projection
    (:mod:`kvmemory.reforge.probe`); its τ_r then gates the probe through layer r.

    Raises:
        ValueError: ``budget_pct`` not in (0, 100].
    """
    if not 0 < budget_pct <= 100:
        raise ValueError(f"recompute budget must be in (0, 100] % of layers (got {budget_pct})")
    bank = replay.banks[0]
    groups = groups or default_groups(bank.restart, bank.num_layers)
    stale = replay.evaluate([None])[0].kl
    seen: dict[tuple, ReplayResult] = {}

    def run(cands: list[tuple]) -> list[ReplayResult]:  # candidate: (rows, carry, pacing, group τ)
        todo = [c for c in cands if c not in seen]
        pols = [ReplayPolicy("probed", budget_pct=budget_pct,
                             probe=calibration_with(groups, c[3], bank.num_layers, *c[:3], restart_projection))
                for c in todo]
        for c, res in zip(todo, replay.evaluate(pols) if pols else []):
            seen[c] = res
        if progress is not None:
            progress.update(1)
        return [seen[c] for c in cands]

    def score(c: tuple) -> float:
        return seen[c].kl + 1e-4 * stale * seen[c].recompute_pct

    grid = [(rows, carry, pacing, tuple([tau] * len(groups))) for rows in rows_grid for carry in carries
            for pacing in pacings for tau in start_taus]
    run(grid)
    current = min(grid, key=score)
    for _ in range(max_steps):
        rows, carry, pacing, taus = current
        moves = [(rows, carry, pacing, taus[:g] + (round(taus[g] * f, 6),) + taus[g + 1:])
                 for g in range(len(groups)) for f in factors]
        run(moves)
        best = min(moves, key=score)
        if score(best) >= score(current) - 1e-12:
            break
        current = best
    res = seen[current]
    evaluated = [{"rows": c[0], "carry": c[1], "pacing": c[2], "group_tau": list(c[3]), "kl": r.kl,
                  "recompute_pct": r.recompute_pct, "probe_pct": r.probe_pct} for c, r in seen.items()]
    cal = calibration_with(groups, current[3], bank.num_layers, *current[:3], restart_projection)
    fit = ProbeFit(cal, res.kl, res.recompute_pct, res.probe_pct, res.top1, stale, evaluated)
    fit.calibration = cal.model_copy(update={"fit": {
        "budget_pct": budget_pct, "groups": [list(g) for g in groups], "group_tau": list(current[3]),
        "calibration_kl": res.kl, "calibration_recompute_pct": res.recompute_pct,
        "calibration_probe_pct": res.probe_pct, "calibration_top1": res.top1, "stale_kl": stale,
        "calibration_kl_reduction_pct": fit.kl_reduction_pct, "evaluated": len(seen)}})
    return fit
