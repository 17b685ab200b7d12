"""A repaired cache is not repaired again: identical and append-only requests cost only their new
tokens (stale rows an earlier repair paid for are kept, and still reported stale), a new edit
charges its allowance on its own suffix, ``reprefill`` names what happens on an edit (forced
with ``reprefill:always``), and sliding-window models serve repeats without a fallback."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from peft import LoraConfig, get_peft_model
from pydantic import ValidationError

from kvmemory import kvcache
from kvmemory.policy import RepairPolicy
from kvmemory.selection import allowance
from kvmemory.session import KVSession
from support import QUERY, history, replaced, reprefill_logits, tiny_model, without

TOL = 1e-4  # fp32 logits: equality with Re-prefill
EDIT = without(history(), "a2", "t2") + [QUERY]
TURN = EDIT + [{"role": "assistant", "content": "Helmsford.", "id": "ans"},
               {"role": "user", "content": "And when was she born?", "id": "q2"}]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def repaired(model, tokenizer, policy="sur@5") -> KVSession:
    """A session after a sparse repair: stale rows after ``exact_rows``."""
    s = KVSession(model, tokenizer, policy)
    s.prepare(history() + [QUERY])
    report = s.prepare(EDIT)
    assert 0 < report.refreshed_tokens < report.stale_tokens and s.exact_rows < len(s.token_ids)
    return s


def rows(session: KVSession) -> list[torch.Tensor]:
    return [t.clone() for kv in kvcache.layer_tensors(session.cache) for t in kv]


def end_answer_at_once(session: KVSession) -> None:
    """Decode an empty answer: the end-of-turn token is picked first, so no row is added and
    ``next_logits`` become None (the cache still holds exactly the prompt)."""
    eos = min(session.stop_token_ids())

    def force_eos(ids, scores):
        scores = torch.full_like(scores, -1e9)
        scores[:, eos] = 0.0
        return scores

    n = len(session.token_ids)
    gen = session.generate(4, logits_processor=force_eos)
    assert gen.token_ids == [] and session.next_logits is None and len(session.token_ids) == n


# ------------------------------------------------------------ after a sparse repair
def test_identical_request_after_sparse_repair_refreshes_nothing(llama, tokenizer):
    s = repaired(llama, tokenizer)
    n, exact, logits, before = len(s.token_ids), s.exact_rows, s.next_logits.clone(), rows(s)
    report = s.prepare(EDIT)
    assert (report.recomputed_tokens, report.refreshed_tokens, report.stale_tokens) == (0, 0, 0)
    assert report.reused_tokens == n and report.kept_stale_tokens == n - exact and report.fallback is None
    assert s.exact_rows == exact  # the kept rows are still stale, and say so
    assert torch.equal(s.next_logits, logits)
    assert all(torch.equal(a, b) for a, b in zip(before, rows(s)))
    s.check_invariants()


def test_a_restored_cache_keeps_its_repair_budget(llama, tokenizer):
    """An exported state says what its stale rows were repaired under: the restored thread does
    not refresh them again on an identical request."""
    from kvmemory.persistence import CacheState
    from kvmemory.threads import ThreadCaches

    reg = ThreadCaches(llama, tokenizer, "sur@5")
    with reg.lease("a") as s:
        s.prepare(history() + [QUERY])
        s.prepare(EDIT)
    state = reg.export_state("a")
    state = CacheState.from_parts(state.tensors(), state.metadata())
    assert state.stale_budget == 5.0
    restored = ThreadCaches(llama, tokenizer, "sur@5").import_state("b", state)
    report = restored.prepare(EDIT)
    assert (report.recomputed_tokens, report.refreshed_tokens) == (0, 0) and report.kept_stale_tokens > 0


def test_identical_request_after_an_ended_answer_needs_no_forward(llama, tokenizer):
    s = repaired(llama, tokenizer)
    logits = s.next_logits.clone()
    end_answer_at_once(s)
    report = s.prepare(EDIT)
    assert report.recomputed_tokens == 0 and report.refreshed_tokens == 0 and report.fallback is None
    assert torch.equal(s.next_logits, logits)


def test_append_after_sparse_repair_prefills_only_new_tokens(llama, tokenizer):
    s = repaired(llama, tokenizer)
    n, exact = len(s.token_ids), s.exact_rows
    stale = s.fork()
    report = s.prepare(TURN)
    assert report.reused_tokens == n and report.recomputed_tokens == len(s.token_ids) - n > 0
    assert report.refreshed_tokens == 0 and report.stale_tokens == 0 and report.kept_stale_tokens == n - exact
    assert s.exact_rows == exact  # appended rows attend to stale rows: not exact either
    # the new rows are exactly the new tokens forwarded on the repaired cache
    ref = stale.model(input_ids=torch.tensor([s.token_ids[n:]]), position_ids=torch.arange(n, len(s.token_ids))[None],
                      cache=stale.cache, use_cache=True).logits[0, -1].float()
    torch.testing.assert_close(s.next_logits, ref, atol=TOL, rtol=0)
    s.check_invariants()
    # a b = 100 % repair afterwards still recomputes every stale row and equals Re-prefill
    report = s.prepare(TURN, policy="replay")
    assert report.reused_tokens == exact and s.exact_rows == len(s.token_ids)
    torch.testing.assert_close(s.next_logits, reprefill_logits(llama, s.token_ids), atol=TOL, rtol=0)


def test_a_policy_that_asks_for_more_refreshes_the_stale_rows_again(llama, tokenizer):
    s = repaired(llama, tokenizer, "sur@5")
    n, exact = len(s.token_ids), s.exact_rows
    more = s.prepare(EDIT, policy="sur@20")  # higher budget: every stale row is in the suffix again
    assert more.stale_tokens == n - exact and more.kept_stale_tokens == 0
    assert more.refreshed_tokens == allowance(n - exact, 20)
    assert s.prepare(EDIT, policy="sur@5").refreshed_tokens == 0  # repaired under 20 % >= 5 %
    assert s.prepare(EDIT, policy="sur@20").refreshed_tokens == 0
    assert s.prepare(EDIT, policy="shift").recomputed_tokens == 0
    exact_again = s.prepare(EDIT, policy="replay")
    assert exact_again.reused_tokens == exact and s.exact_rows == n
    torch.testing.assert_close(s.next_logits, reprefill_logits(llama, s.token_ids), atol=TOL, rtol=0)
    assert s.prepare(EDIT).recomputed_tokens == 0  # exact now: nothing to repair for any policy


def test_a_new_edit_charges_its_allowance_on_its_own_suffix(llama, tokenizer):
    """The second edit's suffix s is what follows its own first edit point f (the query's rows);
    the stale rows before f, paid for by the first edit, are kept and not charged again."""
    s = repaired(llama, tokenizer, "sur@5")
    exact, cached = s.exact_rows, list(s.token_ids)
    report = s.prepare(replaced(EDIT, "t3", "Ilse Marrow was born in Helmsford."))
    f = next(i for i, (a, b) in enumerate(zip(cached, s.token_ids)) if a != b)
    query = next(seg for seg in s.rendered.segments if seg.key == "q")
    assert report.kept_stale_tokens == f - exact > 0
    assert report.stale_tokens == query.token_end - query.token_start  # only rows after f are s
    assert report.refreshed_tokens == allowance(report.stale_tokens, 5)
    assert all(a >= f for a, _ in report.spans)  # no kept stale row is recomputed
    assert s.exact_rows == exact
    s.check_invariants()


# ------------------------------------------------------------ reprefill
def test_reprefill_policy_prefills_only_new_tokens_on_an_exact_cache(llama, tokenizer):
    s = KVSession(llama, tokenizer, "reprefill")
    first = s.prepare(EDIT)
    n = len(s.token_ids)
    assert first.recomputed_tokens == n
    assert s.prepare(EDIT).recomputed_tokens == 0  # identical
    append = s.prepare(TURN)  # the cache ends with the generation prompt the answer follows
    assert append.reused_tokens == n and append.recomputed_tokens == len(s.token_ids) - n
    assert append.operator == "reprefill" and append.fallback is None and s.exact_rows == len(s.token_ids)
    torch.testing.assert_close(s.next_logits, reprefill_logits(llama, s.token_ids), atol=TOL, rtol=0)
    # a tool result appended after a prompt nobody answered: the generation prompt's rows go
    cached = list(s.token_ids)
    tool = s.prepare(TURN + [{"role": "tool", "content": "1841", "id": "t4"}])
    f = next(i for i, (a, b) in enumerate(zip(cached, s.token_ids)) if a != b)
    assert tool.reused_tokens == f > len(cached) - 4 and tool.recomputed_tokens == len(s.token_ids) - f
    torch.testing.assert_close(s.next_logits, reprefill_logits(llama, s.token_ids), atol=TOL, rtol=0)
    edit = s.prepare(EDIT)  # an edit: the whole prompt
    assert edit.reused_tokens == 0 and edit.recomputed_tokens == len(s.token_ids)


def test_reprefill_after_a_sparse_repair_rebuilds_the_stale_cache(llama, tokenizer):
    s = repaired(llama, tokenizer)
    report = s.prepare(TURN, policy="reprefill")  # append-only, but rows are stale
    assert report.reused_tokens == 0 and report.recomputed_tokens == len(s.token_ids)
    assert s.exact_rows == len(s.token_ids)


def test_forced_reprefill_recomputes_everything(llama, tokenizer):
    s = KVSession(llama, tokenizer)
    s.prepare(history())
    forced = RepairPolicy.coerce("reprefill:always")
    assert forced == RepairPolicy(operator="reprefill", scope="always") and forced.label == "reprefill:always"
    for msgs in (history(), history() + [QUERY]):  # identical, then append-only
        report = s.prepare(msgs, policy=forced)
        assert report.reused_tokens == 0 and report.recomputed_tokens == report.prompt_tokens == len(s.token_ids)
        assert report.operator == "reprefill" and report.fallback is None
    with pytest.raises(ValidationError, match="operator='reprefill'"):
        RepairPolicy(operator="replay", scope="always")


# ------------------------------------------------------------ sliding windows
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _gemma3(window):
    config = tf.Gemma3TextConfig(**COMMON, sliding_window=window,
                                 layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _mistral(window):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(tf.MistralConfig(**COMMON, sliding_window=window),
                                               dtype=torch.float32).eval()


@pytest.mark.parametrize("build", [_gemma3, _mistral], ids=["gemma3", "mistral"])
@pytest.mark.parametrize("window", [64, 1024], ids=["beyond-window", "inside-window"])
def test_sliding_window_repeat_and_append_cost_only_new_tokens(build, window, tokenizer):
    model = build(window)  # the prompts have ~170-190 tokens: window 64 is well past
    s = KVSession(model, tokenizer)
    s.prepare(EDIT)
    n = len(s.token_ids)
    same = s.prepare(EDIT)
    assert same.fallback is None and same.recomputed_tokens == 0 and same.reused_tokens == n
    torch.testing.assert_close(s.next_logits, reprefill_logits(model, s.token_ids), atol=TOL, rtol=0)
    end_answer_at_once(s)  # next_logits None, cache = prompt: the kept last-row logits serve
    same = s.prepare(EDIT)
    assert same.fallback is None and same.recomputed_tokens == 0
    torch.testing.assert_close(s.next_logits, reprefill_logits(model, s.token_ids), atol=TOL, rtol=0)
    more = s.prepare(TURN)  # the answer after the generation prompt, then the next question
    assert more.fallback is None and more.reused_tokens == n and more.recomputed_tokens == len(s.token_ids) - n
    torch.testing.assert_close(s.next_logits, reprefill_logits(model, s.token_ids), atol=TOL, rtol=0)
    s.check_invariants()


# ------------------------------------------------------------ adapter updates
def test_kept_last_row_logits_are_not_served_after_an_adapter_update(tokenizer):
    """CacheReforge maintenance rewrites rows (and only pending next_logits): logits kept from
    before an update must not answer a repeat."""
    model = get_peft_model(tiny_model("llama", num_hidden_layers=4),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"], layers_to_transform=[2])).eval()
    s = KVSession(model, tokenizer, "sur@5")
    s.prepare(history())
    end_answer_at_once(s)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    s.maintain()  # what OnlineAdapter does for every live thread after a step
    s.prepare(history())
    torch.testing.assert_close(s.next_logits, reprefill_logits(model, s.token_ids), atol=TOL, rtol=0)


# ------------------------------------------------------------ real model
@pytest.mark.real_model
def test_real_model_identical_request_after_sur5_repair_is_not_refreshed(real):
    s = KVSession(real.model, real.tokenizer, "sur@5")
    s.prepare(history() + [QUERY])
    first = s.prepare(EDIT)
    assert first.refreshed_tokens == allowance(first.stale_tokens, 5) > 0
    logits = s.next_logits.clone()
    again = s.prepare(EDIT)
    assert (again.refreshed_tokens, again.recomputed_tokens, again.fallback) == (0, 0, None)
    assert again.reused_tokens == again.prompt_tokens and again.kept_stale_tokens == len(s.token_ids) - s.exact_rows > 0
    torch.testing.assert_close(s.next_logits, logits, atol=0, rtol=0)
