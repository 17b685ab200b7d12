"""Edit fuzzing: the reduced fuzz profile finds no invariant violation, and
every invariant check can fail (each is shown catching a deliberately corrupted session)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmemory import kvcache
from kvmemory_lab.fuzz import MODELS, FuzzCase, ModelPool, Step, run_case, run_fuzz_profile, tiny_model
from kvmemory_lab.invariants import (
    check_session,
    fidelity_violations,
    memory_violations,
    registry_violations,
    segment_violations,
    state_violations,
    token_violations,
)
from kvmemory.session import KVSession
from kvmemory.persistence import export_state
from kvmemory.threads import ThreadCaches
from support import QUERY, history, without


@pytest.fixture(scope="module")
def pool(real):
    return ModelPool(real)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def edited_session(model, tokenizer, budget=5.0) -> KVSession:
    """A session holding a sparse repair (stale rows after the edit point)."""
    s = KVSession(model, tokenizer, f"sur@{budget:g}")
    s.prepare(history() + [QUERY])
    s.prepare(without(history(), "t2") + [QUERY])
    return s


# ----------------------------------------------------------------- profiles
def test_reduced_profile_on_tiny_models_finds_no_violation(pool):
    result = run_fuzz_profile("reduced", seed=0, models=MODELS[:-1], pool=pool)
    assert result["counterexamples"] == [] and result["ok"]
    assert result["invariant_violations"] == 0
    assert result["sequences_tried"] >= 4 * 6 and result["steps"] > result["sequences_tried"]
    assert set(result["models"]) == {"tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-llama-lora"}
    assert result["sparse_repairs"] > 0


@pytest.mark.real_model
def test_reduced_profile_on_the_embedded_model_finds_no_violation(pool):
    result = run_fuzz_profile("reduced", seed=0, models=("embedded",), pool=pool)
    assert result["counterexamples"] == [] and result["ok"]
    assert result["models"] == {"embedded": result["sequences_tried"]} and result["sequences_tried"] >= 2


@pytest.mark.real_model
def test_every_edit_kind_keeps_the_invariants_on_the_embedded_model(pool):
    case = FuzzCase("embedded", (("system", "You answer briefly."), ("user", "Where is Port Calder?"),
                                 ("assistant", "search('Port Calder')"),
                                 ("tool", "Port Calder has three lighthouses. The oldest was built in 1790.")),
                    (Step("delete", index=2, budget=5), Step("insert", index=1, role="tool", text="ok", budget=0),
                     Step("replace", index=1, text="Where is Ostrava Nova?", budget=50, executor="packed"),
                     Step("summarise", count=1, text="the user asked", allocator="bm25", budget=25),
                     Step("clear_tool", executor="sequential", budget=10), Step("generate", mode="append"),
                     Step("resend", mode="remove_all", budget=100), Step("append", role="tool", text="done")))
    result = run_case(case, pool)
    assert result.violations == [] and result.steps >= len(case.steps) + 1
    assert result.sparse_repairs >= 3  # stale rows were left and checked (b < 100 %)


def test_unknown_profile_or_model_is_refused():
    with pytest.raises(ValueError, match="reduced"):
        run_fuzz_profile("huge")
    with pytest.raises(ValueError, match="tiny-llama"):
        run_fuzz_profile("reduced", models=("gpt",))


def test_a_crash_inside_a_step_is_a_counterexample(pool, monkeypatch):
    def broken(self, *a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(KVSession, "generate", broken)
    result = run_case(FuzzCase("tiny-llama", (("system", "hi"),), (Step("generate"),)), pool)
    assert result.violations == [(1, "crash: RuntimeError: boom")]


# ------------------------------------------- each invariant check can fail
def test_clean_session_passes_every_check(llama, tokenizer):
    s = edited_session(llama, tokenizer)
    assert check_session(s, without(history(), "t2") + [QUERY]) == []


def test_token_check_reports_a_corrupted_token_id(llama, tokenizer):
    s = edited_session(llama, tokenizer)
    s.token_ids[7] = (s.token_ids[7] + 1) % 49152
    assert any("cached ids differ" in v and "token 7" in v for v in token_violations(s))


def test_token_check_reports_messages_other_than_the_caller_sent(llama, tokenizer):
    s = edited_session(llama, tokenizer)
    found = token_violations(s, history() + [QUERY])  # the caller deleted t2; the session did too
    assert found and found[0].startswith("(a) the session holds")


def test_token_check_reports_a_missing_cache_row(llama, tokenizer):
    s = edited_session(llama, tokenizer)
    kvcache.crop_to(s.cache, len(s.token_ids) - 1)
    assert any("rows for" in v for v in token_violations(s))


def test_segment_check_reports_a_moved_boundary(llama, tokenizer):
    s = edited_session(llama, tokenizer)
    segs = list(s.rendered.segments)
    segs[2] = dataclasses.replace(segs[2], token_end=segs[2].token_end - 1)
    s.rendered = dataclasses.replace(s.rendered, segments=tuple(segs))
    found = segment_violations(s)
    assert any("segment 3 starts at token" in v for v in found)
    assert any("fresh rendering" in v for v in found)


def test_segment_check_reports_a_missing_segment(llama, tokenizer):
    s = edited_session(llama, tokenizer)
    s.rendered = dataclasses.replace(s.rendered, segments=s.rendered.segments[:-1])
    assert any("segments for" in v for v in segment_violations(s))


def test_memory_check_reports_a_view_of_a_larger_storage(llama, tokenizer, monkeypatch):
    from kvmemory import kvcache

    s = edited_session(llama, tokenizer)
    layer = s.cache.layers[0]
    layer.keys = torch.cat([layer.keys, layer.keys], dim=2)[:, :, : layer.keys.shape[2]]  # same shape, 2x storage
    assert memory_violations(s) == []  # memory_bytes counts whole storages (the engine's buffers are such views)
    monkeypatch.setattr(kvcache, "cache_nbytes", lambda cache: sum(  # counting only the visible rows undercounts
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)))
    found = memory_violations(s)
    assert found and "memory_bytes reports" in found[0]


def test_memory_check_counts_cachereforge_boundary_states(llama, tokenizer, monkeypatch):
    from kvmemory.reforge.restart import Boundary
    from kvmemory.reforge.state import ReforgeState

    s = edited_session(llama, tokenizer)
    s.reforge.boundaries.states[1] = Boundary(torch.zeros(1, len(s.token_ids), 64), None)
    assert memory_violations(s) == []  # memory_bytes counts them
    monkeypatch.setattr(ReforgeState, "boundary_bytes", property(lambda self: 0))  # the bug fixed in session.py
    found = memory_violations(s)
    assert found and "memory_bytes reports" in found[0]


def test_registry_and_state_checks_report_wrong_accounting(llama, tokenizer, monkeypatch):
    caches = ThreadCaches(llama, tokenizer)
    with caches.lease("a") as s:
        s.prepare(history())
    assert registry_violations(caches) == []
    state = export_state(caches.session("a"))
    assert state_violations(state) == []
    state.layers[0] = (torch.cat([state.layers[0][0]] * 2, dim=2)[:, :, : len(state.token_ids)], state.layers[0][1])
    assert state_violations(state)
    monkeypatch.setattr(ThreadCaches, "memory_bytes", property(lambda self: 1))
    assert any("ThreadCaches.memory_bytes" in v for v in registry_violations(caches))


def test_fidelity_check_reports_a_corrupted_exact_row(llama, tokenizer):
    s = edited_session(llama, tokenizer)
    assert 0 < s.exact_rows < len(s.token_ids)
    s.cache.layers[1].values[0, 0, s.exact_rows - 1, 0] += 1e-3
    found = fidelity_violations(s)
    assert any("claimed exact differ" in v for v in found)


def test_fidelity_check_reports_wrong_full_budget_logits(llama, tokenizer, monkeypatch):
    import kvmemory.repair as repair_module

    real_replay = repair_module._replay

    def off_by_a_bit(*args):
        result = real_replay(*args)
        result.next_logits[5] += 1e-3
        return result

    s = edited_session(llama, tokenizer)
    monkeypatch.setattr(repair_module, "_replay", off_by_a_bit)
    found = fidelity_violations(s)
    assert any("logits differ from Re-prefill" in v for v in found)


def test_fidelity_check_reports_an_overstated_exact_prefix(llama, tokenizer):
    s = edited_session(llama, tokenizer, budget=0)
    s.exact_rows = len(s.token_ids)  # claims the Shifted rows are exact
    assert any("claimed exact differ" in v for v in fidelity_violations(s))



def test_two_committed_answers_in_a_row(pool, monkeypatch):
    # the harness prepares a new turn when the last answer ended (generate would refuse)
    stop = pool.get("tiny-llama")[1].eos_token_id
    monkeypatch.setattr("kvmemory.session._pick", lambda logits, temperature, generator: stop)
    case = FuzzCase("tiny-llama", (("system", "hi"), ("user", "Say ok.")),
                    (Step("generate", mode="commit"), Step("generate", mode="commit")))
    result = run_case(case, pool)
    assert result.violations == [] and result.steps == 6  # prepare + (generate, commit) + (prepare, generate, commit)
