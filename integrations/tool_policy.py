"""Deciding between a tool call and a text answer under ``tool_choice="auto"`` for models too small
to open calls by themselves (the ``auto_tool_calls="scored"`` policy of ChatKVMemory).

The score is the model's own preference: the log-probability of the answer opening with
``<tool_call>`` (all its tokens, teacher-forced on a fork of the thread's cache) against the
log-probability of its most likely first token. A call is decoded (under the call grammar) when the
gap is at most ``margin`` nats, text (under a grammar that never opens a call) otherwise.

On SmolLM2-135M-Instruct (docs/chat-model-parity.md) the gap separates follow-up turns after a
tool round (calls: 0.1-1.9 nats; "thanks", "summarise", "goodbye": 2.5-6.1) but not first turns,
where the model never gives calls weight (gap 6-12 nats whether or not a tool is needed): the
policy therefore calls on the first user turn of a conversation (no tool result yet), as
``"after_user"`` does, and scores later user turns.
"""

from __future__ import annotations

import torch

from kvmemory.execution import forward_rows
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
