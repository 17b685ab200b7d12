"""Tests of kvmemory.selection: allowance (eq. 3), relevance (eq. 7), semantic units and the five allocators."""

from __future__ import annotations

import json
import math
import random
import re
from fractions import Fraction

import pytest
import torch

from kvmemory.selection import (
    ALLOCATORS,
    MessageSpan,
    SelectionInput,
    Unit,
    allocate_units,
    allowance,
    best_envelope_window,
    bm25_unit_scores,
    build_units,
    content_regions,
    forward_envelope,
    relevance_scores,
    select,
    to_intervals,
    unit_score,
)

# --------------------------------------------------------------------------- synthetic prompts

WORD = re.compile(r"\S+\s*|\s+")  # a toy tokenizer: one token per word with its trailing space
VOCAB: dict[str, int] = {}
V, H = 4096, 16
EMBED = torch.randn(V, H, generator=torch.Generator().manual_seed(0))


def token_id(piece: str) -> int:
    tid = VOCAB.setdefault(piece.strip().lower(), len(VOCAB))
    assert tid < V
    return tid


def make_input(messages, eligible=None, query="word", header="<s> ", footer="</s>") -> SelectionInput:
    """Render ``messages`` (content strings) as header+content+footer; tokens never cross messages."""
    text, ids, offsets, spans = "", [], [], []
    for index, content in enumerate(messages):
        token_start = len(ids)
        for piece, is_content in ((header, False), (content, True), (footer, False)):
            lo = len(text)
            text += piece
            if is_content:
                content_span = (lo, len(text))
            for m in WORD.finditer(piece):
                ids.append(token_id(m.group()))
                offsets.append((lo + m.start(), lo + m.end()))
        spans.append(MessageSpan(index, token_start, len(ids), *content_span))
    eligible = list(range(len(ids))) if eligible is None else eligible
    return SelectionInput(text, ids, offsets, spans, eligible, [token_id(w) for w in WORD.findall(query)], query)


def sentence(n: int, word: str = "word") -> str:
    """A sentence of exactly n toy tokens."""
    return " ".join(["Start"] + [word] * (n - 2) + ["end."]) + " " if n > 1 else "Stop. "


def unit_sizes(inp) -> list[int]:
    return [len(u) for u in build_units(inp)]


def assert_partition(units, eligible):
    assert [p for u in units for p in u.positions] == list(eligible)
    for u in units:
        assert list(u.positions) == list(range(u.positions[0], u.positions[-1] + 1))
        assert 1 <= len(u) <= 128


def random_content(rng: random.Random) -> str:
    blocks = []
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(["prose", "prose", "code", "json", "list", "long"])
        if kind == "prose":
            blocks.append("".join(sentence(rng.randint(1, 20), rng.choice(["cat", "dog", "word"])) for _ in range(rng.randint(1, 4))))
        elif kind == "long":
            blocks.append(sentence(rng.randint(100, 300)))
        elif kind == "code":
            blocks.append("```python\n" + "\n".join(f"x{i} = {i}" for i in range(rng.randint(1, 6))) + "\n```")
        elif kind == "json":
            blocks.append(json.dumps({f"k{i}": [i, "v"] for i in range(rng.randint(1, 5))}, indent=1))
        else:
            blocks.append("\n".join(f"- item {i} cat" for i in range(rng.randint(1, 6))))
    return "\n\n".join(blocks)


def random_input(seed: int) -> SelectionInput:
    rng = random.Random(seed)
    inp = make_input([random_content(rng) for _ in range(rng.randint(1, 4))], query=rng.choice(["cat dog", "word", "item x1"]))
    n = len(inp.token_ids)
    start = rng.randrange(n)
    eligible = [p for p in range(start, n) if rng.random() > 0.15 or seed % 3 == 0]  # gaps in 2 of 3 cases
    return SelectionInput(inp.text, inp.token_ids, inp.offsets, inp.messages, eligible or [n - 1], inp.query_ids, inp.query_text)


# --------------------------------------------------------------------------- allowance (eq. 3)


