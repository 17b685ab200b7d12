"""The main job: an agent history edited in the middle, answered with each repair method.

For every case: prefill the agent's history (tool results holding passages), then delete one
non-supporting tool result and ask the question. Each method starts from a clone of the same
pre-edit cache (the clone is not timed) and answers greedily; fidelity is measured against
Re-prefill (greedy-answer agreement, first-token KL, and answer-level: teacher-forced top-1
agreement and mean KL over Re-prefill's answer tokens, common prefix of the greedy answers) and
post-edit latency is the time from the edited message list to the first-token distribution
(repair + query prefill), in ms. Aggregates carry source-paired bootstrap intervals.

Beside the repairs, the model's own precision floor: the same edited history Re-prefilled by the
model in bf16 (``FLOOR``), scored against the fp32 Re-prefill like every method. A repair that
agrees as often as it does is as faithful as the model's arithmetic allows.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import mean

from kvmemory.policy import RepairPolicy
from kvmemory.session import KVSession

from .demo_cases import DemoCase
from .evaluation.answer_fidelity import answer_fidelity, teacher_forced_logits
from .evaluation.stats import paired_bootstrap
from .metrics import answers_agree, contains_gold, exact_match, first_token_kl


FLOOR = "reprefill bf16 (floor)"


def demo_policies(budgets: list[float], tolerances: list[float] = ()) -> dict[str, RepairPolicy]:
    """Methods in table order, keyed by their JSON names (``sur@5``, ``sur@auto:0.001`` ...):
    the references, SUR at the fixed ``budgets`` (%) and the adaptive budget at ``tolerances``."""
    policies = {"dirty": RepairPolicy(operator="dirty"), "shift": RepairPolicy(operator="shift")}
    for b in budgets:
        policies[f"sur@{b:g}"] = RepairPolicy(operator="refresh", budget=b, allocator="sur")
    for tolerance in tolerances:
        policy = RepairPolicy(operator="refresh", budget="auto", tolerance=tolerance)
        policies[policy.label] = policy
    policies["replay"] = RepairPolicy(operator="replay")
    policies["reprefill"] = RepairPolicy(operator="reprefill", scope="always")  # whole prompt, whatever the edit
    return policies


@dataclass
class MethodResult:
    method: str
    answer: str
    agrees: bool
    kl: float
    exact_match: bool
    contains_gold: bool
    recomputed_tokens: int
    reused_tokens: int
    intervals: int
    latency_ms: float
    answer_ms: float
    fallback: str | None = None
    tf_agreement: float = 1.0
    tf_kl: float = 0.0
    common_prefix: int = 0
    spent_budget: float | None = None


@dataclass
class CaseResult:
    case_id: str
    question: str
    gold: str
    prompt_tokens: int
    deleted_tokens: int
    methods: list[MethodResult] = field(default_factory=list)


def run_case(session: KVSession, case: DemoCase, policies: dict[str, RepairPolicy], max_new_tokens: int = 32,
             floor: KVSession | None = None) -> CaseResult:
    """Run every method on one case from the same pre-edit cache; Re-prefill first (reference).
    ``floor``: a session on the same model in bf16, whose Re-prefill of the edited history is
    scored as the last method (:data:`FLOOR`)."""
    session.reset()
    session.prepare(case.messages(with_deleted=True, with_query=False))
    deleted = sum(s.length for s in session.rendered.segments if s.key in case.deleted_ids)
    edited = case.messages(with_deleted=False, with_query=True)
    runs, rows = {}, {}
    for name in ["reprefill"] + [n for n in policies if n != "reprefill"]:
        fork = session.fork()
        report = fork.prepare(edited, policy=policies[name])
        probe = fork.fork()  # scores Re-prefill's answer teacher-forced (Re-prefill's own once decoded)
        gen = fork.generate(max_new_tokens=max_new_tokens)
        runs[name] = (report, gen)
        rows[name] = teacher_forced_logits(probe, runs["reprefill"][1].token_ids)
    if floor is not None:
        floor.reset()
        report = floor.prepare(edited, policy=policies["reprefill"])
        probe = floor.fork()
        runs[FLOOR] = (report, floor.generate(max_new_tokens=max_new_tokens))
        rows[FLOOR] = teacher_forced_logits(probe, runs["reprefill"][1].token_ids).float()
    ref_report, ref_gen = runs["reprefill"]
    result = CaseResult(case.case_id, case.question, case.answer, ref_report.prompt_tokens, deleted)
    for name in [*policies, *([FLOOR] if floor is not None else [])]:
        report, gen = runs[name]
        fidelity = answer_fidelity(rows["reprefill"], rows[name], ref_gen.token_ids, gen.token_ids)
        result.methods.append(
            MethodResult(
                method=name,
                answer=gen.text.strip(),
                agrees=answers_agree(gen.text, ref_gen.text),
                kl=first_token_kl(ref_gen.first_logits, gen.first_logits.float()),
                exact_match=exact_match(gen.text, case.answer),
                contains_gold=contains_gold(gen.text, case.answer),
                recomputed_tokens=report.recomputed_tokens,
                reused_tokens=report.reused_tokens,
                intervals=report.intervals,
                latency_ms=report.latency_ms,
                answer_ms=gen.decode_ms,
                fallback=report.fallback,
                tf_agreement=fidelity.tf_agreement,
                tf_kl=fidelity.tf_kl,
                common_prefix=fidelity.common_prefix,
                spent_budget=report.budget,
            )
        )
    return result


def aggregate(cases: list[CaseResult]) -> dict[str, dict[str, float]]:
    """Per method: agreement (fraction of cases equal to Re-prefill's greedy answer) with its 95 %
    bootstrap interval (``agreement_ci``, cases resampled), tf_agreement (mean teacher-forced
    top-1 agreement over Re-prefill's answer tokens) with ``tf_agreement_ci``, tf_kl (mean KL per
    answer token, nats), common_prefix (mean tokens), mean_kl (first token), em (HotpotQA EM),
    gold_in_answer (normalized gold inside the answer), recomputed_tokens (mean), spent_budget
    (mean % of the stale suffix refreshed, refresh policies), latency_ms (mean post-edit),
    answer_ms (mean decode)."""
    names = [m.method for m in cases[0].methods] if cases else []
    out = {}
    for name in names:
        rows = [m for c in cases for m in c.methods if m.method == name]
        groups = [c.case_id for c in cases]
        budgets = [m.spent_budget for m in rows if m.spent_budget is not None]
        out[name] = {
            "agreement": mean(m.agrees for m in rows),
            "agreement_ci": list(paired_bootstrap([float(m.agrees) for m in rows], groups)[1:]),
            "tf_agreement": mean(m.tf_agreement for m in rows),
            "tf_agreement_ci": list(paired_bootstrap([m.tf_agreement for m in rows], groups)[1:]),
            "tf_kl": mean(m.tf_kl for m in rows),
            "common_prefix": mean(m.common_prefix for m in rows),
            "spent_budget": mean(budgets) if budgets else None,
            "mean_kl": mean(m.kl for m in rows),
            "em": mean(m.exact_match for m in rows),
            "gold_in_answer": mean(m.contains_gold for m in rows),
            "recomputed_tokens": mean(m.recomputed_tokens for m in rows),
            "latency_ms": mean(m.latency_ms for m in rows),
            "answer_ms": mean(m.answer_ms for m in rows),
            "cases": len(rows),
        }
    return out


def write_json(path: Path, meta: dict, cases: list[CaseResult]) -> None:
    """Write every figure (``meta``, per-case rows, the ``methods`` aggregate) to ``path`` and the
    aggregate table as markdown next to it (same name, ``.md``)."""
    methods = aggregate(cases)
    payload = {**meta, "methods": methods, "cases": [_case_dict(c) for c in cases]}
    Path(path).write_text(json.dumps(payload, indent=2))
    Path(path).with_suffix(".md").write_text(markdown_table(meta, methods, len(cases)))


def markdown_table(meta: dict, methods: dict, n: int) -> str:
    """The aggregate as a markdown table (agreement and EM as fractions, KL in nats, ms)."""
    lines = [
        f"# kvmemory demo: {n} cases, {meta.get('model')} ({meta.get('dtype')}), {meta.get('source')}",
        "",
        "Agreement: greedy answer equal to Re-prefill's; TF: Re-prefill's answer scored teacher-forced "
        "(top-1 agreement, mean KL per token); [95 % bootstrap interval over cases].",
        "",
        "| method | agreement with Re-prefill | TF agreement | TF KL | common prefix | mean first-token KL | EM "
        "| gold in answer | recomputed tokens (mean) | spent budget % | post-edit latency ms (mean) | decode ms (mean) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in methods.items():
        lo, hi = m["agreement_ci"]
        tlo, thi = m["tf_agreement_ci"]
        spent = "–" if m["spent_budget"] is None else f"{m['spent_budget']:.1f}"
        lines.append(
            f"| {name} | {m['agreement']:.2f} [{lo:.2f}, {hi:.2f}] | {m['tf_agreement']:.3f} [{tlo:.3f}, {thi:.3f}] | "
            f"{m['tf_kl']:.2e} | {m['common_prefix']:.1f} | {m['mean_kl']:.2e} | {m['em']:.2f} | {m['gold_in_answer']:.2f} | "
            f"{m['recomputed_tokens']:.0f} | {spent} | {m['latency_ms']:.0f} | {m['answer_ms']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _case_dict(case: CaseResult) -> dict:
    return asdict(case)
