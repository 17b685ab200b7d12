"""Aggregates, paired bootstrap intervals, markdown report and plots of ``kvmemory bench quality``."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean, median

from kvmemory.policy import RepairPolicy
from kvmemory.selection import ALLOCATOR_TITLES

from ..evaluation.stats import REPLICATES, SEED, paired_bootstrap
from ..metrics import contains_gold
from .common import agg_pyplot, table_cell as _fmt
from .quality_detectors import detector_section, detector_table, escalation_section, escalation_table

DEFAULT_SIGNAL = RepairPolicy().signal

REFERENCE_NAMES = ("dirty", "shift", "replay", "reprefill")
BOOTSTRAP_REFERENCES = ("shift", "replay", "reprefill")


GROUP_METRICS = ("em", "gold_in_answer", "agreement", "tf_agreement", "median_kl", "nr_tv", "latency_ms",
                 "recomputed_tokens")


def _rows(records: list[dict], method: str) -> list[dict]:
    return [m for r in records for m in r["methods"] if m["method"] == method]


def _mean_of(rows: list[dict], key: str) -> float | None:
    values = [m[key] for m in rows if m.get(key) is not None]
    return mean(values) if values else None


def _adaptive_stats(rows: list[dict]) -> dict:
    """Adaptive budget: spent budget (%), stop reasons, and calibration: the share of repairs the
    signal stopped whose greedy answer still differs from Re-prefill's."""
    runs = [m for m in rows if m.get("adaptive")]
    if not runs:
        return {}
    by_signal = [m for m in runs if m["adaptive"]["stopped_by"] == "signal"]
    return {
        "spent_budget": mean(m["adaptive"]["spent_budget"] for m in runs),
        "rounds": mean(len(m["adaptive"]["rounds"]) for m in runs),
        "probe_tokens": mean(m["adaptive"]["probe_tokens"] for m in runs),
        "stopped_by_signal": len(by_signal) / len(runs),
        "stopped_by_cap": sum(m["adaptive"]["stopped_by"] == "cap" for m in runs) / len(runs),
        "signal_stops_diverged": (sum(not m["agree"] for m in by_signal) / len(by_signal)) if by_signal else None,
        "signal_stops_tf_below_1": (sum(m.get("tf_agree", 1.0) < 1.0 for m in by_signal) / len(by_signal)) if by_signal else None,
    }


def aggregate(rows: list[dict]) -> dict:
    """Per-method aggregate over cases: fractions in [0, 1], KL in nats, times in ms (means).

    ``agreement``: greedy answer equal to Re-prefill's; ``tf_agreement`` / ``tf_kl``: mean over
    cases of the teacher-forced top-1 agreement / mean KL (nats) over Re-prefill's answer tokens;
    ``common_prefix``: mean common prefix of the greedy answers (tokens); ``recomputed_tokens``:
    mean positions forwarded (refreshed rows + new text + adaptive probes)."""
    defined = [m["nr_tv"] for m in rows if m["nr_tv"] is not None]
    leaks = [m["leak"] for m in rows if m["leak"] is not None]
    return {
        "tf_agreement": _mean_of(rows, "tf_agree"),
        "tf_kl": _mean_of(rows, "tf_kl"),
        "common_prefix": _mean_of(rows, "common_prefix"),
        "tf_exact": _mean_of([{"v": float(m["tf_agree"] == 1.0)} for m in rows if m.get("tf_agree") is not None], "v"),
        "n": len(rows),
        "agreement": mean(m["agree"] for m in rows),
        "median_kl": median(m["kl"] for m in rows),
        "mean_tv": mean(m["tv"] for m in rows),
        "nr_tv": median(defined) if defined else None,  # median of the defined per-case ratios (App. 11)
        "nr_tv_defined": len(defined),
        "em": mean(m["em"] for m in rows),
        "gold_in_answer": mean(m["gold_in_answer"] for m in rows),
        "leak_rate": mean(leaks) if leaks else None,
        "latency_ms": mean(m["post_edit_ms"] for m in rows),
        "selection_ms": mean(m["selection_ms"] for m in rows),
        "shift_ms": mean(m["shift_ms"] for m in rows),
        "refresh_ms": mean(m["refresh_ms"] for m in rows),
        "answer_ms": mean(m["answer_ms"] for m in rows),
        "recomputed_tokens": mean(m["recomputed_tokens"] for m in rows),
        "refreshed_tokens": mean(m["refreshed_tokens"] for m in rows),
        "intervals": mean(m["intervals"] for m in rows),
        "median_intervals": median(m["intervals"] for m in rows),
        "fallbacks": sum(bool(m["fallback"]) for m in rows),
        **_adaptive_stats(rows),
        **_decode_replay_stats(rows),
    }


