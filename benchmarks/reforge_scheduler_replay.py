"""The budgeted CacheReforge schedulers (drift-predicted ``scheduled`` and K/V-probed ``probed``)
against the paper's eq. 9 by exact replay (``kvmemory_lab.reforge.trajectory.PolicyReplay``) on
cached trajectory banks.

Fit (calibration banks only, seeds 53 and 61 as in the paper)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/reforge_scheduler_replay.py fit \
        --base benchmarks/results/reforge_profiles/fit5_seeds53-61.json --budget 5 --bank-dir .banks \
        --out benchmarks/results/reforge_profiles/sched5_seeds53-61.json

Fit the probed policy's thresholds (calibration banks only; several seeds are fitted jointly,
~2 GB of memory per seed)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/reforge_scheduler_replay.py fit-probe --seeds 53,61,67,71 \
        --pacings 0.75 --base benchmarks/results/reforge_profiles/sched5_seed53.json --budget 5 --bank-dir .banks \
        --out benchmarks/results/reforge_profiles/probe5_paced_seeds53-61-67-71.json

Held-out replay (8 eval prompts × seeds 7, 17, 29, 32 updates)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/reforge_scheduler_replay.py eval \
        --profile benchmarks/results/reforge_profiles/probe5_paced_seeds53-61-67-71.json \
        --labelled benchmarks/results/reforge_profiles/calib16_gaps1-4-16.json --bank-dir .banks \
        --out benchmarks/results/reforge_scheduler_probe/joint4

Writes ``replay.json`` / ``replay.md`` / ``frontier.png``: per seed and pooled KL reduction vs
stale reuse and recomputed layers for stale reuse, eq. 9 (labelled and fitted δ, with risk
scales for its frontier), drift-only, fixed window, the scheduler (at several budgets for its
frontier), the probed policy when the profile has a ``probe`` calibration (probes charged in
its recomputed layers), and the exact-KL oracle (an in-sample reference, not a runtime policy),
plus where the schedulers' decisions differ from eq. 9 (per-layer refresh frequency, range ends).
Banks (~2 GB each for 8 prompts × 33 versions) are kept in ``--bank-dir``; each bank's measured
state KLs are kept in ``--memo-dir`` (``*.memo``) so later replays of the same bank skip those forwards.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="fit the scheduler on calibration banks")
    fit.add_argument("--base", type=Path, required=True, help="eq. 9 profile the scheduler is added to")
    fit.add_argument("--budget", type=float, default=5.0)
    fit.add_argument("--seeds", default="53,61")
    fit.add_argument("--rules", default="ratio,lagrangian")
    fit.add_argument("--out", type=Path, required=True)
    fp = sub.add_parser("fit-probe", help="fit the probed policy's thresholds on calibration banks")
    fp.add_argument("--base", type=Path, required=True, help="profile the probe calibration is added to")
    fp.add_argument("--budget", type=float, default=5.0)
    fp.add_argument("--seeds", default="53")
    fp.add_argument("--pacings", default="0,0.5,0.9", help="pacing κ grid (comma list; one value fixes κ)")
    fp.add_argument("--restart-projection", action="store_true",
                    help="fit the policy that refreshes the restart layer's K/V by projection of its boundary state")
    fp.add_argument("--out", type=Path, required=True)
    ev = sub.add_parser("eval", help="replay every policy on held-out banks")
    ev.add_argument("--profile", type=Path, required=True, help="profile (eq. 9 fitted; its scheduler and probe calibrations when it has them)")
    ev.add_argument("--labelled", type=Path, default=None, help="the paper's label-calibrated profile (eq. 6-7)")
    ev.add_argument("--seeds", default="7,17,29")
    ev.add_argument("--budgets", default="3,4,5,6,8", help="scheduler budgets for its frontier")
    ev.add_argument("--scales", default="0.7,1.4", help="eq. 9 risk scales for its frontier")
    ev.add_argument("--extra", nargs="*", default=[],
                    help="NAME=PATH: also replay the scheduler of another profile as scheduled_NAME")
    ev.add_argument("--probe-extra", nargs="*", default=[],
                    help="NAME=PATH: also replay the probed policy of another profile as probed_NAME")
    ev.add_argument("--probe-pacings", default="",
                    help="also replay the profile's probe thresholds with these pacings κ (probed_kκ)")
    ev.add_argument("--oracle-prices", default="0.003", help="λ of the exact-KL oracle (empty: none)")
    ev.add_argument("--out", type=Path, required=True)
    ev.add_argument("--reuse-seeds", action="store_true",
                    help="take a seed's rows from OUT/seed_S.json when an earlier run of the same policies wrote it")
    for p in (fit, fp, ev):
        p.add_argument("--prompts", default="8", help="prompts per seed: one number, or one per seed (8,8,4)")
        p.add_argument("--updates", type=int, default=32)
        p.add_argument("--bank-dir", type=Path, default=Path(".banks"))
        p.add_argument("--memo-dir", type=Path, default=None,
                       help="where each bank's measured state KLs are kept (default: --bank-dir)")
        p.add_argument("--target", default="v_proj")
        p.add_argument("--layer", default=None, help="LoRA layer(s), comma list (default N//2)")
    args = parser.parse_args()
    w = workload(args)
    {"fit": run_fit, "fit-probe": run_fit_probe, "eval": run_eval}[args.command](w, args)


def workload(args):
    from kvmemory_lab.reforge.cli import add_workload_arguments, check_workload_args, load_workload

    wl = argparse.ArgumentParser()
    add_workload_arguments(wl)
    wargs = wl.parse_args(["--target", args.target])
    wargs.quick = False
    problem = check_workload_args(wargs)
    if problem:
        raise SystemExit(problem)
    if args.layer is not None:
        wargs.layer = [int(x) for x in str(args.layer).split(",")]
        wargs.layer = wargs.layer[0] if len(wargs.layer) == 1 else wargs.layer
    return load_workload(wargs, Console())


def prompts_of(args, seed: int) -> int:
    counts = [int(x) for x in str(args.prompts).split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    return counts[0] if len(counts) == 1 else dict(zip(seeds, counts))[seed]


def banks(w, args, split: str, seeds: list[int]):
    from kvmemory_lab.reforge import trajectory
    from kvmemory_lab.reforge.cli import cached_bank

    sys.modules.setdefault("kvmemory.reforge.trajectory", trajectory)  # banks pickled before the lab split
    return [cached_bank(w, split, prompts_of(args, seed), seed, args.updates, 1e-2, args.bank_dir) for seed in seeds]


def memo_path(w, args, split: str, seed: int) -> Path:
    from kvmemory_lab.reforge.cli import bank_path

    path = bank_path(args.bank_dir, w, split, prompts_of(args, seed), seed, args.updates, 1e-2).with_suffix(".memo")
    if args.memo_dir is None:
        return path
    args.memo_dir.mkdir(parents=True, exist_ok=True)
    return args.memo_dir / path.name


def replay_for(w, args, split: str, seeds: list[int], replay_class=None, **options):
    """A PolicyReplay (or ``replay_class(..., **options)``) over the seeds' banks (~2 GB each)
    with their memoised state KLs loaded, and each bank's memo path (for ``save_memo``)."""
    from kvmemory_lab.reforge.trajectory import PolicyReplay
    from kvmemory_lab.reforge.workload import load_snapshot

    replay = (replay_class or PolicyReplay)(w.model, banks(w, args, split, seeds), load_snapshot, **options)
    memos = [memo_path(w, args, split, seed) for seed in seeds]
    for index, memo in enumerate(memos):
        if memo.is_file():
            replay.load_memo(memo, index)
    return replay, memos


