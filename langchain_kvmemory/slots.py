"""Several live caches per thread, one per distinct prompt head (like llama.cpp's slots).

A graph whose model nodes call the same thread with different system prompts (a router and an
answerer) would otherwise edit message 0 of one cache on every call: each node's prompt is
recomputed and the history rows after it were computed under the other prompt (repaired only up
to the budget). Here each call goes to the thread's cache whose token ids share the longest exact
prefix with the new prompt. When none shares the prompt's head (its system message, as rendered
with the tools; a prompt without one has no head of its own) but a slot holds that system message
edited (most of its text kept around the change: a memory line rewritten each turn), that slot
serves the call and the edit is repaired (Shift + SUR) rather than re-prefilled from nothing.
Otherwise a new slot ``<thread>/slot-<k>`` opens, up to ``max_slots`` per thread (then the
least recently used slot is taken over and repaired as an edit). Slots are ordinary entries of the
:class:`kvmemory.threads.ThreadCaches` registry, so the memory budget counts them and evicts them
least-recently-used first; strict erase drops them with the thread's other side caches.
"""

from __future__ import annotations

from typing import Sequence

from kvmemory.edits import common_prefix_length
from kvmemory.prompt import ChatMessage, render_text
from kvmemory.threads import ThreadCaches

SLOT_SEP = "/slot-"
# a held system message sharing at least this fraction of the new one's text (common start + end)
# is the same head edited; router / answerer prompts share a few words and stay in their own slots
EDITED_HEAD_SHARE = 0.5


def prompt_head_tokens(tokenizer, messages: Sequence[ChatMessage], tools) -> int:
    """Tokens of the prompt's head: its first message rendered alone, tools included, without
    the assistant opener; 0 when that is not a system message (no prompt head of the caller's:
    any slot of the thread serves, edits are repaired). Raises what rendering raises."""
    if not messages or messages[0].role != "system":
        return 0
    head = render_text(tokenizer, messages[:1], tools=tools, generation_prompt=False)
    return len(tokenizer(head, add_special_tokens=False)["input_ids"])


def prompt_head_text(messages: Sequence[ChatMessage]) -> str | None:
    """The content of the prompt's system message (its first message), or None without one."""
    return messages[0].content if messages and messages[0].role == "system" else None


def pick_slot(registry: ThreadCaches, thread_id: str, prompt: Sequence[int], head_tokens: int,
              max_slots: int, head_text: str | None = None) -> tuple[str, int]:
    """The registry id whose cache serves this prompt, and its exact prefix reuse in tokens.

    Order: the slot with the longest exact prefix when it covers the head; else the slot holding
    this head edited (:func:`edited_head`; the longest exact prefix among them, ties to the most
    recently used); else a slot whose cache was dropped; else a new slot; else the least
    recently used slot.

    Args:
        registry: the model's live caches. thread_id: the LangGraph thread.
        prompt: the prompt's token ids. head_tokens: tokens a slot must share to serve it.
        max_slots: live caches one thread may hold (1 = one cache per thread, edits repaired).
        head_text: the prompt's system message content (:func:`prompt_head_text`); None: no
            slot is matched as an edited head.
    """
    live = [tid for tid in registry.thread_ids if tid == thread_id or tid.startswith(thread_id + SLOT_SEP)]
    if max_slots <= 1 or not live:
        return thread_id, 0
    reuse = {tid: _shared(registry, tid, prompt) for tid in live}  # live: least recently used first
    best = max(live, key=lambda tid: reuse[tid])
    if reuse[best] >= max(1, head_tokens - 1):  # the head's last row may tokenize with what follows
        return best, reuse[best]
    edited = [tid for tid in live if _holds_edited_head(registry, tid, head_text)]
    if edited:  # the thread's own head, edited: repairing its cache beats prefilling an empty slot
        best = max(reversed(edited), key=lambda tid: reuse[tid])
        return best, reuse[best]
    empty = [tid for tid in live if _holds_nothing(registry, tid)]
    if empty:  # a slot whose cache was dropped (it reports why at its next call) before a new one
        return empty[0], 0
    if len(live) < max_slots:
        names = [thread_id] + [f"{thread_id}{SLOT_SEP}{k}" for k in range(1, max_slots)]
        return next(n for n in names if n not in live), 0
    return live[0], reuse[live[0]]


def _shared(registry: ThreadCaches, tid: str, prompt: Sequence[int]) -> int:
    session = registry.get(tid)
    if session is None:
        return -1
    return common_prefix_length(list(session.token_ids), prompt)  # a snapshot: a call may be running on that slot


def edited_head(old: str, new: str) -> bool:
    """Whether system message ``new`` is ``old`` edited: the text they share as a common start
    and a common end (characters, not overlapping) is at least ``EDITED_HEAD_SHARE`` of the
    longer one. A rewritten facts line in a long prompt is; another node's prompt is not."""
    longest = max(len(old), len(new))
    start = common_prefix_length(old, new)
    end = common_prefix_length(old[start:][::-1], new[start:][::-1])
    return longest == 0 or (start + end) / longest >= EDITED_HEAD_SHARE


def _holds_edited_head(registry: ThreadCaches, tid: str, head_text: str | None) -> bool:
    session = registry.get(tid)
    if head_text is None or session is None:
        return False
    held = session.messages  # a snapshot, as in _shared
    return bool(held) and held[0].role == "system" and edited_head(held[0].content, head_text)


def _holds_nothing(registry: ThreadCaches, tid: str) -> bool:
    session = registry.get(tid)
    return session is not None and not session.token_ids
