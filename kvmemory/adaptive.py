"""Adaptive budget: refresh in rounds in the allocator's priority order until a convergence signal
says more refresh would not change the answer (our extension; the paper's fixed budget b, §7.1, is
the reference and stays the default).

Round k refreshes the rows the allocator adds between allowances B(S, b_{k-1}) and B(S, b_k)
(eq. 3, b_k = start · 2^k, capped at ``max_budget``), on the same cache, in place. The
convergence signal of a round is either

- ``query_kl``: KL(p_k ‖ p_{k-1}) in nats of the next-token distribution after the prompt, the
  query (the last turn) recomputed after every round (round 0 is Shift), or
- ``kv_change``: ‖ΔK‖ + ‖ΔV‖ over ‖K‖ + ‖V‖ (L2, every layer) of the rows the round refreshed,
  against their Shifted values: how much the edit still changed the most relevant rows left.
  No extra rows: the query is computed once, after the last round.

The loop stops after the first round whose signal is below ``tolerance`` (a round that adds no
row also stops it), or at the cap (``stopped_by="cap"``: the caller may escalate to Replay).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from .executors import choose_executor, run_refresh
from .divergence import first_token_kl
from .selection import allowance, to_intervals

_observers: list[Callable[[dict, object], None]] = []


@contextmanager
def observe_rounds(callback: Callable[[dict, object], None]):
    """Evaluation hook: call ``callback(round_info, cache)`` after every round of every adaptive
    repair made inside the ``with`` block (the cache is live: clone what you keep)."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def schedule(S: int, start: float, cap: float) -> list[int]:
    """Allowances (tokens) of the rounds: B(S, start·2^k) for k = 0, 1, ... while below the cap,
    then B(S, cap); strictly increasing, duplicates removed.

    Raises:
        ValueError: start or cap outside (0, 100], or start > cap.
    """
    if not (0 < start <= cap <= 100):
        raise ValueError(f"need 0 < start <= max_budget <= 100 (got start={start}, max_budget={cap})")
    budgets, b = [], start
    while b < cap:
        budgets.append(b)
        b *= 2
    budgets.append(cap)
    out: list[int] = []
    for b in budgets:
        B = allowance(S, b)
        if not out or B > out[-1]:
            out.append(B)
    return out


@dataclass
class RoundsResult:
    """What the rounds did: ``next_logits`` fp32 ``[vocab]``; ``selected`` stale rows refreshed;
    ``forwarded`` rows forwarded over all rounds (new text, stale rows and probes);
    ``probe_tokens`` the query rows recomputed again after round 0 (query_kl) among them; ``rounds`` one dict per round; ``stopped_by``
    (``signal``, ``cap`` or ``exhausted``: a round would add no row);
    ``intervals`` the distinct computed intervals over all rounds."""

    next_logits: torch.Tensor
    selected: list[int]
    forwarded: int
    probe_tokens: int
    stopped_by: str
    rounds: list[dict] = field(default_factory=list)
    intervals: list[tuple[int, int]] = field(default_factory=list)
    executor: str | None = None
    executor_fallback: str | None = None


def refresh_in_rounds(
    model,
    cache,
    token_ids: torch.Tensor,
    new_positions: list[int],
    allowances: list[int],
    select_for: Callable[[int], list[int]],
    *,
    signal: str,
    tolerance: float,
    executor: str = "auto",
    backend: str = "sdpa",
) -> RoundsResult:
    """Run the rounds in place on ``cache`` (the Shifted cache, all N rows present).

    The query is the last run of new positions (it ends at N). ``query_kl``: round 0 computes
    the new text on the Shifted cache (Shift's distribution p_0); round k >= 1 refreshes its new
    rows and recomputes the query (p_k); value = KL(p_k ‖ p_{k-1}). ``kv_change``: round k
    refreshes its new rows (round 1 also any new text before the query); value = their relative
    K/V change; the query is computed once after the last round.

    Args:
        token_ids: LongTensor ``[N]``, the edited prompt.
        new_positions: positions of new text (inserted / replaced messages and the query).
        allowances: increasing allowances B_k (tokens), e.g. from :func:`schedule`.
        select_for: B -> the allocator's B stale positions (its priority order is read from the
            growing selections; rows already refreshed are not refreshed again, also when a
            later round refreshes rows before them).
        signal: ``query_kl`` or ``kv_change``; tolerance: its stop threshold (nats / ratio).

    Raises:
        ValueError: unknown signal, or an empty schedule.
    """
    if signal not in ("query_kl", "kv_change"):
        raise ValueError(f"unknown convergence signal {signal!r}: use 'query_kl' or 'kv_change'")
    if not allowances:
        raise ValueError("the adaptive schedule is empty")
    n = token_ids.shape[0]
    query = _query_rows(new_positions, n)
    middle = set(new_positions) - query
    selected: set[int] = set()
    state = {"forwarded": 0, "spans": [], "choice": None}

    def forward(rows: set[int]):
        intervals = to_intervals(sorted(rows))
        state["choice"] = choose_executor(executor, len(intervals), model, cache)
        out = run_refresh(model, cache, token_ids, intervals, state["choice"], backend)
        state["forwarded"] += out.forwarded_tokens
        state["spans"].extend(intervals)
        return out.next_logits

    logits = forward(middle | query) if signal == "query_kl" else None  # round 0: Shift's answer
    queries, rounds, stopped_by = 0, [], "cap"
    for k, B in enumerate(allowances):
        fresh = sorted(set(select_for(B)) - selected)
        if not fresh:
            stopped_by = "exhausted"  # the allocator has nothing left to add
            break
        extra = (middle if k == 0 and signal == "kv_change" else set()) | (query if signal == "query_kl" else set())
        before = _rows_kv(cache, fresh) if signal == "kv_change" else None
        out_logits = forward(set(fresh) | extra)
        selected |= set(fresh)
        if signal == "query_kl":
            queries += 1
            value = first_token_kl(logits, out_logits)
            logits = out_logits
        else:
            value = _kv_change(before, _rows_kv(cache, fresh))
        rounds.append({"allowance": B, "refreshed": len(selected), "new_rows": len(fresh), "value": value})
        for callback in _observers:
            callback(dict(rounds[-1]), cache)
        if value is not None and value < tolerance:
            stopped_by = "signal"
            break
    if signal == "kv_change" or logits is None:
        logits = forward(query | ({n - 1} if not rounds and signal == "kv_change" else set()))
    probes = queries * len(query) if signal == "query_kl" else 0
    choice = state["choice"]
    return RoundsResult(logits, sorted(selected), state["forwarded"], probes, stopped_by, rounds,
                        sorted(set(state["spans"])), choice.name if choice else None, choice.fallback if choice else None)


def _query_rows(new_positions: list[int], n: int) -> set[int]:
    """The last run of new positions, ending at the prompt's end (at least the last row)."""
    rows, p = {n - 1}, n - 2
    known = set(new_positions)
    while p >= 0 and p in known:
        rows.add(p)
        p -= 1
    return rows


def _rows_kv(cache, positions: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    index = torch.tensor(positions, dtype=torch.long)
    return [(layer.keys[:, :, index].clone(), layer.values[:, :, index].clone()) for layer in cache.layers]


def _kv_change(before, after) -> float | None:
    """Relative L2 change of K and V rows over all layers (None for no rows)."""
    if not before or before[0][0].shape[2] == 0:
        return None
    diff = sum(float((a - b).norm()) + float((c - d).norm()) for (b, d), (a, c) in zip(before, after))
    base = sum(float(b.norm()) + float(d.norm()) for b, d in before)
    return diff / max(base, 1e-12)
