"""``kvmemory bench reforge``: CacheReforge RQ4 protocol on the embedded model.

Consecutive middle value-projection updates (rank-8 LoRA, Adam step 1e-2, answer-supervised on
disjoint training items) while held-out HotpotQA / 2Wiki prompts keep live caches. Per update,
each method maintains its cache: fresh full (Re-prefill), exact affected suffix, stale reuse,
CacheReforge (eq. 9), the budgeted drift scheduler (``scheduled``, when the profile carries a
scheduler calibration), the K/V-probed policy (``probed``, when it carries a probe calibration;
probes counted in its recomputed layers and maintenance time), drift-only and fixed-window (2 layers). Reported: first-token KL to fresh, top-1
agreement, task score (token F1 of a short greedy answer), recomputed-layer %, and
cache-maintenance time (summed over a trajectory, averaged across trajectories; S2.1).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from .common import agg_pyplot

METHODS = ("fresh", "exact_suffix", "stale", "cachereforge", "scheduled", "probed", "drift_only", "fixed_window")
TARGETED = ("cachereforge", "scheduled", "probed")  # methods checked against the targets
EVAL_SEED = 7  # the paper's first held-out seed


def add_arguments(parser) -> None:
    from ..reforge.cli import add_workload_arguments

    parser.add_argument("--quick", action="store_true", help="4 updates, 1 prompt (a few minutes)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    parser.add_argument("--updates", type=int, default=None, help="consecutive updates (default 32; quick 4)")
    parser.add_argument("--samples", type=int, default=None, help="held-out prompts (default 2; quick 1)")
    parser.add_argument("--score-every", type=int, default=None, help="task score every k versions (default 16; quick 2)")
    parser.add_argument("--profile", type=Path, default=None, help="use this calibration profile instead of calibrating")
    parser.add_argument("--budget", type=float, default=None,
                        help="recompute budget of the scheduled / probed methods (%% of layers per update; default: "
                        "the budget each was fitted for)")
    parser.add_argument("--risk-scales", default="",
                        help="also run CacheReforge with sensitivities × alpha for each alpha (comma list, e.g. "
                             "0.5,0.7,1.4,2): the recomputed-layers vs KL frontier of the same calibration")
    add_workload_arguments(parser)


def run(args, console) -> int:
    from ..reforge.cli import calibration_plan, check_workload_args, load_workload, run_calibration
    from kvmemory.reforge.profile import ProfileKey, ReforgeProfile
    from ..reforge.cli import context_regime

    problem = check_workload_args(args)
    if problem:
        console.print(f"[red]{problem}[/red]")
        return 2
    updates = args.updates or (4 if args.quick else 32)
    n_samples = args.samples or (1 if args.quick else 2)
    score_every = args.score_every or (2 if args.quick else 16)
    w = load_workload(args, console)
    t0 = time.perf_counter()
    if args.profile:
        key = ProfileKey(model=w.lm.name, update_target=w.update_target, adapter_config=w.adapter_config,
                         context_regime=context_regime(w.passages))
        profile = ReforgeProfile.load(args.profile, expect=key)
    else:
        samples = args.calib_samples or (1 if args.quick else 16)
        profile = run_calibration(w, args, console, samples=samples, **calibration_plan(args.quick, args))
    calibration_s = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    profile.save(args.out / "reforge-profile.json")  # the frozen profile the held-out run used
    result = evaluate(w, args, profile, updates, n_samples, score_every)
    result["calibration_s"] = calibration_s
    write_outputs(args.out, result, console)
    return 0


def evaluate(w, args, profile, updates: int, n_samples: int, score_every: int) -> dict:
    from ..reforge.analysis import certificates, hybrid_executions
    from ..reforge.calibration import horizons
    from ..reforge.workload import load_snapshot, qa_samples, update_trajectory

    held_out = qa_samples(w.data_dir, "eval", n_samples, passages=w.passages, seed=EVAL_SEED)
    train = qa_samples(w.data_dir, "train", 40, passages=0, seed=EVAL_SEED)
    with tqdm(total=updates, desc="evaluation updates") as bar:
        versions = update_trajectory(w.model, w.tokenizer, train, updates, args.magnitude, EVAL_SEED, bar)
    scales = risk_scales(args.risk_scales)
    methods = tuple(m for m in METHODS if (m != "scheduled" or profile.scheduler is not None)
                    and (m != "probed" or profile.probe is not None))
    names = methods + tuple(_scaled_name(a) for a in scales)
    per_method = {m: {"kl": [], "top1": [], "score": [], "recompute": [], "maint": [], "request": [], "actions": []}
                  for m in names}
    certs = {"checked": 0, "kl_bound_holds": 0, "top1_certified": 0, "top1_certificate_holds": 0}
    prompt_tokens = []
    with tqdm(total=len(held_out) * updates, desc="held-out versions") as bar:
        for sample in held_out:
            sessions = _start_sessions(w, profile, sample, versions[0], load_snapshot, scales, methods,
                                       {m: _budget(args, profile, m) for m in ("scheduled", "probed")})
            prompt_tokens.append(len(sessions["stale"].token_ids))
            traj = {m: {"kl": [], "top1": [], "score": [], "recompute": [], "maint": 0.0, "request": 0.0, "actions": []}
                    for m in names}
            for t in range(1, updates + 1):
                load_snapshot(w.model, versions[t])
                scored = t % score_every == 0 or t == updates
                _step(w, sessions, sample, traj, scored)
                bar.update(1)
            _certify(sessions["stale"], certs, certificates, hybrid_executions)
            for m in names:
                agg = per_method[m]
                for k in ("kl", "top1", "score", "recompute"):
                    agg[k].append(statistics.fmean(traj[m][k]) if traj[m][k] else 0.0)
                agg["maint"].append(traj[m]["maint"])
                agg["request"].append(traj[m]["request"])
                agg["actions"].append({a: traj[m]["actions"].count(a) for a in ("reuse", "bounded", "full_suffix")})
    load_snapshot(w.model, versions[0])
    return _summary(w, args, profile, per_method, certs, horizons(profile), updates, held_out, prompt_tokens,
                    score_every)


def _targets(m: dict, stale: dict, fresh: dict) -> dict:
    """KL reduction vs stale ≥ 95 %, ≤ 5 % recomputed layers, maintenance ≤ 7 % of fresh."""
    out = {
        "kl_reduction_vs_stale_pct": 100.0 * (1 - m["kl"] / stale["kl"]) if stale["kl"] > 0 else None,
        "recompute_pct": m["recompute_pct"],
        "maintenance_vs_fresh_pct": 100.0 * m["maintenance_s"] / fresh["maintenance_s"],
    }
    out["met"] = bool(out["kl_reduction_vs_stale_pct"] is not None and out["kl_reduction_vs_stale_pct"] >= 95.0
                      and out["recompute_pct"] <= 5.0 and out["maintenance_vs_fresh_pct"] <= 7.0)
    return out


def risk_scales(text: str) -> list[float]:
    """``--risk-scales`` "0.5,2" -> [0.5, 2.0]. Raises SystemExit naming the fix on bad input."""
    try:
        scales = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--risk-scales must be a comma list of positive numbers (got {text!r})") from None
    if any(not a > 0 for a in scales):
        raise SystemExit(f"--risk-scales must be positive (got {text!r})")
    return scales


def _scaled_name(alpha: float) -> str:
    return f"cachereforge_x{alpha:g}"


def _budget(args, profile, method: str = "scheduled") -> float:
    """``--budget``, else the budget the method's calibration was fitted for, else 5 %."""
    if getattr(args, "budget", None) is not None:
        return args.budget
    calibration = profile.scheduler if method == "scheduled" else profile.probe
    fit = calibration.fit if calibration is not None else None
    return float(fit["budget_pct"]) if fit and "budget_pct" in fit else 5.0


