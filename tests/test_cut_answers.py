"""Answers cut by a stop sequence or by max_tokens stay in the live cache as the text the caller
got: the next turn, whose history holds that text, reuses their rows (a kept message, not new
text), the rows equal a Re-prefill of that history, and tokens decoded past a stop sequence are
not held as rows of the answer."""

from __future__ import annotations

import pytest
import torch
from langchain_core.messages import HumanMessage

from kvmemory import KVSession, kvcache
from kvmemory.prompt import normalize_messages, render_text
from langchain_kvmemory import ChatKVMemory
from langchain_kvmemory.messages import to_session_messages
from support import QUERY, history, reprefill_logits, tiny_model

ROWS_ATOL = 1e-4  # K/V rows against Re-prefill (as tests/test_engine.py)
LOGPROB_ATOL = 2e-3  # logits within 1e-3 (tests/test_engine.py) move a log-softmax by at most twice that
QUESTION = HumanMessage("What is the capital of France? Answer with one sentence.", id="q1")
FOLLOW_UP = HumanMessage("And of Italy?", id="q2")


def _ids(tokenizer, messages, *, generation_prompt: bool) -> list[int]:
    text = render_text(tokenizer, normalize_messages(to_session_messages(messages, False)),
                       generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _second_turn_reuses_the_cut_answer(real, thread: str, **cut):
    llm = ChatKVMemory(model=real, max_tokens=40, logprobs=True, top_logprobs=3)
    cfg = {"configurable": {"thread_id": thread}}
    first = llm.invoke([QUESTION], config=cfg, **cut)
    held = _ids(real.tokenizer, [QUESTION, first], generation_prompt=False)
    # the cache holds the prompt, the answer the caller got and its end-of-turn text: nothing decoded after a cut
    assert llm.threads.session(thread).token_ids == held

    turn = [QUESTION, first, FOLLOW_UP]
    second = llm.invoke(turn, config=cfg)
    repair = second.response_metadata["repair"]
    assert repair["edits"] == {"keep": 2, "append": 1}  # the answer is a kept message, not new text
    assert repair["fallback"] is None and repair["reused_tokens"] == len(held)
    assert second.usage_metadata["input_token_details"]["cache_read"] == len(held)
    assert repair["recomputed_tokens"] == second.usage_metadata["input_tokens"] - len(held)

    reference = llm.invoke(turn, config={"configurable": {"thread_id": thread + "-reprefill"}})
    assert reference.response_metadata["repair"]["reused_tokens"] == 0  # a fresh thread: Re-prefill
    assert second.content == reference.content
    got, want = (m.response_metadata["logprobs"]["content"] for m in (second, reference))
    for a, b in zip(got, want, strict=True):
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        for x, y in zip(a["top_logprobs"], b["top_logprobs"]):
            assert x["logprob"] == pytest.approx(y["logprob"], abs=LOGPROB_ATOL)
    live, fresh = llm.threads.session(thread), llm.threads.session(thread + "-reprefill")
    assert live.token_ids == fresh.token_ids
    for (k, v), (rk, rv) in zip(kvcache.layer_tensors(live.cache), kvcache.layer_tensors(fresh.cache)):
        torch.testing.assert_close(k, rk, atol=ROWS_ATOL, rtol=0)
        torch.testing.assert_close(v, rv, atol=ROWS_ATOL, rtol=0)
    return first


@pytest.mark.real_model
def test_an_answer_cut_at_a_stop_sequence_is_reused_next_turn(real):
    first = _second_turn_reuses_the_cut_answer(real, "cut-stop", stop=["Paris"])
    assert first.response_metadata["finish_reason"] == "stop"
    assert first.content and "Paris" not in first.content  # the stop sequence cut the answer


@pytest.mark.real_model
def test_an_answer_cut_by_max_tokens_is_reused_next_turn(real):
    first = _second_turn_reuses_the_cut_answer(real, "cut-length", max_tokens=5)
    assert first.response_metadata["finish_reason"] == "length" and first.usage_metadata["output_tokens"] == 5


@pytest.mark.real_model
def test_an_edit_before_a_cut_answer_shifts_its_rows_instead_of_recomputing_them(real):
    """The cut answer is a held message: an edit before it (a cleared passage) keeps its rows
    as stale rows repaired under the budget, not as new text computed again."""
    llm = ChatKVMemory(model=real, max_tokens=30, repair_policy="sur@5")
    cfg = {"configurable": {"thread_id": "cut-then-edit"}}
    passage = HumanMessage("Ostrava Nova was founded in 1873 by the engineer Ilse Marrow. It lies on the Mira "
                           "River. Its mill was the first in the valley. " * 3, id="passage")
    question = HumanMessage("Describe Ostrava Nova in detail.", id="q1")
    first = llm.invoke([passage, question], config=cfg)
    assert first.response_metadata["finish_reason"] == "length"
    cleared = HumanMessage("[cleared]", id="passage")
    second = llm.invoke([cleared, question, first, FOLLOW_UP], config=cfg)
    repair = second.response_metadata["repair"]
    assert repair["edits"] == {"keep": 2, "replace": 1, "append": 1} and repair["fallback"] is None
    assert repair["stale_tokens"] >= first.usage_metadata["output_tokens"]  # the answer's rows are reused
    assert repair["refreshed_tokens"] == -(-repair["stale_tokens"] * 5 // 100)  # B = ceil(S * b / 100)


# ------------------------------------------------------------------ KVSession.commit_answer
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_commit_answer_keeps_only_the_rows_of_the_text_given(family, tokenizer):
    """A stop cut inside the decoded tokens: the rows after the given text are dropped, the
    end-of-turn text computed, and the held rows equal a Re-prefill."""
    model = tiny_model(family)
    session = KVSession(model, tokenizer)
    session.prepare(history() + [QUERY])
    prompt = len(session.token_ids)
    answer = session.generate(6)
    assert answer.finish_reason == "length" and len(session.token_ids) == prompt + 6
    given = tokenizer.decode(answer.token_ids[:2], skip_special_tokens=True)  # the caller cut it after 2 tokens
    assert session.commit_answer({"role": "assistant", "content": given, "id": "cut"})
    session.check_invariants()
    assert session.answer_committed and session.next_logits is None and session.exact_rows == len(session.token_ids)
    fresh = KVSession(model, tokenizer)
    fresh.prepare(history() + [QUERY, {"role": "assistant", "content": given, "id": "cut"},
                               {"role": "user", "content": "Go on.", "id": "u9"}])
    report = session.prepare(history() + [QUERY, {"role": "assistant", "content": given, "id": "cut"},
                                          {"role": "user", "content": "Go on.", "id": "u9"}])
    assert report.edits.get("keep", 0) == len(history()) + 2 and session.token_ids == fresh.token_ids
    torch.testing.assert_close(session.next_logits, reprefill_logits(model, session.token_ids), atol=1e-4, rtol=0)
    for (k, v), (rk, rv) in zip(kvcache.layer_tensors(session.cache), kvcache.layer_tensors(fresh.cache)):
        torch.testing.assert_close(k, rk, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, rv, atol=1e-5, rtol=0)


def test_commit_answer_refuses_what_it_cannot_hold(tokenizer):
    session = KVSession(tiny_model("llama"), tokenizer)
    assert not session.commit_answer({"role": "assistant", "content": "hi"})  # nothing prepared
    session.prepare(history() + [QUERY])
    session.generate(3)
    assert session.commit_answer({"role": "assistant", "content": "hi", "id": "a"})
    held = list(session.token_ids)
    assert not session.commit_answer({"role": "assistant", "content": "again", "id": "b"})  # already held
    assert session.token_ids == held
