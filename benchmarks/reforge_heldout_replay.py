"""Held-out check of CacheReforge profiles on several update trajectories (the paper's held-out
seeds 7, 17, 29), by exact replay (``kvmemory.reforge.trajectory.PolicyReplay``, which
reproduces a maintained session's KL and recomputed layers; tests/test_reforge_trajectory.py).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/reforge_heldout_replay.py \
        --profiles labelled=benchmarks/results/reforge_profiles/calib16_gaps1-4-16.json \
                   fit5=benchmarks/results/reforge_profiles/fit5_seeds53-61.json \
        --out benchmarks/results/reforge_heldout_replay

Writes ``replay.json`` and ``replay.md``: per seed and pooled, mean first-token KL to fresh, KL
reduction vs stale reuse (%) and recomputed layers (% of N per update). Maintenance time is
not measured here (``kvmemory bench reforge`` does that).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rich.console import Console


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", nargs="+", required=True, help="name=path pairs")
    parser.add_argument("--scales", default="1", help="risk scales α per profile (comma list, default 1)")
    parser.add_argument("--seeds", default="7,17,29", help="held-out trajectory seeds")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per seed")
    parser.add_argument("--updates", type=int, default=32)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from kvmemory.reforge.cli import add_workload_arguments, check_workload_args, load_workload, trajectory_bank
    from kvmemory.reforge.profile import ReforgeProfile
    from kvmemory.reforge.trajectory import PolicyReplay
    from kvmemory.reforge.workload import load_snapshot

    wl = argparse.ArgumentParser()
    add_workload_arguments(wl)
    wargs = wl.parse_args([])
    wargs.quick = False
    problem = check_workload_args(wargs)
    if problem:
        raise SystemExit(problem)
    w = load_workload(wargs, Console())
    profiles = {}
    for item in args.profiles:
        name, path = item.split("=", 1)
        for alpha in (float(a) for a in args.scales.split(",")):
            label = name if alpha == 1 else f"{name}_x{alpha:g}"
            profiles[label] = ReforgeProfile.load(path).scaled(alpha)
    rows = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        bank = trajectory_bank(w, "eval", args.prompts, seed, args.updates, wargs.magnitude)
        results = PolicyReplay(w.model, [bank], load_snapshot).evaluate([None, *profiles.values()])
        rows[seed] = {"stale": results[0].__dict__, **{n: r.__dict__ for n, r in zip(profiles, results[1:])}}
    pooled = {n: {"kl": statistics.fmean(rows[s][n]["kl"] for s in rows),
                  "recompute_pct": statistics.fmean(rows[s][n]["recompute_pct"] for s in rows)}
              for n in ["stale", *profiles]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay.json").write_text(json.dumps({"seeds": rows, "pooled": pooled, "prompts_per_seed": args.prompts,
                                                      "updates": args.updates, "profiles": args.profiles}, indent=1))
    lines = [f"# CacheReforge held-out replay ({args.prompts} eval prompts × seeds {args.seeds}, "
             f"{args.updates} updates each)", "",
             "| profile | " + " | ".join(f"seed {s}: KL red. % / layers %" for s in rows) + " | pooled KL | pooled KL red. % | pooled layers % |",
             "|---|" + "---|" * (len(rows) + 3)]
    for n in profiles:
        cells = [f"{100 * (1 - rows[s][n]['kl'] / rows[s]['stale']['kl']):.1f} / {rows[s][n]['recompute_pct']:.2f}" for s in rows]
        red = 100 * (1 - pooled[n]["kl"] / pooled["stale"]["kl"])
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {pooled[n]['kl']:.4f} | {red:.1f} | {pooled[n]['recompute_pct']:.2f} |")
    lines.append(f"\nStale reuse KL per seed: " + ", ".join(f"{s}: {rows[s]['stale']['kl']:.4f}" for s in rows))
    (args.out / "replay.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