def replay_of(w, args, split: str, seed: int):
    """A one-bank PolicyReplay with the bank's memoised state KLs loaded, and its memo path."""
    replay, (memo,) = replay_for(w, args, split, [seed])
    return replay, memo


def run_fit_probe(w, args) -> None:
    from kvmemory.reforge.profile import ReforgeProfile
    from kvmemory_lab.reforge.probe_fit import fit_probe

    seeds = [int(s) for s in args.seeds.split(",")]
    replay, memos = replay_for(w, args, "calibration", seeds)
    t0 = time.perf_counter()
    fit = fit_probe(replay, args.budget, pacings=tuple(float(x) for x in args.pacings.split(",")),
                    restart_projection=args.restart_projection)
    for index, memo in enumerate(memos):
        replay.save_memo(memo, index)
    cal = fit.calibration
    cal.fit.update({"seeds": seeds, "prompts_per_seed": [prompts_of(args, s) for s in seeds], "updates": args.updates,
                    "fit_s": time.perf_counter() - t0})
    profile = ReforgeProfile.load(args.base).model_copy(update={"probe": cal})
    profile.save(args.out)
    print(f"probed: calibration {fit.kl_reduction_pct:.2f} % KL reduction at {fit.recompute_pct:.2f} % layers "
          f"(probes {fit.probe_pct:.3f} %), rows {cal.rows}, carry {cal.carry:g}, pacing {cal.pacing:g}, "
          f"restart projection {cal.restart_projection}, group τ {cal.fit['group_tau']}")
    print(f"wrote {args.out}")


