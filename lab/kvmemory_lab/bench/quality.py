"""``kvmemory bench quality``: repair fidelity on Erasing-NIAH and natural multi-hop QA (paper §4.2, §4.3, Appendix 8).

For every case, one KVSession prefills the pre-edit history once (untimed); every method then
starts from a fork of that cache, applies the deletion plus the query under its policy and
decodes greedily. The references (Re-prefill, Dirty, Shift, Replay) run once per case and are
reused for every allocator and budget. Per case and method it records the answer, EM, agreement
with Re-prefill's greedy answer, first-token KL(p_reprefill ‖ p_method), TV, NR_TV (eq. 14), the
leak of the deleted needle's value, the latency split (selection, Shift, refresh, answer) and
the recomputed positions and intervals. Cases are appended to ``cases.jsonl`` as they finish, so
an interrupted run resumes where it stopped, and several processes on one ``--out`` split the
remaining cases (``worklist``: claims plus locked appends); ``summary.json``, ``report.md`` and
PNG plots are rewritten from all finished cases.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from kvmemory.policy import RepairPolicy
from kvmemory.selection import ALLOCATOR_NAMES, KNOWN_ALLOCATORS, allowance, shared_signals
from kvmemory.session import KVSession

from ..demo_cases import default_data_dir
from ..evaluation import QA_DATASETS, EvalCase, niah_cases, qa_cases
from ..evaluation.answer_fidelity import answer_fidelity, teacher_forced_logits, with_decode_replay
from ..evaluation.decoding import verified_greedy
from ..metrics import (
    answers_agree,
    first_token_kl,
    first_token_tv,
    leaked,
    niah_exact_match,
    normalized_recovery,
    qa_exact_match,
)
from .quality_report import write_outputs
from .worklist import append_record, claim, done_ids, release

REFERENCES = ("reprefill", "dirty", "shift", "replay")
QA_ALLOCATORS = ("sur", "bm25", "cacheblend", "infoflow", "prophetkv")  # the paper's QA comparison (§4.3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=("niah", "qa"), default="niah", help="Erasing-NIAH or natural multi-hop QA")
    parser.add_argument("--budgets", default="2,5,10,20,40,80", help="suffix budgets b in %% (comma list)")
    parser.add_argument("--allocators", default=None,
                        help=f"comma list or 'all' (NIAH default: all 14; QA default: {','.join(QA_ALLOCATORS)})")
    parser.add_argument("--methods", default="",
                        help="further policy labels (comma list), e.g. adaptive budgets sur@auto:0.001, "
                             "sur@auto:kv_change:0.05 or selection options sur+idf@5, sur+tail32@5")
    parser.add_argument("--no-fixed", action="store_true",
                        help="skip the allocators x budgets grid (run only the references and --methods)")
    parser.add_argument("--cases", type=int, default=None, help="NIAH: cases per length (default 5, one per variant); QA: sources per dataset (default 5)")
    parser.add_argument("--lengths", default="1024,2048,4096", help="NIAH prompt lengths in tokens")
    parser.add_argument("--datasets", default=",".join(QA_DATASETS), help="QA datasets (comma list)")
    parser.add_argument("--edits", default=None,
                        help="QA: HotpotQA distractor-setting histories padded to --lengths, one case per edit kind "
                             "and source (comma list of delete, replace, summary; --cases = sources per length) "
                             "instead of the four datasets' placement cases")
    parser.add_argument("--data", type=Path, default=None, help="shared data folder (default ../shared/data)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results/quality_<task>)")
    parser.add_argument("--quick", action="store_true", help="a few small cases and budgets 2,5 (a few minutes)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="greedy answer limit in tokens, EOS stops earlier (default: NIAH 32, QA 24)")
    parser.add_argument("--model", default=None, help="model: a name of kvmemory_lab.gguf_models (qwen2.5-coder-0.5b, qwen2.5-coder-1.5b), a .gguf file or a folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--seed", type=int, default=0, help="case-construction and random-allocator seed")
    parser.add_argument("--answers", choices=("verified", "stepwise"), default="verified",
                        help="allocator answers: greedy verified against Re-prefill's answer in one forward "
                             "(same tokens, ~10x faster; answer ms then = tokens x Re-prefill's measured ms/token) "
                             "or decoded step by step (default verified)")
    parser.add_argument("--shard", default=None, metavar="K/N",
                        help="run only cases i with i %% N == K (0 <= K < N), a fixed split (e.g. across machines); "
                             "processes on one --out share the remaining cases anyway")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite summary.json, report.md and plots from the cases already in --out/cases.jsonl")
    parser.add_argument("--pool", default=None, metavar="DIR,DIR,...",
                        help="with --report-only: write one report into --out from the cases of these finished "
                             "runs (e.g. held-out seeds run apart); their cases must not overlap")
    parser.add_argument("--merge", default=None, metavar="DIR,DIR,...",
                        help="with --report-only: one report from runs of other methods on the same cases (the "
                             "cases all of them finished); the references they share must have given the same answers")


def _settings(args) -> dict:
    """Resolved run settings (``--quick`` shrinks the defaults; explicit flags still win)."""
    quick = args.quick
    budgets = [float(b) for b in (args.budgets if not quick or args.budgets != "2,5,10,20,40,80" else "2,5").split(",")]
    if args.allocators in (None, ""):
        allocators = list(ALLOCATOR_NAMES if args.task == "niah" else QA_ALLOCATORS)
    elif args.allocators == "all":
        allocators = list(ALLOCATOR_NAMES)
    else:
        allocators = [a.strip() for a in args.allocators.split(",") if a.strip()]
    unknown = [a for a in allocators if a.split("+")[0] not in KNOWN_ALLOCATORS]
    if unknown:
        raise SystemExit(f"unknown allocator(s) {', '.join(unknown)}: use {', '.join(KNOWN_ALLOCATORS)} or 'all'")
    methods = [m.strip() for m in getattr(args, "methods", "").split(",") if m.strip()]
    for label in methods + [f"{a}@5" for a in allocators]:
        try:
            RepairPolicy.coerce(label)
        except ValueError as exc:
            raise SystemExit(f"--methods / --allocators: {exc}") from None
    lengths = [int(x) for x in (args.lengths if not quick or args.lengths != "1024,2048,4096" else "1024").split(",")]
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    # NIAH: 5 = one case of each variant (first early, second late, second early, first late, control)
    cases = args.cases if args.cases is not None else (2 if quick else 5)
    if quick and args.task == "qa" and args.datasets == ",".join(QA_DATASETS):
        datasets = ["hotpotqa", "musique"]
    return {"task": args.task, "budgets": budgets, "allocators": allocators, "lengths": lengths,
            "datasets": datasets, "cases": cases, "seed": args.seed, "methods": methods,
            "fixed": not getattr(args, "no_fixed", False),
            "edits": [e.strip() for e in args.edits.split(",") if e.strip()] if getattr(args, "edits", None) else None,
            "max_new_tokens": args.max_new_tokens or (32 if args.task == "niah" else 24),
            "answers": getattr(args, "answers", "stepwise")}


def build_cases(settings: dict, data_dir: Path, tokenizer) -> list[EvalCase]:
    if settings["task"] == "niah":
        return niah_cases(data_dir, tokenizer, settings["lengths"], settings["cases"], settings["seed"])
    if settings.get("edits"):
        from ..evaluation.hotpot_edits import hotpot_edit_cases

        return hotpot_edit_cases(data_dir, tokenizer, settings["lengths"], settings["cases"], settings["seed"],
                                 settings["edits"])
    return qa_cases(data_dir, settings["datasets"], settings["cases"], settings["seed"])


def _score(case: EvalCase, text: str) -> tuple[bool, bool | None]:
    if case.task == "niah":
        return niah_exact_match(text, case.gold), leaked(text, case.leak_value)
    return qa_exact_match(text, case.gold, case.dataset), None


def run_case(session: KVSession, case: EvalCase, settings: dict) -> dict:
    """Every reference and allocator × budget on one case; returns its JSONL record."""
    session.reset()
    dirty_tokens = session.prepare(case.dirty_messages()).prompt_tokens
    edited = case.edited_messages()
    # the Re-prefill reference rebuilds the whole edited prompt whatever the edit (forced form)
    policies = [(name, RepairPolicy(operator=name, scope="always" if name == "reprefill" else "edits"))
                for name in REFERENCES]
    grid = [f"{a}@{b:g}" for b in settings["budgets"] for a in settings["allocators"]] if settings.get("fixed", True) else []
    for label in grid + list(settings.get("methods", [])):
        policy = RepairPolicy.coerce(label).model_copy(update={"seed": settings["seed"]})
        policies.append((policy.label, policy))
    runs, rows, reference_rows = {}, [], {}
    with shared_signals():  # each probe runs once per case; reuses are charged its measured time
        for label, policy in policies:
            rows.append(_run_method(session, case, settings, edited, label, policy, runs, reference_rows))
    reference = rows[0]
    return {"case_id": case.case_id, "task": case.task, "dataset": case.dataset, "source_id": case.source_id,
            "gold": list(case.gold), "leak_value": case.leak_value, "deleted": list(case.deleted),
            "query": case.query, "meta": dict(case.meta), "dirty_prompt_tokens": dirty_tokens,
            "edited_prompt_tokens": reference["recomputed_tokens"], "methods": rows}


def _run_method(session: KVSession, case: EvalCase, settings: dict, edited, label: str, policy: RepairPolicy,
                runs: dict, reference_rows: dict) -> dict:
    """One method on a fork of the case's pre-edit session: repair, greedy answer, metrics row.
    ``reference_rows["reprefill"]`` holds Re-prefill's teacher-forced rows once its answer is known."""
    fork = session.fork()
    report = fork.prepare(edited, policy=policy)
    stale_after_repair = fork.exact_rows < len(fork.token_ids)
    # Re-prefill runs first: its answer is scored on an untouched copy once decoded; every other
    # method scores that answer teacher-forced before decoding its own (the rows are cropped again)
    probe = fork.fork() if label == "reprefill" else None
    rows = None if probe is not None else teacher_forced_logits(fork, runs["reprefill"].token_ids)
    # decode-time Replay acts inside the session's own decoding: those answers go step by step
    verified = settings["answers"] == "verified" and label not in REFERENCES and not policy.replay_margin
    if verified:  # proposals: Re-prefill's answer first, then every answer already decoded on this case
        others = [g.token_ids for name, g in runs.items() if name != "reprefill"]
        gen = verified_greedy(fork, runs["reprefill"].token_ids, settings["max_new_tokens"], alternatives=others)
    else:
        gen = fork.generate(max_new_tokens=settings["max_new_tokens"])
    runs[label] = gen
    if probe is not None:
        reference_rows["reprefill"] = rows = teacher_forced_logits(probe, gen.token_ids)
    ref, dirty = runs["reprefill"], runs.get("dirty", gen)
    pre_edit = label not in ("reprefill", "dirty")  # the pre-edit (Dirty) answer is known from here on
    # verified answers cost one forward; latency tables charge step-by-step decoding at the
    # case's measured Re-prefill rate so that allocators compare on repair cost
    answer_ms = len(gen.token_ids) * _ms_per_token(ref) if verified else gen.decode_ms
    tv = first_token_tv(ref.first_logits, gen.first_logits)
    tv_dirty = first_token_tv(ref.first_logits, dirty.first_logits)
    em, leak = _score(case, gen.text)
    B = allowance(report.stale_tokens, policy.budget) if policy.operator == "refresh" and not policy.adaptive else None
    if B is not None and report.refreshed_tokens != B and not report.fallback:
        raise RuntimeError(f"{label} refreshed {report.refreshed_tokens} positions, allowance is {B} (a bug)")
    other = report.latency_ms - report.selection_ms - report.shift_ms - report.refresh_ms
    if policy.replay_margin and stale_after_repair:  # forced along Re-prefill's answer, it replays as it decodes
        rows = with_decode_replay(rows, reference_rows["reprefill"], policy.replay_margin)
    fidelity = answer_fidelity(reference_rows["reprefill"], rows, ref.token_ids, gen.token_ids)
    return {
        "method": label,
        "allocator": policy.allocator if policy.operator == "refresh" else None,
        "budget": policy.budget if policy.operator == "refresh" else None,
        "spent_budget": report.budget,
        "adaptive": report.adaptive,
        "answer": gen.text,
        "em": em,
        "leak": leak,
        "agree": answers_agree(gen.text, ref.text),
        "kl": first_token_kl(ref.first_logits, gen.first_logits),
        # edit sensitivity, measurable without Re-prefill: how far the repair moved the pre-edit answer
        "kl_pre_edit": first_token_kl(dirty.first_logits, gen.first_logits) if pre_edit else None,
        "pre_edit_agree": answers_agree(gen.text, dirty.text) if pre_edit else None,
        "tv": tv,
        "nr_tv": normalized_recovery(tv, tv_dirty),
        "tf_agree": fidelity.tf_agreement,
        "tf_kl": fidelity.tf_kl,
        "common_prefix": fidelity.common_prefix,
        "answer_tokens": len(gen.token_ids),
        "reference_tokens": len(ref.token_ids),
        "selection_ms": report.selection_ms,
        "shift_ms": report.shift_ms,
        "refresh_ms": report.refresh_ms,
        "other_ms": other,
        "answer_ms": answer_ms,
        "answer_mode": "verified" if verified else "stepwise",
        "decode_ms": gen.decode_ms,
        "post_edit_ms": report.latency_ms + answer_ms,
        "stale_tokens": report.stale_tokens,
        "allowance": B,
        "refreshed_tokens": report.refreshed_tokens,
        # decode-time Replay's rows count as recomputed: they are part of what the answer cost
        "recomputed_tokens": report.recomputed_tokens + (report.decode_replay or {}).get("recomputed_tokens", 0),
        "decode_replay": report.decode_replay,
        "intervals": report.intervals,
        "spans": [list(s) for s in report.spans],
        "fallback": report.fallback,
    }