def _decode_replay_stats(rows: list[dict]) -> dict:
    """Decode-time Replay (``replay_margin``): the share of answers that replayed and the mean
    answer token (picks before it) at which they did."""
    if not any("decode_replay" in m for m in rows):
        return {}
    replayed = [m for m in rows if m.get("decode_replay")]
    return {"decode_replayed": len(replayed) / len(rows),
            "decode_replay_at_token": mean(m["decode_replay"]["at_token"] for m in replayed) if replayed else None}


def _methods(records: list[dict]) -> list[str]:
    return list(dict.fromkeys(m["method"] for r in records for m in r["methods"]))


def bootstrap_table(records: list[dict]) -> list[dict]:
    """EM, agreement, gold-in-answer and first-token TV differences (percentage points, i.e. 100 ×
    the difference of fractions) of every allocator@budget against Shift, Replay and Re-prefill,
    with source-paired, dataset-stratified 95 % intervals."""
    out = []
    groups = [r["source_id"] for r in records]
    strata = [r["dataset"] for r in records]
    for method in _methods(records):
        if "@" not in method and ":margin=" not in method:
            continue
        for ref in BOOTSTRAP_REFERENCES:
            for metric in ("em", "agree", "gold_in_answer", "tv", "tf_agree"):
                diff = []
                for r in records:
                    by = {m["method"]: m for m in r["methods"]}
                    if by[method].get(metric) is None or by[ref].get(metric) is None:
                        break
                    diff.append(100.0 * (float(by[method][metric]) - float(by[ref][metric])))
                if len(diff) < len(records):
                    continue
                est, lo, hi = paired_bootstrap(diff, groups, strata)
                out.append({"method": method, "reference": ref, "metric": metric, "delta_pp": est,
                            "ci_low": lo, "ci_high": hi, "n_cases": len(diff), "n_sources": len(set(groups))})
    return out


def _adaptive_key(allocator: str, rows: list[dict]) -> tuple[str, str]:
    """Summary entry of an adaptive method, from what its repairs report: ``adaptive`` for SUR
    with the default signal, ``adaptive_<signal>`` for the other, ``[allocator]`` for other
    allocators; keyed by tolerance."""
    info = next(m["adaptive"] for m in rows if m.get("adaptive"))
    signal = info["signal"]
    key = "adaptive" + ("" if signal == DEFAULT_SIGNAL else f"_{signal}") + ("" if allocator == "sur" else f"[{allocator}]")
    return key, f"{info['tolerance']:g}"


def _add_gold_in_answer(records: list[dict]) -> None:
    """Lenient secondary score, derived from the stored answers: QA: a normalized gold answer or
    alias occurs as a whole-word span of the answer (small models answer in sentences); NIAH: EM."""
    for r in records:
        for m in r["methods"]:
            qa = r["task"] == "qa"
            m["gold_in_answer"] = any(contains_gold(m["answer"], g) for g in r["gold"]) if qa else m["em"]


def _group(record: dict) -> str:
    """A case's report group: its dataset (NIAH: with the length), and the edit kind of an edit case."""
    edit = record.get("meta", {}).get("edit")
    return f"{record['dataset']}-{edit}" if edit else record["dataset"]


