"""How often does Re-prefill itself change its answer when only the arithmetic changes?

Exact-answer agreement with Re-prefill is the repair target. This measures the same metric for
Re-prefills that differ from the reference only in precision or kernels, on the very cases of
finished ``kvmemory bench quality`` runs, and puts the repairs of those runs beside them:

- ``transformers``: the model's own fp32 forward instead of the GGUF-block engine (same weights,
  other summation order: ~1e-6 relative);
- ``q4_1_bf16``: the engine with bf16 linears for prefills (decoding stays fp32);
- ``bf16``: the whole model in bf16 (what a user picks for speed or memory).

Per case and variant: the variant's greedy answer vs the reference Re-prefill's (exact text),
teacher-forced top-1 agreement and mean KL over the reference's answer, common prefix and
first-token KL, the same measures the repairs are judged by. The reference is rerun and checked
against the answer the run recorded.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fidelity_precision_floor.py \
        --runs benchmarks/results/fidelity/qa,benchmarks/results/fidelity/qa_seed1,benchmarks/results/fidelity/qa_seed2 \
        --out benchmarks/results/fidelity/precision_floor/qa48
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

VARIANTS = {"transformers": ("fp32", "transformers"), "q4_1_bf16": ("fp32", "q4_1_bf16"), "bf16": ("bf16", "auto")}
REPAIRS = ["shift", "sur@2", "sur@5", "sur@10", "sur@20", "sur@25", "sur@40", "sur@auto:kv_change:0.06", "sur@5:margin=0.01", "replay"]


def rebuild_cases(run: Path, tokenizer) -> tuple[list, dict[str, dict], dict]:
    """The cases of a finished bench-quality run (rebuilt from its config), its records by case id and its config."""
    from kvmemory_lab.bench.quality import build_cases, load_records

    config = json.loads((run / "config.json").read_text())
    records = {r["case_id"]: r for r in load_records(run / "cases.jsonl")}
    cases = [c for c in build_cases(config, Path(config["data"]), tokenizer) if c.case_id in records]
    if len(cases) != len(records):
        raise SystemExit(f"{run}: rebuilt {len(cases)} of its {len(records)} cases; is the data folder the same?")
    return cases, records, config


def reprefill(session, messages, max_new_tokens: int):
    """Greedy answer of a fresh prefill of ``messages``, and a fork holding the prompt for teacher forcing."""
    session.reset()
    session.prepare(messages)
    probe = session.fork()
    return session.generate(max_new_tokens=max_new_tokens), probe


def measure_case(case, record: dict, reference_session, variant_sessions: dict, max_new_tokens: int) -> dict:
    from kvmemory.divergence import first_token_kl
    from kvmemory_lab.evaluation.answer_fidelity import answer_fidelity, teacher_forced_logits
    from kvmemory_lab.metrics import answers_agree

    messages = case.edited_messages()
    ref, probe = reprefill(reference_session, messages, max_new_tokens)
    ref_rows = teacher_forced_logits(probe, ref.token_ids)
    recorded = {row["method"]: row for row in record["methods"]}
    out = {"case_id": case.case_id, "task": case.task, "dataset": case.dataset, "reference": ref.text,
           "reference_matches_run": answers_agree(ref.text, recorded["reprefill"]["answer"]), "variants": {}}
    for name, session in variant_sessions.items():
        t0 = time.perf_counter()
        gen, variant_probe = reprefill(session, messages, max_new_tokens)
        rows = teacher_forced_logits(variant_probe, ref.token_ids)
        fid = answer_fidelity(ref_rows, rows, ref.token_ids, gen.token_ids)
        out["variants"][name] = {"answer": gen.text, "agree": answers_agree(gen.text, ref.text),
                                 "tf_agreement": fid.tf_agreement, "tf_kl": fid.tf_kl,
                                 "common_prefix": fid.common_prefix,
                                 "kl": first_token_kl(ref.first_logits, gen.first_logits),
                                 "seconds": time.perf_counter() - t0}
    return out


def repair_rows(runs: list[Path]) -> dict[str, dict[str, dict]]:
    """The recorded repairs of the runs, as the variants' measures: case id -> method -> row."""
    from kvmemory_lab.bench.quality import load_records

    out = {}
    for run in runs:
        for record in load_records(run / "cases.jsonl"):
            out[record["case_id"]] = {row["method"]: {"agree": row["agree"], "tf_agreement": row["tf_agree"],
                                                      "tf_kl": row["tf_kl"], "kl": row["kl"]}
                                      for row in record["methods"] if row["method"] in REPAIRS}
    return out


