"""Prompt lookup: greedy answers checked several tokens per forward equal one-token decoding, and
a stream closed in the middle of a draft leaves the session as one-token decoding would."""

from __future__ import annotations

import pytest
import torch
from transformers import QuantizedCache

from kvmemory import InputError, InputTypeError, KVSession, engine, kvcache
from kvmemory.engine import forward_rows
from kvmemory.lookup import propose
from support import QUERY, history, reprefill_logits, tiny_loaded

LOGITS_ATOL = 1e-3  # fp32, another summation order (see test_engine.py)


def test_propose_copies_what_followed_the_longest_recurring_suffix():
    ids = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 4, 6, 7]
    # the suffix (6, 7) last occurred before 2, 3, 4; the 3-gram (4, 6, 7) never did
    assert propose(ids, 3) == [2, 3, 4]
    assert propose(ids, 1) == [2]
    assert propose([1, 2, 3, 9], 4) == []  # 9 never occurred before
    assert propose([1, 2, 3, 1, 2], 5) == [3, 1, 2]  # the continuation ends with the ids
    assert propose([1, 2, 1], 0) == []
    # one recurring token is a suffix only when asked for (the default needs two)
    assert propose([4, 1, 5, 2, 1], 2) == []
    assert propose([4, 1, 5, 2, 1], 2, min_ngram=1) == [5, 2]


