"""Two code versions' single-thread agent hops side by side: the medians of interleaved
``kvmemory bench agent`` runs (one trial each) of a version A and a version B, per system and step,
and B / A. The peers (llama.cpp, transformers) ran beside each version: their B / A is the noise.

    python benchmarks/agent_hops_ab.py --runs benchmarks/results/agent_hops_ab_batching

reads ``old_*.json`` (A) and ``new_*.json`` (B) there and writes ``ab.json`` and ``ab.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

STEPS = ("first", "repeat", "append", "delete", "decode")


def _values(paths: list[Path]) -> dict[tuple[str, str], list[float]]:
    """(system, step) -> per-run values: ms to the end of the answer, decode in tokens/s."""
    values: dict[tuple[str, str], list[float]] = {}
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            value = row["decode_tok_s"] if row["step"] == "decode" else row["median_ms"]
            values.setdefault((row["system"], row["step"]), []).append(value)
    return values


def compare(folder: Path) -> dict:
    old, new = sorted(folder.glob("old_*.json")), sorted(folder.glob("new_*.json"))
    if not old or not new:
        raise SystemExit(f"{folder} needs old_*.json and new_*.json (kvmemory bench agent outputs)")
    a, b = _values(old), _values(new)
    rows = []
    for (system, step), before in a.items():
        after = b.get((system, step))
        if after:
            ma, mb = statistics.median(before), statistics.median(after)
            rows.append({"system": system, "step": step, "unit": "tok/s" if step == "decode" else "ms",
                         "a_median": ma, "b_median": mb, "b_over_a": mb / ma, "a_runs": before, "b_runs": after})
    meta = json.loads(old[0].read_text())["meta"]
    return {"runs_a": len(old), "runs_b": len(new), "cpu_flags": meta.get("cpu_flags"), "threads": meta.get("threads"),
            "command": meta.get("command"), "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"Medians of {result['runs_a']} (A) and {result['runs_b']} (B) interleaved runs, {result['threads']} threads, "
             f"CPU flags {', '.join(result['cpu_flags'] or [])}. Decode in tokens/s (higher is faster), the rest in ms.", "",
             "| system | step | A | B | B / A |", "|---|---|---|---|---|"]
    for r in sorted(result["rows"], key=lambda r: (r["system"], STEPS.index(r["step"]))):
        lines.append(f"| {r['system']} | {r['step']} | {r['a_median']:.1f} | {r['b_median']:.1f} | {r['b_over_a']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, required=True, help="folder with old_*.json and new_*.json")
    folder = parser.parse_args().runs
    result = compare(folder)
    (folder / "ab.json").write_text(json.dumps(result, indent=1))
    (folder / "ab.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