@pytest.mark.parametrize(
    "S, b, B",
    [(100, 5, 5), (100, 0, 0), (100, 100, 100), (100, 2, 2), (1500, 2.2, 33), (7, 0.001, 1), (0, 50, 0),
     (3, 50, 2), (10, 12.5, 2), (40, 2.5, 1), (1000, 0.1, 1), (999, 10, 100), (1, 100, 1), (250, 40, 100)],
)
def test_allowance_exact(S, b, B):
    assert allowance(S, b) == B


def test_allowance_matches_exact_decimal_formula():
    for S in range(0, 600, 7):
        for b in (0, 0.1, 0.5, 1, 2, 2.2, 5, 7.5, 10, 20, 33.3, 40, 80, 99.9, 100):
            assert allowance(S, b) == min(S, math.ceil(S * Fraction(str(b)) / 100))


@pytest.mark.parametrize("bad", [-1, 100.5, float("nan"), float("inf"), "5", True, None])
def test_allowance_rejects_bad_budget(bad):
    with pytest.raises(ValueError, match="budget"):
        allowance(100, bad)


def test_allowance_rejects_bad_length():
    with pytest.raises(ValueError, match="S"):
        allowance(-1, 5)


# --------------------------------------------------------------------------- relevance (eq. 7)


def test_relevance_identical_token_is_exactly_one_and_a_quarter():
    r = relevance_scores(EMBED, [5, 6, 5], [5, 9])
    assert r.dtype == torch.float32 and r.shape == (3,)
    assert r[0].item() == 1.25 and r[2].item() == 1.25
    assert r[1].item() < 1.0


def test_relevance_hand_computed_cosines():
    E = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0], [-1.0, 0.0]])
    r = relevance_scores(E, [1, 2, 3, 0], [0])
    assert torch.allclose(r, torch.tensor([0.0, math.sqrt(0.5), -1.0, 1.25]))
    r = relevance_scores(E, [3], [0, 1])  # max over query tokens
    assert r.item() == pytest.approx(0.0, abs=1e-7)


def test_relevance_blocks_equal_unblocked():
    g = torch.Generator().manual_seed(1)
    suffix = torch.randint(0, V, (2500,), generator=g).tolist()
    query = torch.randint(0, V, (9,), generator=g).tolist()
    full = relevance_scores(EMBED, suffix, query, block=10**6)
    assert torch.equal(relevance_scores(EMBED, suffix, query), full)  # 1024-token blocks (3 here)
    assert torch.equal(relevance_scores(EMBED, suffix, query, block=100), full)
    # A 1-row block (here the last of block=7) runs a matrix-vector kernel whose summation order
    # may differ by one float32 ulp; the scores agree to rounding.
    assert torch.allclose(relevance_scores(EMBED, suffix[:302], query, block=7), full[:302], rtol=0, atol=1e-6)
    assert torch.allclose(relevance_scores(EMBED, suffix[:200], query, block=1), full[:200], rtol=0, atol=1e-6)
    assert relevance_scores(EMBED.half(), suffix[:10], query).dtype == torch.float32


def test_relevance_errors():
    with pytest.raises(ValueError, match="query_ids is empty"):
        relevance_scores(EMBED, [1, 2], [])
    with pytest.raises(ValueError, match="outside the embedding table"):
        relevance_scores(EMBED, [V], [1])
    with pytest.raises(ValueError, match="block"):
        relevance_scores(EMBED, [1], [1], block=0)


# --------------------------------------------------------------------------- regions and units


def test_content_regions_keep_structured_containers_whole():
    content = (
        "Intro text. Second sentence.\n\n```python\nx = 1. y = 2.\n```\n"
        '{\n "a": "b. c",\n "d": [1,\n 2]\n}\n- one. two.\n- three.\n1. four.\nLast one. Really last.'
    )
    regions = content_regions(content, 0, len(content))
    pieces = [(content[r.start : r.end], r.structured) for r in regions]
    assert [p for p, s in pieces if s] == [
        "```python\nx = 1. y = 2.\n```\n",
        '{\n "a": "b. c",\n "d": [1,\n 2]\n}\n',
        "- one. two.\n- three.\n1. four.\n",
    ]
    assert [p for p, s in pieces if not s] == ["Intro text. ", "Second sentence.\n\n", "Last one. ", "Really last."]
    assert "".join(p for p, _ in pieces) == content
    whole_json = '{"a": "one. two.", "b": [1, 2]}'
    assert [(r.start, r.end, r.structured) for r in content_regions("xx" + whole_json, 2, 2 + len(whole_json))] == [(2, 2 + len(whole_json), True)]


