"""Runtime range selection after an adapter update (CacheReforge §Methodology, eqs. 8-9), the
two RQ4 ablations (drift-only single threshold, fixed two-layer window) and the two budgeted
policies that go beyond eq. 9: the drift scheduler (``scheduled``, :mod:`kvmemory.reforge.scheduler`)
and the K/V-probed policy (``probed``, :mod:`kvmemory.reforge.probe`; it decides while recovery
runs, so ``ReforgeState`` executes it and :func:`decide` does not)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .profile import ReforgeProfile
from .scheduler import BudgetAccount, schedule

Policy = Literal["cachereforge", "scheduled", "probed", "exact_suffix", "drift_only", "fixed_window", "stale"]
POLICIES: tuple[str, ...] = ("cachereforge", "scheduled", "probed", "exact_suffix", "drift_only", "fixed_window",
                             "stale")
FIXED_WINDOW = 2  # layers, the RQ4 fixed-window ablation


@dataclass
class Decision:
    """What to recompute: layers ``[start, end)`` (``end`` None: direct reuse).

    ``r_kv``: first cache layer the update invalidated (N: none); ``triggered``: layers with
    q_ℓ ≥ 1 (or d_ℓ ≥ τ for drift-only); ``distances`` d_ℓ and ``risks`` q_ℓ per layer (scheduled:
    the predicted tail-influence term w_ℓ·d_ℓ of each layer); ``predicted_kl``: the scheduler's
    KL̂ before and after the chosen refresh (None for other policies); ``probe_layers``: the
    probed policy's probe cost (layers, charged with the executed ones); ``deviations``: its
    probed relative K/V deviation per layer; ``projected``: the restart layer refreshed from its
    boundary state by projection (probed policy; None: none), at ``projection_layers``."""

    policy: str
    r_kv: int
    start: int
    end: int | None
    triggered: list[int]
    distances: list[float]
    risks: list[float]
    predicted_kl: tuple[float, float] | None = None
    probe_layers: float = 0.0
    deviations: dict[int, float] | None = None
    projected: int | None = None
    projection_layers: float = 0.0

    @property
    def action(self) -> str:
        """``reuse`` (no affected layer recomputed), ``bounded`` or ``full_suffix`` (b_t = N)."""
        if self.end is None or self.end <= self.r_kv:
            return "reuse"
        return "full_suffix" if self.end >= len(self.distances) else "bounded"

    @property
    def layers(self) -> int:
        """Executed layers b_t − r (0 for reuse)."""
        return 0 if self.action == "reuse" else self.end - self.start


def decide(
    policy: str,
    distances: list[float],
    invalid: list[int],
    start: int,
    profile: ReforgeProfile | None = None,
    window: int = FIXED_WINDOW,
    account: BudgetAccount | None = None,
) -> Decision:
    """Choose the recovery range.

    Args:
        policy: one of :data:`POLICIES`.
        distances: d_ℓ(t) = ‖θ_t − θ_ℓ^anchor‖₂ per layer (eq. 8).
        invalid: cache layers whose K/V the update can change (ascending; ``invalid[0]`` = r_kv).
        start: executable restart r (a valid boundary at or below r_kv).
        profile: calibrated sensitivities (cachereforge) / threshold (drift_only) / scheduler
            calibration (scheduled).
        account: the cache's running budget (scheduled only; the caller deposits the update's
            allowance before and charges what it executes after).

    Returns:
        Decision with b_t = 1 + max triggered layer (eq. 9) for cachereforge / drift_only; for
        scheduled the affordable b with the lowest KL̂ + λ·(b − r).

    Raises:
        ValueError: unknown policy, a profile-based policy without a profile / threshold, or
            scheduled without a scheduler calibration or budget account, or probed (executed by
            ``ReforgeState.maintain``).
    """
    n = len(distances)
    if policy not in POLICIES:
        raise ValueError(f"unknown CacheReforge policy {policy!r}; use one of {', '.join(POLICIES)}")
    r_kv = invalid[0] if invalid else n
    if policy == "scheduled":
        return _scheduled(distances, invalid, start, profile, account)
    if policy == "probed":
        raise ValueError("policy 'probed' decides while bounded recovery runs: maintain the cache through "
                         "ReforgeState.maintain (kvmemory.reforge.probe), not runtime.decide")
    risks = [0.0] * n
    triggered: list[int] = []
    end: int | None = None
    if invalid:
        if policy == "exact_suffix":
            end = n
        elif policy == "fixed_window":
            end = min(start + window, n)
        elif policy == "cachereforge":
            if profile is None:
                raise ValueError("policy 'cachereforge' needs a calibration profile: run `kvmemory calibrate`")
            risks = [s * d for s, d in zip(profile.sensitivity, distances)]
            triggered = [layer for layer in invalid if risks[layer] >= 1.0]
        elif policy == "drift_only":
            if profile is None:
                raise ValueError("policy 'drift_only' needs a calibration profile: run `kvmemory calibrate`")
            tau = profile.drift_threshold  # None: no calibration condition needed recovery
            triggered = [layer for layer in invalid if tau is not None and distances[layer] >= tau]
        if triggered:
            end = 1 + max(triggered)
    return Decision(policy, r_kv, start, end, triggered, list(distances), risks)


def _scheduled(distances, invalid, start, profile, account) -> Decision:
    if profile is None or profile.scheduler is None:
        raise ValueError("policy 'scheduled' needs a profile with a scheduler calibration: run "
                         "`kvmemory calibrate --schedule` (or use policy 'cachereforge', eq. 9)")
    if account is None:
        raise ValueError("policy 'scheduled' needs the cache's BudgetAccount (ReforgeConfig.budget_pct opens one)")
    n = len(distances)
    plan = schedule(distances, invalid, start, profile.scheduler, account)
    r_kv = invalid[0] if invalid else n
    chosen = [] if plan.end is None else list(range(max(start, r_kv), plan.end))
    return Decision("scheduled", r_kv, start, plan.end, chosen, list(distances), plan.terms,
                    (plan.predicted_before, plan.predicted_after))
