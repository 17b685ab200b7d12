"""Thread registry: isolation between threads, LRU eviction under a byte budget, and the
export / import of a thread's cache state."""

from __future__ import annotations

import pytest
import torch

from kvmemory import kvcache
from kvmemory.errors import CacheStateError
from kvmemory.persistence import CacheState
from kvmemory.threads import ThreadCaches
from support import QUERY, history, replaced, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _snapshot(session):
    return [(k.clone(), v.clone()) for k, v in kvcache.layer_tensors(session.cache)]


def _identical(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(k1, k2) and torch.equal(v1, v2) for (k1, v1), (k2, v2) in zip(a, b))


def test_one_threads_repair_leaves_another_threads_cache_bit_identical(llama, tokenizer):
    reg = ThreadCaches(llama, tokenizer, "sur@50")
    with reg.lease("a") as a:
        a.prepare(history() + [QUERY])
    with reg.lease("b") as b:
        b.prepare(history() + [QUERY])
        b.generate(4)
    before, ids_before = _snapshot(reg.session("b")), list(reg.session("b").token_ids)
    with reg.lease("a") as a:
        report = a.prepare(replaced(history(), "t1", "[cleared]") + [QUERY])  # mid-history edit
        a.generate(4)
    assert report.refreshed_tokens > 0 and report.stale_tokens > 0  # a real sparse repair ran
    assert _identical(before, _snapshot(reg.session("b")))
    assert reg.session("b").token_ids == ids_before
    # and the two threads do not share storage
    pa, pb = reg.session("a").cache.layers[0].keys, reg.session("b").cache.layers[0].keys
    assert pa.untyped_storage().data_ptr() != pb.untyped_storage().data_ptr()


def test_lru_eviction_keeps_the_budget_and_drops_the_oldest_idle_thread(llama, tokenizer):
    evicted = []
    probe = ThreadCaches(llama, tokenizer)
    with probe.lease("x") as s:
        s.prepare(history())
    one = probe.memory_bytes
    reg = ThreadCaches(llama, tokenizer, memory_budget_bytes=int(2.5 * one),
                       on_evict=lambda tid, session: evicted.append((tid, session.memory_bytes)))
    for tid in ("t1", "t2", "t3"):
        with reg.lease(tid) as s:
            s.prepare(history())
    assert reg.thread_ids == ["t2", "t3"] and evicted == [("t1", one)]
    with reg.lease("t2") as s:  # t2 becomes the most recent; t3 is now the oldest
        s.prepare(history() + [QUERY])
    with reg.lease("t4") as s:
        s.prepare(history())
    assert "t3" not in reg and reg.thread_ids == ["t2", "t4"]
    assert reg.memory_bytes <= reg.memory_budget_bytes and reg.evictions == 2


def test_a_thread_larger_than_the_budget_is_dropped_after_its_call(llama, tokenizer, caplog):
    reg = ThreadCaches(llama, tokenizer, memory_budget_bytes=1000)
    with reg.lease("big") as s:
        s.prepare(history())
        assert s.memory_bytes > 1000  # still usable during the call
    assert "big" not in reg and "more than the whole budget" in caplog.text


def test_export_import_round_trip_reuses_every_row(llama, tokenizer):
    reg = ThreadCaches(llama, tokenizer, model_name="tiny-llama")
    with reg.lease("a") as s:
        s.prepare(history())
        answer = s.generate(3)
    state = reg.export_state("a")
    restored = CacheState.from_parts(state.tensors(), state.metadata())  # what a safetensors file holds
    other = ThreadCaches(llama, tokenizer, model_name="tiny-llama")
    session = other.import_state("a", restored)
    assert session.token_ids == reg.session("a").token_ids
    assert _identical(_snapshot(session), _snapshot(reg.session("a")))
    session.check_invariants()
    turn = history() + [{"role": "assistant", "content": answer.text}, QUERY]
    report = session.prepare(turn)
    # every prompt row is served from the imported cache (the last may merge with random answer text)
    assert report.reused_tokens >= len(reg.session("a").rendered) - 1 and report.fallback is None


def test_export_is_detached_from_later_repairs(llama, tokenizer):
    reg = ThreadCaches(llama, tokenizer, "sur@50")
    with reg.lease("a") as s:
        s.prepare(history() + [QUERY])
    state = reg.export_state("a")
    keys0 = state.layers[0][0].clone()
    with reg.lease("a") as s:
        s.prepare(replaced(history(), "t1", "[cleared]") + [QUERY])
    assert torch.equal(state.layers[0][0], keys0)


def test_import_rejects_states_that_do_not_fit(llama, tokenizer):
    reg = ThreadCaches(llama, tokenizer, model_name="tiny-llama")
    with reg.lease("a") as s:
        s.prepare(history())
    state = reg.export_state("a")
    wrong_ids = CacheState(**{**state.__dict__, "token_ids": [state.token_ids[0] + 7] + state.token_ids[1:]})
    with pytest.raises(CacheStateError, match="tokenization"):
        reg.import_state("b", wrong_ids)
    wrong_shape = CacheState(**{**state.__dict__, "layers": [(k[:, :1], v[:, :1]) for k, v in state.layers]})
    with pytest.raises(CacheStateError, match="shape"):
        reg.import_state("b", wrong_shape)
    with pytest.raises(CacheStateError, match="layers"):
        reg.import_state("b", CacheState(**{**state.__dict__, "layers": state.layers[:1]}))
    with pytest.raises(CacheStateError, match="computed by"):
        reg.import_state("b", CacheState(**{**state.__dict__, "model_name": "other"}))
    with pytest.raises(CacheStateError, match="format"):
        CacheState.from_parts(state.tensors(), {**state.metadata(), "format": "x"})
    truncated = state.tensors()
    del truncated["layers.1.values"]
    with pytest.raises(CacheStateError, match="incomplete"):
        CacheState.from_parts(truncated, state.metadata())
    assert reg.session("b").token_ids == []  # a failed import leaves the thread empty, not wrong


def test_bad_thread_ids_and_budgets_are_refused(llama, tokenizer):
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        ThreadCaches(llama, tokenizer, memory_budget_bytes=-1)
    reg = ThreadCaches(llama, tokenizer)
    with pytest.raises(TypeError, match="thread_id"):
        reg.session(None)


@pytest.mark.real_model
def test_real_model_threads_are_isolated_and_round_trip(real):
    reg = ThreadCaches(real.model, real.tokenizer, "sur@5", model_name=real.name)
    for tid in ("a", "b"):
        with reg.lease(tid) as s:
            s.prepare(history() + [QUERY])
    before = _snapshot(reg.session("b"))
    with reg.lease("a") as s:
        report = s.prepare(replaced(history(), "t2", "[cleared]") + [QUERY])
    assert report.operator == "refresh" and report.refreshed_tokens > 0
    assert _identical(before, _snapshot(reg.session("b")))
    state = reg.export_state("a")
    fresh = ThreadCaches(real.model, real.tokenizer, model_name=real.name)
    s = fresh.import_state("a", CacheState.from_parts(state.tensors(), state.metadata()))
    assert torch.allclose(s.next_logits, reg.session("a").next_logits)
    assert s.generate(6).text == reg.session("a").fork().generate(6).text