def _reference_draft(ids: list[int], tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """propose's definition, written out: for n from max_ngram down, the latest earlier window
    equal to the last n ids, and the ids after it."""
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == ids[-n:]:
                return ids[start + n:start + n + tokens]
    return []


def test_propose_equals_its_definition_on_random_ids():
    generator = torch.Generator().manual_seed(0)
    for _ in range(3000):
        length = int(torch.randint(2, 40, (1,), generator=generator))
        ids = torch.randint(0, int(torch.randint(1, 5, (1,), generator=generator)), (length,), generator=generator).tolist()
        for max_ngram, min_ngram in ((3, 2), (3, 1), (4, 2), (1, 1)):
            tokens = int(torch.randint(1, 4, (1,), generator=generator))
            assert propose(ids, tokens, max_ngram, min_ngram) == _reference_draft(ids, tokens, max_ngram, min_ngram), ids


def _counting_forwards(monkeypatch) -> list[int]:
    """Record the number of rows of every forward the session runs."""
    import kvmemory.session as session_module

    rows: list[int] = []

    def counted(model, cache, ids, start, **kwargs):
        rows.append(ids.shape[0])
        return forward_rows(model, cache, ids, start, **kwargs)

    monkeypatch.setattr(session_module, "forward_rows", counted)
    return rows


def _answer(lm, messages, lookup: int, tokens: int = 48, processor=None):
    session = KVSession(lm.model, lm.tokenizer, prompt_lookup=lookup)
    session.prepare(messages)
    return session, session.generate(tokens, logits_processor=processor)


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded("lookup")


def test_tiny_greedy_answer_is_the_same_with_fewer_forwards(tiny, monkeypatch):
    plain_session, plain = _answer(tiny, history(), 0)
    rows = _counting_forwards(monkeypatch)
    session, drafted = _answer(tiny, history(), 4)
    assert drafted.token_ids == plain.token_ids
    assert len(rows) < len(drafted.token_ids)  # a random tiny model repeats itself: drafts are accepted
    assert max(rows) > 1
    session.check_invariants()
    assert session.token_ids == plain_session.token_ids
    for (k, v), (k2, v2) in zip(kvcache.layer_tensors(session.cache), kvcache.layer_tensors(plain_session.cache)):
        torch.testing.assert_close(k, k2, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, v2, atol=1e-5, rtol=0)


def test_a_logits_processor_sees_what_one_token_decoding_shows_it(tiny):
    def recorder(calls):
        def processor(input_ids, scores):
            calls.append((input_ids[0].tolist(), scores.argmax().item()))
            scores = scores.clone()
            scores[..., 7] = float("-inf")  # a constraint: never token 7
            return scores
        return processor

    plain_calls, drafted_calls = [], []
    _, plain = _answer(tiny, history(), 0, processor=recorder(plain_calls))
    _, drafted = _answer(tiny, history(), 4, processor=recorder(drafted_calls))
    assert drafted.token_ids == plain.token_ids and 7 not in drafted.token_ids
    assert drafted_calls == plain_calls


@pytest.mark.parametrize("taken", [1, 2, 5])
def test_a_stream_closed_inside_a_draft_keeps_exactly_the_streamed_tokens(tiny, taken):
    _, plain = _answer(tiny, history(), 0)
    session = KVSession(tiny.model, tiny.tokenizer, prompt_lookup=4)
    session.prepare(history())
    prompt = len(session.token_ids)
    stream = session.stream_tokens(48)
    got = [next(stream) for _ in range(taken)]
    stream.close()
    assert got == plain.token_ids[:taken]
    assert session.token_ids[prompt:] == got
    session.check_invariants()
    torch.testing.assert_close(session.next_logits, reprefill_logits(tiny.model, session.token_ids), atol=1e-4, rtol=0)
    rest = session.generate(48 - taken).token_ids
    assert got + rest == plain.token_ids


def test_sampling_and_quantized_caches_decode_one_token_per_forward(tiny, monkeypatch):
    rows = _counting_forwards(monkeypatch)
    session = KVSession(tiny.model, tiny.tokenizer, prompt_lookup=4)
    session.prepare(history())
    session.generate(12, temperature=0.8, seed=3)
    quantized = KVSession(tiny.model, tiny.tokenizer, prompt_lookup=4,
                          cache_factory=lambda config: QuantizedCache("fp8", config))
    quantized.prepare(history())
    rows.clear()
    quantized.generate(12)  # rows of a quantized cache cannot be dropped: no draft to check
    assert set(rows) == {1}


def test_bad_prompt_lookup_values_say_what_to_pass(tiny):
    session = KVSession(tiny.model, tiny.tokenizer)
    for bad in (-1, 2.5, True, "3", None):
        with pytest.raises((InputError, InputTypeError), match="prompt_lookup must be an int >= 0"):
            KVSession(tiny.model, tiny.tokenizer, prompt_lookup=bad)
        with pytest.raises((InputError, InputTypeError), match="prompt_lookup must be an int >= 0"):
            session.prompt_lookup = bad  # settable later, checked the same way
    assert session.prompt_lookup == 2


def test_a_stream_left_suspended_is_closed_by_the_next_call(tiny):
    _, plain = _answer(tiny, history(), 0, tokens=12)
    session = KVSession(tiny.model, tiny.tokenizer, prompt_lookup=4)
    session.prepare(history())
    prompt = len(session.token_ids)
    stream = session.stream_tokens(48)
    for i, _ in enumerate(stream):
        if i == 3:
            break  # the generator stays alive (and suspended) in `stream`
    session.check_invariants()  # closes it first: exactly the 4 streamed tokens are cached
    assert session.token_ids[prompt:] == plain.token_ids[:4]
    assert session.generate(8).token_ids == plain.token_ids[4:12]
    again = session.stream_tokens(8)
    next(again)
    fork = session.fork()  # closes it too: both copies hold the same answered rows
    assert fork.token_ids == session.token_ids
    fork.check_invariants()
    del stream, again  # closing them now changes nothing
    session.check_invariants()


def test_engine_rows_of_a_draft_equal_transformers_at_every_position(real):
    ids = torch.tensor(real.tokenizer(" ".join(m["content"] for m in history()), add_special_tokens=False)["input_ids"][:90])
    fast = kvcache.new_cache(real.model.config)
    assert engine.engine_for(real.model, fast).kind == "q4_1"
    forward_rows(real.model, fast, ids[:80], 0)
    rows = forward_rows(real.model, fast, ids[80:90], 80, every_row=True)
    assert rows.shape == (10, real.model.config.vocab_size)
    with torch.no_grad():
        ref = real.model(input_ids=ids[None]).logits[0, 80:90].float()
    torch.testing.assert_close(rows, ref, atol=LOGITS_ATOL, rtol=0)


def test_real_model_agent_answer_is_the_same_with_fewer_forwards(real, monkeypatch):
    messages = history() + [{"role": "user", "content": "Repeat the last tool result word for word.", "id": "q2"}]
    plain_session, plain = _answer(real, messages, 0)
    rows = _counting_forwards(monkeypatch)
    session, drafted = _answer(real, messages, 3)
    assert drafted.token_ids == plain.token_ids
    assert len(rows) < 0.8 * len(drafted.token_ids)  # it quotes its context: most drafts are accepted
    session.check_invariants()
    assert session.token_ids == plain_session.token_ids
    for (k, v), (k2, v2) in zip(kvcache.layer_tensors(session.cache), kvcache.layer_tensors(plain_session.cache)):
        torch.testing.assert_close(k, k2, atol=1e-4, rtol=0)
        torch.testing.assert_close(v, v2, atol=1e-4, rtol=0)


def test_real_model_with_a_lora_adapter_keeps_its_boundary_rows_in_step(real_lora, real, monkeypatch):
    rows = _counting_forwards(monkeypatch)
    session = KVSession(real.model, real.tokenizer, prompt_lookup=3)
    session.prepare(history() + [QUERY])
    answer = session.generate(24)
    assert max(rows) > 1 and answer.token_ids  # drafts were checked on the adapter (transformers) path
    session.check_invariants()
    for boundary in session.reforge.boundaries.states.values():
        assert boundary.hidden.shape[1] == len(session.token_ids)