def _parse_shard(text: str | None) -> tuple[int, int]:
    """``"K/N"`` -> (K, N); None -> (0, 1). Raises SystemExit naming the fix on bad input."""
    if not text:
        return 0, 1
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"--shard must look like K/N, e.g. 0/2 (got {text!r})") from None
    if n < 1 or not 0 <= k < n:
        raise SystemExit(f"--shard K/N needs 0 <= K < N (got {text!r})")
    return k, n


def _ms_per_token(reference) -> float:
    """Measured step-by-step decode time per answer token of a reference Generation (ms)."""
    return reference.decode_ms / max(1, len(reference.token_ids))


def load_records(path: Path) -> list[dict]:
    """Every complete case record of ``path``."""
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def pool_runs(folders: list[Path]) -> tuple[list[dict], dict]:
    """The case records of several finished runs and a config naming them (``pooled_from``, seeds).
    Adaptive methods are relabelled ``<allocator>@auto:<signal>:<tolerance>`` from what their
    repairs report, so runs made when another signal was the default pool by signal.

    Raises:
        SystemExit: a folder without cases, or a case found in two runs."""
    records, configs, seen = [], [], set()
    for folder in folders:
        found = load_records(folder / "cases.jsonl")
        if not found:
            raise SystemExit(f"--pool: no finished cases in {folder / 'cases.jsonl'}")
        twice = seen & {r["case_id"] for r in found}
        if twice:
            raise SystemExit(f"--pool: {folder} repeats cases of an earlier run ({sorted(twice)[0]}, ...): pool disjoint runs")
        seen |= {r["case_id"] for r in found}
        for record in found:
            for row in record["methods"]:
                if row.get("adaptive"):
                    info = row["adaptive"]
                    row["method"] = f"{row['method'].split('@')[0]}@auto:{info['signal']}:{info['tolerance']:g}"
        records += found
        configs.append(json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {})
    meta = {**configs[0], "pooled_from": [str(f) for f in folders], "seed": [c.get("seed") for c in configs]}
    return records, meta


