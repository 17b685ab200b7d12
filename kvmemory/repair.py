"""Turning an edit plan into a repaired cache: Shift, budgeted sparse refresh, Replay, Re-prefill.

Every sparse arm starts from the Shift cache (paper §7.1): rows of deleted text are dropped,
kept rows move to their new positions with their keys rotated (eq. 2), new text is prefilled at
its place, and B = min(S, ceil(S·b/100)) stale suffix positions chosen by the allocator are
recomputed through every layer by the executor ``policy.executor`` selects (``executors/``:
direct sequential for one interval, packed for several, unless overridden).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from . import engine, kvcache
from .capabilities import Capabilities, cache_unsupported_reason
from .edits import EditPlan
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
class RepairContext:
    """What a repair needs besides the plan: the model and what it can do. ``new_cache`` makes
    the empty cache a Re-prefill fills (default: ``kvcache.new_cache(model.config)``), so that a
    session on a quantized cache stays on one. ``last_logits``: fp32 ``[vocab]`` logits predicting
    the token after the cache's last row, when the caller knows them (None: unknown); a request
    identical to the cache then needs no forward at all."""

    model: torch.nn.Module
    capabilities: Capabilities
    shifter: RotaryShifter | None
    query_ids: list[int]
    query_text: str
    new_cache: Callable[[], Cache] | None = None
    last_logits: torch.Tensor | None = None


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def repair(
    ctx: RepairContext,
    cache: DynamicCache,
    cached_ids: list[int],
    new: RenderedPrompt,
    plan: EditPlan,
    policy: RepairPolicy,
) -> RepairResult:
    """Repair ``cache`` (rows for ``cached_ids``; modified or replaced) into the cache of ``new``.

    A request that only appends to the cached rows (``plan.extends``) prefills just its new
    tokens under every operator but a forced Re-prefill (``scope="always"``); an identical one
    forwards nothing when ``ctx.last_logits`` are known. Stale rows the plan keeps (``[g, k)``)
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

    Args:
        cache: ``len(cached_ids)`` rows; ``cached_ids`` the token ids they were computed for.
        new: the rendered new prompt (N tokens); ``plan``: ``plan_edits(cached_ids, ..., new)``.
        policy: a RepairPolicy or its label (``"sur@5"``, ``"replay"``, ...).

    Returns:
        RepairResult; ``exact_rows`` is N only when no stale row is left.

    Raises:
        InputError (ValueError): the cache length differs from ``len(cached_ids)``, the plan was
            made for another prompt, or a bad policy label. InputTypeError: ``policy`` of another type.
        ValueError: from the executor if the plan does not cover every position (a bug).
    """
    t0 = time.perf_counter()
    policy = RepairPolicy.coerce(policy)
    _check_inputs(cache, cached_ids, new, plan)
    ids = torch.tensor(new.token_ids, dtype=torch.long)
    report = RepairReport(
        operator=policy.operator,
        budget=policy.effective_budget if policy.operator in ("refresh", "shift", "replay") else None,
        allocator=policy.allocator if policy.operator == "refresh" else None,
        prompt_tokens=len(new),
        reused_tokens=0,
        recomputed_tokens=0,
        stale_tokens=plan.stale_tokens,
        kept_stale_tokens=plan.kept_stale_tokens,
        edits={k: plan.count(k) for k in ("keep", "delete", "replace", "insert", "append") if plan.count(k)},
        widened=list(plan.widened),
    )
    report.capability_notes = list(ctx.capabilities.notes)
    # only appended rows (or, for an identical request, known last-row logits): no cached row is
    # dropped, moved or rewritten, so no capability gate applies
    extends = plan.extends(len(cached_ids)) and (len(new) > len(cached_ids) or ctx.last_logits is not None)
    cache_gate = cache_unsupported_reason(cache)
    gate = cache_gate or ctx.capabilities.row_reuse_reason
    # Re-prefill names what happens on an edit; it also rebuilds a cache whose rows are stale
    exact_without_edit = not (plan.edits_history or plan.stale_tokens or plan.kept_stale_tokens)
    if policy.forces_reprefill or (policy.operator == "reprefill" and not exact_without_edit):
        result = _reprefill(ctx, ids, report)
    elif extends:
        result = _extend(ctx, cache, ids, plan, report)
    elif gate:
        if not cache_gate and ctx.capabilities.replay_exact(len(cached_ids)):
            result = _replay(ctx.model, cache, ids, plan, report)  # every row it attends to is still held
            report.fallback = f"{gate} [this edit: Replay from token {report.spans[0][0]}]"
        else:
            result = _reprefill(ctx, ids, report)
            report.fallback = f"{gate} [this edit: Re-prefill]"
    else:
        budget = policy.effective_budget
        moved = any(run.new_start != run.old_start for run in plan.reuse)
        if moved and budget < 100 and ctx.capabilities.shift_reason:
            report.fallback = ctx.capabilities.shift_reason
            budget = 100.0
        B = allowance(plan.stale_tokens, budget)
        if B == plan.stale_tokens:
            result = _replay(ctx.model, cache, ids, plan, report)
        elif policy.adaptive:
            result = _adaptive_refresh(ctx, cache, cached_ids, ids, new, plan, policy, report)
        else:
            result = _sparse_refresh(ctx, cache, cached_ids, ids, new, plan, policy, B, report)
    report.latency_ms = _ms(t0) + report.replayed_probe_ms
    return result


def _check_inputs(cache, cached_ids, new: RenderedPrompt, plan: EditPlan) -> None:
    rows = kvcache.cache_length(cache)
    if rows != len(cached_ids):
        raise InputError(
            f"the cache holds {rows} rows but cached_ids has {len(cached_ids)} ids: pass the ids the rows were "
            "computed for (KVSession.token_ids)"
        )
    if plan.new_length != len(new):
        raise InputError(
            f"the plan was made for a {plan.new_length}-token prompt but the new prompt has {len(new)}: "
            "build it with plan_edits(cached_ids, old, new)"
        )


def _reprefill(ctx: RepairContext, ids: torch.Tensor, report: RepairReport) -> RepairResult:
    t0 = time.perf_counter()
    model = ctx.model
    cache = ctx.new_cache() if ctx.new_cache is not None else kvcache.new_cache(model.config)
    out = run_sequential(model, cache, ids, [(0, ids.shape[0])])
    report.recomputed_tokens = ids.shape[0]
    report.intervals, report.spans, report.executor = 1, [(0, ids.shape[0])], "sequential"
    report.refresh_ms = _ms(t0)
    return RepairResult(cache, out.next_logits, report, ids.shape[0])


def _extend(ctx: RepairContext, cache, ids: torch.Tensor, plan: EditPlan, report: RepairReport) -> RepairResult:
    """Keep every cached row; prefill only the new tokens (none for an identical request, whose
    logits ``ctx.last_logits`` are already known). Rows appended after stale rows attend to them,
    so they are exact only when the whole cache was."""
    t0 = time.perf_counter()
    held, n = kvcache.cache_length(cache), ids.shape[0]
    if held < n:
        logits = run_sequential(ctx.model, cache, ids, [(held, n)]).next_logits
        report.intervals, report.spans, report.executor = 1, [(held, n)], "sequential"
    else:
        logits = ctx.last_logits
    report.reused_tokens, report.recomputed_tokens = held, n - held
    report.refresh_ms = _ms(t0)
    return RepairResult(cache, logits, report, n if plan.exact_prefix == held else plan.exact_prefix)


def _replay(model, cache: DynamicCache, ids: torch.Tensor, plan: EditPlan, report: RepairReport) -> RepairResult:
    """Keep the kept prefix, recompute everything after it (at least the last token, for logits).
    The result is exact unless stale rows were kept (``plan.kept_prefix`` > ``exact_prefix``)."""
    t0 = time.perf_counter()
    start = min(plan.kept_prefix, ids.shape[0] - 1)
    kvcache.crop_to(cache, start)
    out = run_sequential(model, cache, ids, [(start, ids.shape[0])])
    report.reused_tokens = start
    report.recomputed_tokens = ids.shape[0] - start
    report.refreshed_tokens = plan.stale_tokens
    report.intervals, report.spans, report.executor = 1, [(start, ids.shape[0])], "sequential"
    report.refresh_ms = _ms(t0)
    exact = ids.shape[0] if start <= plan.exact_prefix else plan.exact_prefix
    return RepairResult(cache, out.next_logits, report, exact)


def _sparse_refresh(ctx, cache, cached_ids, ids, new, plan, policy, B, report) -> RepairResult:
    t0 = time.perf_counter()
    signals = _signals(ctx, cache, cached_ids, new, plan, policy)
    selected = _select(ctx, new, plan, policy, B, signals)
    report.replayed_probe_ms = signals.replayed_ms if signals is not None else 0.0
    report.selection_ms = _ms(t0) + report.replayed_probe_ms

    intervals = to_intervals(sorted(set(plan.new_positions) | set(selected)))
    if not intervals or intervals[-1][1] != ids.shape[0]:
        intervals = to_intervals(sorted(set(plan.new_positions) | set(selected) | {ids.shape[0] - 1}))
    choice = choose_executor(policy.executor, len(intervals), ctx.model)
    report.executor, report.executor_fallback = executor_label(choice, policy.backend), choice.fallback

    t1 = time.perf_counter()
    # packed and direct write rows in place: give them all N rows at once (placeholders included)
    rows = plan.source_rows(ids.shape[0] if choice.name != "sequential" else None)
    shifted = engine.gather_rows(ctx.model, cache, rows)
    report.shifted_tokens = _rotate_moved_keys(ctx.shifter, shifted, rows)
    report.shift_ms = _ms(t1)

    t2 = time.perf_counter()
    out = run_refresh(ctx.model, shifted, ids, intervals, choice, policy.backend)
    report.refresh_ms = _ms(t2)
    report.refreshed_tokens = B
    report.recomputed_tokens = out.forwarded_tokens
    report.reused_tokens = ids.shape[0] - out.forwarded_tokens
    report.intervals, report.spans = len(intervals), intervals
    return RepairResult(shifted, out.next_logits, report, plan.exact_prefix)


def _adaptive_refresh(ctx, cache, cached_ids, ids, new, plan, policy, report) -> RepairResult:
    """``budget="auto"``: Shift, then refresh in rounds until the convergence signal settles
    (see :mod:`kvmemory.adaptive`); the report gives the budget spent and every round."""
    signals = _signals(ctx, cache, cached_ids, new, plan, policy)
    selections: dict[int, list[int]] = {}

    def select_for(B: int) -> list[int]:
        t = time.perf_counter()
        if B not in selections:
            selections[B] = _select(ctx, new, plan, policy, B, signals)
        report.selection_ms += _ms(t)
        return selections[B]

    t1 = time.perf_counter()
    rows = plan.source_rows(ids.shape[0])
    shifted = engine.gather_rows(ctx.model, cache, rows)
    report.shifted_tokens = _rotate_moved_keys(ctx.shifter, shifted, rows)
    report.shift_ms = _ms(t1)
    S = plan.stale_tokens
    allowances = adaptive.schedule(S, policy.start, policy.max_budget)  # eq. 3 on S, as the fixed budget
    t2, selecting = time.perf_counter(), report.selection_ms
    out = adaptive.refresh_in_rounds(ctx.model, shifted, ids, list(plan.new_positions), allowances, select_for,
                                     signal=policy.signal, tolerance=policy.tolerance, executor=policy.executor,
                                     backend=policy.backend)
    report.refresh_ms = _ms(t2) - (report.selection_ms - selecting)  # rounds, without their selections
    report.replayed_probe_ms = signals.replayed_ms if signals is not None else 0.0
    report.selection_ms += report.replayed_probe_ms
    report.refreshed_tokens = len(out.selected)
    report.recomputed_tokens = out.forwarded
    report.reused_tokens = ids.shape[0] - len(set(out.selected) | set(plan.new_positions) | {ids.shape[0] - 1})
    report.intervals, report.spans = len(out.intervals), out.intervals
    report.executor = executor_label(ExecutorChoice(out.executor), policy.backend) if out.executor else None
    report.executor_fallback = out.executor_fallback
    spent = 100.0 * len(out.selected) / S if S else 0.0
    report.adaptive = {"signal": policy.signal, "tolerance": policy.tolerance, "max_budget": policy.max_budget,
                       "start": policy.start, "stopped_by": out.stopped_by, "spent_budget": spent,
                       "probe_tokens": out.probe_tokens, "rounds": out.rounds, "escalated": False}
    if out.stopped_by == "cap" and policy.on_cap == "replay":
        # not settled within the cap: exact Replay of the suffix from the untouched cache; the
        # rounds' work stays counted
        rounds_tokens, rounds_ms = out.forwarded, report.refresh_ms
        result = _replay(ctx.model, cache, ids, plan, report)
        report.recomputed_tokens += rounds_tokens
        report.refresh_ms += rounds_ms
        report.adaptive.update(escalated=True, spent_budget=100.0)
        report.budget = 100.0
        report.fallback = (f"adaptive budget: the {policy.signal} signal stayed above {policy.tolerance:g} up to "
                           f"max_budget={policy.max_budget:g} %: Replay of the suffix")
        return result
    report.budget = spent
    return RepairResult(shifted, out.next_logits, report, plan.exact_prefix)


def _signals(ctx, cache, cached_ids, new, plan, policy) -> RepairSignals | None:
    """Model probes for the signal allocators (Appendix 7.4 Table 1); None for text allocators."""
    if policy.allocator not in SIGNAL_ALLOCATORS or not plan.stale_tokens:
        return None

    def shift_cache() -> DynamicCache:
        rows = plan.source_rows()
        shifted = engine.gather_rows(ctx.model, cache, rows)
        _rotate_moved_keys(ctx.shifter, shifted, rows)
        return shifted

    # rows before kept_prefix (exact, or stale and already paid for) are context shared by both prompts
    return RepairSignals(
        model=ctx.model, token_ids=new.token_ids, eligible=_eligible(plan), old_ids=cached_ids,
        dirty_cache=cache, reuse=plan.reuse, exact_prefix=plan.kept_prefix, make_shift_cache=shift_cache,
        shifter=ctx.shifter,
    )


def _select(
    ctx: RepairContext, new: RenderedPrompt, plan: EditPlan, policy: RepairPolicy, B: int, signals: RepairSignals | None
) -> list[int]:
    eligible = _eligible(plan)
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
        query_ids=ctx.query_ids,
        query_text=ctx.query_text,
    )
    embedding = ctx.model.get_input_embeddings().weight
    options = SelectionOptions(relevance=policy.relevance, ties=policy.ties, tail_tokens=policy.tail_tokens)
    return select(policy.allocator, inp, B, embedding=embedding, seed=policy.seed, signals=signals, options=options)


def _eligible(plan: EditPlan) -> list[int]:
    """Stale positions the allocator chooses from: the suffix s without the last prompt
    position, which is recomputed anyway (its logits are the answer's). Without this, a stale
    last row (same messages resent after a sparse repair) left the query-attention allocators
    (ProphetKV, InfoFlow, A3) an empty query to forward, and cost the others a slot of B."""
    last = plan.new_length - 1
    return [p for p in plan.suffix_positions if p != last]


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
