"""Held-out check of CacheReforge profiles on several update trajectories (the paper's held-out
seeds 7, 17, 29), by exact replay (``kvmemory_lab.reforge.trajectory.PolicyReplay``, which
reproduces a maintained session's KL and recomputed layers; tests/test_reforge_trajectory.py).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/reforge_heldout_replay.py \
        --profiles labelled=benchmarks/results/reforge_profiles/calib16_gaps1-4-16.json \
                   fit5=benchmarks/results/reforge_profiles/fit5_seeds53-61.json \
        --out benchmarks/results/reforge_heldout_replay

Writes ``replay.json`` and ``replay.md``: per seed and pooled, mean first-token KL to fresh, KL
reduction vs stale reuse (%) and recomputed layers (% of N per update). Maintenance time is
not measured here (``kvmemory bench reforge`` does that).

``--ceiling-budget PCT`` also fits δ on the held-out trajectories themselves (``fit_to_budget``,
one δ per group of ``--ceiling-groups``): an in-sample upper bound of what the runtime rule
(q_ℓ = s_ℓ·d_ℓ ≥ 1, b_t = 1 + max triggered layer) can reach on them at that budget, not a
policy result. ``--bank-dir`` keeps the held-out banks (~1.9 GB each) between runs.
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
    parser.add_argument("--bank-dir", type=Path, default=None, help="load / save held-out banks here")
    parser.add_argument("--ceiling-budget", type=float, default=None,
                        help="also fit δ in-sample on the held-out banks at this budget (%% layers)")
    parser.add_argument("--ceiling-groups", default="window",
                        help="δ groups of the ceiling fit: window (the paper's windows) or lo-hi,lo-hi,… layer ranges")
    parser.add_argument("--ceiling-start", type=Path,
                        default=Path("benchmarks/results/reforge_profiles/calib16_gaps1-4-16.json"),
                        help="label-calibrated profile the ceiling fit starts from")
    args = parser.parse_args()

    from kvmemory_lab.reforge.cli import add_workload_arguments, check_workload_args, load_workload
    from kvmemory.reforge.profile import ReforgeProfile
    from kvmemory_lab.reforge.trajectory import PolicyReplay, fit_to_budget, parse_groups
    from kvmemory_lab.reforge.workload import load_snapshot

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
    seeds = [int(s) for s in args.seeds.split(",")]
    ceiling = None
    if args.ceiling_budget is not None:
        banks = [held_out_bank(w, args, seed, wargs.magnitude) for seed in seeds]
        replay = PolicyReplay(w.model, banks, load_snapshot)
        fitted, fit = fit_to_budget(replay, ReforgeProfile.load(args.ceiling_start), args.ceiling_budget,
                                    groups=parse_groups(args.ceiling_groups))
        ceiling = {"budget_pct": args.ceiling_budget, "groups": [list(g) for g in fit.groups],
                   "group_delta": fit.group_delta, "kl": fit.kl, "stale_kl": fit.stale_kl,
                   "kl_reduction_pct": fit.kl_reduction_pct, "recompute_pct": fit.recompute_pct,
                   "evaluated_profiles": fit.evaluated}
        profiles["ceiling (in-sample)"] = fitted
        del banks, replay
    rows = {}
    for seed in seeds:
        bank = held_out_bank(w, args, seed, wargs.magnitude)
        results = PolicyReplay(w.model, [bank], load_snapshot).evaluate([None, *profiles.values()])
        rows[seed] = {"stale": results[0].__dict__, **{n: r.__dict__ for n, r in zip(profiles, results[1:])}}
    pooled = {n: {"kl": statistics.fmean(rows[s][n]["kl"] for s in rows),
                  "recompute_pct": statistics.fmean(rows[s][n]["recompute_pct"] for s in rows)}
              for n in ["stale", *profiles]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay.json").write_text(json.dumps({"seeds": rows, "pooled": pooled, "prompts_per_seed": args.prompts,
                                                      "updates": args.updates, "profiles": args.profiles,
                                                      "ceiling": ceiling}, indent=1))
    lines = [f"# CacheReforge held-out replay ({args.prompts} eval prompts × seeds {args.seeds}, "
             f"{args.updates} updates each)", "",
             "| profile | " + " | ".join(f"seed {s}: KL red. % / layers %" for s in rows) + " | pooled KL | pooled KL red. % | pooled layers % |",
             "|---|" + "---|" * (len(rows) + 3)]
    for n in profiles:
        cells = [f"{100 * (1 - rows[s][n]['kl'] / rows[s]['stale']['kl']):.1f} / {rows[s][n]['recompute_pct']:.2f}" for s in rows]
        red = 100 * (1 - pooled[n]["kl"] / pooled["stale"]["kl"])
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {pooled[n]['kl']:.4f} | {red:.1f} | {pooled[n]['recompute_pct']:.2f} |")
    lines.append(f"\nStale reuse KL per seed: " + ", ".join(f"{s}: {rows[s]['stale']['kl']:.4f}" for s in rows))
    if ceiling:
        lines.append(f"\nCeiling: δ fitted on these held-out trajectories themselves at ≤ {ceiling['budget_pct']:g} % "
                     f"(groups {ceiling['groups']}): {ceiling['kl_reduction_pct']:.2f} % at "
                     f"{ceiling['recompute_pct']:.2f} % layers — an upper bound of the runtime rule here, not a policy result.")
    (args.out / "replay.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def held_out_bank(w, args, seed: int, magnitude: float):
    """The eval-split bank of ``seed``, from ``--bank-dir`` when it holds one."""
    import torch

    from kvmemory_lab.reforge.cli import trajectory_bank

    path = args.bank_dir / f"eval_s{seed}_p{args.prompts}_u{args.updates}_m{magnitude:g}.pt" if args.bank_dir else None
    if path is not None and path.is_file():
        return torch.load(path, weights_only=False)  # our own pickled TrajectoryBank
    bank = trajectory_bank(w, "eval", args.prompts, seed, args.updates, magnitude)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(bank, path)
    return bank


if __name__ == "__main__":
    main()
