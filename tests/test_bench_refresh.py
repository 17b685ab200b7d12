"""``kvmemory bench refresh``: matched causal-pair sets, and the whole benchmark (and the prepared
GPU script) on a tiny random-weight Qwen3 on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmemory_lab.bench.refresh import refresh_positions
from kvmemory_lab.cli import main
from kvmemory.selection import to_intervals

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n, pairs", [(2048, 65568), (8192, 262176)])
def test_refresh_sets_have_matched_causal_pairs(n, pairs):
    """B = 64 in R = 1, 4, 16 intervals: the paper's M(U) at 2 K and 8 K for every R (§4.4)."""
    for r in (1, 4, 16):
        positions = refresh_positions(n, r, 64)
        assert len(positions) == len(set(positions)) == 64
        assert len(to_intervals(positions)) == r
        assert sum(u + 1 for u in positions) == pairs
    with pytest.raises(ValueError, match="equal intervals"):
        refresh_positions(n, 3, 64)


def _check_outputs(out: Path, executors: set[str], intervals: set[int]) -> dict:
    data = json.loads((out / "refresh.json").read_text())
    rows = data["rows"]
    assert {r["executor"] for r in rows} == executors and {r["R"] for r in rows} == intervals
    assert all(r["median_ms"] > 0 and r["context"] == 512 for r in rows)
    assert len({r["causal_pairs"] for r in rows}) == 1
    assert all(r["max_abs_diff_vs_sequential"] < 0.05 for r in rows)  # bf16 reduction-order noise only
    assert "loadavg" in data["meta"] and (out / "refresh.png").stat().st_size > 0
    assert "| 512 | 16 |" in (out / "refresh.md").read_text()
    return data


def test_bench_refresh_runs_on_a_tiny_random_model(tmp_path):
    code = main(["bench", "refresh", "--random-config", "qwen3-tiny", "--contexts", "512", "--trials", "1",
                 "--warmup", "0", "--device", "cpu", "--out", str(tmp_path)])
    assert code == 0
    _check_outputs(tmp_path, {"sequential", "direct", "oneshot", "packed-sdpa"}, {1, 4, 16})


def test_gpu_script_builds_on_cpu_with_the_tiny_variant(tmp_path):
    env = {"CONFIG": "qwen3-tiny", "DEVICE": "cpu", "OUT": str(tmp_path), "PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_refresh.sh"), "--contexts", "512", "--trials", "1",
                           "--warmup", "0", "--intervals", "1,16", "--executors", "sequential,packed-sdpa"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    data = _check_outputs(tmp_path, {"sequential", "packed-sdpa"}, {1, 16})
    assert data["meta"]["model"] == "random qwen3-tiny" and data["meta"]["dtype"] == "bfloat16"


def test_bad_options_name_the_fix(capsys):
    assert main(["bench", "refresh", "--positions", "60", "--intervals", "16", "--quick"]) == 2
    assert "--positions" in capsys.readouterr().out