def summarize(records: list[dict], meta: dict) -> dict:
    """summary.json: allocator → budget → metrics, the references, per-group EM and the bootstrap."""
    _add_gold_in_answer(records)
    summary: dict = {}
    for method in _methods(records):
        agg = aggregate(_rows(records, method))
        if ":margin=" in method:  # decode-time Replay: keyed by margin under its repair's label
            base, margin = method.split(":margin=")
            summary.setdefault(f"decode_replay[{base}]", {})[margin] = agg
        elif "@" in method:
            allocator, budget = method.split("@")
            if budget.startswith("auto"):  # adaptive: keyed by tolerance, like the fixed budgets
                key, tolerance = _adaptive_key(allocator, _rows(records, method))
                summary.setdefault(key, {})[tolerance] = agg
            else:
                summary.setdefault(allocator, {})[budget] = agg
        else:
            summary[method] = agg
    by_group: dict = {}
    for group in dict.fromkeys(map(_group, records)):
        subset = [r for r in records if _group(r) == group]
        by_group[group] = {}
        for m in _methods(subset):
            agg = aggregate(_rows(subset, m))
            by_group[group][m] = {k: agg[k] for k in GROUP_METRICS} | {"n": len(subset)}
    summary["by_group"] = by_group
    summary["bootstrap"] = {"replicates": REPLICATES, "seed": SEED, "rows": bootstrap_table(records)}
    summary["detectors"] = detector_table(records)
    summary["escalation"] = escalation_table(records)
    summary["meta"] = {**meta, "n_cases": len(records), "n_sources": len({r["source_id"] for r in records}),
                       "datasets": sorted({r["dataset"] for r in records})}
    return summary


