"""Text boundaries inside one message's content: structured containers, paragraphs, sentences (paper §3.2, §7.3).

A message's content is cut into char regions that partition it exactly. Structured regions are
kept whole and are each their own container:
- fenced code: from a line starting with ``` to the next such line (or the content's end);
- JSON: the whole content when it parses as an object/array; otherwise a line starting with
  '{' or '[' whose balanced block (JSON strings skipped) closes on a later line, or a single
  such line that parses as JSON;
- markdown lists: a run of lines starting with "-", "*", "+" or "1." (any number), with
  indented continuation lines and blank lines between items.
The remaining text is cut at blank lines (paragraphs), then at pysbd sentence starts.
Whitespace between two regions belongs to the earlier one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

import pysbd

LIST_ITEM = re.compile(r"[ \t]*(?:[-*+]|\d+\.)[ \t]")
FENCE = "```"


@dataclass(frozen=True)
class Region:
    """Char span [start, end) of the prompt text; ``structured`` regions are their own container."""

    start: int
    end: int
    structured: bool


@lru_cache(maxsize=1)
def _segmenter() -> pysbd.Segmenter:
    # clean=False keeps the text unchanged so char_span offsets refer to our text.
    return pysbd.Segmenter(language="en", clean=False, char_span=True)


def _parses_as_json_container(s: str) -> bool:
    try:
        return isinstance(json.loads(s), (dict, list))
    except ValueError:
        return False


def _balanced_end(s: str, i: int) -> int | None:
    """Index just past the bracket closing ``s[i]`` ('{' or '['), skipping JSON strings; None if unbalanced."""
    depth, in_string, escaped = 0, False, False
    for k in range(i, len(s)):
        c = s[k]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return k + 1
    return None


def _lines(s: str) -> list[tuple[int, int]]:
    """Char spans of the lines of ``s``, each with its newline."""
    spans, start = [], 0
    for line in s.splitlines(keepends=True):
        spans.append((start, start + len(line)))
        start += len(line)
    return spans


def _structured_end(s: str, lines: list[tuple[int, int]], i: int) -> int | None:
    """Index of the line after the structured block starting at line ``i``, or None if it starts none."""
    text = s[lines[i][0] : lines[i][1]]
    stripped = text.strip()
    if stripped.startswith(FENCE):  # fenced code: up to the closing fence, or the end if unclosed
        return next((j + 1 for j in range(i + 1, len(lines)) if s[lines[j][0] : lines[j][1]].strip().startswith(FENCE)), len(lines))
    if stripped[:1] in ("{", "["):  # JSON: a balanced block over several lines, or one line that parses
        close = _balanced_end(s, lines[i][0] + text.index(stripped[0]))
        if close is None:
            return None
        j = next(j for j in range(i, len(lines)) if close <= lines[j][1])  # the line holding the close
        return j + 1 if j > i or _parses_as_json_container(stripped) else None
    if LIST_ITEM.match(text):  # markdown list: item lines, indented continuations, blank lines between items
        j = i + 1
        while j < len(lines):
            line = s[lines[j][0] : lines[j][1]]
            nxt = s[lines[j + 1][0] : lines[j + 1][1]] if j + 1 < len(lines) else ""
            if LIST_ITEM.match(line) or (line[:1] in " \t" and line.strip()) or (not line.strip() and LIST_ITEM.match(nxt)):
                j += 1
            else:
                break
        return j
    return None


def _sentence_starts(s: str, lo: int, hi: int) -> list[int]:
    """Starts of the paragraphs (blank-line separated) and pysbd sentences in ``s[lo:hi]``."""
    starts, para_start = [], None
    for a, b in [(lo + a, lo + b) for a, b in _lines(s[lo:hi])] + [(hi, hi)]:
        blank = a == hi or not s[a:b].strip()
        if blank and para_start is not None:
            paragraph = s[para_start:a]
            starts += [para_start + span.start for span in _segmenter().segment(paragraph)]
            starts.append(para_start)  # pysbd may skip leading whitespace; the paragraph still starts here
            para_start = None
        elif not blank and para_start is None:
            para_start = a
    return sorted(set(starts))


def content_regions(text: str, start: int, end: int) -> list[Region]:
    """Partition the message content ``text[start:end]`` into regions.

    Args:
        text: the rendered prompt.
        start, end: char span of one message's content.

    Returns:
        Regions in order with regions[0].start == start, regions[-1].end == end and each
        region's end equal to the next one's start. Empty content gives one empty region.

    Source: paper §3.2 ("message, structured-container, paragraph, and sentence boundaries"),
    §7.3 ("message and structured-container boundaries are preserved; ordinary text is split at
    sentence and paragraph boundaries").
    """
    content = text[start:end]
    if _parses_as_json_container(content.strip()):
        return [Region(start, end, True)]
    lines = _lines(content)
    cuts: list[tuple[int, bool]] = []  # (content offset where a region starts, structured)
    i, prose_from = 0, None
    while i < len(lines):
        j = _structured_end(content, lines, i)
        if j is None:  # an ordinary line: extend the current stretch of prose
            prose_from = lines[i][0] if prose_from is None else prose_from
            i += 1
            continue
        if prose_from is not None:
            cuts += [(c, False) for c in _sentence_starts(content, prose_from, lines[i][0])]
            prose_from = None
        cuts.append((lines[i][0], True))
        i = j
    if prose_from is not None:
        cuts += [(c, False) for c in _sentence_starts(content, prose_from, len(content))]
    if not cuts:  # empty or whitespace-only content
        cuts = [(0, False)]
    cuts[0] = (0, cuts[0][1])  # leading whitespace joins the first region
    bounds = [c for c, _ in cuts] + [len(content)]
    return [Region(start + bounds[k], start + bounds[k + 1], cuts[k][1]) for k in range(len(cuts))]