def _start_sessions(w, profile, sample, v0, load_snapshot, scales=(), methods=METHODS,
                    budgets: dict | None = None) -> dict:
    from kvmemory.reforge.state import ReforgeConfig
    from kvmemory.session import KVSession

    load_snapshot(w.model, v0)
    base = KVSession(w.model, w.tokenizer, "replay", reforge=ReforgeConfig(policy="exact_suffix"))
    base.prepare(list(sample.messages))
    sessions = {}
    for m in methods[1:]:
        s = base.fork()
        s.reforge.config = ReforgeConfig(policy=m, profile=profile, budget_pct=(budgets or {}).get(m, 5.0))
        sessions[m] = s
    for alpha in scales:
        s = base.fork()
        s.reforge.config = ReforgeConfig(policy="cachereforge", profile=profile.scaled(alpha))
        sessions[_scaled_name(alpha)] = s
    return sessions


def _step(w, sessions, sample, traj, scored: bool) -> None:
    """One adapter version: fresh prefill (maintenance = the prefix, request = the last token),
    then every method maintains its own cache."""
    import torch

    from kvmemory import kvcache
    from kvmemory.engine import forward_rows
    from ..metrics import first_token_kl, token_f1
    from kvmemory.session import KVSession

    ids = torch.tensor(sessions["stale"].token_ids)
    cache = kvcache.new_cache(w.model.config)
    t0 = time.perf_counter()
    forward_rows(w.model, cache, ids[:-1], 0)
    t1 = time.perf_counter()
    z_star = forward_rows(w.model, cache, ids[-1:], ids.shape[0] - 1)
    rec = traj["fresh"]
    rec["maint"] += t1 - t0
    rec["request"] += time.perf_counter() - t1
    rec["kl"].append(0.0)
    rec["top1"].append(1.0)
    rec["recompute"].append(100.0)
    if scored:
        fresh = KVSession(w.model, w.tokenizer, "reprefill")
        fresh.prepare(list(sample.messages))
        rec["score"].append(100.0 * token_f1(fresh.generate(w.answer_tokens).text, sample.answer))
    for m, s in sessions.items():
        report = s.maintain()
        rec = traj[m]
        rec["maint"] += report.maintenance_ms / 1000.0
        rec["request"] += report.request_ms / 1000.0
        rec["kl"].append(first_token_kl(z_star, s.next_logits))
        rec["top1"].append(float(int(s.next_logits.argmax()) == int(z_star.argmax())))
        rec["recompute"].append(report.recompute_pct)
        rec["actions"].append(report.action)
        if scored:
            rec["score"].append(100.0 * token_f1(s.fork().generate(w.answer_tokens).text, sample.answer))