def run_fit(w, args) -> None:
    from kvmemory.reforge.profile import ReforgeProfile
    from kvmemory_lab.reforge.schedule_fit import fit_scheduler
    from kvmemory_lab.reforge.trajectory import PolicyReplay
    from kvmemory_lab.reforge.workload import load_snapshot

    seeds = [int(s) for s in args.seeds.split(",")]
    replay = PolicyReplay(w.model, banks(w, args, "calibration", seeds), load_snapshot)
    base = ReforgeProfile.load(args.base)
    t0 = time.perf_counter()
    best = None
    for rule in args.rules.split(","):
        profile, fit = fit_scheduler(replay, base, args.budget, rule=rule)
        print(f"{rule}: calibration {fit.kl_reduction_pct:.2f} % KL reduction at {fit.recompute_pct:.2f} % layers "
              f"(λ {fit.calibration.price:g}, carry {fit.calibration.carry:g})", flush=True)
        if best is None or fit.kl < best[1].kl:
            best = (profile, fit)
    profile, fit = best
    profile.scheduler.fit.update({"seeds": seeds, "prompts_per_seed": [prompts_of(args, s) for s in seeds], "updates": args.updates,
                                  "fit_s": time.perf_counter() - t0, "batched_forwards": replay.forwards})
    profile.save(args.out)
    print(f"wrote {args.out}: rule {profile.scheduler.rule}, weights {[round(x, 3) for x in profile.scheduler.weights]}")