def merge_runs(folders: list[Path]) -> tuple[list[dict], dict]:
    """The cases every run in ``folders`` finished, each with the union of the runs' methods (a
    method two runs share is kept from the first), and a config naming them (``merged_from``).

    Raises:
        SystemExit: a folder without cases, no case common to all, or a shared method whose answer
            differs between runs on a case (the runs would not be comparable: another model,
            seed or arithmetic)."""
    runs = []
    for folder in folders:
        found = {r["case_id"]: r for r in load_records(folder / "cases.jsonl")}
        if not found:
            raise SystemExit(f"--merge: no finished cases in {folder / 'cases.jsonl'}")
        runs.append(found)
    common = [case for case in runs[0] if all(case in run for run in runs[1:])]
    if not common:
        raise SystemExit(f"--merge: no case is finished in all of {', '.join(map(str, folders))}: merge runs of the same cases")
    records = []
    for case in common:
        merged = dict(runs[0][case], methods=[])
        seen: dict[str, str] = {}
        for run, folder in zip(runs, folders):
            for row in run[case]["methods"]:
                if row["method"] not in seen:
                    seen[row["method"]] = row["answer"]
                    merged["methods"].append(row)
                elif seen[row["method"]] != row["answer"]:
                    raise SystemExit(f"--merge: {row['method']} answered differently in {folder} on {case}: "
                                     "these runs are not of the same model, seed and arithmetic")
        records.append(merged)
    configs = [json.loads((f / "config.json").read_text()) if (f / "config.json").is_file() else {} for f in folders]
    methods = [m for c in configs for m in c.get("methods", [])]
    meta = {**configs[0], "methods": list(dict.fromkeys(methods)), "merged_from": [str(f) for f in folders],
            "allocators": list(dict.fromkeys(a for c in configs for a in c.get("allocators", []))),
            "budgets": sorted({b for c in configs for b in c.get("budgets", [])})}
    return records, meta


