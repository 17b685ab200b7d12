"""Lexical BM25 relevance of semantic units, the "BM25 (same units)" control (paper §7.4)."""

from __future__ import annotations

import re
from typing import Sequence

import bm25s

TERM = re.compile(r"[a-z0-9]+")
K1 = 1.2
B_BM25 = 0.75


def lexical_terms(text: str) -> list[str]:
    """Lowercase ASCII-alphanumeric terms of ``text``, repeats kept (1-char terms included)."""
    return TERM.findall(text.lower())


def bm25_unit_scores(unit_texts: Sequence[str], query_text: str) -> list[float]:
    """BM25 score of each unit's text against the query, one unit = one document.

    score(u) = Σ_{t in query, with multiplicity} idf(t) · tf(t,u) / (tf(t,u) + k1·(1 − b + b·|u|/avg|u|)),
    idf(t) = ln(1 + (N − df(t) + 0.5) / (df(t) + 0.5)), k1 = 1.2, b = 0.75 (bm25s' default
    "lucene" variant; |u| counts terms).

    Args:
        unit_texts: N >= 0 unit texts (the corpus).
        query_text: the next query.

    Returns:
        N floats >= 0; all 0 when the query shares no term with the corpus.

    Source: paper §7.4 ("BM25 (same units)").
    """
    corpus = [lexical_terms(t) for t in unit_texts]
    query = lexical_terms(query_text)
    if not any(corpus) or not query:  # bm25s cannot index a corpus without terms
        return [0.0] * len(corpus)
    # We tokenize ourselves: bm25s' own tokenizer drops 1-char terms and stop words.
    retriever = bm25s.BM25(k1=K1, b=B_BM25)
    retriever.index(corpus, show_progress=False)
    # get_tokens_ids keeps repeats and bm25s adds one contribution per query token, so a term
    # that occurs twice in the query counts twice (the paper's multiplicity weighting).
    ids = retriever.get_tokens_ids(query)
    if not ids:
        return [0.0] * len(corpus)
    return [float(s) for s in retriever.get_scores(ids)]