def run_eval(w, args) -> None:
    from kvmemory.reforge.profile import ReforgeProfile
    from kvmemory_lab.reforge.trajectory import PolicyReplay, ReplayPolicy
    from kvmemory_lab.reforge.workload import load_snapshot

    profile = ReforgeProfile.load(args.profile)
    policies = {"stale": None}
    if args.labelled:
        labelled = ReforgeProfile.load(args.labelled)
        policies["eq9_labelled"] = labelled
        policies["drift_only"] = ReplayPolicy("drift_only", labelled)
    policies["eq9_fitted"] = profile
    for a in (float(x) for x in args.scales.split(",") if x):
        policies[f"eq9_fitted_x{a:g}"] = profile.scaled(a)
    policies["fixed_window"] = ReplayPolicy("fixed_window", window=2)
    budget = profile.scheduler.fit["budget_pct"] if profile.scheduler and profile.scheduler.fit else 5.0
    if profile.scheduler is not None:
        policies["scheduled"] = ReplayPolicy("scheduled", profile, budget)
        for b in (float(x) for x in args.budgets.split(",") if x):
            if b != budget:
                policies[f"scheduled_b{b:g}"] = ReplayPolicy("scheduled", profile, b)
    for item in args.extra:
        name, path = item.split("=", 1)
        other = ReforgeProfile.load(path)
        policies[f"scheduled_{name}"] = ReplayPolicy("scheduled", other, other.scheduler.fit["budget_pct"])
    if profile.probe is not None:
        probe_budget = profile.probe.fit["budget_pct"] if profile.probe.fit else 5.0
        policies["probed"] = ReplayPolicy("probed", budget_pct=probe_budget, probe=profile.probe)
        for b in (float(x) for x in args.budgets.split(",") if x):
            if b != probe_budget:
                policies[f"probed_b{b:g}"] = ReplayPolicy("probed", budget_pct=b, probe=profile.probe)
        for k in (float(x) for x in args.probe_pacings.split(",") if x):
            policies[f"probed_k{k:g}"] = ReplayPolicy("probed", budget_pct=probe_budget,
                                                      probe=profile.probe.model_copy(update={"pacing": k}))
    for item in args.probe_extra:
        name, path = item.split("=", 1)
        other = ReforgeProfile.load(path).probe
        policies[f"probed_{name}"] = ReplayPolicy("probed", budget_pct=other.fit["budget_pct"], probe=other)
    for price in (float(x) for x in args.oracle_prices.split(",") if x):
        carry = (profile.scheduler or profile.probe).carry
        policies[f"oracle_l{price:g}"] = ReplayPolicy("oracle", budget_pct=budget, price=price, carry=carry)
    rows, decisions = {}, {}
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in (int(s) for s in args.seeds.split(",")):
        saved = args.out / f"seed_{seed}.json"
        if args.reuse_seeds and saved.is_file():
            old = json.loads(saved.read_text())
            if set(policies) <= set(old["rows"]):  # an earlier run of these policies (and maybe more)
                rows[seed], decisions[seed] = old["rows"], old["decisions"]
                continue
        t0 = time.perf_counter()
        replay, memo = replay_of(w, args, "eval", seed)
        bank = replay.banks[0]
        results = replay.evaluate(list(policies.values()))
        replay.save_memo(memo)
        rows[seed] = {n: {"kl": r.kl, "top1": r.top1, "recompute_pct": r.recompute_pct, "probe_pct": r.probe_pct,
                          "actions": r.actions} for n, r in zip(policies, results)}
        decisions[seed] = {n: r.ends[0] for n, r in zip(policies, results) if n in DECIDERS}
        decisions[seed]["restart"], decisions[seed]["num_layers"] = bank.restart, bank.num_layers
        saved.write_text(json.dumps({"rows": rows[seed], "decisions": decisions[seed]}))
        print(f"seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
        del bank, replay
    result = summarise(rows, decisions, policies, args, profile)
    (args.out / "replay.json").write_text(json.dumps(result, indent=1))
    (args.out / "replay.md").write_text(markdown(result))
    plot(result, args.out / "frontier.png")
    print(markdown(result))


def summarise(rows, decisions, policies, args, profile) -> dict:
    seeds = list(rows)
    pooled = {}
    stale = statistics.fmean(rows[s]["stale"]["kl"] for s in seeds)
    names = list(dict.fromkeys(n for s in seeds for n in rows[s]))
    for n in names:
        if not all(n in rows[s] for s in seeds):  # e.g. the oracle, run on some seeds only
            continue
        kl = statistics.fmean(rows[s][n]["kl"] for s in seeds)
        pooled[n] = {"kl": kl, "kl_reduction_pct": 100 * (1 - kl / stale) if stale > 0 else None,
                     "recompute_pct": statistics.fmean(rows[s][n]["recompute_pct"] for s in seeds),
                     "top1": statistics.fmean(rows[s][n]["top1"] for s in seeds),
                     "min_seed_kl_reduction_pct": min(100 * (1 - rows[s][n]["kl"] / rows[s]["stale"]["kl"]) for s in seeds)}
    return {"seeds": rows, "pooled": pooled, "decisions": decision_summary(decisions),
            "prompts_per_seed": {s: prompts_of(args, s) for s in seeds}, "updates": args.updates, "target": args.target, "layer": args.layer,
            "profile": str(args.profile), "scheduler": profile.scheduler.model_dump() if profile.scheduler else None}


DECIDERS = ("scheduled", "probed", "eq9_fitted")  # policies whose range ends are compared


def decision_summary(decisions) -> dict:
    """Per-layer refresh frequency (% of updates that recompute layer ℓ) and mean range end."""
    out = {}  # frequencies: mean over seeds; refreshes and ends: pooled over trajectories
    for seed, d in decisions.items():
        r, n = d["restart"], d["num_layers"]
        for name in (n for n in DECIDERS if n in d):
            ends = [e for prompt in d[name] for e in prompt]
            freq = [100 * sum(1 for e in ends if e is not None and e > layer) / len(ends) for layer in range(r, n)]
            agg = out.setdefault(name, {"freq": [0.0] * (n - r), "ends": [], "restart": r})
            agg["freq"] = [a + f / len(decisions) for a, f in zip(agg["freq"], freq)]
            agg["ends"] += [e for e in ends if e is not None]
        for name in (n for n in DECIDERS[:-1] if n in d):
            same = sum(1 for a, b in zip(sum(d[name], []), sum(d["eq9_fitted"], [])) if a == b)
            out.setdefault(f"{name}_same_decision_pct", []).append(100 * same / len(sum(d[name], [])))
    for name in (n for n in DECIDERS if n in out):
        ends = out[name].pop("ends")
        out[name]["refreshes_per_trajectory"] = len(ends) / sum(len(d[name]) for d in decisions.values())
        out[name]["mean_end"] = statistics.fmean(ends) if ends else None
        out[name]["full_suffix_share_pct"] = 100 * sum(1 for e in ends if e == next(iter(decisions.values()))["num_layers"]) / max(1, len(ends))
    return out


def markdown(r: dict) -> str:
    seeds = list(r["seeds"])
    counts = ", ".join(f"{n} for seed {s}" for s, n in r["prompts_per_seed"].items())
    lines = [f"# Scheduler vs eq. 9, held-out exact replay ({counts}; {r['updates']} updates, target "
             f"{r['target']}@{r['layer'] or 'N//2'})", "",
             "| policy | " + " | ".join(f"seed {s}: KL red. % / layers %" for s in seeds)
             + " | pooled KL | pooled KL red. % | pooled layers % | top-1 % | worst seed % |",
             "|---|" + "---|" * (len(seeds) + 5)]
    names = list(dict.fromkeys(n for s in seeds for n in r["seeds"][s]))
    for n in names:
        cells = [f"{100 * (1 - r['seeds'][s][n]['kl'] / r['seeds'][s]['stale']['kl']):.1f} / "
                 f"{r['seeds'][s][n]['recompute_pct']:.2f}" if n in r["seeds"][s] else "–" for s in seeds]
        p = r["pooled"].get(n)
        tail = (f" | {p['kl']:.4f} | {p['kl_reduction_pct']:.2f} | {p['recompute_pct']:.2f} | {p['top1']:.1f} | "
                f"{p['min_seed_kl_reduction_pct']:.1f} |") if p else " | – | – | – | – | – |"
        lines.append(f"| {n} | " + " | ".join(cells) + tail)
    d = r["decisions"]
    lines += ["", "Where the decisions differ (pooled over seeds):", ""]
    lines += [f"- {name}: same range end as eq. 9 (fitted) in {statistics.fmean(d[f'{name}_same_decision_pct']):.1f} "
              "% of updates" for name in DECIDERS[:-1] if f"{name}_same_decision_pct" in d]
    lines += ["", "| policy | refreshes / trajectory | mean end b | full-suffix share of refreshes % | "
              "per-layer refresh frequency from r (% of updates) |", "|---|---|---|---|---|"]
    for name in (n for n in DECIDERS if n in d):
        x = d[name]
        lines.append(f"| {name} | {x['refreshes_per_trajectory']:.2f} | {x['mean_end'] or 0:.2f} | "
                     f"{x['full_suffix_share_pct']:.1f} | {', '.join(f'{f:.1f}' for f in x['freq'])} |")
    lines += ["", "oracle_*: the same budget account choosing by the exact KL of every candidate range "
              "(in-sample reference, not a runtime policy). probed*: recomputed layers include the probes "
              "(their FLOP share of a layer)."]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    from kvmemory_lab.bench.common import agg_pyplot

    plt = agg_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    families = {"eq. 9 fitted δ (× α)": "eq9_fitted", "drift scheduler (budgets)": "scheduled",
                "probed (budgets)": "probed"}
    members = {prefix: [n for n in r["pooled"] if n == prefix or re.fullmatch(rf"{prefix}_(b|x)[0-9.]+", n)]
               for prefix in families.values()}
    for label, prefix in ((label, prefix) for label, prefix in families.items() if members[prefix]):
        pts = sorted((r["pooled"][n]["recompute_pct"], r["pooled"][n]["kl_reduction_pct"]) for n in members[prefix])
        ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=label)
    others = [n for n in r["pooled"] if n != "stale" and not any(n in m for m in members.values())]
    for k, n in enumerate(others):
        p = r["pooled"][n]
        ax.scatter(p["recompute_pct"], p["kl_reduction_pct"], marker="s", color=f"C{(k + 3) % 10}", label=n)
    ax.axhline(95, color="gray", lw=0.8, ls="--")
    ax.axvline(5, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("recomputed layers (% of N per update)")
    ax.set_ylabel("KL reduction vs stale reuse (%)")
    ax.set_ylim(bottom=max(0, min(p["kl_reduction_pct"] for p in r["pooled"].values() if p["kl_reduction_pct"]) - 5))
    ax.legend(fontsize=7)
    ax.set_title(f"Held-out frontier, {r['updates']} updates, {r['target']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
