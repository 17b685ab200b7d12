"""Two variants of the probed CacheReforge policy, replayed exactly on trajectory banks to see
whether they lift its held-out ceiling (neither is a runtime policy; findings in
``benchmarks/results/reforge_scheduler_probe/findings.md``).

- ``exact``: every affected layer's deviation is known at each update (read from the bank), and
  the range ends at the deepest layer whose deviation reaches its τ and that the account covers,
  instead of probing one layer ahead and stopping at the first quiet layer. The probe cost
  charged is the probed policy's first probe per distinct anchor version.
- ``relative``: the probed rule with every τ scaled by this thread's mean adapter step so far,
  mean_s ‖θ_s − θ_{s−1}‖ / ``--step-ref`` (the calibration trajectories' mean step), so the
  thresholds follow the update size of the thread.

Fit on calibration banks (jointly), then replay held out::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/reforge_probe_variants.py fit --kind relative \
        --seeds 53,61 --bank-dir .banks --out P.json
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/reforge_probe_variants.py eval --kind relative \
        --profile P.json --seeds 7,17,29 --bank-dir .banks
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reforge_scheduler_replay as bench  # noqa: E402
from kvmemory.reforge.probe import ProbeCalibration, probe_cost  # noqa: E402
from kvmemory_lab.reforge import probe_fit  # noqa: E402
from kvmemory_lab.reforge.trajectory import PolicyReplay, ReplayPolicy  # noqa: E402


class VariantReplay(PolicyReplay):
    """PolicyReplay whose ``probed`` decisions follow ``kind`` (``probed``: unchanged)."""

    def __init__(self, *args, kind: str, step_ref: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.kind, self.step_ref = kind, step_ref

    def _step(self, b, i, bank, t, anchor, policy, account):
        if policy is None or policy.policy != "probed" or self.kind == "probed":
            return super()._step(b, i, bank, t, anchor, policy, account)
        if self.kind == "relative":
            steps = [float(bank.distances[s, s - 1]) for s in range(1, t + 1)]
            factor = sum(steps) / len(steps) / self.step_ref
            scaled = policy.probe.model_copy(update={"thresholds": [
                None if tau is None else tau * factor for tau in policy.probe.thresholds]})
            return super()._step(b, i, bank, t, anchor,
                                 ReplayPolicy("probed", budget_pct=policy.budget_pct, probe=scaled), account)
        return self._exact_step(b, i, bank, t, anchor, policy, account)

    def _exact_step(self, b, i, bank, t, anchor, policy, account):
        r = bank.restart
        account.deposit()
        table = self.probe_values(b, policy.probe.rows)[i]
        rows = bank.prompts[i].token_ids.shape[0] - 1
        charge = probe_cost(self.model.config, policy.probe.rows or rows, rows) * len(set(anchor))
        taus, scale = policy.probe.thresholds, policy.probe.scale(account)
        stale = [j for j in range(len(anchor))
                 if taus[r + j] is not None and float(table[j, t, anchor[j]]) >= taus[r + j] * scale]
        balance = account.balance - charge
        end = next((r + j + 1 for j in sorted(stale, reverse=True) if j + 1 <= balance + 1e-9), None)
        layers = 0 if end is None else end - r
        account.charge(charge + layers)
        for layer in range(r, end or r):
            anchor[layer - r] = t
        return layers, ("reuse" if end is None else "bounded"), end, charge


def run_fit(w, args) -> None:
    seeds = [int(s) for s in args.seeds.split(",")]
    replay, memos = bench.replay_for(w, args, "calibration", seeds, VariantReplay, kind=args.kind,
                                     step_ref=args.step_ref)
    t0 = time.perf_counter()
    fit = probe_fit.fit_probe(replay, args.budget, pacings=tuple(float(x) for x in args.pacings.split(",")))
    for index, memo in enumerate(memos):
        replay.save_memo(memo, index)
    cal = fit.calibration
    cal.fit.update({"kind": args.kind, "step_ref": args.step_ref, "seeds": seeds})
    print(f"{args.kind}: calibration {fit.kl_reduction_pct:.2f} % at {fit.recompute_pct:.2f} % (rows {cal.rows}, "
          f"carry {cal.carry:g}, κ {cal.pacing:g}, group τ {cal.fit['group_tau']}; {time.perf_counter() - t0:.0f} s)")
    args.out.write_text(cal.model_dump_json())


def run_eval(w, args) -> None:
    cal = ProbeCalibration.model_validate_json(args.profile.read_text())
    budgets = [float(b) for b in args.budgets.split(",")]
    per_seed = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        replay, (memo,) = bench.replay_for(w, args, "eval", [seed], VariantReplay, kind=args.kind,
                                           step_ref=args.step_ref)
        results = replay.evaluate([None] + [ReplayPolicy("probed", budget_pct=b, probe=cal) for b in budgets])
        replay.save_memo(memo)
        stale = results[0].kl
        per_seed[seed] = [{"budget_pct": b, "kl": r.kl, "stale_kl": stale, "recompute_pct": r.recompute_pct,
                           "kl_reduction_pct": 100 * (1 - r.kl / stale)} for b, r in zip(budgets, results[1:])]
        print(seed, [f"{row['kl_reduction_pct']:.1f} % / {row['recompute_pct']:.2f} %" for row in per_seed[seed]],
              flush=True)
    for k, b in enumerate(budgets):
        rows = [per_seed[s][k] for s in per_seed]
        pooled = 100 * (1 - sum(r["kl"] for r in rows) / sum(r["stale_kl"] for r in rows))
        spent = sum(r["recompute_pct"] for r in rows) / len(rows)
        print(f"budget {b:g}: pooled {pooled:.2f} % at {spent:.2f} %, worst seed "
              f"{min(r['kl_reduction_pct'] for r in rows):.1f} %")
    if args.out:
        args.out.write_text(json.dumps({"kind": args.kind, "profile": str(args.profile), "seeds": per_seed}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["fit", "eval"])
    parser.add_argument("--kind", choices=["probed", "exact", "relative"], default="relative")
    parser.add_argument("--step-ref", type=float, default=0.4,
                        help="relative: the step norm at which τ is unscaled (calibration mean ‖θ_s − θ_{s−1}‖)")
    parser.add_argument("--seeds", default="53,61")
    parser.add_argument("--budget", type=float, default=5.0)
    parser.add_argument("--budgets", default="5", help="eval: allowances to replay (%% of layers per update)")
    parser.add_argument("--pacings", default="0.75", help="fit: pacing κ grid")
    parser.add_argument("--profile", type=Path, help="eval: a ProbeCalibration JSON written by fit")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--prompts", default="8")
    parser.add_argument("--updates", type=int, default=32)
    parser.add_argument("--bank-dir", type=Path, default=Path(".banks"))
    parser.add_argument("--memo-dir", type=Path, default=None)
    args = parser.parse_args()
    args.target, args.layer = "v_proj", None
    if args.command == "fit" and args.out is None or args.command == "eval" and args.profile is None:
        parser.error("fit needs --out, eval needs --profile")
    w = bench.workload(args)
    {"fit": run_fit, "eval": run_eval}[args.command](w, args)


if __name__ == "__main__":
    main()
