"""Two conversations that show where a sparse repair answers unlike Re-prefill, per policy.

- ``name``: the user corrects an earlier message ("My name is Bob." -> "My name is Alice.",
  same id) after k further exchanges, then asks "What is my name?". The assistant replies in the
  history are the model's own greedy replies to the original conversation.
- ``deletions``: an agent chat of ~800-3,300 tokens (ten HotpotQA passages as tool results)
  from which four distractor passages are deleted one after another; after each deletion the
  question is asked again. Every policy repairs its own session across the four steps (errors
  compound, as in a live thread); each step is compared with a Re-prefill of the same history.
  ``sur@5+guard:replay`` runs SUR@5 with the fidelity guard checking every repair (``fraction=1``,
  default measure; ``:raise_budget`` the other action, no suffix the default action); its
  later repairs use the escalated policy (the check is awaited before the next step: the
  guard's best case). A decode-time Replay label (``sur@5:margin=0.01``) decodes the answer in
  the thread's own session, so the exact rows of a replay carry to the next step; its
  recomputed tokens include the replayed rows.

Per repair: greedy answer vs Re-prefill's (exact text), teacher-forced top-1 agreement and KL over
Re-prefill's answer, common prefix, first-token KL, recomputed tokens, and whether the fidelity
guard at its defaults (``teacher_forced``) and the first-token measure at 1e-2 would escalate.
``oracle@5`` (privileged: ranks rows by their K/V deviation from a Re-prefill) is a localisation
reference, not a policy.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fidelity_scenarios.py --out benchmarks/results/fidelity/scenarios
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

NAMES = [("Bob", "Alice"), ("Tom", "Maria"), ("Peter", "Sofia"), ("David", "Emma")]
FILLERS = ["What is the capital of France?", "Can you suggest a name for a cat?",
           "How many legs does a spider have?"]
METHODS = ["shift", "sur@5", "sur+idf@5", "sur@auto", "sur@20", "oracle@5", "replay"]
ANSWER_TOKENS = 32


def name_conversations(session, pairs: int = len(NAMES), exchanges=(0, 1, 3)) -> list[dict]:
    """The ``name`` cases: (dirty history, edited history with the question) per name pair and k."""
    cases = []
    for old, new in NAMES[:pairs]:
        for k in exchanges:
            history = [{"role": "system", "content": "You are a friendly assistant.", "id": "system"},
                       {"role": "user", "content": f"Hi! My name is {old}.", "id": "intro"}]
            for i, question in enumerate([None, *FILLERS[:k]]):
                if question is not None:
                    history.append({"role": "user", "content": question, "id": f"user-{i}"})
                session.reset()
                session.prepare(history)
                reply = session.generate(max_new_tokens=40).text.strip()
                history.append({"role": "assistant", "content": reply, "id": f"assistant-{i}"})
            edited = [dict(m, content=f"Hi! My name is {new}.") if m["id"] == "intro" else m for m in history]
            query = {"role": "user", "content": "What is my name?", "id": "query"}
            cases.append({"case_id": f"{old}->{new}, {k} exchanges", "dirty": history, "steps": [edited + [query]]})
    return cases


def deletion_conversations(data: Path, n: int, skip: int) -> list[dict]:
    """The ``deletions`` cases: ten HotpotQA passages, four distractors deleted one per step."""
    from kvmemory_lab.demo_cases import HOTPOT_FILE, hotpot_cases

    items = {i["_id"]: i for i in json.loads((data / HOTPOT_FILE).read_text())}
    cases = []
    for case in hotpot_cases(data, skip + n, passages=10, seed=11)[skip:]:
        gold = {t for t, _ in items[case.case_id]["supporting_facts"]}
        distractors = [i for i, p in enumerate(case.passages) if p.title not in gold]
        order = [distractors[k] for k in (1, 5, 3, 7)]  # spread over the history
        full = case.messages(with_deleted=True, with_query=False)
        query = case.messages(with_deleted=True, with_query=True)[-1]
        steps = []
        for s in range(1, 5):
            gone = {f"result-{i}" for i in order[:s]}
            steps.append([m for m in full if m["id"] not in gone] + [query])
        cases.append({"case_id": case.case_id, "dirty": full, "steps": steps})
    return cases


def reference(session, messages):
    """Re-prefill of ``messages``: its greedy answer and teacher-forced rows."""
    from kvmemory_lab.evaluation.answer_fidelity import teacher_forced_logits

    session.reset()
    session.prepare(messages)
    rows_from = session.fork()
    answer = session.generate(max_new_tokens=ANSWER_TOKENS)
    return answer, teacher_forced_logits(rows_from, answer.token_ids)


def measure(session, report, ref, ref_rows, guard, thread: str, replay_margin: float = 0.0) -> dict:
    """One repaired session against Re-prefill's answer. The session is left untouched, except
    under decode-time Replay (``replay_margin``), which acts in the thread's own decoding: the
    session decodes the answer, so a replay's exact rows carry to the next step."""
    from kvmemory.divergence import first_token_kl
    from kvmemory_lab.evaluation.answer_fidelity import answer_fidelity, teacher_forced_logits, with_decode_replay
    from kvmemory_lab.evaluation.decoding import verified_greedy
    from kvmemory_lab.metrics import answers_agree

    stale = session.exact_rows < len(session.token_ids)
    rows = teacher_forced_logits(session.fork(), ref.token_ids)
    guard.observe(thread, session, report)
    guard.wait()
    sample = guard.thread_info(thread)["last_sample"]
    if replay_margin:
        answer = session.generate(max_new_tokens=ANSWER_TOKENS)
        rows = with_decode_replay(rows, ref_rows, replay_margin) if stale else rows
    else:
        answer = verified_greedy(session.fork(), ref.token_ids, ANSWER_TOKENS)
    fid = answer_fidelity(ref_rows, rows, ref.token_ids, answer.token_ids)
    kl1 = first_token_kl(ref.first_logits, answer.first_logits)
    return {"answer": answer.text.strip(), "reference": ref.text.strip(), "agree": answers_agree(answer.text, ref.text),
            "tf_agreement": fid.tf_agreement, "tf_kl": fid.tf_kl, "common_prefix": fid.common_prefix,
            "first_token_kl": kl1, "operator": report.operator, "decode_replay": report.decode_replay,
            "recomputed_tokens": report.recomputed_tokens + (report.decode_replay or {}).get("recomputed_tokens", 0),
            "budget": report.budget, "fallback": report.fallback,
            "guard_escalates": bool(sample and sample["escalated"]), "guard_kl": sample and sample["kl"],
            "guard_tf_agreement": sample and sample["tf_agreement"], "first_token_guard_escalates": kl1 > 1e-2}