def test_content_regions_edge_cases():
    def structured(content):
        return [content[r.start : r.end] for r in content_regions(content, 0, len(content)) if r.structured]

    assert structured("Text.\n```\nunclosed = 1\nstill code") == ["```\nunclosed = 1\nstill code"]
    assert structured("{ not closed\nText here.") == []  # unbalanced brace: prose
    assert structured("[1] A citation line.\nMore.") == []  # one line that is not JSON: prose
    assert structured('Data:\n[1, 2, "]"]\nDone.') == ['[1, 2, "]"]\n']  # one line that parses
    assert structured("- a\n\n- b\n\nAfter.") == ["- a\n\n- b\n\n"]  # loose list stays one container
    assert structured("-1.5 is negative. ---") == []
    assert [(r.start, r.end) for r in content_regions("abc", 1, 1)] == [(1, 1)]  # empty content: one empty region


def test_units_split_long_into_balanced_chunks():
    assert unit_sizes(make_input([sentence(300)], header="", footer="")) == [100, 100, 100]
    assert unit_sizes(make_input([sentence(129)], header="", footer="")) == [65, 64]
    assert unit_sizes(make_input([sentence(128)], header="", footer="")) == [128]


def test_units_merge_short_with_shorter_neighbour_tie_preceding():
    plain = dict(header="", footer="")
    assert unit_sizes(make_input([sentence(20) + sentence(3) + sentence(10)], **plain)) == [20, 13]
    assert unit_sizes(make_input([sentence(10) + sentence(3) + sentence(10)], **plain)) == [13, 10]  # tie → preceding
    assert unit_sizes(make_input([sentence(3) + sentence(2) + sentence(20)], **plain)) == [25]  # merged unit keeps merging
    assert unit_sizes(make_input([sentence(128) + sentence(5)], **plain)) == [67, 66]  # oversized merge splits again
    # Template tokens attach to the nearest region: the header to the first sentence, the footer to the last.
    assert unit_sizes(make_input([sentence(20) + sentence(20)])) == [21, 21]


def test_units_never_merge_across_containers_or_gaps():
    plain = dict(header="", footer="")
    # A 7-token code block stays alone: its container is not the message's prose.
    inp = make_input([sentence(20) + "\n```\nx = 1 2 3\n```\n" + sentence(20)], **plain)
    assert unit_sizes(inp) == [20, 7, 20]
    # Messages are containers: a 3-token message does not merge into its neighbours.
    assert unit_sizes(make_input([sentence(20), sentence(3), sentence(20)], **plain)) == [20, 3, 20]
    # A gap in eligible splits a unit and blocks merging across it.
    inp = make_input([sentence(30)], eligible=[*range(0, 10), *range(12, 15), *range(20, 30)], **plain)
    units = build_units(inp)
    assert [u.positions for u in units] == [tuple(range(0, 10)), tuple(range(12, 15)), tuple(range(20, 30))]


@pytest.mark.parametrize("seed", range(40))
def test_units_partition_eligible(seed):
    inp = random_input(seed)
    assert_partition(build_units(inp), inp.eligible)


def test_units_cover_positions_outside_messages():
    inp = make_input([sentence(10), sentence(10)])
    inner = inp.messages[1]
    messages = [inp.messages[0], MessageSpan(1, inner.token_start + 2, inner.token_end, inner.content_start, inner.content_end)]
    inp = SelectionInput(inp.text, inp.token_ids, inp.offsets, messages, inp.eligible, inp.query_ids)
    assert_partition(build_units(inp), inp.eligible)


def test_build_units_rejects_inconsistent_input():
    inp = make_input([sentence(10)])
    with pytest.raises(ValueError, match="eligible"):
        build_units(SelectionInput(inp.text, inp.token_ids, inp.offsets, inp.messages, [3, 2], inp.query_ids))
    with pytest.raises(ValueError, match="offsets"):
        build_units(SelectionInput(inp.text, inp.token_ids, inp.offsets[:-1], inp.messages, [0], inp.query_ids))


