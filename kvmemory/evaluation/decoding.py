"""Greedy answers verified against a reference answer in one forward (evaluation speed-up).

The quality benchmark decodes ~90 greedy answers per case, most of them equal to Re-prefill's.
Greedy decoding with a draft (speculative decoding with greedy verification) gives the same
tokens as step-by-step greedy decoding: the draft is forwarded in one call, every position
whose argmax equals the next draft token is accepted, the first disagreement contributes the
model's own token, and decoding continues step by step from there. Only the arithmetic order
differs (one batched forward instead of single-row forwards: fp32 rounding of ~1e-6), which
could flip an exact near-tie; tests compare both paths on the real model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .. import kvcache
from ..execution import forward_rows
from ..session import Generation, KVSession


def verified_greedy(session: KVSession, draft: Sequence[int], max_new_tokens: int) -> Generation:
    """Greedy answer of ``session`` (a prepared fork; consumed), using ``draft`` as a proposal.

    Args:
        session: a KVSession after ``prepare`` (next-token logits pending), consumed: its cache
            receives the answer rows but its ids and pending logits are not updated, so
            discard it afterwards (e.g. a ``fork()``).
        draft: answer token ids of another method (e.g. Re-prefill's ``Generation.token_ids``,
            without the stop token).
        max_new_tokens: answer limit in tokens (>= 1).

    Returns:
        Generation with the greedy tokens/text, the first-token logits fp32 ``[vocab]`` and
        ``decode_ms`` = wall time of verification plus any step-by-step continuation (ms).

    Raises:
        ValueError: ``max_new_tokens`` < 1. RuntimeError: the session has no pending prompt.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
    if session.next_logits is None:
        raise RuntimeError("call prepare(messages) before verified_greedy(): the cache has no pending prompt")
    t0 = time.perf_counter()
    first, stops, start = session.next_logits, session.stop_token_ids(), len(session.token_ids)
    tokens, logits = _accept_draft(session, list(draft)[:max_new_tokens], first, start)
    finished = False
    while len(tokens) < max_new_tokens:
        token = int(torch.argmax(logits))
        if token in stops:
            finished = True
            break
        logits = forward_rows(session.model, session.cache, torch.tensor([token]), start + len(tokens))
        tokens.append(token)
    text = session.tokenizer.decode(tokens, skip_special_tokens=True)
    return Generation(text, tokens, first, "stop" if finished else "length", (time.perf_counter() - t0) * 1000.0)


def _accept_draft(session: KVSession, draft: list[int], first: torch.Tensor, start: int):
    """Forward ``draft`` once; keep its longest greedy-consistent prefix in the cache.

    Returns (accepted tokens, fp32 logits ``[vocab]`` after the last accepted token)."""
    if not draft or int(torch.argmax(first)) != draft[0]:
        return [], first
    with torch.no_grad():
        out = session.model(input_ids=torch.tensor([draft]), position_ids=torch.arange(start, start + len(draft))[None],
                            cache=session.cache, use_cache=True)
    rows = out.logits[0].float()  # rows[i] predicts the token after draft[i]
    accepted = 1
    while accepted < len(draft) and int(torch.argmax(rows[accepted - 1])) == draft[accepted]:
        accepted += 1
    kvcache.crop_to(session.cache, start + accepted)
    return draft[:accepted], rows[accepted - 1]