def summarise(records: list[dict], repairs: dict[str, dict[str, dict]]) -> dict:
    """Agreement of each variant and repair over the same cases, and how their divergent cases overlap."""
    import statistics

    n = len(records)
    answers = {name: [r["variants"][name] for r in records] for name in records[0]["variants"]}
    answers |= {m: [repairs[r["case_id"]][m] for r in records] for m in REPAIRS
                if all(m in repairs[r["case_id"]] for r in records)}
    rows = {name: {"agreement": sum(v["agree"] for v in vs) / n,
                   "tf_agreement": statistics.mean(v["tf_agreement"] for v in vs),
                   "tf_kl": statistics.mean(v["tf_kl"] for v in vs),
                   "first_token_kl_median": statistics.median(v["kl"] for v in vs),
                   "diverging": sorted(r["case_id"] for r, v in zip(records, vs) if not v["agree"])}
            for name, vs in answers.items()}
    overlap = {}
    for name in records[0]["variants"]:
        for method in ("shift", "sur@5"):
            if method in rows:
                a, b = set(rows[name]["diverging"]), set(rows[method]["diverging"])
                overlap[f"{name} & {method}"] = {"both": len(a & b), name: len(a), method: len(b)}
    return {"n_cases": n, "reference_reproduced": sum(r["reference_matches_run"] for r in records),
            "rows": rows, "overlap": overlap}


def report(summary: dict, meta: dict) -> str:
    lines = [f"# Re-prefill under other arithmetic vs the repairs ({summary['n_cases']} cases)", "",
             f"Model {meta['model']}, torch threads {meta['torch_threads']}, load {meta['load']}. Runs: "
             + ", ".join(f"`{r}`" for r in meta["runs"]) + ".",
             f"The reference Re-prefill reproduced the runs' recorded answer in "
             f"{summary['reference_reproduced']} of {summary['n_cases']} cases.", "",
             "| answer from | agreement with Re-prefill | TF agreement | TF KL | median first-token KL |",
             "|---|---|---|---|---|"]
    for name, row in summary["rows"].items():
        lines.append(f"| {name} | {row['agreement']:.2f} ({summary['n_cases'] - len(row['diverging'])}/{summary['n_cases']}) | "
                     f"{row['tf_agreement']:.3f} | {row['tf_kl']:.1e} | {row['first_token_kl_median']:.1e} |")
    lines += ["", "| divergent cases | both | first only | second only |", "|---|---|---|---|"]
    for pair, counts in summary["overlap"].items():
        a, b = pair.split(" & ")
        lines.append(f"| {pair} | {counts['both']} | {counts[a] - counts['both']} | {counts[b] - counts['both']} |")
    return "\n".join(lines) + "\n"


def measure_runs(runs: list[Path], variants: list[str], jsonl: Path, model: str | None = None) -> dict:
    """Every case of ``runs`` not yet in ``jsonl``, appended as it finishes; returns the run's meta."""
    import torch

    from kvmemory.models import load_model
    from kvmemory.session import KVSession
    from kvmemory_lab.bench.common import load_average, machine_name
    from kvmemory_lab.bench.worklist import append_record, done_ids

    from kvmemory_lab.gguf_models import resolve_model

    model = resolve_model(model)
    reference = load_model(model)
    reference_session = KVSession(reference.model, reference.tokenizer)
    sessions = {}
    for name in variants:
        dtype, engine = VARIANTS[name]
        lm = load_model(model, dtype=dtype, engine=engine)
        sessions[name] = KVSession(lm.model, lm.tokenizer)
    done = done_ids(jsonl)
    per_run = []
    for run in runs:
        cases, records, config = rebuild_cases(run, reference.tokenizer)
        per_run.append([(case, records[case.case_id], config) for case in cases if case.case_id not in done])
    # round robin over the runs, so that a run cut short covers every task
    for k in range(max((len(x) for x in per_run), default=0)):
        for todo in per_run:
            if k < len(todo):
                case, record, config = todo[k]
                row = measure_case(case, record, reference_session, sessions, config["max_new_tokens"])
                append_record(jsonl, row)
                print(case.case_id, {n: v["agree"] for n, v in row["variants"].items()}, flush=True)
    return {"model": reference.name, "engine": reference.engine.as_dict() if reference.engine else None,
            "torch_threads": torch.get_num_threads(), "machine": machine_name(),
            "load": load_average(), "runs": [str(r) for r in runs],
            "variants": {n: dict(zip(("dtype", "engine"), VARIANTS[n])) for n in variants},
            "command": " ".join([Path(sys.executable).name, *sys.argv])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", required=True, help="finished bench-quality folders (comma list), e.g. the held-out QA seeds")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=None,
                        help="the runs' model: a name of kvmemory_lab.gguf_models (e.g. qwen2.5-coder-0.5b), a .gguf "
                             "file or a folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--report-only", action="store_true", help="rewrite summary.json and report.md from --out/cases.jsonl")
    args = parser.parse_args(argv)
    from kvmemory_lab.bench.quality import load_records

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}: use {', '.join(VARIANTS)}")
    runs = [Path(r) for r in args.runs.split(",") if r.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "cases.jsonl"
    if args.report_only:
        meta = json.loads((args.out / "summary.json").read_text())["meta"]
    else:
        meta = measure_runs(runs, variants, jsonl, args.model)
    summary = summarise(load_records(jsonl), repair_rows(runs))
    (args.out / "summary.json").write_text(json.dumps({"meta": meta, **summary}, indent=2))
    (args.out / "report.md").write_text(report(summary, meta))
    print(report(summary, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
