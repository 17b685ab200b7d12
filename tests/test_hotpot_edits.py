"""HotpotQA distractor-setting edit cases: length, the three edit kinds, support never edited, bench wiring."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvmemory_lab.bench.quality import _settings, add_arguments, build_cases
from kvmemory_lab.demo_cases import default_data_dir
from kvmemory_lab.evaluation.hotpot_edits import CLEARED, hotpot_edit_cases

DATA = default_data_dir() or Path("/work/shared/data")
needs_data = pytest.mark.skipif(not (DATA / "hotpotqa").is_dir(), reason="shared data folder not available")


def _tokens(tokenizer, messages):
    text = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                         tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@needs_data
def test_edit_cases_fit_the_length_and_edit_old_non_supporting_turns(tokenizer):
    cases = hotpot_edit_cases(DATA, tokenizer, lengths=(1024, 2048), sources_per_length=2, seed=5)
    assert len(cases) == 12 and [c.meta["edit"] for c in cases[:3]] == ["delete", "replace", "summary"]
    assert {c.meta["length"] for c in cases[:6]} == {1024, 2048}  # lengths interleave source by source
    for case in cases:
        length = case.meta["length"]
        dirty = case.dirty_messages() + [{"role": "user", "content": case.query}]
        assert length * 0.75 <= _tokens(tokenizer, dirty) <= length
        supports = [m for m in case.history if m["id"].startswith("support-")]
        assert len(supports) == 2
        edited = case.edited_messages()
        assert edited[-1]["id"] == "query" and all(m in edited for m in supports)  # gold stays answerable
        tools = [m for m in case.history if m["role"] == "tool"]
        old = tools[: case.meta["old_turns"]]
        assert not any(m["id"].startswith("support-") for m in old)
        if case.meta["edit"] == "delete":
            assert len(edited) == len(case.history) and case.meta["edited_id"] not in {m["id"] for m in edited}
        elif case.meta["edit"] == "replace":
            changed = [m for m in edited if m["content"] == CLEARED]
            assert [m["id"] for m in changed] == [case.meta["edited_id"]] and case.deleted == ()
        else:
            assert set(case.deleted) == {m["id"] for m in old}
            assert edited[2]["id"] == "summary" and edited[3] == tools[len(old)]
    # same seed, same cases; another seed, another draw of sources (at 2 K nearly every source fits)
    assert hotpot_edit_cases(DATA, tokenizer, (1024, 2048), 2, 5) == cases
    assert {c.source_id for c in hotpot_edit_cases(DATA, tokenizer, (2048,), 2, 6)} != {
        c.source_id for c in cases if c.meta["length"] == 2048}


@needs_data
def test_bench_quality_builds_edit_cases_from_its_flags(tokenizer):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = _settings(parser.parse_args(["--task", "qa", "--edits", "replace,summary", "--lengths", "1024", "--cases", "1"]))
    assert settings["edits"] == ["replace", "summary"]
    cases = build_cases(settings, DATA, tokenizer)
    assert [c.meta["edit"] for c in cases] == ["replace", "summary"]
    plain = _settings(parser.parse_args(["--task", "qa", "--cases", "1", "--datasets", "hotpotqa"]))
    assert plain["edits"] is None and all(c.edited_history is None for c in build_cases(plain, DATA, tokenizer))
