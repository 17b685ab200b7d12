"""Tool choice: LangChain's ``tool_choice`` forms normalised, and deciding between a tool call and
a text answer under ``tool_choice="auto"`` for models too small to open calls by themselves (the
``auto_tool_calls="scored"`` policy of ChatKVMemory).

The score is the model's own preference: the log-probability of the answer opening with
``<tool_call>`` (all its tokens, teacher-forced on a fork of the thread's cache) against the
log-probability of its most likely first token. A call is decoded (under the call grammar) when the
gap is at most ``margin`` nats, text (under a grammar that never opens a call) otherwise.

On SmolLM2-135M-Instruct (``benchmarks/tool_call_gap.py``, docs/chat-model-parity.md) the gap
roughly separates user turns right after a tool round (needing a tool: 0.1-1.9 nats; "thanks",
"summarise", "goodbye": 1.8-6.1, one of six under 2) but not first turns, where the model never
gives calls weight (6-12.5 nats whether or not a tool is needed): the policy therefore calls on
the first user turn of a conversation (no tool result yet), as ``"after_user"`` does, and scores
later user turns. After a text answer the model's gap grows (5-11 nats in an agent run, also for
turns needing a tool): the small model then answers from context instead of calling.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmemory.engine import forward_rows
from kvmemory.session import KVSession

from .tool_calls import CALL_OPEN

DEFAULT_MARGIN = 2.0  # nats; measured separation on the embedded model (see the module docstring)


def call_gap(session: KVSession) -> float:
    """``log p(top first token) - log p(<tool_call>\\n)`` after the prepared prompt, in nats (>= 0
    up to rounding; 0 = the model's favourite opening is a call). The thread's cache is untouched
    (the call's tokens are forwarded on a fork).

    Raises:
        RuntimeError: the session has no pending prompt (call ``prepare`` first).
    """
    if session.next_logits is None:
        raise RuntimeError("call_gap needs a prepared session (its next-token logits)")
    ids = session.tokenizer(CALL_OPEN + "\n", add_special_tokens=False)["input_ids"]
    first = torch.log_softmax(session.next_logits.float(), dim=-1)
    total = float(first[ids[0]])
    if len(ids) > 1:
        fork = session.fork()
        start = len(fork.token_ids)
        for i, token in enumerate(ids[1:]):
            logits = forward_rows(fork.model, fork.cache, torch.tensor([ids[i]]), start + i)
            total += float(torch.log_softmax(logits, dim=-1)[token])
    return float(first.max()) - total


def scored_choice(session: KVSession, has_tool_results: bool, margin: float = DEFAULT_MARGIN) -> tuple[str, float | None]:
    """``("required", gap)`` or ``("none", gap)`` for a user turn; the first user turn of a
    conversation (``has_tool_results`` False) calls without scoring (gap None)."""
    if not has_tool_results:
        return "required", None
    gap = call_gap(session)
    return ("required" if gap <= margin else "none"), gap


def normalize_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str | None:
    """Normalise LangChain's tool_choice forms to ``auto`` / ``required`` / ``none`` / a tool name
    (None: no tools bound, nothing to constrain).

    Raises:
        ValueError: a forced choice without tools, or a name that is not a bound tool.
    """
    if choice is None or choice == "auto" or choice == "none":
        return (choice or "auto") if tools else None
    if not tools:
        raise ValueError(f"tool_choice={choice!r} but no tools are bound: pass tools to bind_tools")
    if choice is True or choice in ("any", "required"):
        return "required"
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else choice
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not a bound tool: use one of "
                         f"{', '.join(names)}, 'auto', 'any' or 'none'")
    return name
