"""Greedy answers verified against a reference answer in one forward (evaluation speed-up).

The quality benchmark decodes ~90 greedy answers per case, most of them equal to Re-prefill's.
Greedy decoding with a draft (speculative decoding with greedy verification) gives the same
tokens as step-by-step greedy decoding: the draft is forwarded in one call, every position
whose argmax equals the next draft token is accepted, the first disagreement contributes the
model's own token, and decoding continues from there with the next answer that agrees so far
as the proposal (other methods' answers on the same case), or step by step. Only the arithmetic order
differs (one batched forward instead of single-row forwards: fp32 rounding of ~1e-6), which
could flip an exact near-tie; tests compare both paths on the real model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvmemory import kvcache
from kvmemory.engine import forward_rows
from kvmemory.session import Generation, KVSession


def verified_greedy(session: KVSession, draft: Sequence[int], max_new_tokens: int,
                    alternatives: Sequence[Sequence[int]] = ()) -> Generation:
    """Greedy answer of ``session`` (a prepared fork; consumed), using ``draft`` as a proposal.

    Whenever the greedy token leaves the current proposal, the longest continuation among
    ``draft`` and ``alternatives`` that agrees with every token so far is proposed next (one
    forward each); with none, decoding goes step by step.

    Args:
        session: a KVSession after ``prepare`` (next-token logits pending), consumed: its cache
            receives the answer rows but its ids and pending logits are not updated, so
            discard it afterwards (e.g. a ``fork()``).
        draft: answer token ids of another method (e.g. Re-prefill's ``Generation.token_ids``,
            without the stop token).
        max_new_tokens: answer limit in tokens (>= 1).
        alternatives: further answers (token ids) to draw proposals from, e.g. the answers of
            methods already run on the same case.

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
    candidates = [list(draft)] + [list(a) for a in alternatives]
    tokens: list[int] = []
    logits, finished = first, False
    while len(tokens) < max_new_tokens:
        token = int(torch.argmax(logits))
        if token in stops:
            finished = True
            break
        draft_ids = proposal(tokens + [token], candidates, max_new_tokens - len(tokens))
        if len(draft_ids) > 1:
            accepted, logits = _accept_draft(session, draft_ids, start + len(tokens))
            tokens += accepted
        else:
            logits = forward_rows(session.model, session.cache, torch.tensor([token]), start + len(tokens))
            tokens.append(token)
    text = session.tokenizer.decode(tokens, skip_special_tokens=True)
    return Generation(text, tokens, first, "stop" if finished else "length", (time.perf_counter() - t0) * 1000.0)


def proposal(prefix: list[int], candidates: list[list[int]], limit: int) -> list[int]:
    """The longest continuation (at most ``limit`` tokens, starting with ``prefix[-1]``) of a
    candidate that begins with ``prefix``; ``[prefix[-1]]`` when none does."""
    known = len(prefix) - 1
    best = prefix[-1:]
    for cand in candidates:
        if len(cand) > known and cand[: known + 1] == prefix:
            continuation = cand[known : known + limit]
            if len(continuation) > len(best):
                best = continuation
    return best


def _accept_draft(session: KVSession, draft: list[int], start: int):
    """Forward ``draft`` (its first token is the greedy one) at ``start``; keep its longest
    greedy-consistent prefix in the cache.

    Returns (accepted tokens, fp32 logits ``[vocab]`` after the last accepted token)."""
    with torch.no_grad():
        out = session.model(input_ids=torch.tensor([draft]), position_ids=torch.arange(start, start + len(draft))[None],
                            cache=session.cache, use_cache=True)
    rows = out.logits[0].float()  # rows[i] predicts the token after draft[i]
    accepted = 1
    while accepted < len(draft) and int(torch.argmax(rows[accepted - 1])) == draft[accepted]:
        accepted += 1
    kvcache.crop_to(session.cache, start + accepted)
    return draft[:accepted], rows[accepted - 1]
