"""The main job end to end on the embedded model, and the package layout rules."""

from __future__ import annotations

import importlib.metadata
import json

from kvmemory_lab.cli import main
from kvmemory_lab.demo import FLOOR
from kvmemory_lab.demo_cases import builtin_cases, default_data_dir, hotpot_cases

METHODS = ("dirty", "shift", "sur@2", "sur@5", "sur@auto:kv_change:0.06", "replay", "reprefill")


def test_demo_writes_every_method(tmp_path, real, capsys):
    out = tmp_path / "demo.json"
    assert main(["demo", "--cases", "1", "--json", str(out), "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in METHODS)
    data = json.loads(out.read_text())
    assert set(data["methods"]) == {*METHODS, FLOOR}
    for name in METHODS:
        m = data["methods"][name]
        assert {"agreement", "agreement_ci", "tf_agreement", "tf_agreement_ci", "tf_kl", "common_prefix", "mean_kl",
                "recomputed_tokens", "spent_budget", "latency_ms"} <= set(m)
        assert 0.0 <= m["tf_agreement"] <= 1.0 and m["tf_kl"] >= 0.0
    ref, sur5, replay = data["methods"]["reprefill"], data["methods"]["sur@5"], data["methods"]["replay"]
    assert ref["agreement"] == 1.0 and ref["mean_kl"] == 0.0
    assert ref["tf_agreement"] == 1.0 and ref["tf_kl"] == 0.0 and ref["common_prefix"] > 0
    assert replay["tf_agreement"] == 1.0 and replay["tf_kl"] < 1e-6
    adaptive = data["methods"]["sur@auto:kv_change:0.06"]
    assert adaptive["spent_budget"] is not None and 0 < adaptive["spent_budget"] <= 100
    assert replay["mean_kl"] < 1e-6  # Replay equals Re-prefill
    assert sur5["recomputed_tokens"] < replay["recomputed_tokens"] < ref["recomputed_tokens"]
    for m in data["methods"].values():  # the summary table prints every figure whole, not cut to fit
        assert f"{m['tf_kl']:.1e}" in printed and f"{m['mean_kl']:.2e}" in printed
    # the precision floor: the bf16 model's Re-prefill of the same history, scored like a repair
    floor = data["methods"][FLOOR]
    assert data["floor"] == "bf16 Re-prefill" and floor["recomputed_tokens"] == ref["recomputed_tokens"]
    assert 0 < floor["mean_kl"] < 0.1 and floor["tf_kl"] > 0  # other arithmetic, the same model


def test_demo_without_the_floor(tmp_path, real):
    out = tmp_path / "demo.json"
    assert main(["demo", "--cases", "1", "--json", str(out), "--max-new-tokens", "4", "--no-floor"]) == 0
    data = json.loads(out.read_text())
    assert FLOOR not in data["methods"] and data["floor"] is None


def test_demo_rejects_bad_budget(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["demo", "--budget", "150"])
    assert "[0, 100]" in capsys.readouterr().err


def test_case_builders():
    data = default_data_dir()
    cases = hotpot_cases(data, 3) if data else builtin_cases()
    for case in cases:
        with_del = case.messages(with_deleted=True, with_query=False)
        edited = case.messages(with_deleted=False, with_query=True)
        removed = {m["id"] for m in with_del} - {m["id"] for m in edited}
        assert removed == set(case.deleted_ids)
        assert 0 < case.deleted < len(case.passages) - 1  # an edit in the middle
        assert edited[-1]["id"] == "query"


def test_integrations_and_kernels_are_not_top_level_packages():
    # other distributions may own these names (transformers >= 5.25 pulls Hugging Face's
    # `kernels`); ours must not install them at the top level
    owners = importlib.metadata.packages_distributions()
    ours = {"kvmemory", "kvmemory-lab", "kvmemory_lab"}
    for name in ("kernels", "integrations"):
        assert not ours & {d.lower() for d in owners.get(name, [])}, name
    assert set(owners.get("kvmemory", [])) == set(owners.get("langchain_kvmemory", [])) == {"kvmemory"}
    assert set(owners.get("kvmemory_lab", [])) == {"kvmemory-lab"}


def test_demo_checks_options_before_loading_the_model(tmp_path, capsys):
    assert main(["demo", "--passages", "2"]) == 2
    assert "--passages" in capsys.readouterr().out
    assert main(["demo", "--data", str(tmp_path)]) == 2
    assert "hotpotqa" in capsys.readouterr().out
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["demo", "--json", str(blocker / "sub" / "x.json")]) == 2
    assert "writable" in capsys.readouterr().out
    assert main(["demo", "--max-new-tokens", "0"]) == 2


def test_example_agent_runs(real, capsys):
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "agents" / "edit_history.py"
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "clear tool output" in out and "delete first question" in out and "fallback: None" in out
