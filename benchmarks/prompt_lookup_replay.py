"""How long a prompt-lookup draft should be: replay the agent benchmark's greedy answers.

For each agent chat (``kvmemory bench agent``'s, contexts and seeds below) and each step whose
answer the benchmark decodes (``first``; ``delete`` after the 19-token first answer), the greedy
answer (stop tokens masked, as in the benchmark) is decoded once without lookup. The drafts
``kvmemory.lookup.propose`` would make for every draft length are then replayed on those tokens
(which prefix of each draft the picks accept), and each forward is costed with the engine's
measured time for that many rows at that context (medians of ``--repeats`` forwards, measured in
the same run). Output: per answer and draft length the forwards and the time per token relative
to one token per forward, and their means (``lookup.json``, ``lookup.md`` in ``--out``).

    PYTHONPATH=.:lab .venv/bin/python benchmarks/prompt_lookup_replay.py --threads 2 \\
        --out benchmarks/results/agent_lookup_2k/replay
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvmemory.engine import forward_rows
from kvmemory.kvcache import crop_to
from kvmemory.lookup import propose
from kvmemory.models import load_model
from kvmemory.session import KVSession, stop_token_ids
from kvmemory_lab.bench.agent import SEARCH_TOOL, agent_chat
from kvmemory_lab.demo_cases import default_data_dir

DRAFTS = (0, 1, 2, 3, 4, 6, 8)


def row_costs(lm, session: KVSession, most: int, repeats: int) -> dict[int, float]:
    """Median ms of a forward of n = 1..most rows after the session's cached rows."""
    start = len(session.token_ids)
    costs = {}
    for n in range(1, most + 1):
        times = []
        for _ in range(repeats + 1):
            ids = torch.randint(100, 1000, (n,))
            t0 = time.perf_counter()
            forward_rows(lm.model, session.cache, ids, start, capacity=start + 64)
            times.append(time.perf_counter() - t0)
            crop_to(session.cache, start)
        costs[n] = statistics.median(times[1:]) * 1e3
    return costs


def forwards(prompt: list[int], answer: list[int], draft: int, min_ngram: int = 1) -> list[int]:
    """Rows of each forward lookup with ``draft`` tokens needs for ``answer`` after ``prompt``
    (the first answer token comes from the prompt's logits; each later forward feeds the last
    picked token plus its draft)."""
    rows, i, seen = [], 0, list(prompt)
    while i < len(answer):  # the last token's row is computed too, as in generate()
        seen.append(answer[i])
        guess = propose(seen, min(draft, len(answer) - 1 - i), min_ngram=min_ngram) if draft else []
        accepted = 0
        for g in guess:
            if g != answer[i + 1 + accepted]:
                break
            accepted += 1
        rows.append(1 + len(guess))
        seen += answer[i + 1:i + 1 + accepted]
        i += 1 + accepted
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="2048", help="comma list of chat sizes (tokens)")
    parser.add_argument("--seeds", default="0,1,2", help="comma list of passage-order seeds")
    parser.add_argument("--tokens", default="20,128", help="comma list of answer lengths")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(None, "fp32", engine="q4_1")
    stops = sorted(stop_token_ids(lm.model, lm.tokenizer))

    def masked(_, scores):
        scores = scores.clone()
        scores[..., stops] = float("-inf")
        return scores

    rows_out = []
    for context in [int(c) for c in args.contexts.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            chat = agent_chat(Path(default_data_dir()), lm.tokenizer, context, 8192 - 256, seed)
            for step in ("first", "delete"):
                for tokens in [int(t) for t in args.tokens.split(",")]:
                    session = KVSession(lm.model, lm.tokenizer, "sur@5", tools=[SEARCH_TOOL], prompt_lookup=0)
                    session.prepare(chat.steps["first"])
                    if step == "delete":
                        session.generate(19, logits_processor=masked)
                        session.prepare(chat.steps["delete"])
                    prompt = list(session.token_ids)
                    costs = row_costs(lm, session, 1 + max(DRAFTS), args.repeats)
                    answer = session.generate(tokens, logits_processor=masked).token_ids
                    plain = sum(costs[n] for n in forwards(prompt, answer, 0))
                    for draft, min_ngram in [(d, 1) for d in DRAFTS] + [(d, 2) for d in DRAFTS[1:]]:
                        used = forwards(prompt, answer, draft, min_ngram)
                        rows_out.append({"context": context, "seed": seed, "step": step, "tokens": tokens,
                                         "draft": draft, "min_ngram": min_ngram, "forwards": len(used),
                                         "relative_time": sum(costs[n] for n in used) / plain,
                                         "row_costs_ms": costs})
                    print(context, seed, step, tokens, "done", flush=True)
    write(args, rows_out)


def write(args, rows: list[dict]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    settings = sorted({(r["draft"], r["min_ngram"]) for r in rows})
    means = {}
    for tokens in sorted({r["tokens"] for r in rows}):
        for draft, min_ngram in settings:
            picked = [r["relative_time"] for r in rows
                      if r["tokens"] == tokens and r["draft"] == draft and r["min_ngram"] == min_ngram]
            means[f"{tokens}:{draft}:{min_ngram}"] = {"mean_relative_time": statistics.mean(picked),
                                                      "worst_relative_time": max(picked)}
    meta = {"threads": args.threads, "repeats": args.repeats, "contexts": args.contexts, "seeds": args.seeds,
            "command": "PYTHONPATH=.:lab .venv/bin/python benchmarks/prompt_lookup_replay.py "
                       f"--contexts {args.contexts} --seeds {args.seeds} --tokens {args.tokens} "
                       f"--threads {args.threads} --out {args.out}"}
    (args.out / "lookup.json").write_text(json.dumps({"meta": meta, "means": means, "rows": rows}, indent=1))
    lines = [f"# Prompt lookup replay\n\nCommand: `{meta['command']}`\n",
             "Time per token relative to one token per forward (mean over answers / worst answer); "
             "drafts from suffixes of at least 1 or 2 recurring tokens:\n",
             "| draft tokens, shortest suffix | " + " | ".join(f"{t} answer tokens" for t in sorted({r['tokens'] for r in rows})) + " |",
             "|---|" + "---|" * len({r["tokens"] for r in rows})]
    for draft, min_ngram in settings:
        cells = [f"{means[f'{t}:{draft}:{min_ngram}']['mean_relative_time']:.2f} / "
                 f"{means[f'{t}:{draft}:{min_ngram}']['worst_relative_time']:.2f}" for t in sorted({r['tokens'] for r in rows})]
        lines.append(f"| {draft}, {min_ngram} | " + " | ".join(cells) + " |")
    (args.out / "lookup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