def run_case(lm, case: dict, methods: list[str], guard_cls) -> list[dict]:
    from kvmemory.policy import RepairPolicy
    from kvmemory.session import KVSession

    ref_session = KVSession(lm.model, lm.tokenizer)
    refs = [reference(ref_session, step) for step in case["steps"]]
    base = KVSession(lm.model, lm.tokenizer)
    base.prepare(case["dirty"])
    check = guard_cls(lm.model, {"fraction": 1.0})  # one fresh thread per check: a verdict, no escalation carried
    rows = []
    for method in methods:
        policy, guarded, action = method.partition("+guard")  # e.g. "sur@5+guard:replay"
        config = {"fraction": 1.0, **({"action": action[1:]} if action else {})}
        loop_guard = guard_cls(lm.model, config) if guarded else None
        session = base.fork()
        for s, (messages, (ref, ref_rows)) in enumerate(zip(case["steps"], refs)):
            used = loop_guard.policy_for("thread", policy) if loop_guard else policy
            report = session.prepare(messages, policy=used)
            row = measure(session, report, ref, ref_rows, check, f"{case['case_id']}/{method}/{s}",
                          RepairPolicy.coerce(used).replay_margin)
            if loop_guard:
                loop_guard.observe("thread", session, report)
                loop_guard.wait()
            rows.append({"case_id": case["case_id"], "step": s + 1, "method": method, "prompt_tokens": len(session.token_ids), **row})
        if loop_guard:
            loop_guard.close()
    check.close()
    return rows


