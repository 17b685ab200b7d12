"""``kvmemory calibrate`` and ``kvmemory bench reforge`` wiring (the benchmark itself runs
outside the test suite; its results live in benchmarks/results/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmemory_lab.bench import BENCHMARKS
from kvmemory_lab.cli import build_parser, main
from kvmemory_lab.demo_cases import default_data_dir
from kvmemory.reforge.profile import ReforgeProfile

ROOT_PROFILE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "reforge_profiles" / "calib16_gaps1-4-16.json"


def test_commands_are_registered():
    assert "reforge" in BENCHMARKS
    args = build_parser().parse_args(["bench", "reforge", "--quick", "--updates", "2"])
    assert args.quick and args.updates == 2 and args.bench_module == "reforge"
    assert build_parser().parse_args(["calibrate", "--quick"]).command == "calibrate"


def test_calibration_gaps_and_starts_override_the_plan():
    from kvmemory_lab.reforge.cli import calibration_plan

    args = build_parser().parse_args(["calibrate", "--gaps", "1,2,4,8,16", "--starts", "0,8"])
    assert calibration_plan(False, args) == {"updates": 32, "starts": (0, 8), "gaps": (1, 2, 4, 8, 16)}
    assert calibration_plan(False, build_parser().parse_args(["calibrate"]))["gaps"] == (1, 4, 16)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["calibrate", "--gaps", "1,x"])


def test_options_are_checked_before_the_model_loads(tmp_path, capsys):
    assert main(["calibrate", "--data", str(tmp_path)]) == 2
    assert "hotpotqa" in capsys.readouterr().out
    assert main(["bench", "reforge", "--rank", "0"]) == 2
    assert main(["calibrate", "--updates", "0"]) == 2
    from kvmemory_lab.demo_cases import HOTPOT_FILE
    from kvmemory_lab.reforge.workload import WIKI_FILE

    data = tmp_path / "data"  # the fit options are checked after the data folder
    for f in (HOTPOT_FILE, WIKI_FILE):
        (data / f).parent.mkdir(parents=True, exist_ok=True)
        (data / f).write_text("")
    capsys.readouterr()
    assert main(["calibrate", "--data", str(data), "--fit-budget", "0"]) == 2
    assert "--fit-budget must be in (0, 100]" in capsys.readouterr().out
    assert main(["calibrate", "--data", str(data), "--schedule", "120"]) == 2
    assert "--schedule must be in (0, 100]" in capsys.readouterr().out
    assert main(["calibrate", "--data", str(data), "--fit-budget", "5", "--fit-groups", "15-x"]) == 2
    assert "--fit-groups" in capsys.readouterr().out
    missing = tmp_path / "missing.json"
    assert main(["calibrate", "--data", str(data), "--fit-budget", "5", "--from-profile", str(missing)]) == 2
    assert "no such file" in capsys.readouterr().out


@pytest.mark.real_model
@pytest.mark.skipif(default_data_dir() is None, reason="calibration prompts come from ../shared/data (set KVMEMORY_DATA)")
def test_calibrate_fits_a_budget_from_a_labelled_profile(tmp_path):
    out = tmp_path / "fit.json"
    assert main(["calibrate", "--from-profile", str(ROOT_PROFILE), "--fit-budget", "5", "--fit-seeds", "53",
                 "--fit-prompts", "1", "--updates", "3", "--fit-groups", "15-15,16-18,19-29",
                 "--out", str(out)]) == 0
    fitted, labelled = ReforgeProfile.load(out), ReforgeProfile.load(ROOT_PROFILE)
    assert fitted.fit["budget_pct"] == 5 and fitted.fit["calibration_recompute_pct"] <= 5
    assert fitted.fit["groups"] == [[15], [16, 17, 18], list(range(19, 30))] and fitted.fit["start_delta"][0] == pytest.approx(labelled.delta[15])
    assert fitted.key == labelled.key and fitted.conditions == labelled.conditions  # labels kept for reference
    for group, delta in zip(fitted.fit["groups"], fitted.fit["group_delta"]):
        assert all(fitted.delta[layer] == pytest.approx(delta) for layer in group)


@pytest.mark.real_model
@pytest.mark.skipif(default_data_dir() is None, reason="calibration prompts come from ../shared/data (set KVMEMORY_DATA)")
def test_calibrate_fits_the_scheduler_and_keeps_eq9(tmp_path):
    out = tmp_path / "sched.json"
    assert main(["calibrate", "--from-profile", str(ROOT_PROFILE), "--schedule", "20", "--fit-seeds", "53",
                 "--fit-prompts", "1", "--updates", "3", "--bank-dir", str(tmp_path / "banks"), "--out", str(out)]) == 0
    fitted, labelled = ReforgeProfile.load(out), ReforgeProfile.load(ROOT_PROFILE)
    sched = fitted.scheduler
    assert sched.fit["budget_pct"] == 20 and sched.fit["calibration_recompute_pct"] <= 20 + 1e-9
    assert sched.fit["calibration_kl"] < sched.fit["stale_kl"]  # the scheduler recovers something
    assert len(sched.weights) == 30 and all(w == 0 for w in sched.weights[:15]) and any(sched.weights[15:])
    assert fitted.sensitivity == labelled.sensitivity  # eq. 9 stays in the profile as the reference
    assert len(list((tmp_path / "banks").glob("*.pt"))) == 1  # the bank is kept for the next run


@pytest.mark.real_model
@pytest.mark.skipif(default_data_dir() is None, reason="calibration prompts come from ../shared/data (set KVMEMORY_DATA)")
def test_calibrate_quick_freezes_a_profile(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--quick", "--updates", "2", "--out", str(out)]) == 0
    profile = ReforgeProfile.load(out)
    assert profile.key.update_target == "v_proj@15" and profile.num_layers == 30
    assert [c.gap for c in profile.conditions] == [1, 2]
    assert all(c.restart == 15 and c.distance > 0 for c in profile.conditions)
    assert all(c.windows["15"]["kl"] < 1e-8 for c in profile.conditions)  # the full suffix equals fresh
    labelled = [i for i, s in enumerate(profile.sensitivity) if s > 0]
    assert all(15 <= i < 30 for i in labelled)  # only affected layers can be labelled
    assert "wrote" in capsys.readouterr().out


@pytest.mark.real_model
@pytest.mark.skipif(default_data_dir() is None, reason="calibration prompts come from ../shared/data (set KVMEMORY_DATA)")
def test_calibrate_a_lora_on_several_layers(tmp_path):
    """``--layer 10,20`` puts one LoRA on each layer; recovery restarts at the lowest."""
    assert build_parser().parse_args(["calibrate", "--layer", "10,20"]).layer == (10, 20)
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--quick", "--updates", "1", "--layer", "10,20", "--out", str(out)]) == 0
    profile = ReforgeProfile.load(out)
    assert profile.key.update_target == "v_proj@10,20"
    assert [c.restart for c in profile.conditions] == [10]


def test_scaled_profile_moves_every_trigger_distance():
    profile = ReforgeProfile.load(ROOT_PROFILE)
    half = profile.scaled(0.5)
    assert half.sensitivity == [0.5 * s for s in profile.sensitivity]
    assert all((d is None and e is None) or abs(e - 2 * d) < 1e-12 for d, e in zip(profile.delta, half.delta))
    assert half.key == profile.key and profile.scaled(1.0).sensitivity == profile.sensitivity
    with pytest.raises(ValueError, match="positive"):
        profile.scaled(0)


def test_risk_scales_option_and_sweep_table():
    from kvmemory_lab.bench.reforge import risk_scales, sweep_lines

    assert risk_scales("0.5, 2") == [0.5, 2.0] and risk_scales("") == []
    for bad in ("x", "0,1", "-1"):
        with pytest.raises(SystemExit, match="risk-scales"):
            risk_scales(bad)
    row = {"alpha": 0.5, "recompute_pct": 3.3, "kl": 0.09, "kl_reduction_vs_stale_pct": 90.0, "top1": 80.0,
           "maintenance_vs_fresh_pct": 5.0}
    lines = sweep_lines([row, {**row, "alpha": 1.0}])
    assert any(line.startswith("| 0.5 | 3.30 | 0.0900 | 90.0 |") for line in lines)
    assert sweep_lines([]) == []
