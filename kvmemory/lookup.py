"""Prompt lookup: draft the next answer tokens by copying what followed the same n-gram earlier.

An agent's answer often repeats its context: a tool call names an entity from a tool result, an
answer quotes a passage, a JSON key recurs. Greedy decoding can then check several guessed tokens
in one forward (the "prompt lookup decoding" of transformers' ``prompt_lookup_num_tokens``,
llama.cpp's lookup decoding and vLLM's n-gram speculation): the session feeds the picked token
plus the draft, picks each next token from the logits of the row before it, and keeps the draft's
rows while the picks equal the draft. Every token is still the argmax of the logits computed
after exactly the tokens before it, so the answer is greedy decoding's answer (up to the fp32
summation order of a several-row forward, as for any appended turn). A rejected guess costs its
share of that forward: on the quantized engine one more row adds ~1/4 of a one-row step at 2 K
cached rows, so a draft pays off when it is accepted about one time in four.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .errors import InputError, InputTypeError

MAX_NGRAM = 3  # the longest suffix looked up (tokens); shorter suffixes are tried after it
# the shortest: a single recurring token guesses too often wrong once a rejected row costs more
# (at 8 K cached rows an extra row costs half a one-row step: see docs/engine.md)
MIN_NGRAM = 2


def propose(token_ids: Sequence[int], tokens: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to ``tokens`` draft tokens to follow ``token_ids``: what followed the most recent earlier
    occurrence of its longest suffix (``max_ngram`` tokens, then shorter, down to ``min_ngram``)
    in ``token_ids`` itself. Empty when no such suffix recurs or ``tokens`` < 1.

    Cost: one vectorised comparison of ``token_ids`` with its last id, then a check of the few
    matches (~10 us at 2 K ids).
    """
    if tokens < 1 or len(token_ids) < 2:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    # ends of earlier windows: positions before the last id that hold the last id
    ends = np.flatnonzero(ids[:-1] == ids[-1])
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        hits = ends[ends >= n - 1]
        for back in range(1, n):
            hits = hits[ids[hits - back] == ids[-1 - back]]
        if hits.size:
            start = int(hits[-1]) + 1
            return ids[start:start + tokens].tolist()
    return []


def checked_prompt_lookup(tokens) -> int:
    """``tokens`` as a draft length (``prompt_lookup`` settings).

    Raises:
        InputTypeError: not an int (bools included). InputError: negative.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise InputTypeError(f"prompt_lookup must be an int >= 0 (got {type(tokens).__name__} {tokens!r}); "
                             "0 decodes one token per forward")
    if tokens < 0:
        raise InputError(f"prompt_lookup must be an int >= 0 (got {tokens}); 0 decodes one token per forward")
    return tokens