def summarise(rows: list[dict]) -> dict:
    out = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        diverged = [r for r in mine if not r["agree"]]
        out[method] = {"repairs": len(mine), "agreement": sum(r["agree"] for r in mine) / len(mine),
                       "tf_agreement": sum(r["tf_agreement"] for r in mine) / len(mine),
                       "recomputed_tokens": sum(r["recomputed_tokens"] for r in mine) / len(mine),
                       "diverged": len(diverged),
                       "guard_catches": sum(r["guard_escalates"] for r in diverged),
                       "first_token_guard_catches": sum(r["first_token_guard_escalates"] for r in diverged),
                       "guard_false_alarms": sum(r["guard_escalates"] for r in mine if r["agree"])}
    return out


def markdown(summary: dict, rows: list[dict]) -> str:
    lines = []
    for scenario, methods in summary.items():
        lines += [f"## {scenario}", "", "| method | agreement | TF agreement | recomputed | diverged | guard (teacher-forced) catches | first-token 1e-2 catches | guard false alarms |",
                  "|---|---|---|---|---|---|---|---|"]
        for m, s in methods.items():
            lines.append(f"| {m} | {s['agreement']:.2f} | {s['tf_agreement']:.3f} | {s['recomputed_tokens']:.0f} | {s['diverged']} "
                         f"| {s['guard_catches']} | {s['first_token_guard_catches']} | {s['guard_false_alarms']} |")
        lines += ["", "| case | step | method | answer | agrees |", "|---|---|---|---|---|"]
        for r in rows:
            if r["scenario"] == scenario:
                lines.append(f"| {r['case_id']} | {r['step']} | {r['method']} | {r['answer'][:60]!r} | {'yes' if r['agree'] else 'no: ' + repr(r['reference'][:40])} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    parser.add_argument("--chats", type=int, default=3, help="deletion chats (HotpotQA questions)")
    parser.add_argument("--skip", type=int, default=20, help="HotpotQA cases skipped (the demo's come first)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--guarded", default="sur@5+guard:raise_budget,sur@5+guard:replay",
                        help="guarded methods of the deletion chats (policy+guard[:action])")
    parser.add_argument("--scenarios", default="name,deletions")
    parser.add_argument("--quick", action="store_true", help="one name pair, one chat (a smoke run)")
    args = parser.parse_args()

    import torch

    from kvmemory import FidelityGuard
    from kvmemory.models import load_model
    from kvmemory.session import KVSession

    lm = load_model()
    methods = [m for m in args.methods.split(",") if m]
    args.out.mkdir(parents=True, exist_ok=True)
    t0, rows = time.time(), []
    pairs, chats = (1, 1) if args.quick else (len(NAMES), args.chats)
    build = {"name": lambda: (name_conversations(KVSession(lm.model, lm.tokenizer), pairs), methods),
             "deletions": lambda: (deletion_conversations(args.data, chats, args.skip),
                                   methods + [m for m in args.guarded.split(",") if m])}
    scenarios = {name: build[name]() for name in args.scenarios.split(",")}
    for scenario, (cases, ms) in scenarios.items():
        for case in cases:
            rows += [dict(r, scenario=scenario) for r in run_case(lm, case, ms, FidelityGuard)]
            print(scenario, case["case_id"], f"{time.time() - t0:.0f} s", flush=True)
    summary = {s: summarise([r for r in rows if r["scenario"] == s]) for s in scenarios}
    meta = {"model": "SmolLM2-135M-Instruct", "dtype": "fp32", "torch_threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(), "seconds": time.time() - t0,
            "command": "OMP_NUM_THREADS=1 .venv/bin/python " + " ".join(sys.argv)}
    (args.out / "scenarios.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    (args.out / "report.md").write_text(f"# Fidelity scenarios\n\n`{meta['command']}` ({meta['seconds']:.0f} s, "
                                        f"{meta['torch_threads']} thread)\n\n" + markdown(summary, rows))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
