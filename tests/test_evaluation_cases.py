"""Case builders of the fidelity evaluation: Erasing-NIAH spans, exact lengths, gold lists; QA pairing."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmemory_lab.demo_cases import default_data_dir
from kvmemory_lab.evaluation import QA_DATASETS, niah_cases, qa_cases
from kvmemory_lab.evaluation.niah import needle_text
from kvmemory.prompt import normalize_messages, render_prompt

DATA = default_data_dir() or Path("/work/shared/data")
needs_data = pytest.mark.skipif(not (DATA / "niah_haystack").is_dir(), reason="shared data folder not available")


@needs_data
def test_niah_cases_spans_lengths_and_gold(tokenizer):
    cases = niah_cases(DATA, tokenizer, lengths=(512, 1024), per_length=5, seed=3)
    assert [c.meta["length"] for c in cases[:4]] == [512, 1024, 512, 1024]  # lengths interleave
    short = [c for c in cases if c.meta["length"] == 512]
    assert [c.meta["variant"] for c in short] == ["needle-0", "needle-1", "needle-1", "needle-0", "control"]
    assert [c.meta["deleted_depth"] for c in short[:4]] == ["early", "late", "early", "late"]
    for c in cases:
        length = c.meta["length"]
        full = c.history + ({"role": "user", "content": c.query, "id": "query"},)
        rendered = render_prompt(tokenizer, normalize_messages(list(full)))
        # exact length: the recorded count is the tokenizer's, within the target, cut at a sentence
        assert c.meta["prompt_tokens"] == len(rendered) <= length
        assert len(rendered) > length - 96 - 16, "the haystack fills the target up to one sentence (+ template)"
        values = c.meta["values"]
        assert len(set(values)) == 2 and all(len(v) == 7 and v.isdigit() for v in values)
        # every recorded span holds the message it names
        for key, (a, b) in c.meta["spans"].items():
            text = tokenizer.decode(rendered.token_ids[a:b])
            if key.startswith("needle"):
                assert needle_text(c.meta["key"], values[int(key[-1])]) in text
        assert c.meta["spans"]["needle-0"][0] < c.meta["spans"]["needle-1"][0]
        assert c.meta["deleted_span"] == c.meta["spans"][c.deleted[0]]
        if c.meta["variant"] == "control":
            assert c.gold == tuple(values) and c.leak_value is None and c.deleted == ("span",)
            a, b = c.meta["spans"]["span"]
            n0, n1 = c.meta["spans"]["needle-0"]
            assert abs((b - a) - (n1 - n0)) <= 20, "the control deletes a span of about the needle's length"
        else:
            j = int(c.meta["variant"][-1])
            assert c.gold == (values[1 - j],) and c.leak_value == values[j] and c.deleted == (f"needle-{j}",)
        edited_ids = [m["id"] for m in c.edited_messages()]
        assert c.deleted[0] not in edited_ids and edited_ids[-1] == "query"
    again = niah_cases(DATA, tokenizer, lengths=(512,), per_length=2, seed=3)
    assert again == short[:2]  # seeded, reproducible


@needs_data
def test_qa_cases_three_placements_paired_by_source():
    cases = qa_cases(DATA, QA_DATASETS, sources_per_dataset=2, seed=0)
    assert len(cases) == 3 * 2 * len(QA_DATASETS)
    by_source = {}
    for c in cases:
        by_source.setdefault(c.source_id, []).append(c)
    assert len(by_source) == 8
    for group in by_source.values():
        assert [c.meta["placement"] for c in group] == ["before", "between", "after"]
        assert len({c.meta["inserted_title"] for c in group}) == 1 and len({c.gold for c in group}) == 1
        # deleting the inserted passage restores one clean document for all three placements
        assert len({str(c.edited_messages()) for c in group}) == 1
        for c in group:
            ids = [m["id"] for m in c.history]
            supports = [i for i, m in enumerate(ids) if m.startswith("support-")]
            k = ids.index("inserted")
            assert {"before": k < supports[0], "between": supports[0] < k < supports[-1],
                    "after": supports[-1] < k}[c.meta["placement"]]
            assert ids[-1] == "tail" and c.deleted == ("inserted",)
            assert c.meta["inserted_title"] not in c.meta["support_titles"]
    musique = [c for c in cases if c.dataset == "musique"]
    assert all(c.gold[0] for c in musique)
    assert qa_cases(DATA, ["hotpotqa"], 2) == [c for c in cases if c.dataset == "hotpotqa"]
    with pytest.raises(ValueError, match="unknown dataset"):
        qa_cases(DATA, ["squad"], 1)