# --------------------------------------------------------------------------- allocators: contract


@pytest.mark.parametrize("seed", range(25))
def test_every_allocator_returns_exactly_B_eligible_positions(seed):
    inp = random_input(seed)
    S = len(inp.eligible)
    rng = random.Random(seed)
    for name in ALLOCATORS:
        for B in {0, 1, S, rng.randint(0, S), allowance(S, rng.choice([2, 5, 10, 20, 40, 80]))}:
            got = select(name, inp, B, embedding=EMBED, seed=seed)
            assert len(got) == B and got == sorted(set(got)) and set(got) <= set(inp.eligible), (name, B)


def test_select_errors():
    inp = make_input([sentence(10)])
    with pytest.raises(ValueError, match="sur, dense, window, bm25, random"):
        select("nope", inp, 1, embedding=EMBED)
    for B in (-1, len(inp.eligible) + 1, 1.0, True):
        with pytest.raises(ValueError, match="B must be"):
            select("sur", inp, B, embedding=EMBED)
    with pytest.raises(ValueError, match="embedding"):
        select("dense", inp, 1)
    with pytest.raises(ValueError, match="query_text"):
        select("bm25", SelectionInput(inp.text, inp.token_ids, inp.offsets, inp.messages, inp.eligible, inp.query_ids), 1)


def test_to_intervals():
    assert to_intervals([]) == []
    assert to_intervals([3, 4, 8, 9, 10, 12]) == [(3, 5), (8, 11), (12, 13)]
    with pytest.raises(ValueError, match="strictly increasing"):
        to_intervals([3, 3])


# --------------------------------------------------------------------------- allocators: hand-computed cases

# Token ids 0..4 on the unit circle so that r = cos to the query token 0 is known: 1.25, 0.6, 0, 0.8, -1.
CIRCLE = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0], [0.8, 0.6], [-1.0, 0.0]])


def circle_input(ids, eligible=None) -> SelectionInput:
    text = " ".join(str(i) for i in ids)
    offsets = [(2 * k, 2 * k + 1) for k in range(len(ids))]
    eligible = list(range(len(ids))) if eligible is None else eligible
    return SelectionInput(text, ids, offsets, [MessageSpan(0, 0, len(ids), 0, len(text))], eligible, [0], "0")


def test_dense_hand_computed():
    inp = circle_input([2, 1, 3, 2, 0, 1, 3, 4])  # r = 0, .6, .8, 0, 1.25, .6, .8, -1
    assert select("dense", inp, 3, embedding=CIRCLE) == [2, 4, 6]
    assert select("dense", inp, 4, embedding=CIRCLE) == [1, 2, 4, 6]  # tie .6 at 1 and 5 → earlier
    inp = circle_input([2, 1, 3, 2, 0, 1, 3, 4], eligible=[0, 1, 5, 6, 7])  # r = 0, .6, .6, .8, -1
    assert select("dense", inp, 2, embedding=CIRCLE) == [1, 6]


def test_window_hand_computed():
    inp = circle_input([2, 1, 3, 2, 0, 1, 3, 4])  # pair sums: .6 1.4 .8 1.25 1.85 1.4 -.2
    assert select("window", inp, 2, embedding=CIRCLE) == [4, 5]
    inp = circle_input([1, 3, 2, 1, 3])  # [1, 3] at 0 and 3 tie exactly → earliest
    assert select("window", inp, 2, embedding=CIRCLE) == [0, 1]
    inp = circle_input([2, 1, 2, 3, 0, 2], eligible=[0, 1, 3, 4, 5])  # contiguous in eligible order
    assert select("window", inp, 2, embedding=CIRCLE) == [3, 4]


