"""Selection on Erasing-NIAH without a model forward: how often eq. 1's identical-token bonus ties
units at the top score, and how much of the surviving needle each selection rule covers.

For every NIAH case (the quality benchmark's, seed 0), the edit plan of the deletion gives the
stale suffix; SUR selects B = B(S, b) positions under the paper's rule and the options
(``relevance="idf"``, ``ties="latest"``, ``tail_tokens``). Reported per rule: the share of units
whose top-4-mean score equals the maximum (ties), and the share of the surviving needle's tokens
that lie in the selection (needle coverage). Only the tokenizer and the input embedding table are
used. Output: JSON + markdown.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/selection_ties.py --out benchmarks/results/fidelity/selection_ties
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean

RULES = {"paper": {}, "idf": {"relevance": "idf"}, "latest": {"ties": "latest"}, "idf+latest": {"relevance": "idf", "ties": "latest"},
         "tail32": {"tail_tokens": 32}}


def main() -> None:
    from kvmemory.edits import plan_edits
    from kvmemory_lab.evaluation import niah_cases
    from kvmemory.models import load_model
    from kvmemory.prompt import normalize_messages, render_prompt
    from kvmemory.selection import MessageSpan, SelectionInput, SelectionOptions, allowance, build_units, select
    from kvmemory.selection.allocators import _token_scores
    from kvmemory.selection.unit_allocator import unit_score

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budgets", default="2,5,10")
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    args = parser.parse_args()
    lm = load_model()
    tok, emb = lm.tokenizer, lm.model.get_input_embeddings().weight.detach()
    cases = niah_cases(args.data, tok, [int(x) for x in args.lengths.split(",")], 5, 0)
    rows = []
    for case in cases:
        old = render_prompt(tok, normalize_messages(case.dirty_messages()), generation_prompt=False)
        new = render_prompt(tok, normalize_messages(case.edited_messages()))
        plan = plan_edits(old.token_ids, old, new)
        eligible = [p for p in plan.suffix_positions if p != len(new) - 1]
        query = case.edited_messages()[-1]["content"]
        spans = [MessageSpan(s.index, s.token_start, s.token_end, s.content_start, s.content_end) for s in new.segments]
        inp = SelectionInput(new.text, new.token_ids, new.offsets, spans, eligible,
                             tok(query, add_special_tokens=False)["input_ids"], query)
        survivor = _needle_positions(new, case)
        units = build_units(inp)
        for rule, fields in RULES.items():
            options = SelectionOptions(**fields)
            scores = _token_scores(inp, emb, options)
            bounds, lo = [], 0
            for u in units:
                bounds.append((lo, lo + len(u)))
                lo += len(u)
            unit_scores = [unit_score(scores[a:b]) for a, b in bounds]
            ties = sum(s == max(unit_scores) for s in unit_scores) / len(unit_scores)
            for b in [float(x) for x in args.budgets.split(",")]:
                chosen = set(select("sur", inp, allowance(plan.stale_tokens, b), embedding=emb, options=options))
                rows.append({"case": case.case_id, "length": case.meta["length"], "variant": case.meta["variant"],
                             "rule": rule, "budget": b, "units": len(units), "top_tied_units": ties,
                             "needle_coverage": len(chosen & survivor) / len(survivor) if survivor else None})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "selection_ties.json").write_text(json.dumps(rows, indent=1))
    lines = ["| rule | budget % | share of units tied at the top score | surviving-needle coverage (mean) | cases with full coverage |",
             "|---|---|---|---|---|"]
    for rule in RULES:
        for b in sorted({r["budget"] for r in rows}):
            sel = [r for r in rows if r["rule"] == rule and r["budget"] == b and r["needle_coverage"] is not None]
            lines.append(f"| {rule} | {b:g} | {mean(r['top_tied_units'] for r in sel):.2f} | "
                         f"{mean(r['needle_coverage'] for r in sel):.2f} | {sum(r['needle_coverage'] == 1.0 for r in sel)}/{len(sel)} |")
    (args.out / "selection_ties.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _needle_positions(rendered, case) -> set[int]:
    """Prompt positions of the needle sentences still present after the edit (by their value)."""
    values = [v for v in case.meta.get("values", []) if v != case.leak_value]
    out = set()
    for value in values:
        at = rendered.text.find(value)
        if at < 0:
            continue
        start, end = rendered.text.rfind(".", 0, at) + 1, rendered.text.find(".", at + len(value))
        out |= {p for p, (a, b) in enumerate(rendered.offsets) if a < (end if end > 0 else at + len(value)) and b > start}
    return out


if __name__ == "__main__":
    main()
