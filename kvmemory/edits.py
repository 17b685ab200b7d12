"""Edit plans: how a new message list differs from the one a cache holds, down to token rows.

Messages are matched by key in order (keep / replace = same key, new content / delete / insert /
append). The token-level plan then says, for every position of the new prompt, whether its K/V
row is exact (common token prefix), reusable from an old row (a kept message after the first
change: correct tokens, stale context, maybe moved), or must be computed (new text, widened
boundaries, generation prompt). Several edits in one call produce one plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Literal, NamedTuple, Sequence

import torch

from .prompt import RenderedPrompt

OpKind = Literal["keep", "delete", "replace", "insert", "append"]


@dataclass(frozen=True)
class EditOp:
    """One message-level operation; spans are token spans (old prompt / new prompt)."""

    kind: OpKind
    key: str
    old_span: tuple[int, int] | None
    new_span: tuple[int, int] | None


class ReuseRun(NamedTuple):
    """Stale rows that keep their old K/V (after Shift): new-prompt positions
    ``[new_start, new_start + length)`` hold the cached rows ``[old_start, old_start + length)``."""

    new_start: int
    old_start: int
    length: int


@dataclass
class EditPlan:
    """Token-level plan for turning the cached rows into the new prompt's rows.

    Attributes:
        ops: message-level operations in new-prompt order (deletions where they were).
        common_prefix: f, the number of leading tokens identical in the cached ids and the new
            prompt; rows [0, f) keep their place. f is this request's first edit point.
        exact_prefix: g <= f, the rows [0, g) that equal a Re-prefill of the new prompt. g < f
            when an earlier sparse repair left stale rows before f.
        kept_prefix: k, g <= k <= f: rows [0, k) are kept as they are. Rows [g, k) are stale rows
            an earlier repair already paid for (the allowance belongs to the edit that made them
            stale); k = g (the default) puts them back into the repairable suffix, so that a full
            budget (Replay) still equals Re-prefill.
        reuse: :class:`ReuseRun` runs of stale rows at positions >= g that keep their old K/V
            (after Shift). Those at positions >= k form the suffix s,
            S = len(s) (``stale_tokens``); a run in [g, k) holds the kept stale rows in place.
        widened: keys of kept messages whose tokens did not re-tokenize identically (a boundary
            token merged differently, or delimiters a template adds by the message's neighbours):
            the rows their old and new spans share as a common token prefix and suffix are
            reused, the tokens between are computed as new text.
        new_length: N, the new prompt's token count.
    """

    ops: list[EditOp]
    common_prefix: int
    exact_prefix: int
    reuse: list[ReuseRun]
    widened: list[str] = field(default_factory=list)
    new_length: int = 0
    kept_prefix: int | None = None

    def __post_init__(self) -> None:
        if self.kept_prefix is None:
            self.kept_prefix = self.exact_prefix

    @property
    def suffix_positions(self) -> list[int]:
        """Sorted new-prompt positions of the stale reused rows the allowance is charged on (the
        repairable suffix s: positions >= kept_prefix)."""
        return [p for run in self.reuse for p in range(max(run.new_start, self.kept_prefix), run.new_start + run.length)]

    @property
    def stale_tokens(self) -> int:
        """S = len(s)."""
        return sum(max(0, run.new_start + run.length - max(run.new_start, self.kept_prefix)) for run in self.reuse)

    @property
    def kept_stale_tokens(self) -> int:
        """Stale rows [g, k) kept as an earlier repair left them (not refreshed again)."""
        return self.kept_prefix - self.exact_prefix

    @property
    def edits_history(self) -> bool:
        """Whether a held message was deleted, replaced or inserted before (an edit); a request
        that only appends messages (or resends the same ones) is not one."""
        return any(op.kind in ("delete", "replace", "insert") for op in self.ops)

    def extends(self, cached_rows: int) -> bool:
        """Whether the new prompt only appends to the ``cached_rows`` cached rows (or equals
        them): every cached row is kept in place and nothing stale is to be repaired."""
        return self.kept_prefix == cached_rows and not self.stale_tokens

    @property
    def new_positions(self) -> list[int]:
        """Positions >= g that must be computed because no row exists for them."""
        reused = {run.new_start + k for run in self.reuse for k in range(run.length)}  # kept stale rows too
        return [p for p in range(self.exact_prefix, self.new_length) if p not in reused]

    def source_rows(self, total: int | None = None) -> torch.Tensor:
        """LongTensor ``[m]``: the old row of each new row (-1: computed anew), the exact prefix in
        place and the reuse runs moved, up to the last reused row or ``total`` rows if longer.
        K/V rows (repair) and CacheReforge boundary states (session) follow it."""
        end = max([self.exact_prefix, total or 0] + [run.new_start + run.length for run in self.reuse])
        rows = torch.full((end,), -1, dtype=torch.long)
        rows[: self.exact_prefix] = torch.arange(self.exact_prefix)
        for run in self.reuse:
            rows[run.new_start : run.new_start + run.length] = torch.arange(run.old_start, run.old_start + run.length)
        return rows

    def count(self, kind: OpKind) -> int:
        return sum(op.kind == kind for op in self.ops)


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (token ids, or any items compared
    with ``==``); ``min(len(a), len(b))`` when one is a prefix of the other."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def plan_edits(
    cached_ids: Sequence[int], old: RenderedPrompt | None, new: RenderedPrompt, exact_rows: int | None = None,
    kept_rows: int | None = None,
) -> EditPlan:
    """Compute the edit plan from the cached state to the ``new`` rendered prompt.

    This edit's suffix s (the paper's: everything after the first edit point) is every reused
    row after the first token the new prompt changes (f, the common prefix), including rows an
    earlier repair left stale there (they moved, or now follow changed text). Stale rows before
    f are unchanged since the repair that paid for them: with ``kept_rows`` they are kept as
    they are and stay out of S, so a new edit charges its allowance B on its own suffix only.

    Args:
        cached_ids: token ids of the cache rows (old prompt, possibly plus generated tokens).
        old: the rendered prompt those rows were built from (None: nothing reusable but the
            common prefix).
        new: the rendered new prompt.
        exact_rows: how many leading cached rows are exact (None: all of them).
        kept_rows: how many leading cached rows need no repair for this request: the exact
            rows plus stale rows already repaired under a budget the request does not exceed
            (None: only the exact rows, so every stale row is in the suffix).

    Returns:
        EditPlan; rows outside the common prefix are reused only for kept messages whose old
        and new token spans hold identical ids (otherwise the message is widened into new text).
    """
    f = common_prefix_length(cached_ids, new.token_ids)
    g = f if exact_rows is None else min(f, exact_rows)
    k = g if kept_rows is None else max(g, min(f, kept_rows))
    ops = _message_ops(old, new)
    reuse = [ReuseRun(new_start=g, old_start=g, length=f - g)] if g < f else []  # stale rows already in place ([g, k) kept, the rest in s)
    widened = []
    for op in ops:
        if op.kind != "keep":
            continue
        (o0, o1), (n0, n1) = op.old_span, op.new_span
        if n1 <= f:
            continue  # wholly inside the exact prefix
        if o1 > len(cached_ids) or tuple(cached_ids[o0:o1]) != new.token_ids[n0:n1]:
            widened.append(op.key)  # boundary did not split cleanly: reuse what matches, compute the rest
            reuse.extend(_matching_ends(cached_ids, new.token_ids, (o0, o1), (n0, n1), f))
            continue
        skip = max(0, f - n0)  # the part inside the common prefix is already exact
        if n1 - n0 - skip > 0:
            reuse.append(ReuseRun(new_start=n0 + skip, old_start=o0 + skip, length=n1 - n0 - skip))
    return EditPlan(ops=ops, common_prefix=f, exact_prefix=g, reuse=reuse, widened=widened, new_length=len(new),
                    kept_prefix=k)


def _matching_ends(cached_ids: Sequence[int], new_ids: Sequence[int], old_span: tuple[int, int],
                   new_span: tuple[int, int], f: int) -> list[ReuseRun]:
    """Reuse runs for a kept message whose old and new tokens differ: its longest common token
    prefix and suffix (outside the exact prefix ``f``), e.g. a tool result whose group opener or
    closer moved to it. Rows hold the same tokens, so they are stale rows like any reused one."""
    (o0, o1), (n0, n1) = old_span, new_span
    old = list(cached_ids[o0:min(o1, len(cached_ids))])
    new = list(new_ids[n0:n1])
    head = common_prefix_length(old, new)
    tail = common_prefix_length(old[head:][::-1], new[head:][::-1])
    runs = []
    skip = max(0, f - n0)
    if head - skip > 0:
        runs.append(ReuseRun(new_start=n0 + skip, old_start=o0 + skip, length=head - skip))
    start = max(n1 - tail, f)
    if n1 - start > 0:
        runs.append(ReuseRun(new_start=start, old_start=o0 + len(old) - (n1 - start), length=n1 - start))
    return runs


def _message_ops(old: RenderedPrompt | None, new: RenderedPrompt) -> list[EditOp]:
    old_segs = list(old.segments) if old is not None else []
    new_segs = list(new.segments)
    matcher = SequenceMatcher(None, [s.key for s in old_segs], [s.key for s in new_segs], autojunk=False)
    pairs = {b.b + k: b.a + k for b in matcher.get_matching_blocks() for k in range(b.size)}
    last_matched_new = max(pairs, default=-1)
    matched_old = set(pairs.values())
    ops: list[EditOp] = []
    next_old = 0

    def flush_deletes(upto: int) -> None:
        nonlocal next_old
        for i in range(next_old, upto):
            if i not in matched_old:
                s = old_segs[i]
                ops.append(EditOp("delete", s.key, (s.token_start, s.token_end), None))
        next_old = max(next_old, upto)

    for j, ns in enumerate(new_segs):
        span = (ns.token_start, ns.token_end)
        if j in pairs:
            os_ = old_segs[pairs[j]]
            flush_deletes(pairs[j])
            kind = "keep" if os_.content_hash == ns.content_hash else "replace"
            ops.append(EditOp(kind, ns.key, (os_.token_start, os_.token_end), span))
            next_old = pairs[j] + 1
        else:
            ops.append(EditOp("insert" if j < last_matched_new else "append", ns.key, None, span))
    flush_deletes(len(old_segs))
    return ops
