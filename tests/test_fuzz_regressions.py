"""Counterexamples the edit fuzzer (kvmemory_lab.fuzz) found, each kept as a regression test.

Each case is the shrunk sequence hypothesis reported, replayed with ``run_case`` (every
invariant of kvmemory_lab.invariants checked after every step), plus a direct test of the fixed
function where that is clearer."""

from __future__ import annotations

import pytest

from kvmemory_lab.fuzz import FuzzCase, ModelPool, Step, run_case
from kvmemory.prompt import normalize_messages, render_prompt
from kvmemory.session import KVSession


@pytest.fixture(scope="module")
def pool(real):
    return ModelPool(real)


def test_deleting_the_system_message_keeps_the_first_segment_at_char_0(pool):
    # Found with seed 1 on all three tiny models. SmolLM2's template writes a default system
    # prompt when the first message is not a system message; after deleting the system message
    # the remaining messages were an unchanged tail of the previous rendering, and the reused
    # boundaries moved message 0's start past that preamble (segment 0 began at char 98).
    question = "Where was the founder of Ostrava Nova born?"
    case = FuzzCase("tiny-llama", (("system", question), ("user", question)),
                    (Step(op="delete", index=0, budget=0.0, allocator="sur", executor="auto"),))
    assert run_case(case, pool).violations == []


def test_reused_tail_bounds_equal_a_fresh_rendering(tokenizer):
    before = normalize_messages([{"role": "system", "content": "Be brief.", "id": "s"},
                                 {"role": "user", "content": "Hi there", "id": "u"},
                                 {"role": "assistant", "content": "Hello", "id": "a"}])
    previous = render_prompt(tokenizer, before)
    after = before[1:]
    reused = render_prompt(tokenizer, after, previous=previous)
    fresh = render_prompt(tokenizer, after)
    assert reused.segments == fresh.segments
    assert reused.segments[0].char_start == 0 and reused.text.startswith("<|im_start|>system")


def test_memory_bytes_counts_cachereforge_boundary_states(pool):
    # Found by invariant (c) once the fuzzer ran a LoRA model: KVSession.memory_bytes (and so
    # ThreadCaches' memory budget) counted only K/V, not the boundary states CacheReforge
    # retains for every cached row (here 8,448 B next to 33,792 B of K/V, a 25 % undercount).
    case = FuzzCase("tiny-llama-lora", (("system", "hi"), ("user", "Where is it?")),
                    (Step(op="append", role="tool", text="Port Calder has three lighthouses."),))
    result = run_case(case, pool)
    assert result.violations == []
    model, tokenizer = pool.get("tiny-llama-lora")
    session = KVSession(model, tokenizer)
    session.prepare([{"role": "user", "content": "Where is Port Calder?"}])
    assert session.reforge.boundary_bytes > 0
    assert session.memory_bytes == sum(t.numel() * t.element_size() for t in _session_tensors(session))


def _session_tensors(session):
    kv = [t for layer in session.cache.layers for t in (layer.keys, layer.values)]
    return kv + [b.hidden for b in session.reforge.boundaries.states.values()]


@pytest.mark.parametrize("allocator", ["prophetkv", "infoflow", "a3", "sur"])
def test_resending_after_a_sparse_repair_with_a_query_attention_allocator(pool, allocator):
    # Found in the full profile (tiny-llama, shrunk). Step 1 repairs at b = 0, so rows from the
    # edit point to the end are stale, the last prompt row included. Step 2 resends the same
    # messages: the stale run reached the last position, the query after it was empty, and
    # ProphetKV / InfoFlow / A3 forwarded 0 tokens (RuntimeError in the attention reshape).
    # The last position is recomputed anyway, so it is no longer offered to the allocators.
    question = "Where was the founder of Ostrava Nova born?"
    case = FuzzCase("tiny-llama", (("system", question), ("user", question), ("user", question)),
                    (Step(op="delete", index=0, budget=0.0),
                     Step(op="replace", text=question, index=0, budget=2.0, allocator=allocator)))
    result = run_case(case, pool)
    assert result.violations == [] and result.sparse_repairs == 2
