"""Turning an edit plan into a repaired cache: Shift, budgeted sparse refresh, Replay, Re-prefill.

Every sparse arm starts from the Shift cache (paper §7.1): rows of deleted text are dropped,
kept rows move to their new positions with their keys rotated (eq. 2), new text is prefilled at
its place, and B = min(S, ceil(S·b/100)) stale suffix positions chosen by the allocator are
recomputed through every layer by the executor ``policy.executor`` selects (``executors/``:
direct sequential for one interval, packed for several, unless overridden).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from . import kvcache
from .capabilities import Capabilities, cache_unsupported_reason
from .edits import EditPlan
from .engine import engine_for
from .errors import InputError
from .executors.sequential import run_sequential
from .executors import ExecutorChoice, choose_executor, executor_label, run_refresh
from .policy import RepairPolicy, RepairReport
from .shift import RotaryShifter
from .prompt import RenderedPrompt
from . import adaptive
from .selection import (SIGNAL_ALLOCATORS, MessageSpan, RepairSignals, SelectionInput, SelectionOptions, allowance,
                        select, to_intervals)


@dataclass
class RepairResult:
    """The repaired cache (exactly ``len(new)`` rows), fp32 next-token logits ``[vocab]``, the
    report, and ``exact_rows``: how many leading rows now equal a Re-prefill (the rest is stale)."""

    cache: DynamicCache
    next_logits: torch.Tensor
    report: RepairReport
    exact_rows: int


@dataclass
class RepairJob:
    """Everything one repair reads: the live cache and the ids its rows were computed for, the
    new prompt and the edit plan between them, the policy, and the model with what it can do.

    ``cache``: ``len(cached_ids)`` rows (modified or replaced by the repair). ``new``: the
    rendered new prompt (N tokens); ``plan``: ``plan_edits(cached_ids, ..., new)``. ``policy``: a
    RepairPolicy or its label (coerced here). ``query_ids`` / ``query_text``: the last message,
    which query-aware allocators score against. ``new_cache`` makes the empty cache a Re-prefill
    fills (default: ``kvcache.new_cache(model.config)``), so that a session on a quantized cache
    stays on one. ``calibration_ids``: the exposure allocator's calibration text under the
    model's tokenizer (see :class:`kvmemory.selection.RepairSignals`). ``last_logits``: fp32
    ``[vocab]`` logits predicting the token after the cache's last row, when the caller knows them
    (None: unknown); a request identical to the cache then needs no forward at all. ``ids``: ``new.token_ids`` as a LongTensor ``[N]``.

    Raises:
        InputError (ValueError): a bad policy label. InputTypeError: ``policy`` of another type.
    """

    model: torch.nn.Module
    capabilities: Capabilities
    shifter: RotaryShifter | None
    cache: DynamicCache
    cached_ids: list[int]
    new: RenderedPrompt
    plan: EditPlan
    policy: RepairPolicy
    query_ids: list[int]
    query_text: str
    new_cache: Callable[[], Cache] | None = None
    last_logits: torch.Tensor | None = None
    calibration_ids: Callable[[], list[int]] | None = None
    ids: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.policy = RepairPolicy.coerce(self.policy)
        self.ids = torch.tensor(self.new.token_ids, dtype=torch.long)


@dataclass
class Repaired:
    """What one repair branch did: the cache (N rows), fp32 next-token logits ``[vocab]``,
    ``exact_rows``, and ``measures``: RepairReport fields by name (token counts, ``spans``,
    executor, times), ``budget`` where the branch spent another than the policy's, ``fallback``
    where exact recomputation replaced a cheaper path (see :func:`_report`)."""

    cache: DynamicCache
    next_logits: torch.Tensor
    exact_rows: int
    measures: dict[str, Any]

    def updated(self, **measures) -> "Repaired":
        """This result with ``measures`` added or replaced."""
        return replace(self, measures={**self.measures, **measures})


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def repair(job: RepairJob) -> RepairResult:
    """Repair ``job.cache`` (rows for ``job.cached_ids``; modified or replaced) into the cache of
    ``job.new``.

    A request that only appends to the cached rows (``plan.extends``) prefills just its new
    tokens under every operator but a forced Re-prefill (``scope="always"``); an identical one
    forwards nothing when ``job.last_logits`` are known. Stale rows the plan keeps (``[g, k)``)
    stay stale and are not refreshed again. ``reprefill`` rebuilds the whole prompt on an edit
    (a message deleted, replaced or inserted) or when rows are stale; on an exact cache, a
    request that only appends messages keeps the common token prefix and computes the rest
    (trailing rows of no message, like a generation prompt, are dropped). Otherwise the
    request is repaired under ``policy`` (Shift + refresh of B of the S suffix rows, or Replay
    when B = S).

    Falls back to exact recomputation, and says why in ``report.fallback``, when a capability
    gate applies (see ``capabilities.py``): rows that cannot be spliced (sliding windows, mrope,
    a quantized cache) are replayed from the first changed token where that is exact, else
    re-prefilled; keys that cannot be rotated (dynamic RoPE) are replayed instead of shifted.

    Returns:
        RepairResult; ``exact_rows`` is N only when no stale row is left. The report's
        ``latency_ms`` is left to the caller (it times the whole request).

    Raises:
        InputError (ValueError): the cache length differs from ``len(cached_ids)``, or the plan
            was made for another prompt.
        ValueError: from the executor if the plan does not cover every position (a bug).
    """
    _check_inputs(job)
    done = _run_branch(job)
    return RepairResult(done.cache, done.next_logits, _report(job, done), done.exact_rows)


def check_policy_fits(policy: RepairPolicy, model) -> None:
    """Raise InputError when ``policy`` asks more of ``model`` than it has (a two-dimensional
    budget's ``lower_layers`` above its layer count)."""
    layers = len(model.get_decoder().layers)
    if policy.lower_layers > layers:
        raise InputError(f"lower_layers={policy.lower_layers} but the model has {layers} layers: use 1 to {layers} "
                         f"(lower{layers} recomputes every stale row in every layer, as Replay does)")


def _check_inputs(job: RepairJob) -> None:
    rows = kvcache.cache_length(job.cache)
    if rows != len(job.cached_ids):
        raise InputError(
            f"the cache holds {rows} rows but cached_ids has {len(job.cached_ids)} ids: pass the ids the rows were "
            "computed for (KVSession.token_ids)"
        )
    if job.plan.new_length != len(job.new):
        raise InputError(
            f"the plan was made for a {job.plan.new_length}-token prompt but the new prompt has {len(job.new)}: "
            "build it with plan_edits(cached_ids, old, new)"
        )


def _run_branch(job: RepairJob) -> Repaired:
    """The branch the policy, the plan and the capability gates call for (see :func:`repair`)."""
    plan, policy, held = job.plan, job.policy, len(job.cached_ids)
    # only appended rows (or, for an identical request, known last-row logits): no cached row is
    # dropped, moved or rewritten, so no capability gate applies
    extends = plan.extends(held) and (len(job.new) > held or job.last_logits is not None)
    cache_gate = cache_unsupported_reason(job.cache)
    gate = cache_gate or job.capabilities.row_reuse_reason
    # Re-prefill names what happens on an edit; it also rebuilds a cache whose rows are stale
    exact_without_edit = not (plan.edits_history or plan.stale_tokens or plan.kept_stale_tokens)
    if policy.forces_reprefill or (policy.operator == "reprefill" and not exact_without_edit):
        return _reprefill(job)
    if extends:
        return _extend(job)
    if not gate:
        return _budgeted(job)
    if not cache_gate and job.capabilities.replay_exact(held):
        done = _replay(job)  # every row it attends to is still held
        return done.updated(fallback=f"{gate} [this edit: Replay from token {done.measures['spans'][0][0]}]")
    return _reprefill(job).updated(fallback=f"{gate} [this edit: Re-prefill]")


def _budgeted(job: RepairJob) -> Repaired:
    """Shift, then refresh B of the S stale suffix rows (B = S: Replay; ``budget="auto"``: in
    rounds). Keys that cannot be rotated make a move replay the suffix (reported)."""
    budget = job.policy.effective_budget
    moved = any(run.new_start != run.old_start for run in job.plan.reuse)
    shift_gate = job.capabilities.shift_reason if moved and budget < 100 else None
    B = allowance(job.plan.stale_tokens, 100.0 if shift_gate else budget)
    if B == job.plan.stale_tokens:
        return _replay(job).updated(fallback=shift_gate)
    if job.policy.adaptive:
        return _adaptive_refresh(job)
    return _sparse_refresh(job, B)


def _report(job: RepairJob, done: Repaired) -> RepairReport:
    """The report of one repair: the plan's and the policy's facts, then the branch's measures."""
    policy, plan = job.policy, job.plan
    measures = dict(done.measures)
    fallback = measures.pop("fallback", None)
    report = RepairReport(**{
        "operator": policy.operator,
        "budget": policy.effective_budget if policy.operator in ("refresh", "shift", "replay") else None,
        "allocator": policy.allocator if policy.operator == "refresh" else None,
        "prompt_tokens": len(job.new),
        "reused_tokens": 0,
        "recomputed_tokens": 0,
        "stale_tokens": plan.stale_tokens,
        "kept_stale_tokens": plan.kept_stale_tokens,
        "edits": {k: plan.count(k) for k in ("keep", "delete", "replace", "insert", "append") if plan.count(k)},
        "widened": list(plan.widened),
        "capability_notes": list(job.capabilities.notes),
        "intervals": len(measures.get("spans", ())),
        **measures,
    })
    report.note_fallback(fallback)
    return report


def _reprefill(job: RepairJob) -> Repaired:
    t0 = time.perf_counter()
    model, ids = job.model, job.ids
    cache = job.new_cache() if job.new_cache is not None else kvcache.new_cache(model.config)
    out = run_sequential(model, cache, ids, [(0, ids.shape[0])])
    return Repaired(cache, out.next_logits, ids.shape[0], dict(
        recomputed_tokens=ids.shape[0], spans=[(0, ids.shape[0])], executor="sequential", refresh_ms=_ms(t0)))


def _extend(job: RepairJob) -> Repaired:
    """Keep every cached row; prefill only the new tokens (none for an identical request, whose
    logits ``job.last_logits`` are already known). Rows appended after stale rows attend to them,
    so they are exact only when the whole cache was."""
    t0 = time.perf_counter()
    cache, ids, plan = job.cache, job.ids, job.plan
    held, n = kvcache.cache_length(cache), ids.shape[0]
    spans = [(held, n)] if held < n else []
    logits = run_sequential(job.model, cache, ids, spans).next_logits if spans else job.last_logits
    return Repaired(cache, logits, n if plan.exact_prefix == held else plan.exact_prefix, dict(
        reused_tokens=held, recomputed_tokens=n - held, spans=spans, executor="sequential" if spans else None,
        refresh_ms=_ms(t0)))


def _replay(job: RepairJob) -> Repaired:
    """Keep the kept prefix, recompute everything after it (at least the last token, for logits).
    The result is exact unless stale rows were kept (``plan.kept_prefix`` > ``exact_prefix``)."""
    t0 = time.perf_counter()
    cache, ids, plan = job.cache, job.ids, job.plan
    start = min(plan.kept_prefix, ids.shape[0] - 1)
    kvcache.crop_to(cache, start)
    out = run_sequential(job.model, cache, ids, [(start, ids.shape[0])])
    exact = ids.shape[0] if start <= plan.exact_prefix else plan.exact_prefix
    return Repaired(cache, out.next_logits, exact, dict(
        reused_tokens=start, recomputed_tokens=ids.shape[0] - start, refreshed_tokens=plan.stale_tokens,
        spans=[(start, ids.shape[0])], executor="sequential", refresh_ms=_ms(t0)))


def _sparse_refresh(job: RepairJob, B: int) -> Repaired:
    t0 = time.perf_counter()
    ids, plan, policy = job.ids, job.plan, job.policy
    signals = _signals(job)
    selected = _select(job, B, signals)
    probe_ms = signals.replayed_ms if signals is not None else 0.0
    selection_ms = _ms(t0) + probe_ms

    intervals = to_intervals(sorted(set(plan.new_positions) | set(selected)))
    if not intervals or intervals[-1][1] != ids.shape[0]:
        intervals = to_intervals(sorted(set(plan.new_positions) | set(selected) | {ids.shape[0] - 1}))
    # a two-dimensional budget (lower_layers) runs on the packed executor only; elsewhere: Replay
    choice = choose_executor("packed" if policy.lower_layers else policy.executor, len(intervals), job.model)
    if policy.lower_layers:
        check_policy_fits(policy, job.model)
        if choice.name != "packed":
            return _replay(job).updated(fallback=f"two-dimensional budget: {choice.fallback}; Replay of the suffix")

    t1 = time.perf_counter()
    # packed and direct write rows in place: give them all N rows at once (placeholders included)
    rows = plan.source_rows(ids.shape[0] if choice.name != "sequential" else None)
    shifted, shifted_tokens = _shift(job, rows)
    shift_ms = _ms(t1)

    t2 = time.perf_counter()
    # the lower layers recompute every stale suffix row besides the rows of the intervals
    lower = sorted(set(plan.suffix_positions).union(*(range(a, b) for a, b in intervals))) if policy.lower_layers else None
    out = run_refresh(job.model, shifted, ids, intervals, choice, policy.backend, lower_rows=lower,
                      lower_layers=policy.lower_layers)
    return Repaired(shifted, out.next_logits, plan.exact_prefix, dict(
        reused_tokens=ids.shape[0] - out.forwarded_tokens, recomputed_tokens=out.forwarded_tokens, refreshed_tokens=B,
        shifted_tokens=shifted_tokens, spans=intervals, executor=executor_label(choice, policy.backend),
        executor_fallback=choice.fallback, selection_ms=selection_ms, shift_ms=shift_ms, refresh_ms=_ms(t2),
        replayed_probe_ms=probe_ms))


def _adaptive_refresh(job: RepairJob) -> Repaired:
    """``budget="auto"``: Shift, then refresh in rounds until the convergence signal settles
    (see :mod:`kvmemory.adaptive`); the report gives the budget spent and every round."""
    ids, plan, policy = job.ids, job.plan, job.policy
    signals = _signals(job)
    selections: dict[int, list[int]] = {}
    selecting_ms = 0.0  # summed over the rounds' selections

    def select_for(B: int) -> list[int]:
        nonlocal selecting_ms
        t = time.perf_counter()
        if B not in selections:
            selections[B] = _select(job, B, signals)
        selecting_ms += _ms(t)
        return selections[B]

    t1 = time.perf_counter()
    rows = plan.source_rows(ids.shape[0])
    shifted, shifted_tokens = _shift(job, rows)
    shift_ms = _ms(t1)
    S = plan.stale_tokens
    allowances = adaptive.schedule(S, policy.start, policy.max_budget)  # eq. 3 on S, as the fixed budget
    t2 = time.perf_counter()
    out = adaptive.refresh_in_rounds(job.model, shifted, ids, list(plan.new_positions), allowances, select_for,
                                     signal=policy.signal, tolerance=policy.tolerance, executor=policy.executor,
                                     backend=policy.backend)
    rounds_ms = _ms(t2) - selecting_ms  # rounds, without their selections
    probe_ms = signals.replayed_ms if signals is not None else 0.0
    spent = 100.0 * len(out.selected) / S if S else 0.0
    summary = {"signal": policy.signal, "tolerance": policy.tolerance, "max_budget": policy.max_budget,
               "start": policy.start, "stopped_by": out.stopped_by, "spent_budget": spent,
               "probe_tokens": out.probe_tokens, "rounds": out.rounds, "escalated": False}
    computed = set(out.selected) | set(plan.new_positions) | {ids.shape[0] - 1}
    rounds = Repaired(shifted, out.next_logits, plan.exact_prefix, dict(
        reused_tokens=ids.shape[0] - len(computed), recomputed_tokens=out.forwarded, refreshed_tokens=len(out.selected),
        shifted_tokens=shifted_tokens, spans=out.intervals, executor_fallback=out.executor_fallback,
        executor=executor_label(ExecutorChoice(out.executor), policy.backend) if out.executor else None,
        selection_ms=selecting_ms + probe_ms, shift_ms=shift_ms, refresh_ms=rounds_ms, replayed_probe_ms=probe_ms,
        budget=spent, adaptive=summary))
    if out.stopped_by == "cap" and policy.on_cap == "replay":
        return _replay_after_rounds(job, rounds)
    return rounds


def _replay_after_rounds(job: RepairJob, rounds: Repaired) -> Repaired:
    """An adaptive refresh that did not settle within its cap: exact Replay of the suffix from
    the untouched cache. The rounds' Shift, selections, forwarded rows and time stay counted."""
    policy, done = job.policy, rounds.measures
    replayed = _replay(job)
    kept = {k: done[k] for k in ("shifted_tokens", "executor_fallback", "selection_ms", "shift_ms", "replayed_probe_ms")}
    return replayed.updated(
        **kept, recomputed_tokens=replayed.measures["recomputed_tokens"] + done["recomputed_tokens"],
        refresh_ms=replayed.measures["refresh_ms"] + done["refresh_ms"], budget=100.0,
        adaptive={**done["adaptive"], "escalated": True, "spent_budget": 100.0},
        fallback=(f"adaptive budget: the {policy.signal} signal stayed above {policy.tolerance:g} up to "
                  f"max_budget={policy.max_budget:g} %: Replay of the suffix"))


def _signals(job: RepairJob) -> RepairSignals | None:
    """Model probes for the signal allocators (Appendix 7.4 Table 1); None for text allocators."""
    cache, plan = job.cache, job.plan
    if job.policy.allocator not in SIGNAL_ALLOCATORS or not plan.stale_tokens:
        return None

    def shift_cache() -> DynamicCache:
        return _shift(job, plan.source_rows())[0]

    # rows before kept_prefix (exact, or stale and already paid for) are context shared by both prompts
    return RepairSignals(
        model=job.model, token_ids=job.new.token_ids, eligible=_eligible(plan), old_ids=job.cached_ids,
        dirty_cache=cache, reuse=plan.reuse, exact_prefix=plan.kept_prefix, make_shift_cache=shift_cache,
        shifter=job.shifter, calibration_ids=job.calibration_ids,
    )


def _select(job: RepairJob, B: int, signals: RepairSignals | None) -> list[int]:
    new, policy = job.new, job.policy
    eligible = _eligible(job.plan)
    B = min(B, len(eligible))
    if B == 0:
        return []
    spans = [
        MessageSpan(s.index, s.token_start, s.token_end, s.content_start, s.content_end) for s in new.segments
    ]
    inp = SelectionInput(
        text=new.text,
        token_ids=new.token_ids,
        offsets=new.offsets,
        messages=spans,
        eligible=eligible,
        query_ids=job.query_ids,
        query_text=job.query_text,
    )
    embedding = job.model.get_input_embeddings().weight
    options = SelectionOptions(relevance=policy.relevance, ties=policy.ties, tail_tokens=policy.tail_tokens)
    return select(policy.allocator, inp, B, embedding=embedding, seed=policy.seed, signals=signals, options=options)


def _eligible(plan: EditPlan) -> list[int]:
    """Stale positions the allocator chooses from: the suffix s without the last prompt
    position, which is recomputed anyway (its logits are the answer's). Without this, a stale
    last row (same messages resent after a sparse repair) left the query-attention allocators
    (ProphetKV, InfoFlow, A3) an empty query to forward, and cost the others a slot of B."""
    last = plan.new_length - 1
    return [p for p in plan.suffix_positions if p != last]


def _shift(job: RepairJob, rows: torch.Tensor) -> tuple[DynamicCache, int]:
    """Shift (eq. 2) as a new cache: row p copies the live cache's row ``rows[p]`` (LongTensor
    ``[n]``, -1 = a placeholder to recompute), gathered by the engine (into its storage where it
    has one), and the keys of moved rows are rotated. Returns the cache and how many rows moved."""
    shifted = engine_for(job.model, job.cache).gather_rows(job.cache, rows)
    return shifted, _rotate_moved_keys(job.shifter, shifted, rows)


def _rotate_moved_keys(shifter: RotaryShifter | None, cache: DynamicCache, rows: torch.Tensor) -> int:
    """Shift (eq. 2): rotate the keys of rows that moved from old position ``rows[p]`` to ``p``."""
    new_pos = torch.nonzero((rows >= 0) & (rows != torch.arange(rows.shape[0])), as_tuple=True)[0]
    if new_pos.numel() == 0:
        return 0
    if shifter is None:
        raise RuntimeError("rows moved but no rotary shifter is available (capability check skipped)")
    coeffs = shifter.coefficients(rows[new_pos], new_pos)
    for layer in cache.layers:
        layer.keys[:, :, new_pos] = shifter.apply(layer.keys[:, :, new_pos], coeffs)
    return int(new_pos.numel())
