"""``kvmemory bench quality`` end to end on the real model: sharded runs append to one resumable
JSONL, the summary covers every finished case, and shared probes do not change any result."""

from __future__ import annotations

import json

import pytest

from kvmemory_lab.cli import main
from kvmemory_lab.demo_cases import default_data_dir

DATA = default_data_dir()
pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(DATA is None, reason="needs ../shared/data beside the checkout")]

ARGS = ["bench", "quality", "--task", "niah", "--lengths", "512", "--cases", "2", "--budgets", "5",
        "--allocators", "sur,oracle,cachecraft", "--max-new-tokens", "8"]


def _records(out):
    return {json.loads(line)["case_id"]: json.loads(line) for line in (out / "cases.jsonl").read_text().splitlines()}


def test_shards_fill_one_resumable_run(tmp_path):
    out = tmp_path / "run"
    assert main(ARGS + ["--out", str(out), "--shard", "1/2"]) == 0
    assert list(_records(out)) == ["niah-512-001"]  # shard 1 of 2: the odd case only
    assert main(ARGS + ["--out", str(out), "--shard", "0/2"]) == 0
    assert main(ARGS + ["--out", str(out)]) == 0  # resumes: nothing left to run
    records = _records(out)
    assert sorted(records) == ["niah-512-000", "niah-512-001"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["n_cases"] == 2
    assert set(summary["by_group"]["niah-512"]["sur@5"]) >= {"agreement", "median_kl", "nr_tv", "latency_ms", "em"}
    report = (out / "report.md").read_text()
    assert "## Agreement with Re-prefill by group" in report and "## Median first-token KL by group" in report
    assert isinstance(summary["detectors"], list)
    for record in records.values():
        methods = {m["method"]: m for m in record["methods"]}
        assert methods["reprefill"]["kl"] == 0.0
        assert methods["reprefill"]["kl_pre_edit"] is None and methods["dirty"]["pre_edit_agree"] is None
        m = methods["sur@5"]  # edit sensitivity against the pre-edit (Dirty) answer of the same case
        assert m["kl_pre_edit"] >= 0.0 and m["pre_edit_agree"] == (m["answer"].strip() == methods["dirty"]["answer"].strip())
        for label in ("oracle@5", "cachecraft@5"):  # probe allocators: probe time is in their selection time
            m = methods[label]
            assert m["selection_ms"] > 0 and m["post_edit_ms"] >= m["selection_ms"] + m["refresh_ms"]


def test_bad_shard_names_the_fix(tmp_path, capsys):
    for bad in ("half", "2/2", "0/0"):
        with pytest.raises(SystemExit, match="K/N"):
            main(ARGS + ["--out", str(tmp_path), "--shard", bad])
    assert not (tmp_path / "cases.jsonl").exists()


def test_disjoint_runs_pool_into_one_report(tmp_path):
    first, second, pooled = tmp_path / "a", tmp_path / "b", tmp_path / "pooled"
    assert main(ARGS + ["--out", str(first), "--shard", "0/2"]) == 0
    assert main(ARGS + ["--out", str(second), "--shard", "1/2"]) == 0
    assert main(["bench", "quality", "--report-only", "--pool", f"{first},{second}", "--out", str(pooled)]) == 0
    summary = json.loads((pooled / "summary.json").read_text())
    assert summary["meta"]["n_cases"] == 2 and summary["meta"]["pooled_from"] == [str(first), str(second)]
    assert not (pooled / "cases.jsonl").exists()  # the report points at the runs, it does not copy them
    with pytest.raises(SystemExit, match="repeats cases"):
        main(["bench", "quality", "--report-only", "--pool", f"{first},{first}", "--out", str(pooled)])


def test_runs_of_other_methods_on_the_same_cases_merge_into_one_report(tmp_path):
    first, second, merged = tmp_path / "a", tmp_path / "b", tmp_path / "merged"
    assert main(ARGS[:-6] + ["--budgets", "5", "--allocators", "sur", "--max-new-tokens", "8", "--out", str(first)]) == 0
    assert main(ARGS[:-6] + ["--budgets", "5", "--allocators", "sur", "--no-fixed", "--methods", "sur+lower2@5",
                             "--max-new-tokens", "8", "--out", str(second)]) == 0
    assert main(["bench", "quality", "--report-only", "--merge", f"{first},{second}", "--out", str(merged)]) == 0
    summary = json.loads((merged / "summary.json").read_text())
    assert summary["meta"]["n_cases"] == 2 and summary["meta"]["merged_from"] == [str(first), str(second)]
    assert {"sur@5", "sur+lower2@5"} <= set(summary["by_group"]["niah-512"])
    lines = (second / "cases.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    record["methods"][0]["answer"] += " (another model)"  # the shared Re-prefill reference now differs
    (second / "cases.jsonl").write_text("\n".join([json.dumps(record)] + lines[1:]) + "\n")
    with pytest.raises(SystemExit, match="answered differently"):
        main(["bench", "quality", "--report-only", "--merge", f"{first},{second}", "--out", str(merged)])
