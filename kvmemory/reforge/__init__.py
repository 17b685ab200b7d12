"""CacheReforge: live KV caches that stay valid while a LoRA adapter learns online.

Modules: ``versions`` (adapter digests, anchors θ_ℓ, mixed-version report), ``restart``
(eq. S4 restart layers, retained boundary states), ``recovery`` (execute layers [r, b)),
``runtime`` (risk q_ℓ = s_ℓ·d_ℓ, b_t, ablations), ``scheduler`` (budgeted drift scheduler and the
budget account), ``probe`` (the K/V-probed policy), ``profile`` / ``calibration`` (offline
sensitivities), ``analysis`` (hybrid executions, tail influence, certificates, horizons),
``state`` (what a KVSession keeps). The test-time-training step that updates the adapter and
maintains every live thread is ``kvmemory.online_adapter`` (above the session and its registry).
"""

from .probe import ProbeCalibration
from .profile import ProfileKey, ReforgeProfile
from .restart import restart_layers
from .runtime import POLICIES, Decision, decide
from .state import ReforgeConfig, ReforgeReport, ReforgeState
from .versions import AdapterState, LayerAnchors, VersionReport, capture_adapter

__all__ = [
    "POLICIES", "AdapterState", "Decision", "LayerAnchors", "ProbeCalibration", "ProfileKey", "ReforgeConfig",
    "ReforgeProfile",
    "ReforgeReport", "ReforgeState", "VersionReport", "capture_adapter", "decide", "restart_layers",
]
