"""Sliding-window checkpoints: after an answer past the window, an identical repeated request
(or a turn whose rendering drops decoded rows) restores the window layers' rows at the prompt's
end instead of re-prefilling, and every result equals a Re-prefill (one plain forward of the
prompt without a cache)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from kvmemory.session import KVSession
from support import QUERY, history, reprefill_logits
from test_capability_gates import _gemma3, _mistral, needs_packaged_gemma

ATOL = 1e-4  # fp32
PROMPT = history() + [QUERY]  # ~200 tokens: past a 64-token window


def _answered(model, tokenizer, tokens: int = 8) -> tuple[KVSession, list[int]]:
    session = KVSession(model, tokenizer)
    first = session.prepare(PROMPT)
    assert first.recomputed_tokens == first.prompt_tokens > 64
    answer = session.generate(tokens, temperature=0.0).token_ids
    assert len(answer) == tokens  # the answer's rows pushed prompt rows out of the window
    return session, answer


@pytest.mark.parametrize("build", [_gemma3, _mistral], ids=["gemma3", "mistral"])
def test_an_identical_request_after_an_answer_past_the_window_reuses_the_prompt(build, tokenizer):
    model = build(64)
    session, answer = _answered(model, tokenizer)
    report = session.prepare(PROMPT)
    session.check_invariants()
    assert report.recomputed_tokens == 0 and report.reused_tokens == report.prompt_tokens
    assert report.fallback is None
    assert any("sliding-window checkpoint" in note for note in report.capability_notes)
    torch.testing.assert_close(session.next_logits, reprefill_logits(model, session.token_ids), atol=ATOL, rtol=0)
    assert session.generate(len(answer), temperature=0.0).token_ids == answer


@pytest.mark.parametrize("build", [_gemma3, _mistral], ids=["gemma3", "mistral"])
def test_a_turn_that_rewrites_the_answer_recomputes_only_from_the_prompts_end(build, tokenizer):
    model = build(64)
    session, _ = _answered(model, tokenizer)
    prompt_rows = len(session.token_ids) - 8
    turn = PROMPT + [{"role": "assistant", "content": "The founder was born in Brno.", "id": "a9"},
                     {"role": "user", "content": "And where is Port Calder?", "id": "u9"}]
    report = session.prepare(turn)
    session.check_invariants()
    assert report.fallback is None and report.reused_tokens == prompt_rows
    assert report.recomputed_tokens == report.prompt_tokens - prompt_rows
    torch.testing.assert_close(session.next_logits, reprefill_logits(model, session.token_ids), atol=ATOL, rtol=0)


def test_an_edit_before_the_prompts_end_still_reprefills_with_the_reason(tokenizer):
    model = _gemma3(64)
    session, _ = _answered(model, tokenizer)
    edited = [dict(m, content="A shorter system message.") if m["id"] == "sys" else m for m in PROMPT]
    report = session.prepare(edited)
    assert "Re-prefill" in report.fallback and report.recomputed_tokens == report.prompt_tokens
    torch.testing.assert_close(session.next_logits, reprefill_logits(model, session.token_ids), atol=ATOL, rtol=0)


def test_full_attention_models_keep_no_checkpoint(tokenizer):
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    session = KVSession(model, tokenizer)
    session.prepare(PROMPT)
    assert session._window_checkpoint is None


@pytest.mark.real_model
@needs_packaged_gemma
def test_packaged_gemma3_repeats_a_request_beyond_its_window_from_the_checkpoint():
    from kvmemory import load_model
    from test_capability_gates import _gemma_example

    example = _gemma_example()
    lm = load_model(example.model_dir())
    messages = example.conversation(16)
    session = KVSession(lm.model, lm.tokenizer)
    first = session.prepare(messages)
    assert first.prompt_tokens > 512  # past the 512-token window
    answer = session.generate(12, temperature=0.0).token_ids
    report = session.prepare(messages)
    assert report.recomputed_tokens == 0 and report.fallback is None
    torch.testing.assert_close(session.next_logits, reprefill_logits(lm.model, session.token_ids), atol=ATOL, rtol=0)
    assert session.generate(12, temperature=0.0).token_ids == answer
