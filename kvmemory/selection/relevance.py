"""Query relevance of prompt tokens from the frozen input embedding table (paper §3.2 eq. 1, §7.3 eq. 7)."""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

IDENTICAL_TOKEN_BONUS = 0.25
BLOCK = 1024


def _ids(name: str, ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Token ids as a 1-D int64 tensor, checked against the vocabulary size."""
    t = torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids, dtype=torch.long, device=device)
    if t.dim() != 1:
        raise ValueError(f"{name} must be a flat sequence of token ids, got shape {tuple(t.shape)}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise ValueError(f"{name} holds ids outside the embedding table [0, {vocab}): use the model's own tokenizer")
    return t


def unit_idf(units: Sequence[Sequence[int]], token_ids: Sequence[int]) -> dict[int, float]:
    """Inverse unit frequency of tokens, scaled to [0, 1]: 1 for a token in no unit, ~0 for one in
    every unit (our extension; not in the paper).

    w(t) = log((U + 1) / (df(t) + 0.5)) / log((U + 1) / 0.5), clipped to [0, 1], where U is the
    number of units and df(t) the number of units whose token ids contain t.

    Args:
        units: token ids of each semantic unit (U >= 1 lists).
        token_ids: the tokens to weigh (e.g. the query's).

    Returns:
        {token id: weight} for every distinct id of ``token_ids``.
    """
    n = len(units)
    df = {t: 0 for t in set(int(t) for t in token_ids)}
    for unit in units:
        for t in set(int(t) for t in unit) & df.keys():
            df[t] += 1
    top = math.log((n + 1) / 0.5)
    return {t: min(1.0, max(0.0, math.log((n + 1) / (d + 0.5)) / top)) for t, d in df.items()}


def relevance_scores(
    embedding: torch.Tensor,
    suffix_ids: Sequence[int],
    query_ids: Sequence[int],
    block: int = BLOCK,
    query_weights: dict[int, float] | None = None,
) -> torch.Tensor:
    """Score each suffix token by its best embedding match to the query, plus an identical-token bonus.

    r_i = max_j cos(E(s_i), E(q_j)) + 0.25 · 1[s_i ∈ q]

    Args:
        embedding: E, the model's frozen input embedding table, shape [V, H] (any float dtype/device;
            e.g. ``model.get_input_embeddings().weight``).
        suffix_ids: S token ids s_i to score (the eligible prompt tokens), each in [0, V).
        query_ids: |q| >= 1 token ids of the next query, tokenized without special tokens and
            without stop-word filtering.
        block: suffix tokens per cosine block (paper: 1,024); bounds peak memory to block × |q|.
        query_weights: None (the paper's eq. 1), or a weight in [0, 1] per query token id (e.g.
            :func:`unit_idf`): each cosine with q_j is multiplied by w(q_j) and the bonus of a
            suffix token equal to q_j by w(q_j), so frequent query tokens stop dominating.

    Returns:
        Tensor [S], float32, on the CPU; values in [-1, 1.25]. A token that occurs in the query
        scores exactly 1.25: its best cosine is its cosine with itself, which is 1 (set exactly,
        because fp32 normalisation gives 0.99999988).

    Raises:
        ValueError: empty query; embedding not 2-D; ids outside [0, V); block < 1.

    Source: paper §3.2 eq. (1) and §7.3 eq. (7) (FP32 normalisation and cosine, 1,024-token blocks).
    """
    if embedding.dim() != 2:
        raise ValueError(f"embedding must be the [V, H] input embedding table, got shape {tuple(embedding.shape)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int (tokens per cosine block), got {block!r}")
    vocab, device = embedding.shape[0], embedding.device
    suffix = _ids("suffix_ids", suffix_ids, vocab, device)
    query = _ids("query_ids", query_ids, vocab, device).unique()
    if query.numel() == 0:
        raise ValueError(
            "query_ids is empty: relevance needs the next query's tokens "
            "(tokenize the query text with add_special_tokens=False)"
        )
    query_unit = F.normalize(embedding[query].float(), dim=-1)  # [Q, H] fp32
    if query_weights is not None:
        weights = torch.tensor([query_weights.get(int(t), 1.0) for t in query], dtype=torch.float32, device=device)
        return _weighted_scores(embedding, suffix, query, query_unit, weights, block)
    scores = torch.empty(suffix.numel(), dtype=torch.float32, device=device)
    for lo in range(0, suffix.numel(), block):
        ids = suffix[lo : lo + block]
        cos = F.normalize(embedding[ids].float(), dim=-1) @ query_unit.T  # [blk, Q]
        best = cos.amax(dim=-1).clamp(max=1.0)
        in_query = torch.isin(ids, query)
        # A query token's best match is itself, cos = 1 exactly; fp32 gives 0.99999988, so write
        # the exact value to keep scores (and the ties the allocators break) reproducible.
        scores[lo : lo + block] = torch.where(in_query, 1.0 + IDENTICAL_TOKEN_BONUS, best)
    return scores.cpu()


def _weighted_scores(embedding, suffix, query, query_unit, weights, block) -> torch.Tensor:
    """r_i = max_j w_j cos(E(s_i), E(q_j)) + 0.25 · w(s_i) · 1[s_i ∈ q] (unit_idf weights)."""
    scores = torch.empty(suffix.numel(), dtype=torch.float32, device=query.device)
    for lo in range(0, suffix.numel(), block):
        ids = suffix[lo : lo + block]
        cos = (F.normalize(embedding[ids].float(), dim=-1) @ query_unit.T).clamp(max=1.0)  # [blk, Q]
        same = ids[:, None] == query[None, :]
        cos = torch.where(same, torch.ones_like(cos), cos)  # exact self-match, as in the paper's path
        best = (cos * weights).amax(dim=-1)
        bonus = (same.float() * weights).amax(dim=-1) * IDENTICAL_TOKEN_BONUS
        scores[lo : lo + block] = best + bonus
    return scores.cpu()