def _certify(stale_session, certs: dict, certificates, hybrid_executions) -> None:
    """KL and top-1 certificates on the never-maintained cache at the final version."""
    for c in certificates(hybrid_executions(stale_session)):
        certs["checked"] += 1
        certs["kl_bound_holds"] += int(c.kl_holds)
        certs["top1_certified"] += int(c.top1_certified)
        certs["top1_certificate_holds"] += int(c.top1_holds)


def _summary(w, args, profile, per_method, certs, horizon, updates, held_out, prompt_tokens, score_every) -> dict:
    methods = {}
    for m, agg in per_method.items():
        methods[m] = {
            "kl": statistics.fmean(agg["kl"]),
            "top1": 100.0 * statistics.fmean(agg["top1"]),
            "task_score": statistics.fmean(agg["score"]),
            "recompute_pct": statistics.fmean(agg["recompute"]),
            "maintenance_s": statistics.fmean(agg["maint"]),
            "request_s": statistics.fmean(agg["request"]),
            "actions_per_trajectory": {a: statistics.fmean(x[a] for x in agg["actions"]) for a in ("reuse", "bounded", "full_suffix")}
            if m != "fresh" else None,
        }
    sweep = [{"alpha": float(m.removeprefix("cachereforge_x")), **methods.pop(m)} for m in list(methods)
             if m.startswith("cachereforge_x")]
    stale, cr, fresh = methods["stale"], methods["cachereforge"], methods["fresh"]
    sweep = sorted(sweep + [{"alpha": 1.0, **cr}], key=lambda row: row["recompute_pct"])
    for row in sweep:
        row["kl_reduction_vs_stale_pct"] = 100.0 * (1 - row["kl"] / stale["kl"]) if stale["kl"] > 0 else None
        row["maintenance_vs_fresh_pct"] = 100.0 * row["maintenance_s"] / fresh["maintenance_s"]
    targets = {m: _targets(methods[m], stale, fresh) for m in TARGETED if m in methods}
    return {
        "benchmark": "reforge",
        "model": w.lm.name,
        "dtype": args.dtype,
        "update_target": w.update_target,
        "adapter_config": w.adapter_config,
        "magnitude": args.magnitude,
        "updates": updates,
        "held_out": [{"id": s.sample_id, "source": s.source} for s in held_out],
        "prompt_tokens_mean": statistics.fmean(prompt_tokens),
        "answer_tokens": w.answer_tokens,
        "calibration_answer_tokens": w.calib_answer_tokens,
        "score_every": score_every,
        "quick": bool(args.quick),
        "methods": methods,
        "targets": targets["cachereforge"],
        "targets_by_method": targets,
        "budget_pct": _budget(args, profile) if "scheduled" in methods else None,
        "probe_budget_pct": _budget(args, profile, "probed") if "probed" in methods else None,
        "risk_scale_sweep": sweep if len(sweep) > 1 else [],
        "certificates": certs,
        "horizons": horizon,
        "profile": {"sensitivity": profile.sensitivity, "drift_threshold": profile.drift_threshold,
                    "scheduler": profile.scheduler.model_dump(exclude={"fit"}) if profile.scheduler else None,
                    "probe": profile.probe.model_dump(exclude={"fit"}) if profile.probe else None,
                    "conditions": len(profile.conditions), "key": profile.key.model_dump()},
    }


def write_outputs(out: Path, result: dict, console) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "reforge.json").write_text(json.dumps(result, indent=1))
    (out / "reforge.md").write_text(markdown(result))
    _plot(result, out / "reforge.png")
    console.print(markdown(result))
    console.print(f"wrote {out / 'reforge.json'}, reforge.md, reforge.png")


