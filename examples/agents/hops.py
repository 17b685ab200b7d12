"""Per-hop bookkeeping shared by the agent examples: what each model call did to the thread's
live cache, and what a Re-prefill of the very same prompt costs.

A hop is one model call. After it, the thread's session holds the rendered prompt it answered
from; that prompt (messages + tools) is replayed afterwards on a fresh session with the
``reprefill`` policy, so both columns time the same work up to the first answer token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from kvmemory import KVSession


@dataclass
class Hop:
    """One model call. Tokens are tokens, times milliseconds (prompt preparation up to the
    first answer token; decoding is the same work in both runs and is left out).

    ``appended``: tokens of messages new at the end of the history plus the generation prompt
    (work any cache must do); ``repair``: the rest of ``recomputed`` (edited messages and the
    budgeted refresh of the stale suffix)."""

    index: int
    context: int
    reused: int
    recomputed: int
    appended: int
    refreshed: int
    stale: int
    edits: dict
    operator: str
    fallback: str | None
    latency_ms: float
    messages: list = field(repr=False, default_factory=list)
    tools: list | None = field(repr=False, default=None)
    reprefill_ms: float = float("nan")

    @property
    def repair(self) -> int:
        return self.recomputed - self.appended

    @property
    def edited(self) -> bool:
        """Whether the history changed before the new messages (a clear, removal or summary)."""
        return any(self.edits.get(k) for k in ("delete", "replace", "insert"))


def record_hop(session: KVSession, previous_keys: set[str], index: int) -> Hop:
    """A :class:`Hop` from the session right after a model call (its last report and prompt).

    ``previous_keys``: keys of the messages the cache held before the call (answers included).
    """
    report, rendered = session.last_report, session.rendered
    n = len(rendered.messages) - (1 if session.answer_committed else 0)  # the prompt, without the new answer
    segments = rendered.segments[:n]
    appended = sum(s.length for s in segments if s.key not in previous_keys)
    appended += report.prompt_tokens - (segments[-1].token_end if segments else 0)  # the generation prompt
    return Hop(
        index=index,
        context=report.prompt_tokens,
        reused=report.reused_tokens,
        recomputed=report.recomputed_tokens,
        appended=min(appended, report.recomputed_tokens),
        refreshed=report.refreshed_tokens,
        stale=report.stale_tokens,
        edits=dict(report.edits),
        operator=report.operator if report.operator != "refresh" else f"{report.allocator}@{report.budget:g}",
        fallback=report.fallback,
        latency_ms=report.latency_ms,
        messages=list(rendered.messages[:n]),
        tools=session.tools,
    )


def time_reprefill(model, tokenizer, hops: list[Hop]) -> None:
    """Fill ``reprefill_ms`` of every hop: the same prompt prepared from an empty cache."""
    for hop in hops:
        baseline = KVSession(model, tokenizer, "reprefill", tools=hop.tools)
        hop.reprefill_ms = baseline.prepare(hop.messages).latency_ms


def print_hops(hops: list[Hop], title: str, console: Console | None = None) -> None:
    """A table of the hops and their totals."""
    console = console or Console(width=132)
    table = Table(title=title)
    for name in ("hop", "edit", "context", "reused", "recomputed", "new text", "repair", "repair %", "policy",
                 "kvmemory ms", "re-prefill ms"):
        table.add_column(name, justify="right")
    for h in hops:
        edit = ",".join(f"{k}{v}" for k, v in h.edits.items() if k in ("delete", "replace", "insert")) or "-"
        table.add_row(str(h.index), edit, str(h.context), str(h.reused), str(h.recomputed), str(h.appended),
                      str(h.repair), f"{100 * h.repair / h.context:.1f}", h.operator + (" (fallback)" if h.fallback else ""),
                      f"{h.latency_ms:.0f}", f"{h.reprefill_ms:.0f}")
    total_kv, total_re = sum(h.latency_ms for h in hops), sum(h.reprefill_ms for h in hops)
    table.add_row("total", "", "", str(sum(h.reused for h in hops)), str(sum(h.recomputed for h in hops)), "", "",
                  "", "", f"{total_kv:.0f}", f"{total_re:.0f}")
    console.print(table)
    for h in hops:
        if h.fallback:
            console.print(f"hop {h.index}: fell back to exact recomputation: {h.fallback}")


def summary(hops: list[Hop]) -> dict:
    """JSON-able totals: per-hop rows plus the worst repair share after an edit."""
    edited = [h for h in hops if h.edited]
    return {
        "hops": [
            {k: getattr(h, k) for k in ("index", "context", "reused", "recomputed", "appended", "refreshed", "stale",
                                        "edits", "operator", "fallback", "latency_ms", "reprefill_ms")}
            | {"repair": h.repair}
            for h in hops
        ],
        "edited_hops": [h.index for h in edited],
        "max_repair_share_after_edit": max((h.repair / h.context for h in edited), default=None),
        "max_recomputed_share_after_edit": max((h.recomputed / h.context for h in edited), default=None),
        "total_latency_ms": sum(h.latency_ms for h in hops),
        "total_reprefill_ms": sum(h.reprefill_ms for h in hops),
    }
