"""The CacheReforge state a session keeps beside its K/V: per-layer adapter anchors, retained
boundary states, and the maintenance step that brings a cache to the current adapter.

Maintenance (CacheReforge §Methodology): layers whose producing parameters are unchanged are
re-anchored for free; otherwise the policy picks ``[r, b_t)``; those layers are re-executed over
every cached row from the stored boundary state (or the embedding), their K/V and retained
states are overwritten and only their anchors move to θ_t. The last cached row (the pending
request) is then recomputed through every layer so the next-token logits come from the current
adapter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from .. import kvcache
from ..capabilities import cache_unsupported_reason
from ..engine import forward_rows
from .probe import extend_while_stale, layer_kv, probe_cost, relative_deviation
from .profile import ReforgeProfile
from .recovery import LayerRun, decoder_of, embed, overwrite_layers, run_layers, run_rows
from .restart import BoundaryStore, target_boundaries
from .runtime import POLICIES, Decision, decide
from .scheduler import BudgetAccount
from .versions import AdapterState, LayerAnchors, base_state, capture_adapter, lora_modules, unknown_state

log = logging.getLogger(__name__)


@dataclass
class CacheView:
    """What maintenance reads of a session: its cache, token ids (one per row), the factory of
    an empty cache of its kind and the reason its rows cannot be rewritten in place (None: they
    can). The session builds it; maintenance never holds the session."""

    cache: Any
    token_ids: Sequence[int]
    cache_factory: Callable[[Any], Any]
    row_reuse_reason: str | None = None


@dataclass
class Maintained:
    """What maintenance produced, for the session to apply (it is the only writer of its state).

    ``cache``: the maintained cache (the same object with layers rewritten in place, or a fresh
    one after a re-prefill); ``next_logits``: fp32 ``[vocab]`` logits of the recomputed last row
    (None: not recomputed); ``exact_rows``: the new count of leading rows equal to a fresh
    prefill (None: unchanged)."""

    report: "ReforgeReport"
    cache: Any
    next_logits: torch.Tensor | None = None
    exact_rows: int | None = None


@dataclass
class ReforgeConfig:
    """How a session keeps its cache valid while the adapter learns.

    ``policy``: cachereforge (needs ``profile``), scheduled, probed, exact_suffix (default without
    a profile: exact), drift_only, fixed_window, stale (benchmarks only). ``boundary_layers``: layers whose
    entering hidden state is retained (None: the restart layers of the trainable adapter
    modules, eq. S4). ``adapter``: the adapter whose trainable modules define those restart
    layers (None: every adapter's); it never narrows the version, which always covers every
    computing adapter, which adapters compute and whether they are disabled.
    ``window``: fixed_window size in layers. ``budget_pct``: the scheduled / probed policies'
    recompute budget, % of the N layers per adapter update, probes included (their profile needs a
    ``scheduler`` / ``probe`` calibration; the paper's eq. 9 stays available as ``cachereforge``).
    """

    policy: str | None = None
    profile: ReforgeProfile | None = None
    boundary_layers: tuple[int, ...] | None = None
    adapter: str | None = None
    window: int = 2
    budget_pct: float = 5.0

    def resolved_policy(self) -> str:
        policy = self.policy or ("cachereforge" if self.profile is not None else "exact_suffix")
        if policy not in POLICIES:
            raise ValueError(f"unknown CacheReforge policy {policy!r}; use one of {', '.join(POLICIES)}")
        return policy


@dataclass
class ReforgeReport:
    """One maintenance step. ``action``: reuse / bounded / full_suffix / reprefill; layers
    ``[start, end)`` executed over ``rows`` rows; ``recompute_pct`` = (b_t − r)/N·100 (%), the
    probed policy's probes included at their layer share (``probes``: their count, their cost in
    layers, which includes the valid layers below r_kv run for the probed rows to reach one, and the
    relative K/V deviation per probed layer);
    ``reanchored``: layers found exactly valid and re-anchored without compute; ``ms``: wall
    time (ms) of the whole step, of which ``request_ms`` recomputed the last row (the pending
    request's first token) and the rest is cache maintenance; ``mixed``: the cache mixes adapter
    versions afterwards; ``incomparable``: layers whose anchor could not be compared with the
    current adapter by a distance (other adapters computing or disabled, or anchors restored
    without θ), recomputed exactly whatever the policy's distance rule says; ``fallback``: why
    every layer was re-prefilled instead of the chosen range (a capability gate: sliding
    windows, a quantized cache), None otherwise; ``budget``: the scheduled policy's account after
    this step (balance, cap, deposits and spent, in layers; scheduled / probed only);
    ``predicted_kl``: the scheduler's predicted KL before / after its chosen range;
    ``projected``: the restart layer whose K/V the probed policy refreshed from its retained
    boundary state by projection (exact; its cost is in ``recompute_pct``), None otherwise."""

    adapter_version: str | None
    policy: str
    action: str
    start: int | None
    end: int | None
    r_kv: int
    rows: int
    recompute_pct: float
    triggered: list[int] = field(default_factory=list)
    reanchored: list[int] = field(default_factory=list)
    incomparable: list[int] = field(default_factory=list)
    stale_layers: list[int] = field(default_factory=list)
    mixed: bool = False
    ms: float = 0.0
    request_ms: float = 0.0
    note: str | None = None
    fallback: str | None = None
    budget: dict | None = None
    predicted_kl: tuple[float, float] | None = None
    probes: dict | None = None
    projected: int | None = None

    @property
    def maintenance_ms(self) -> float:
        """Cache-maintenance time (ms): digests, policy, layer execution, K/V writes."""
        return self.ms - self.request_ms

    def as_dict(self) -> dict:
        return asdict(self)


class ReforgeState:
    """Anchors + boundary states of one cache. Without adapters every layer is anchored to the
    base version (no boundary states, no hooks); adapters attached later (peft wrapping the
    model after the session was created) are a new version like any other update."""

    def __init__(self, model, config: ReforgeConfig | None = None):
        """Raises:
            ValueError: unknown policy, a profile-based policy without a profile, boundary layers
                outside ``[0, N)``, or ``config.adapter`` names no adapter of a model that has some.
        """
        self.model = model
        self.config = config or ReforgeConfig()
        policy = self.config.resolved_policy()
        _check_calibration(policy, self.config.profile)
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.account = self._open_account(policy)
        modules = lora_modules(model)
        adapter = self.config.adapter
        loaded = sorted({a for m in modules for a in m.adapters()})
        if adapter is not None and loaded and adapter not in loaded:
            raise ValueError(f"ReforgeConfig.adapter={adapter!r} names no adapter of this model (it has "
                             f"{', '.join(map(repr, loaded))}): pass one of them, or None for all")
        layers = self.config.boundary_layers
        if layers is None:
            layers = target_boundaries(model, self.num_layers, adapter) if modules else ()
        bad = [x for x in layers if not 0 <= x < self.num_layers]
        if bad:
            raise ValueError(f"boundary layers {bad} outside [0, {self.num_layers})")
        self.anchors = LayerAnchors(self.num_layers)
        self.boundaries = BoundaryStore(tuple(sorted({x for x in layers if x > 0})))
        self.logits_version: str | None = None  # adapter digest the last cached row was computed under
        self.last_report: ReforgeReport | None = None
        self._fallback: str | None = None  # set by _reprefill, reported by the next _report

    def clone(self) -> "ReforgeState":
        other = object.__new__(ReforgeState)
        other.__dict__.update(self.__dict__)
        other.anchors = self.anchors.clone()
        other.boundaries = self.boundaries.clone()
        other.account = dataclasses.replace(self.account) if self.account is not None else None
        return other

    def overwrite_rows_from(self, start: int) -> int:
        """Zero the retained boundary rows ``[start, N)`` in place (strict erase: they may derive
        from erased text). Returns the number of rows overwritten (summed over boundaries)."""
        count = 0
        for boundary in self.boundaries.states.values():
            count += max(0, boundary.hidden.shape[1] - start)
            boundary.hidden[:, start:].zero_()
        return count

    def reset(self) -> None:
        self.anchors.clear()
        self.boundaries.clear()
        self.logits_version = None

    def current(self) -> AdapterState:
        """The version the model computes now (every computing adapter; the base version when
        none computes or the model has no adapter layers)."""
        return capture_adapter(self.model, self.num_layers) or base_state(self.num_layers)

    @property
    def boundary_bytes(self) -> int:
        """Memory of the retained boundary states (bytes)."""
        return self.boundaries.nbytes

    def version_report(self):
        """Per-layer versions of the cache (mixed-version report) against the active adapter."""
        return self.anchors.report(self.current())

    # ------------------------------------------------------- stored states
    def export_versions(self) -> dict | None:
        """The per-layer adapter versions of the cache as JSON-able data (digests only, no θ),
        or None when a layer has no anchor."""
        records = self.anchors.records()
        if records is None:
            return None
        return {**records, "logits_version": self.logits_version}

    def restore_versions(self, records: dict) -> None:
        """Anchor a restored cache to the versions it was computed under (from
        :meth:`export_versions`). Restored anchors carry no θ, so a layer whose version differs
        from the live adapter's is recomputed exactly by the next maintenance (never compared by
        distance, never trusted). No boundary state is restored: recovery starts at the embedding.

        Raises:
            ValueError: malformed records or another layer count.
        """
        anchors = LayerAnchors(self.num_layers)
        anchors.restore(records)
        logits_version = records.get("logits_version")
        self.boundaries.clear()
        self.anchors = anchors
        self.logits_version = None if logits_version is None else str(logits_version)

    # ------------------------------------------------------------- prefill side
    @contextlib.contextmanager
    def recording(self):
        """Capture boundary states during the session's forwards (no-op without boundary layers)."""
        if not self.boundaries.layers:
            yield []
            return
        with self.boundaries.recording(decoder_of(self.model).layers) as captures:
            yield captures

    def commit(self, captures, *, source_rows, rows: int, recomputed_all: bool, current: AdapterState | None) -> None:
        """Record what a forward/repair did: boundary rows follow the K/V rows (``source_rows``:
        old row of each new row, -1 = computed; None = kept in place); anchors move to
        ``current`` only when every row was recomputed (or the cache was empty)."""
        if current is None:
            return
        if rows == 0:
            self.reset()
            return
        self.anchors.adopt(current)
        self.boundaries.commit(captures, source_rows=source_rows, rows=rows, current=current)
        if recomputed_all or self.anchors.empty:
            self.anchors.set(range(self.num_layers), current)
        self.logits_version = current.digest

    # ---------------------------------------------------------- maintenance
    def needs_maintenance(self, current: AdapterState | None) -> bool:
        if current is None or self.anchors.empty:
            return False
        return self.logits_version != current.digest or any(
            v != current.digest for v in self.anchors.layer_versions
        )

    def usable_policy(self, policy: str | None = None) -> str:
        """The maintenance policy ``policy`` (default: the config's), checked before anything
        runs: known, with the calibration it needs, calibrated for this layer count.

        Raises:
            ValueError: unknown policy; cachereforge / drift_only / scheduled / probed without a
                profile (or scheduled / probed without its calibration); a profile of another
                layer count.
        """
        policy = policy or self.config.resolved_policy()
        if policy not in POLICIES:
            raise ValueError(f"unknown CacheReforge policy {policy!r}; use one of {', '.join(POLICIES)}")
        profile = self.config.profile
        _check_calibration(policy, profile)
        if policy in ("cachereforge", "scheduled", "probed") and profile.num_layers != self.num_layers:
            raise ValueError(f"the CacheReforge profile was calibrated for {profile.num_layers} layers, this model "
                             f"has {self.num_layers}: run `kvmemory calibrate` for this model")
        return policy

    def maintain(self, view: CacheView, *, current: AdapterState | None = None, policy: str | None = None) -> Maintained:
        """Bring ``view.cache`` to the active adapter under ``policy`` (default: the config's).

        Rewrites layers ``[r, b_t)`` and the last row of ``view.cache`` in place (or re-prefills
        into a fresh cache) and returns what the session must apply (``KVSession.maintain``).

        Raises:
            ValueError: an unusable policy (see :meth:`usable_policy`), before anything changes.
        """
        t0 = time.perf_counter()
        policy = self.usable_policy(policy)
        self._fallback = None
        current = current if current is not None else self.current()
        out = Maintained(report=None, cache=view.cache)
        rows = kvcache.cache_length(view.cache)
        if rows == 0:
            out.report = self._report(current, policy, None, rows, [], t0)
            return out
        if self.anchors.empty:  # rows of unknown provenance: never trusted as current
            log.warning("kvmemory: cache rows without adapter anchors: every layer is recomputed")
            self.anchors.set(range(self.num_layers), unknown_state(self.num_layers))
        reanchored, invalid = self._reanchor_unchanged(current)
        start = self.boundaries.valid_start(invalid[0], current, rows) if invalid else self.num_layers
        account = self._account(policy, invalid, current)
        incomparable = self.anchors.incomparable(current, invalid)
        if policy == "probed":
            decision = self._probed(view, out, invalid, start, incomparable, current, account)
        else:
            decision = decide(policy, self.anchors.distances(current), invalid, start,
                              self.config.profile, self.config.window, account)
            if policy != "stale":  # the stale baseline reuses everything on purpose (reported stale)
                decision = _covering(decision, incomparable)
            if account is not None:  # exact-recompute widening is charged too
                account.charge(decision.layers)
            if decision.action != "reuse":
                self._execute(view, out, decision.start, decision.end, current)
        t1 = time.perf_counter()
        if self.anchors.report(current).stale_layers:
            # rows produced partly by an older adapter: none equals a fresh prefill any more, so a
            # later budget-100 repair must recompute from row 0 (see KVSession.exact_rows)
            out.exact_rows = 0
        if decision.action != "reuse" or self.logits_version != current.digest:  # the prefix changed
            self._refresh_last_row(view, out, current)
        out.report = self._report(current, policy, decision, rows, reanchored, t0, incomparable)
        out.report.request_ms = (time.perf_counter() - t1) * 1000.0
        return out

    def _open_account(self, policy: str) -> BudgetAccount | None:
        """A fresh budget account for the scheduled / probed policy (None for the others)."""
        profile = self.config.profile
        if policy == "scheduled":
            return BudgetAccount.open(self.config.budget_pct, self.num_layers, profile.scheduler.carry)
        if policy == "probed":
            return BudgetAccount.open(self.config.budget_pct, self.num_layers, profile.probe.carry)
        return None

    def _account(self, policy: str, invalid: list[int], current: AdapterState) -> BudgetAccount | None:
        """The scheduled / probed policy's budget with this adapter version's allowance deposited (once)."""
        if policy not in ("scheduled", "probed"):
            return None
        if self.account is None or self.account.budget_pct != self.config.budget_pct:
            self.account = self._open_account(policy)
        if invalid:
            self.account.deposit(current.digest)
        return self.account

    def _probed(self, view: CacheView, out: Maintained, invalid: list[int], start: int, incomparable: list[int],
                current: AdapterState, account: BudgetAccount) -> Decision:
        """The probed policy (:mod:`kvmemory.reforge.probe`): execute ``[start, b)`` one layer at a
        time from the boundary state, probing layer b's K/V on the last ``rows`` cached rows
        before the last one, while the deviation reaches τ_b and the account covers it. Layers
        with incomparable anchors are recomputed whatever the deviation or the budget. Where rows
        cannot be overwritten in place, every layer is re-prefilled instead (exact)."""
        n = self.num_layers
        distances = self.anchors.distances(current)
        r_kv = invalid[0] if invalid else n
        forced = 1 + max(incomparable) if incomparable else None
        if not invalid:
            return Decision("probed", r_kv, start, None, [], distances, [0.0] * n)
        if cache_unsupported_reason(out.cache) or view.row_reuse_reason:
            account.charge(n - start)
            self._execute(view, out, start, n, current)  # re-prefills and reports why
            return Decision("probed", r_kv, start, n, list(invalid), distances, [0.0] * n)
        ids = torch.tensor(view.token_ids, dtype=torch.long)
        rows = ids.shape[0]
        calibration = self.config.profile.probe
        hi = rows - 1  # the last row is recomputed for the request anyway
        lo = max(0, hi - calibration.rows) if calibration.rows else 0
        run = _IncrementalRun(self.model, embed(self.model, ids) if start == 0
                              else self.boundaries.states[start].hidden[:, :rows], start, self.boundaries.layers)
        cached = kvcache.layer_tensors(out.cache)
        positions = torch.arange(lo, hi)

        entry = run.hidden  # the state entering layer `start` (retained boundary or embedding)

        def project(layer: int) -> float:  # the restart layer's K/V of rows [0, hi) from that state
            keys, values = cached[layer]
            fresh = layer_kv(self.model, layer, entry[:, :hi], torch.arange(hi))
            dev = relative_deviation((fresh[0][:, :, lo:], fresh[1][:, :, lo:]),
                                     (keys[:, :, lo:hi], values[:, :, lo:hi]))
            keys[:, :, :hi], values[:, :, :hi] = fresh
            return dev

        def probe(layer: int, reach: int) -> float:
            run.advance(reach)
            hidden = run.hidden[:, lo:hi]
            if layer > reach:  # valid layers below r_kv: the probed rows alone, over their cached prefix
                prefix = [(cached[x][0][:, :, :lo], cached[x][1][:, :, :lo]) for x in range(reach, layer)]
                hidden = run_rows(self.model, hidden, reach, layer, prefix)
            fresh = layer_kv(self.model, layer, hidden, positions)
            keys, values = cached[layer]
            return relative_deviation(fresh, (keys[:, :, lo:hi], values[:, :, lo:hi]))

        cost = probe_cost(self.model.config, hi - lo, hi) if hi > lo else 0.0  # share of a layer over the prefix
        plan = extend_while_stale(start, n, probe if hi > lo else (lambda layer, reach: math.inf), calibration,
                                  account, cost, r_kv=r_kv, forced_end=forced, row_share=(hi - lo) / max(hi, 1),
                                  project=project if hi > lo else None,
                                  projection_cost=probe_cost(self.model.config, hi, hi))
        account.charge(plan.charged)
        if plan.projected is not None:
            self.anchors.set([plan.projected], current)
        if plan.end is not None:
            run.advance(plan.end)
            overwrite_layers(out.cache, run.result())
            self.anchors.set(range(start, plan.end), current)
            for layer, h in run.boundaries.items():
                self.boundaries.write(layer, h, current)
        triggered = [layer for layer, dev in plan.deviations.items() if plan.end is not None and layer < plan.end]
        return Decision("probed", r_kv, start, plan.end, triggered, distances, [0.0] * n,
                        probe_layers=plan.probe_layers, deviations=plan.deviations, projected=plan.projected,
                        projection_layers=plan.projection_layers)

    def _reanchor_unchanged(self, current: AdapterState) -> tuple[list[int], list[int]]:
        """Layers whose K/V the change cannot reach keep their rows and take the new anchor."""
        reanchored, invalid = [], []
        for layer in range(self.num_layers):
            anchor = self.anchors.anchor(layer)
            if anchor is None or anchor.digest == current.digest:
                continue
            (reanchored if current.same_cache_layer(anchor, layer) else invalid).append(layer)
        if reanchored:
            self.anchors.set(reanchored, current)
        return reanchored, invalid

    def _execute(self, view: CacheView, out: Maintained, start: int, end: int, current: AdapterState) -> None:
        """Re-execute layers ``[start, end)`` over every cached row and overwrite their K/V in place;
        where rows cannot be overwritten exactly (capability gates), re-prefill every layer instead."""
        reason = cache_unsupported_reason(out.cache) or view.row_reuse_reason
        if reason:  # quantized rows cannot be overwritten; sliding layers need their own masks
            self._reprefill(view, out, current, f"CacheReforge re-prefills every layer instead of executing layers "
                                              f"[{start}, {end}): {reason}")
            return
        ids = torch.tensor(view.token_ids, dtype=torch.long)
        rows = ids.shape[0]
        hidden = embed(self.model, ids) if start == 0 else self.boundaries.states[start].hidden[:, :rows]
        keep = [b for b in self.boundaries.layers if start < b <= end]
        run = run_layers(self.model, hidden, start, end, keep_boundaries=keep)
        overwrite_layers(out.cache, run)
        self.anchors.set(range(start, end), current)
        for layer, h in run.boundaries.items():
            self.boundaries.write(layer, h, current)

    def _reprefill(self, view: CacheView, out: Maintained, current: AdapterState, reason: str) -> None:
        """Re-prefill every cached row (the last one included, so its logits are the pending
        request's) under the current adapter in one forward, into a fresh cache of the session's
        kind (``view.cache_factory``: a quantized session stays quantized). The exact fallback
        where layer ranges cannot be re-executed in place; ``reason`` is logged and reported as
        ``ReforgeReport.fallback``. One forward of all rows, as a fresh prefill does: on a
        quantized cache a separate last row would attend to dequantized rows instead."""
        log.warning("kvmemory: %s", reason)
        self._fallback = reason
        ids = torch.tensor(view.token_ids, dtype=torch.long)
        out.cache = view.cache_factory(self.model.config)
        with self.recording() as captures:
            logits = forward_rows(self.model, out.cache, ids, 0)
        self.boundaries.commit(captures, source_rows=None, rows=ids.shape[0], current=current)
        self.anchors.set(range(self.num_layers), current)
        out.next_logits = logits
        self.logits_version = current.digest
        out.exact_rows = ids.shape[0]  # every row recomputed from the token ids

    def _refresh_last_row(self, view: CacheView, out: Maintained, current: AdapterState) -> None:
        """Recompute the last cached row through every layer under the current adapter (its
        logits are the pending request's first-token distribution)."""
        gate = cache_unsupported_reason(out.cache)
        if gate and self._fallback is None:  # its last row cannot be cropped
            self._reprefill(view, out, current, f"CacheReforge re-prefills the cache to recompute its last row: {gate}")
        if self._fallback is not None:
            return  # _reprefill recomputed every row, the last one included
        rows = len(view.token_ids)
        kvcache.crop_to(out.cache, rows - 1)
        with self.recording() as captures:
            logits = forward_rows(self.model, out.cache, torch.tensor(list(view.token_ids[-1:])), rows - 1)
        self.boundaries.commit(captures, source_rows=None, rows=rows, current=current)
        out.next_logits = logits
        self.logits_version = current.digest

    def _report(self, current, policy, decision: Decision | None, rows, reanchored, t0,
                incomparable=()) -> ReforgeReport:
        versions = self.anchors.report(current)
        action = decision.action if decision else "reuse"
        report = ReforgeReport(
            adapter_version=current.digest if current else None,
            policy=policy,
            action=action,
            start=decision.start if decision and action != "reuse" else None,
            end=decision.end if decision and action != "reuse" else None,
            r_kv=decision.r_kv if decision else self.num_layers,
            rows=rows,
            recompute_pct=100.0 * ((decision.layers + decision.probe_layers + decision.projection_layers)
                                   if decision else 0) / self.num_layers,
            triggered=decision.triggered if decision else [],
            reanchored=reanchored,
            incomparable=list(incomparable),
            stale_layers=versions.stale_layers,
            mixed=versions.mixed,
            ms=(time.perf_counter() - t0) * 1000.0,
            fallback=self._fallback,
            budget=self.account.as_dict() if self.account is not None and policy in ("scheduled", "probed") else None,
            predicted_kl=decision.predicted_kl if decision else None,
            probes={"count": len(decision.deviations), "layers": decision.probe_layers,
                    "deviations": dict(decision.deviations)} if decision and decision.deviations is not None else None,
            projected=decision.projected if decision else None,
        )
        self._fallback = None
        notes = []
        if incomparable and action != "reuse":
            notes.append(f"the adapter layout differs from the anchors of layers {list(incomparable)} (other adapters "
                         f"computing or disabled, or anchors restored without θ): layers [{decision.start}, "
                         f"{decision.end}) recomputed exactly instead of compared by distance")
        if decision and action != "reuse" and decision.start == 0 and decision.r_kv > 1:
            notes.append("no valid retained boundary state below the update: executed from the embedding (exact, slower)")
        if notes:
            report.note = "; ".join(notes)
            log.info("kvmemory: %s", report.note)
        if versions.stale_layers:
            log.info("kvmemory: cache layers %s still hold an older adapter version", versions.stale_layers)
        self.last_report = report
        return report


def _check_calibration(policy: str, profile: ReforgeProfile | None) -> None:
    """Raise ValueError naming the fix when ``policy`` lacks the calibration it needs."""
    if policy in ("cachereforge", "drift_only", "scheduled", "probed") and profile is None:
        raise ValueError(f"CacheReforge policy {policy!r} needs a calibration profile: run `kvmemory calibrate`")
    if policy == "scheduled" and profile.scheduler is None:
        raise ValueError("policy 'scheduled' needs a profile with a scheduler calibration: run "
                         "`kvmemory calibrate --schedule 5` (or use policy 'cachereforge', eq. 9)")
    if policy == "probed" and profile.probe is None:
        raise ValueError("policy 'probed' needs a profile with a probe calibration (ReforgeProfile.probe, fitted by "
                         "kvmemory_lab.reforge.probe_fit), or use policy 'cachereforge' (eq. 9)")


class _IncrementalRun:
    """Bounded recovery executed a few layers at a time (the probed policy extends ``[start, b)``
    after each probe): the state entering the next unexecuted layer, every executed layer's K/V
    and the retained boundary states crossed."""

    def __init__(self, model, hidden: torch.Tensor, start: int, boundary_layers):
        self.model, self.hidden, self.done = model, hidden, start
        self.boundary_layers = tuple(boundary_layers)
        self.kv: dict = {}
        self.boundaries: dict = {}

    def advance(self, end: int) -> None:
        """Execute layers ``[done, end)`` over every row (no-op when already there)."""
        if end <= self.done:
            return
        keep = [b for b in self.boundary_layers if self.done < b <= end]
        run = run_layers(self.model, self.hidden, self.done, end, keep_boundaries=keep)
        self.kv.update(run.kv)
        self.boundaries.update(run.boundaries)
        self.hidden, self.done = run.hidden, end

    def result(self) -> LayerRun:
        return LayerRun(self.kv, self.boundaries, self.hidden)


def _covering(decision: Decision, layers: list[int]) -> Decision:
    """``decision`` widened so layers ``[start, 1 + max(layers))`` are recomputed: layers that
    no distance can judge are recomputed, never reused (``triggered`` keeps the policy's own)."""
    if not layers:
        return decision
    return dataclasses.replace(decision, end=max(decision.end or 0, 1 + max(layers)))