def markdown(r: dict) -> str:
    lines = [
        f"# CacheReforge benchmark ({'quick' if r['quick'] else 'full'})",
        "",
        f"{r['model']} ({r['dtype']}), LoRA {r['adapter_config']} on {r['update_target']}, {r['updates']} consecutive "
        f"updates of magnitude {r['magnitude']}, {len(r['held_out'])} held-out prompts "
        f"(mean {r['prompt_tokens_mean']:.0f} tokens), task score = token F1 (%) of a {r['answer_tokens']}-token greedy answer.",
        "",
        "Maintenance = bringing the cached prefix to the current adapter (fresh: prefilling all but the last prompt "
        "token); every method then recomputes the last prompt token through all layers (request column). Times are "
        "summed over a trajectory and averaged across trajectories (S2.1); KL / top-1 / recompute are means over "
        f"versions. Calibration task-score criterion: {r.get('calibration_answer_tokens', 0)}-token answers (0 = off, "
        "KL and top-1 only).",
        "",
        "| method | task score (%) | KL | top-1 (%) | recomputed layers (%) | maintenance (s / trajectory) "
        "| last-token request (s / trajectory) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, v in r["methods"].items():
        lines.append(f"| {m} | {v['task_score']:.2f} | {v['kl']:.4f} | {v['top1']:.2f} | {v['recompute_pct']:.2f} | "
                     f"{v['maintenance_s']:.2f} | {v['request_s']:.2f} |")
    lines += [""]
    for m, t in r.get("targets_by_method", {"cachereforge": r["targets"]}).items():
        red = "n/a" if t["kl_reduction_vs_stale_pct"] is None else f"{t['kl_reduction_vs_stale_pct']:.1f} %"
        lines.append(f"Targets for {m} (KL reduction vs stale ≥ 95 %, ≤ 5 % recomputed layers, maintenance ≤ 7 % of "
                     f"fresh): KL reduction {red}, recomputed {t['recompute_pct']:.2f} %, maintenance "
                     f"{t['maintenance_vs_fresh_pct']:.1f} % of fresh → {'met' if t['met'] else 'NOT met'}.")
        lines.append("")
    if r.get("budget_pct") is not None:
        lines += [f"scheduled: budget {r['budget_pct']:g} % of layers per update (running account: never exceeded except by exact recomputation of incomparable anchors).", ""]
    if r.get("probe_budget_pct") is not None:
        lines += [f"probed: budget {r['probe_budget_pct']:g} % of layers per update, K/V probes included in its "
                  "recomputed layers and maintenance time.", ""]
    lines += [
        *sweep_lines(r.get("risk_scale_sweep", [])),
        f"Certificates on the stale caches at the last version: {r['certificates']}.",
        "",
        "Recomputation horizons of the calibration conditions (direct / bounded / full):",
        "",
        "| condition | suffix depth | D/B/F | observed horizons |",
        "|---|---|---|---|",
    ]
    for g, row in r["horizons"].items():
        lines.append(f"| {g} | {row['suffix_depth']} | {row['direct']}/{row['bounded']}/{row['full']} | {row['horizons']} |")
    return "\n".join(lines) + "\n"


def sweep_lines(sweep: list[dict]) -> list[str]:
    """Markdown for the risk-scale frontier (empty without ``--risk-scales``)."""
    if not sweep:
        return []
    lines = ["CacheReforge frontier of the same calibration (sensitivities × α; α = 1 is the method itself):", "",
             "| α | recomputed layers (%) | KL | KL reduction vs stale (%) | top-1 (%) | maintenance (% of fresh) |",
             "|---|---|---|---|---|---|"]
    for row in sweep:
        red = "n/a" if row["kl_reduction_vs_stale_pct"] is None else f"{row['kl_reduction_vs_stale_pct']:.1f}"
        lines.append(f"| {row['alpha']:g} | {row['recompute_pct']:.2f} | {row['kl']:.4f} | {red} | {row['top1']:.2f} | "
                     f"{row['maintenance_vs_fresh_pct']:.1f} |")
    return lines + [""]


def _plot(r: dict, path: Path) -> None:
    plt = agg_pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for m, v in r["methods"].items():
        axes[0].scatter(v["recompute_pct"], v["kl"], label=m)
        axes[1].bar(m, v["maintenance_s"])
    sweep = r.get("risk_scale_sweep", [])
    if sweep:
        axes[0].plot([row["recompute_pct"] for row in sweep], [row["kl"] for row in sweep], "k--", lw=1,
                     label="cachereforge × α")
    axes[0].set_xlabel("recomputed layers (%)")
    axes[0].set_ylabel("first-token KL to fresh")
    axes[0].set_yscale("symlog", linthresh=1e-4)
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("maintenance (s / trajectory)")
    axes[1].tick_params(axis="x", rotation=30)
    fig.suptitle(f"CacheReforge, {r['model']}, {r['updates']} updates on {r['update_target']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
