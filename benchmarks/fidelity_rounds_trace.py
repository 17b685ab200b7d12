"""Tuning data for the adaptive budget: per-round convergence signals against answer agreement.

For each quality case (QA by default; seed 7 and hotpotqa / musique, apart from the held-out
benchmark cases of seed 0), the adaptive refresh runs with tolerance 0 up to a 64 % cap
(kv_change signal, no stop). After every round the whole query is recomputed on a copy of the
cache and the copy answers greedily (verified against Re-prefill's answer). Per round it records
the answer agreement with Re-prefill, teacher-forced agreement / KL, the first-token KL to
Re-prefill, the kv_change value, and the query next-token KL to the previous round (round 0 =
Shift), i.e. the query_kl value. ``--simulate`` replays the stop rules offline on that trace:
stop at the first round below a tolerance, Replay when none is (cost: rows refreshed + query
rows, plus the Replay).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fidelity_rounds_trace.py --out trace.jsonl --sources 3
    .venv/bin/python benchmarks/fidelity_rounds_trace.py --out trace.jsonl --simulate
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def trace(out: Path, sources: int, seed: int, data: Path) -> None:
    import torch

    from kvmemory import adaptive, kvcache
    from kvmemory_lab.evaluation import qa_cases
    from kvmemory_lab.evaluation.answer_fidelity import answer_fidelity, teacher_forced_logits
    from kvmemory_lab.evaluation.decoding import verified_greedy
    from kvmemory.executors.sequential import run_direct
    from kvmemory.divergence import first_token_kl
    from kvmemory.models import load_model
    from kvmemory.policy import RepairPolicy
    from kvmemory.session import KVSession

    torch.set_num_threads(1)
    lm = load_model()
    cases = qa_cases(data, ["hotpotqa", "musique"], sources, seed=seed)
    done = {json.loads(line)["case_id"] for line in out.open()} if out.exists() else set()
    session = KVSession(lm.model, lm.tokenizer)
    for case in cases:
        if case.case_id in done:
            continue
        t0 = time.time()
        session.reset()
        session.prepare(case.dirty_messages())
        edited = case.edited_messages()
        fork = session.fork()
        fork.prepare(edited, policy=RepairPolicy(operator="reprefill", scope="always"))
        probe = fork.fork()
        ref = fork.generate(max_new_tokens=24)
        ref_rows = teacher_forced_logits(probe, ref.token_ids)

        def evaluate(state):
            rows = teacher_forced_logits(state, ref.token_ids)
            answer = verified_greedy(state, ref.token_ids, 24)
            fid = answer_fidelity(ref_rows, rows, ref.token_ids, answer.token_ids)
            return {"agree": answer.text.strip() == ref.text.strip(), "tf": fid.tf_agreement, "tf_kl": fid.tf_kl,
                    "cp": fid.common_prefix, "kl_ref": first_token_kl(ref.first_logits, answer.first_logits)}, answer.first_logits

        fork = session.fork()
        shift_report = fork.prepare(edited, policy="shift")
        shift_eval, p0 = evaluate(fork)
        replay_report = session.fork().prepare(edited, policy="replay")
        states = []
        policy = RepairPolicy(budget="auto", tolerance=0.0, signal="kv_change", max_budget=64.0, on_cap="keep")
        with adaptive.observe_rounds(lambda info, cache: states.append((info, kvcache.clone_cache(cache)))):
            fork = session.fork()
            fork.prepare(edited, policy=policy)
        qstart = fork.rendered.segments[-1].token_start
        ids = torch.tensor(fork.token_ids)
        rounds, prev = [], p0
        for info, cache in states:
            state = fork.fork()
            state.cache = cache
            state.next_logits = run_direct(lm.model, cache, ids, [(qstart, len(ids))]).next_logits
            ev, p = evaluate(state)
            ev.update(allowance=info["allowance"], refreshed=info["refreshed"], kv_change=info["value"],
                      query_kl_prev=first_token_kl(prev, p), query_kl_shift=first_token_kl(p0, p))
            rounds.append(ev)
            prev = p
        record = {"case_id": case.case_id, "source_id": case.source_id, "S": shift_report.stale_tokens, "N": len(ids),
                  "query_tokens": len(ids) - qstart, "shift_recomputed": shift_report.recomputed_tokens,
                  "replay_recomputed": replay_report.recomputed_tokens, "shift": shift_eval, "rounds": rounds,
                  "seconds": time.time() - t0}
        with out.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        print(case.case_id, f"{time.time() - t0:.0f} s", flush=True)


def simulate(out: Path) -> None:
    recs = [json.loads(line) for line in out.open()]
    replay = sum(r["replay_recomputed"] for r in recs) / len(recs)
    print(f"{len(recs)} cases; Shift agrees on {sum(r['shift']['agree'] for r in recs)}; Replay recomputes {replay:.0f}")
    print("| signal | tolerance | agreement | mean recomputed | % of Replay | signal stops | of which diverged |")
    print("|---|---|---|---|---|---|---|")
    for signal, tolerances in (("query_kl", (1e-5, 3e-5, 1e-4, 3e-4, 1e-3)), ("kv_change", (0.03, 0.05, 0.06, 0.07, 0.1, 0.15))):
        for tol in tolerances:
            agree = cost = stops = wrong = 0
            for r in recs:
                q, rounds, spent, stop = r["query_tokens"], r["rounds"][:5], 0, None  # cap 32 %: 5 rounds
                cost += q
                for x in rounds:
                    cost += x["refreshed"] - spent + (q if signal == "query_kl" else 0)
                    spent = x["refreshed"]
                    if x["query_kl_prev" if signal == "query_kl" else "kv_change"] < tol:
                        stop = x
                        break
                if stop is None:
                    agree += 1
                    cost += r["replay_recomputed"]
                else:
                    stops += 1
                    wrong += not stop["agree"]
                    agree += stop["agree"]
            n = len(recs)
            print(f"| {signal} | {tol:g} | {agree / n:.2f} | {cost / n:.0f} | {100 * cost / n / replay:.0f} | {stops} | {wrong} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sources", type=int, default=3, help="sources per dataset (3 placements each)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    parser.add_argument("--simulate", action="store_true", help="only replay the stop rules on --out")
    args = parser.parse_args()
    if not args.simulate:
        trace(args.out, args.sources, args.seed, args.data)
    simulate(args.out)


if __name__ == "__main__":
    main()