def run(args, console) -> int:
    from tqdm import tqdm

    from kvmemory.models import load_model

    from ..gguf_models import resolve_model

    settings = _settings(args)
    shard, shards = _parse_shard(args.shard)
    data_dir = args.data or default_data_dir()
    if data_dir is None or not Path(data_dir).is_dir():
        console.print("[red]no data folder: pass --data pointing at the shared data (hotpotqa/, niah_haystack/, ...)")
        return 2
    out = args.out or Path("benchmarks/results") / f"quality_{settings['task']}"
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "cases.jsonl"
    combine = merge_runs if args.merge else pool_runs if args.pool else None
    if args.report_only and combine is not None:
        folders = [Path(d) for d in (args.merge or args.pool).split(",") if d.strip()]
        records, meta = combine(folders)
        (out / "config.json").write_text(json.dumps(meta, indent=2))
        summary = write_outputs(out, records, meta)
        how = "merged the methods of" if args.merge else "pooled the cases of"
        console.print(f"{how} {len(folders)} runs into {out} ({summary['meta']['n_cases']} cases)")
        return 0
    if args.report_only:
        meta = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else settings
        summary = write_outputs(out, load_records(jsonl), meta)
        console.print(f"rewrote {out / 'summary.json'} and report.md from {summary['meta']['n_cases']} finished cases")
        return 0
    loaded = load_model(resolve_model(args.model), dtype=args.dtype)
    cases = build_cases(settings, Path(data_dir), loaded.tokenizer)
    done = done_ids(jsonl)
    todo = [c for i, c in enumerate(cases) if c.case_id not in done and i % shards == shard]
    meta = {
        "model": loaded.name, "dtype": args.dtype, "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "data": str(data_dir), **settings,
        "speccache_auxiliary_model": f"{loaded.name} (the embedded model itself, not Llama-3.2-1B)",
        "privileged": ["oracle"], "executor": "executor auto (one interval: direct sequential; several: packed SDPA)",
    }
    (out / "config.json").write_text(json.dumps(meta, indent=2))
    console.print(f"quality/{settings['task']}: {len(cases)} cases ({len(done)} already done) -> {out}")
    session = KVSession(loaded.model, loaded.tokenizer)
    claims = out / ".claims"
    for case in tqdm(todo, desc=f"quality {settings['task']}", unit="case"):
        # another process on the same --out may have finished or be running this case
        if case.case_id in done_ids(jsonl) or not claim(claims, case.case_id):
            continue
        try:
            t0 = time.perf_counter()
            record = run_case(session, case, settings)
            record["case_seconds"] = time.perf_counter() - t0
            append_record(jsonl, record)
        finally:
            release(claims, case.case_id)
    records = [r for r in load_records(jsonl) if r["case_id"] in {c.case_id for c in cases}]
    summary = write_outputs(out, records, meta)
    console.print(f"wrote {out / 'summary.json'}, {out / 'report.md'} and plots ({summary['meta']['n_cases']} cases)")
    return 0
