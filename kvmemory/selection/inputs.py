"""What a selector is given: the edited prompt, its message layout and the stale positions (paper §7.3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class MessageSpan:
    """One chat message inside the rendered prompt.

    ``token_start``/``token_end``: its tokens [start, end) in the prompt, template tokens included.
    ``content_start``/``content_end``: char span [start, end) of the message *content* in the text.
    """

    index: int
    token_start: int
    token_end: int
    content_start: int
    content_end: int


@dataclass(frozen=True)
class SelectionInput:
    """The edited prompt as the selectors see it.

    text: rendered edited prompt (chat template applied), chars.
    token_ids: its N tokens (the tokenizer must reproduce them from ``text``).
    offsets: N char spans (start, end) in ``text``, from the tokenizer's offset mapping.
    messages: message spans covering the prompt's message tokens, in prompt order.
    eligible: sorted prompt positions that may be refreshed (the stale suffix); S = len(eligible).
    query_ids: the next query's tokens, tokenized without special tokens.
    query_text: the next query as text; needed only by the ``bm25`` allocator (its lexical terms
        are words, which token ids cannot give back without the tokenizer).
    """

    text: str
    token_ids: Sequence[int]
    offsets: Sequence[tuple[int, int]]
    messages: Sequence[MessageSpan]
    eligible: Sequence[int]
    query_ids: Sequence[int]
    query_text: str | None = None


def validate_input(inp: SelectionInput) -> None:
    """Check the spans of ``inp`` against each other.

    Raises:
        ValueError: token/offset count mismatch; a char span outside ``text``; messages out of
            order, overlapping or outside the prompt; ``eligible`` not strictly increasing or
            outside [0, N).
    """
    n, chars = len(inp.token_ids), len(inp.text)
    if len(inp.offsets) != n:
        raise ValueError(f"offsets has {len(inp.offsets)} spans for {n} tokens: pass the tokenizer's offset mapping of text")
    for p, (a, b) in enumerate(inp.offsets):
        if not 0 <= a <= b <= chars:
            raise ValueError(f"offset {(a, b)} of token {p} lies outside text (length {chars})")
    previous_end = 0
    for m in inp.messages:
        if not previous_end <= m.token_start <= m.token_end <= n:
            raise ValueError(f"message {m.index} token span [{m.token_start}, {m.token_end}) is out of order or outside [0, {n})")
        if not 0 <= m.content_start <= m.content_end <= chars:
            raise ValueError(f"message {m.index} content span [{m.content_start}, {m.content_end}) lies outside text")
        previous_end = m.token_end
    eligible = list(inp.eligible)
    if any(b <= a for a, b in zip(eligible, eligible[1:])) or (eligible and not 0 <= eligible[0] <= eligible[-1] < n):
        raise ValueError(f"eligible must be strictly increasing prompt positions in [0, {n})")