def markdown(summary: dict) -> str:
    meta = summary["meta"]
    lines = [
        f"# kvmemory bench quality: {meta['task']} ({meta['n_cases']} cases, {meta['n_sources']} sources)",
        "",
        f"Model {meta['model']} ({meta['dtype']}), {meta['executor']}, greedy answers of at most "
        f"{meta['max_new_tokens']} tokens, CPU ({meta['machine']}, {meta['torch_threads']} threads, shared). "
        f"Groups: {', '.join(meta['datasets'])}. SpecCache-adapted auxiliary model: {meta['speccache_auxiliary_model']}. "
        "The clean-state oracle is privileged (it needs a full recomputation to select). "
        + _answers_note(meta),
        "",
        "Agreement = greedy answer equal to Re-prefill's; KL = first-token KL(p_reprefill ‖ p_method) (median, nats); "
        "NR_TV = median of defined per-case 1 − TV(method)/TV(dirty) (eq. 14, unclipped); EM = task exact match; "
        "gold-in = (QA) gold answer or alias inside the answer; leak = deleted needle value still emitted; latency = mean post-edit ms (selection + Shift + refresh incl. query "
        "prefill + answer decoding).",
        "",
        "## References",
        "",
        "| method | agreement | TF agreement | TF KL | common prefix | median KL | NR_TV | EM | gold-in | leak | latency ms | recomputed | intervals |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ref in REFERENCE_NAMES:
        if ref in summary:
            m = summary[ref]
            lines.append(f"| {ref} | {m['agreement']:.2f} | {_answer_cells(m)} | {m['median_kl']:.2e} | {_fmt(m['nr_tv'])} | {m['em']:.2f} | "
                         f"{m['gold_in_answer']:.2f} | {_fmt(m['leak_rate'])} | {m['latency_ms']:.0f} | {m['recomputed_tokens']:.0f} | {m['intervals']:.1f} |")
    lines += ["", "## Allocators × budget", "",
              "| allocator | budget % | agreement | TF agreement | TF KL | common prefix | median KL | NR_TV | EM | gold-in | leak | latency ms | selection ms | "
              "refresh ms | answer ms | recomputed | intervals |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, title in {**ALLOCATOR_TITLES, **{v: f"{v} (options)" for v in _variants(summary)}}.items():
        for budget, m in summary.get(name, {}).items():
            lines.append(
                f"| {title} | {budget} | {m['agreement']:.2f} | {_answer_cells(m)} | {m['median_kl']:.2e} | {_fmt(m['nr_tv'])} | {m['em']:.2f} | "
                f"{m['gold_in_answer']:.2f} | {_fmt(m['leak_rate'])} | {m['latency_ms']:.0f} | {m['selection_ms']:.0f} | {m['refresh_ms']:.0f} | "
                f"{m['answer_ms']:.0f} | {m['recomputed_tokens']:.0f} | {m['intervals']:.1f} |")
    lines += _adaptive_section(summary)
    lines += _decode_replay_section(summary)
    lines += detector_section(summary.get("detectors", []))
    lines += escalation_section(summary.get("escalation", []))
    lines += ["", "## Paired differences (EM, percentage points; 95 % source-paired bootstrap, "
              f"{summary['bootstrap']['replicates']} replicates, seed {summary['bootstrap']['seed']})", "",
              "| method | vs | ΔEM pp | 95 % CI | Δagreement pp | 95 % CI | Δgold-in pp | 95 % CI | ΔTV pp | 95 % CI |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    rows = summary["bootstrap"]["rows"]
    for r in rows:
        if r["metric"] != "em":
            continue
        a, g, t = (next(x for x in rows if x["metric"] == metric and x["method"] == r["method"] and x["reference"] == r["reference"])
                   for metric in ("agree", "gold_in_answer", "tv"))
        lines.append(f"| {r['method']} | {r['reference']} | {r['delta_pp']:+.1f} | [{r['ci_low']:+.1f}, {r['ci_high']:+.1f}] | "
                     f"{a['delta_pp']:+.1f} | [{a['ci_low']:+.1f}, {a['ci_high']:+.1f}] | "
                     f"{g['delta_pp']:+.1f} | [{g['ci_low']:+.1f}, {g['ci_high']:+.1f}] | "
                     f"{t['delta_pp']:+.2f} | [{t['ci_low']:+.2f}, {t['ci_high']:+.2f}] |")
    for metric, title, spec in (("em", "EM", ".2f"), ("agreement", "Agreement with Re-prefill", ".2f"),
                                ("tf_agreement", "Teacher-forced agreement", ".3f"),
                                ("recomputed_tokens", "Mean recomputed tokens", ".0f"),
                                ("median_kl", "Median first-token KL", ".2e"), ("latency_ms", "Mean latency ms", ".0f")):
        lines += ["", f"## {title} by group", ""] + _group_table(summary["by_group"], metric, spec)
    return "\n".join(lines) + "\n"


def _answer_cells(m: dict) -> str:
    """TF agreement | TF KL | common prefix cells (– for records without answer-level metrics)."""
    return f"{_fmt(m.get('tf_agreement'), '.3f')} | {_fmt(m.get('tf_kl'), '.2e')} | {_fmt(m.get('common_prefix'), '.1f')}"


def _variants(summary: dict) -> list[str]:
    """Allocators with selection options (``sur+idf``, ``sur+tail32`` ...)."""
    return [k for k in summary if "+" in k and not k.startswith(("adaptive", "decode_replay"))]


def _adaptive_keys(summary: dict) -> list[str]:
    return [k for k in summary if k.startswith("adaptive")]


def _decode_replay_keys(summary: dict) -> list[str]:
    return [k for k in summary if k.startswith("decode_replay[")]


def _keyed_section(summary: dict, keys: list[str], title: str, note: str, columns: list[str], cells) -> list[str]:
    """A markdown section with one row per entry keyed by setting (tolerance, margin) under each
    of ``keys``, settings in numeric order; ``cells(key, setting, m)`` gives the row's cells
    after ``columns[:2]`` = key and setting. Empty without keys."""
    if not keys:
        return []
    lines = ["", f"## {title}", "", note, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for key in keys:
        for setting, m in sorted(summary[key].items(), key=lambda kv: float(kv[0])):
            lines.append("| " + " | ".join(cells(key, setting, m)) + " |")
    return lines


def _decode_replay_section(summary: dict) -> list[str]:
    """Decode-time Replay rows: fidelity, cost (repair + replayed rows) and how often it replayed."""
    return _keyed_section(
        summary, _decode_replay_keys(summary), "Decode-time Replay (replay_margin; our extension)",
        "The repair runs as labelled; a greedy pick whose top-1/top-2 logit margin is below the margin (nats) while "
        "stale rows remain replays them (and the answer so far) exactly. Recomputed tokens include those rows.",
        ["repair", "margin (nats)", "agreement", "TF agreement", "TF KL", "common prefix", "recomputed", "replayed",
         "mean answer token at replay", "latency ms"],
        lambda key, margin, m: [key[len("decode_replay["):-1], margin, f"{m['agreement']:.2f}", _answer_cells(m),
                                f"{m['recomputed_tokens']:.0f}", f"{m['decode_replayed']:.2f}",
                                _fmt(m["decode_replay_at_token"], ".1f"), f"{m['latency_ms']:.0f}"])


def _adaptive_section(summary: dict) -> list[str]:
    """Adaptive budget rows: fidelity, cost, spent budget and the signal's calibration."""
    return _keyed_section(
        summary, _adaptive_keys(summary), "Adaptive budget (budget='auto'; our extension, fixed b is the reference)",
        "Calibration: `diverged given signal stop` = share of the repairs the signal stopped (not the cap) whose greedy "
        "answer differs from Re-prefill's; `TF<1 given signal stop` the same for any teacher-forced disagreement.",
        ["signal", "tolerance", "agreement", "TF agreement", "TF KL", "common prefix", "recomputed", "spent budget %",
         "rounds", "query rows re-run", "stopped by signal", "by cap", "diverged given signal stop",
         "TF<1 given signal stop", "latency ms"],
        lambda key, tol, m: [key, tol, f"{m['agreement']:.2f}", _answer_cells(m), f"{m['recomputed_tokens']:.0f}",
                             f"{m['spent_budget']:.1f}", f"{m['rounds']:.1f}", f"{m['probe_tokens']:.1f}",
                             f"{m['stopped_by_signal']:.2f}", f"{m['stopped_by_cap']:.2f}",
                             _fmt(m["signal_stops_diverged"]), _fmt(m["signal_stops_tf_below_1"]),
                             f"{m['latency_ms']:.0f}"])


def _group_table(groups: dict, metric: str, spec: str) -> list[str]:
    """One markdown table: methods × groups (e.g. NIAH lengths, QA datasets) of ``metric``."""
    methods = list(next(iter(groups.values())).keys()) if groups else []
    lines = ["| method | " + " | ".join(f"{g} (n={v[methods[0]]['n']})" for g, v in groups.items()) + " |",
             "|---|" + "---|" * len(groups)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(_fmt(groups[g].get(m, {}).get(metric), spec) for g in groups) + " |")
    return lines


def plots(summary: dict, out: Path) -> list[Path]:
    """fidelity_vs_budget.png (agreement and EM per allocator) and fidelity_vs_latency.png."""
    plt = agg_pyplot()

    allocators = [a for a in ALLOCATOR_TITLES if a in summary] + _variants(summary)
    paths = []
    panels = (("agreement", "agreement with Re-prefill"), ("em", "EM"), ("nr_tv", "NR_TV (median, eq. 14)"))
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    all_budgets = sorted({float(b) for a in allocators for b in summary[a]})
    for ax, (metric, label) in zip(axes, panels):
        for a in allocators:
            budgets = sorted(summary[a], key=float)
            ys = [summary[a][b][metric] for b in budgets]
            ax.plot([float(b) for b in budgets], [float("nan") if y is None else y for y in ys], marker="o",
                    label=ALLOCATOR_TITLES.get(a, a))
        for ref, style in (("shift", ":"), ("replay", "--"), ("reprefill", "-")):
            if ref in summary and summary[ref][metric] is not None:
                ax.axhline(summary[ref][metric], color="k", linestyle=style, linewidth=1, label=ref)
        ax.set_xscale("log")
        ax.set_xticks(all_budgets, [f"{b:g}" for b in all_budgets])
        ax.minorticks_off()
        ax.set_xlabel("suffix budget b (%)")
        ax.set_ylabel(label)
        if metric != "nr_tv":
            ax.set_ylim(-0.02, 1.02)
    axes[2].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{summary['meta']['task']}: fidelity vs budget ({summary['meta']['n_cases']} cases, {summary['meta']['model']})")
    fig.tight_layout()
    paths.append(out / "fidelity_vs_budget.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    for a in allocators:
        budgets = sorted(summary[a], key=float)
        ax.plot([summary[a][b]["latency_ms"] for b in budgets], [summary[a][b]["agreement"] for b in budgets],
                marker="o", label=ALLOCATOR_TITLES.get(a, a))
    for ref, marker in (("shift", "s"), ("replay", "^"), ("reprefill", "*")):
        if ref in summary:
            ax.scatter([summary[ref]["latency_ms"]], [summary[ref]["agreement"]], marker=marker, s=90, color="k", zorder=5)
            ax.annotate(ref, (summary[ref]["latency_ms"], summary[ref]["agreement"]), fontsize=8)
    ax.set_xlabel("mean post-edit latency (ms, incl. answer decoding)")
    ax.set_ylabel("agreement with Re-prefill")
    ax.legend(fontsize=7)
    ax.set_title("fidelity vs latency")
    fig.tight_layout()
    paths.append(out / "fidelity_vs_latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    paths.append(frontier_plot(summary, out / "frontier.png"))
    return paths


def frontier_plot(summary: dict, path: Path) -> Path:
    """Agreement and teacher-forced agreement vs mean recomputed tokens: references, every fixed
    budget curve, selection variants, the adaptive budget at its tolerances and decode-time
    Replay at its margins."""
    plt = agg_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    curves = ([a for a in ALLOCATOR_TITLES if a in summary] + _variants(summary) + _adaptive_keys(summary)
              + _decode_replay_keys(summary))
    for ax, (metric, label) in zip(axes, (("agreement", "exact-answer agreement with Re-prefill"),
                                          ("tf_agreement", "teacher-forced top-1 agreement"))):
        for name in curves:
            points = sorted((m["recomputed_tokens"], m.get(metric)) for m in summary[name].values() if m.get(metric) is not None)
            if points:
                style = (dict(marker="D", linewidth=2.2) if name.startswith("adaptive") else
                         dict(marker="P", linewidth=2.2) if name.startswith("decode_replay") else dict(marker="o", linewidth=1))
                ax.plot([p[0] for p in points], [p[1] for p in points], label=ALLOCATOR_TITLES.get(name, name), **style)
        for ref, marker in (("shift", "s"), ("replay", "^"), ("reprefill", "*")):
            if ref in summary and summary[ref].get(metric) is not None:
                ax.scatter([summary[ref]["recomputed_tokens"]], [summary[ref][metric]], marker=marker, s=90, color="k", zorder=5)
                ax.annotate(ref, (summary[ref]["recomputed_tokens"], summary[ref][metric]), fontsize=8)
        if "replay" in summary:
            ax.axvline(0.25 * summary["replay"]["recomputed_tokens"], color="grey", linestyle=":", linewidth=1,
                       label="25 % of Replay's recomputed tokens")
        ax.set_xlabel("mean recomputed tokens per repair")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=7, loc="lower right")
    meta = summary["meta"]
    fig.suptitle(f"{meta['task']}: fidelity frontier ({meta['n_cases']} cases, {meta['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(out: Path, records: list[dict], meta: dict) -> dict:
    """Write summary.json, report.md and the plots from the finished case records."""
    summary = summarize(records, meta)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "report.md").write_text(markdown(summary))
    if records:
        plots(summary, out)
    return summary


def _answers_note(meta: dict) -> str:
    if meta.get("answers") != "verified":
        return "Every answer is decoded step by step."
    return ("Allocator answers are greedy answers verified against Re-prefill's answer in one forward (speculative "
            "decoding with greedy verification: the same tokens as step-by-step decoding); their answer ms = answer "
            "tokens × the case's measured Re-prefill ms/token, so latencies compare repair cost. References are "
            "decoded step by step.")
