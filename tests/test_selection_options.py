"""Selection options beyond the paper: IDF-weighted relevance, the latest-unit tie rule, the tail."""

import math

import pytest
import torch

from kvmemory.selection import (MessageSpan, SelectionInput, SelectionOptions, Unit, allocate_units, relevance_scores,
                                select, unit_idf)

# a 2-D embedding table: token k sits at angle k·36° on the unit circle
CIRCLE = torch.tensor([[math.cos(k * math.pi / 5), math.sin(k * math.pi / 5)] for k in range(10)])


def test_unit_idf_hand_computed():
    units = [[1, 2, 3], [1, 4], [1, 2], [5]]
    w = unit_idf(units, [1, 2, 9])
    top = math.log(5 / 0.5)
    assert w[1] == pytest.approx(math.log(5 / 3.5) / top)  # in 3 of 4 units
    assert w[2] == pytest.approx(math.log(5 / 2.5) / top)
    assert w[9] == 1.0  # in no unit
    assert 0 < w[1] < w[2] < w[9]


def test_weighted_relevance_discounts_frequent_query_tokens():
    suffix, query = [0, 3, 5], [0, 5]
    paper = relevance_scores(CIRCLE, suffix, query)
    assert paper[0] == paper[2] == 1.25  # both identical to a query token: the maximal score
    weighted = relevance_scores(CIRCLE, suffix, query, query_weights={0: 0.1, 5: 1.0})
    assert weighted[2] == pytest.approx(1.25)
    assert weighted[0] == pytest.approx(max(0.1 * 1.0, 1.0 * math.cos(math.pi)) + 0.25 * 0.1)
    # token 3: best weighted cosine over the query tokens
    assert weighted[1] == pytest.approx(max(0.1 * math.cos(3 * math.pi / 5), math.cos(2 * math.pi / 5)))
    unweighted = relevance_scores(CIRCLE, suffix, query, query_weights={0: 1.0, 5: 1.0})
    torch.testing.assert_close(unweighted, paper)  # weights of 1 are the paper's eq. 1


def _input(ids, query, units_text=None):
    text = " ".join(str(i) for i in ids)
    offsets = [(2 * k, 2 * k + 1) for k in range(len(ids))]
    return SelectionInput(text, ids, offsets, [MessageSpan(0, 0, len(ids), 0, len(text))], list(range(len(ids))), query,
                          " ".join(map(str, query)))


def test_latest_tie_rule_prefers_the_unit_nearer_the_query():
    units = [Unit(tuple(range(0, 8)), 0), Unit(tuple(range(8, 16)), 0)]
    scores = [1.0] * 16
    assert allocate_units(units, scores, 8) == list(range(0, 8))  # the paper: earliest
    assert allocate_units(units, scores, 8, ties="latest") == list(range(8, 16))


def test_tail_tokens_come_first_inside_the_allowance():
    inp = _input([2, 1, 3, 2, 0, 1, 3, 4, 2, 2], [0])
    paper = select("dense", inp, 3, embedding=CIRCLE)
    assert paper == [1, 4, 5]  # r = cos(k·36°) against query token 0, 1.25 for token 0 itself
    tail = select("dense", inp, 3, embedding=CIRCLE, options=SelectionOptions(tail_tokens=2))
    assert tail == [4, 8, 9]  # the last two positions, then the best remaining one
    assert select("dense", inp, 2, embedding=CIRCLE, options=SelectionOptions(tail_tokens=5)) == [8, 9]


@pytest.mark.real_model
def test_idf_relevance_finds_the_passage_frequent_tokens_hide(real):
    """A query full of frequent tokens (" the", ",", " of"): the paper's identical-token bonus
    gives every passage a near-maximal unit score and ties go to the earliest; IDF weighting
    ranks the passage that holds the rare query words first."""
    from test_selection import build_real_input

    passages = [f"The {w} of the city is in the north, and the {w} is old." for w in ("market", "harbour", "museum")]
    passages.append("The lighthouse keeper is called Ilse Marrow, and the lighthouse is old.")
    messages = [{"role": "system", "content": "You answer from the passages."}]
    messages += [{"role": "tool", "content": p} for p in passages]
    query = "Who is the keeper of the lighthouse, and what is the name of the keeper?"
    inp = build_real_input(real.tokenizer, messages, 1, query)
    emb = real.model.get_input_embeddings().weight.detach()
    target = set(range(inp.messages[4].token_start, inp.messages[4].token_end))
    B = 10
    paper = select("sur", inp, B, embedding=emb)
    idf = select("sur", inp, B, embedding=emb, options=SelectionOptions(relevance="idf"))
    assert set(idf) <= target, "IDF relevance spends the allowance on the lighthouse passage"
    assert not set(paper) <= target, "the paper's rule is drawn to the earlier passages (if this fails, the case no longer shows the problem)"
