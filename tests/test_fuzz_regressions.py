"""Counterexamples the edit fuzzer (kvmemory.fuzz) found, each kept as a regression test.

Each case is the shrunk sequence hypothesis reported, replayed with ``run_case`` (every
invariant of kvmemory.invariants checked after every step), plus a direct test of the fixed
function where that is clearer."""

from __future__ import annotations

import pytest

from kvmemory.fuzz import FuzzCase, ModelPool, Step, run_case
from kvmemory.prompt import normalize_messages, render_prompt


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