def test_envelope_hand_computed_earliest_maximizer():
    r = [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    d, e1 = math.exp(-1 / 16), math.exp(-1)
    expected = [e1, 1.0, d, d * d, 1.0, d]
    assert forward_envelope(r) == pytest.approx(expected)
    # Width-2 sums: e1+1, 1+d, d+d², d²+1, 1+d → tie between offsets 1 and 4 → earliest.
    assert best_envelope_window(r, 2) == 1
    assert best_envelope_window(r, 3) == 1  # 1+d+d² beats d²+1+d only by order → earliest
    assert best_envelope_window([0.0, 0.0, 3.0, 0.0], 1) == 2
    assert best_envelope_window([2.0, 2.0, 2.0], 2) == 0  # flat scores → flat envelope → first window


def test_sur_unit_ranking_top4_mean_tie_earlier_and_envelope_window():
    units = [Unit(tuple(range(0, 8)), 0), Unit(tuple(range(8, 14)), 0), Unit(tuple(range(14, 20)), 0), Unit(tuple(range(20, 28)), 0)]
    scores = (
        [0.1] * 8  # unit 3rd... mean 0.1 → last
        + [1.0, 1.0, 1.0, 1.0, 0.0, -1.0]  # top-4 mean 1.0
        + [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]  # top-4 mean 0.5 (envelope case above)
        + [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]  # top-4 mean 1.0, ties the second unit but comes later
    )
    assert [unit_score(scores[a:b]) for a, b in ((0, 8), (8, 14), (14, 20), (20, 28))] == [0.1, 1.0, 0.5, 1.0]
    assert unit_score([3.0, 1.0]) == 2.0  # fewer than four tokens: mean of all
    # Ranking: [8,14), [20,28), [14,20), [0,8). B = 6 + 8 + 2 → the third gets its best 2-window (offset 1).
    assert allocate_units(units, scores, 16) == [*range(8, 14), 15, 16, *range(20, 28)]
    assert allocate_units(units, scores, 6) == list(range(8, 14))
    # The first unit that does not fit gets a window and allocation stops, even if a later one would fit.
    small = [Unit((0, 1, 2, 3, 4), 0), Unit(tuple(range(5, 25)), 0), Unit((25, 26), 0)]
    small_scores = [1.0] * 5 + [0.5] * 20 + [0.1] * 2
    assert allocate_units(small, small_scores, 7) == [0, 1, 2, 3, 4, 5, 6]


def bm25_hand(docs, query, k1=1.2, b=0.75):
    N, avg = len(docs), sum(map(len, docs)) / len(docs)
    out = []
    for d in docs:
        s = 0.0
        for t in query:  # repeats counted
            df = sum(t in doc for doc in docs)
            if t in d:
                idf = math.log(1 + (N - df + 0.5) / (df + 0.5))
                tf = d.count(t)
                s += idf * tf / (tf + k1 * (1 - b + b * len(d) / avg))
        out.append(s)
    return out


def test_bm25_hand_computed_three_units():
    texts = ["The cat sat on a mat, 9 times. ", "A dog and a CAT. ", "x y z. "]
    query = "cat? Cat a dog"
    docs = [["the", "cat", "sat", "on", "a", "mat", "9", "times"], ["a", "dog", "and", "a", "cat"], ["x", "y", "z"]]
    expected = bm25_hand(docs, ["cat", "cat", "a", "dog"])
    assert bm25_unit_scores(texts, query) == pytest.approx(expected, rel=1e-6)
    assert expected[1] > expected[0] > expected[2] == 0
    assert bm25_unit_scores(texts, "zzz") == [0.0, 0.0, 0.0]
    assert bm25_unit_scores(["", " "], "cat") == [0.0, 0.0]
    # Through select: one unit per message; unit 1 whole, then the first 2 tokens of unit 0 (flat envelope).
    inp = make_input(texts, query=query, header="", footer="")
    units = build_units(inp)
    assert [len(u) for u in units] == [8, 5, 3]
    assert select("bm25", inp, 7) == [0, 1, *units[1].positions]


def test_random_units_seeded_and_hand_checked():
    inp = make_input([sentence(12), sentence(9), sentence(20), sentence(15)], header="", footer="")
    units = build_units(inp)
    assert [len(u) for u in units] == [12, 9, 20, 15]
    B = 30
    got = select("random", inp, B, seed=7)
    assert got == select("random", inp, B, seed=7)
    assert len({tuple(select("random", inp, B, seed=s)) for s in range(8)}) > 1
    rng = random.Random(7)  # re-derive: shuffle units, admit whole, exact-width window in the first misfit
    order = list(range(4))
    rng.shuffle(order)
    want, left = [], B
    for j in order:
        if len(units[j]) <= left:
            want += units[j].positions
            left -= len(units[j])
        else:
            start = rng.randrange(len(units[j]) - left + 1)
            want += units[j].positions[start : start + left]
            break
    assert got == sorted(want)


# --------------------------------------------------------------------------- real model


def build_real_input(tok, messages, n_stale_from: int, query: str) -> SelectionInput:
    """Spans by rendering message prefixes; tokens by the offset mapping of the full text."""
    text = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    ids, offsets = enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
    bounds = [0] + [len(tok.apply_chat_template(messages[: k + 1], tokenize=False)) for k in range(len(messages))]
    assert bounds[-1] == len(text)
    owner = [next(k for k in range(len(messages)) if 2 * bounds[k] <= a + b < 2 * bounds[k + 1]) for a, b in offsets]
    spans = []
    for k, m in enumerate(messages):
        start = text.index(m["content"], bounds[k])
        toks = [p for p, o in enumerate(owner) if o == k]
        spans.append(MessageSpan(k, toks[0], toks[-1] + 1, start, start + len(m["content"])))
    eligible = list(range(spans[n_stale_from].token_start, len(ids)))
    query_ids = tok(query, add_special_tokens=False)["input_ids"]
    return SelectionInput(text, ids, offsets, spans, eligible, query_ids, query)


@pytest.mark.real_model
def test_real_model_units_and_sur():
    from kvmemory.models import load_model

    lm = load_model()
    tok, E = lm.tokenizer, lm.model.get_input_embeddings().weight.detach()
    tool_json = json.dumps({"order": 4417, "items": ["kettle", "mug"], "note": "order shipped with carrier DHL Express, arriving June 3"})
    messages = [
        {"role": "system", "content": "You are a helpful shopping assistant."},
        {"role": "user", "content": "Where is my order? I bought a kettle last week."},
        {"role": "assistant", "content": "Let me look it up. I will run this:\n\n```python\nimport shop\nprint(shop.lookup(order))\n```"},
        {"role": "tool", "content": tool_json},
        {"role": "assistant", "content": "Things I checked:\n- the account\n- the payment method\n- the address on file\n\nThe weather today is sunny and mild. My favourite colour is blue, by the way."},
    ]
    query = "Which carrier shipped my kettle order?"
    inp = build_real_input(tok, messages, 2, query)
    assert tok(inp.text, add_special_tokens=False)["input_ids"] == list(inp.token_ids)
    units = build_units(inp)
    assert_partition(units, inp.eligible)

    unit_of = {p: k for k, u in enumerate(units) for p in u.positions}
    for m in inp.messages[2:]:
        for r in content_regions(inp.text, m.content_start, m.content_end):
            inside = [p for p in range(m.token_start, m.token_end) if 2 * r.start <= sum(inp.offsets[p]) < 2 * r.end]
            if r.structured and len(inside) <= 128:
                assert len({unit_of[p] for p in inside}) == 1, inp.text[r.start : r.end]
    structured = [inp.text[r.start : r.end] for m in inp.messages[2:] for r in content_regions(inp.text, m.content_start, m.content_end) if r.structured]
    assert len(structured) == 3 and structured[1] == tool_json  # code block, JSON, list

    S = len(inp.eligible)
    B = allowance(S, 10)
    chosen = select("sur", inp, B, embedding=E)
    assert len(chosen) == B and set(chosen) <= set(inp.eligible)
    # The tool result holds the query's words " shipped" and " carrier" (score 1.25 each), so its
    # (single, 42-token) unit ranks first and the envelope window covers them.
    tool = inp.messages[3]
    assert all(tool.token_start <= p < tool.token_end for p in chosen), chosen
    carrier = tok(" carrier", add_special_tokens=False)["input_ids"]
    assert len(carrier) == 1 and carrier[0] in [inp.token_ids[p] for p in chosen]
    for name in ALLOCATORS:
        got = select(name, inp, B, embedding=E, seed=1)
        assert len(got) == B and got == sorted(set(got)) and set(got) <= set(inp.eligible)
