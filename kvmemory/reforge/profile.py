"""The frozen calibration profile: per-layer sensitivities s_ℓ (eq. 7) and the drift-only
threshold, keyed by model, update target, adapter config and context regime."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from .probe import ProbeCalibration
from .scheduler import SchedulerCalibration


class ProfileKey(BaseModel):
    """What a profile is valid for (CacheReforge: "Indexed by model, update target, adapter
    configuration, context regime, and workload")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    update_target: str = Field(description="e.g. 'v_proj@15' (module@layer)")
    adapter_config: str = Field(description="e.g. 'lora r=8 alpha=16 targets=v_proj'")
    context_regime: str = Field(description="e.g. 'hotpotqa+2wiki, 256-1024 tokens'")


class ConditionResult(BaseModel):
    """One calibration condition i: its restart r_i, distance d_i, per-window aggregates and
    the first safe window h*_i (None: no evaluated window was safe; the full suffix is used)."""

    model_config = ConfigDict(extra="forbid")

    restart: int
    distance: float
    gap: int
    windows: dict[str, dict[str, float]]
    first_safe: int | None
    labels: list[int]


class ReforgeProfile(BaseModel):
    """Frozen calibration output. ``sensitivity[ℓ]`` = s_ℓ = 1/δ_ℓ (0 when layer ℓ was never
    labelled); ``delta[ℓ]`` = δ_ℓ (None when unlabelled); ``drift_threshold``: the single
    threshold of the drift-only ablation; ``thresholds``: the safety criteria used."""

    model_config = ConfigDict(extra="forbid")

    key: ProfileKey
    num_layers: int
    sensitivity: list[float]
    delta: list[float | None]
    drift_threshold: float | None
    thresholds: dict[str, float]
    tail_quantile: float = 0.05
    conditions: list[ConditionResult] = Field(default_factory=list)
    fit: dict | None = Field(default=None, description="trajectory fit for a recompute budget "
                             "(kvmemory_lab.reforge.trajectory): budget, group δs, calibration KL and recompute %")
    scheduler: SchedulerCalibration | None = Field(default=None, description="weights and price of the budgeted "
                                                   "scheduler (policy 'scheduled'; kvmemory.reforge.scheduler)")
    probe: ProbeCalibration | None = Field(default=None, description="K/V-deviation thresholds of the probed "
                                           "policy (policy 'probed'; kvmemory.reforge.probe)")

    def scaled(self, alpha: float) -> "ReforgeProfile":
        """A copy whose sensitivities are ``alpha`` × s_ℓ (δ_ℓ / alpha): the runtime risk q_ℓ = s_ℓ·d_ℓ
        reaches 1 at ``1/alpha`` of the calibrated distance. Used to trace the recompute-vs-KL
        frontier of one calibration (``kvmemory bench reforge --risk-scales``).

        Raises:
            ValueError: ``alpha`` not positive.
        """
        if not alpha > 0:
            raise ValueError(f"risk scale must be positive (got {alpha})")
        return self.model_copy(update={
            "sensitivity": [alpha * s for s in self.sensitivity],
            "delta": [None if d is None else d / alpha for d in self.delta],
        })

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path, expect: ProfileKey | None = None) -> "ReforgeProfile":
        """Read a profile; with ``expect``, refuse one calibrated for something else.

        Raises:
            FileNotFoundError: no file at ``path``.
            pydantic.ValidationError: not a profile.
            ValueError: the key differs from ``expect`` (names both; run ``kvmemory calibrate``).
        """
        profile = cls.model_validate(json.loads(Path(path).read_text()))
        if expect is not None and profile.key != expect:
            raise ValueError(
                f"profile {path} was calibrated for {profile.key.model_dump()}, not {expect.model_dump()}: "
                "run `kvmemory calibrate` for this configuration"
            )
        return profile
