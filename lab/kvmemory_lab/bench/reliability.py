"""``kvmemory bench reliability``: the full reliability profiles and their report.

Three profiles, each a function ``run_<name>_profile(size, *, seed, workdir, progress) -> dict``
in its own module (imported only when the profile runs, so ``kvmemory --help`` stays light):

- ``fuzz`` (:mod:`kvmemory_lab.fuzz`): hypothesis-generated edit sequences on a tiny random-weight
  model and on the embedded model; invariants checked after every step.
- ``crash`` (:mod:`kvmemory_lab.harness.crash`): a child process writing checkpoints and KV
  blobs is SIGKILLed at random points; every restart must keep the messages and either resume
  from a verified blob or re-prefill with a logged reason.
- ``concurrency`` (:mod:`kvmemory_lab.harness.concurrency`): N ≥ 8 LangGraph threads driven
  concurrently against one model and one saver under a memory budget.

``size`` is ``"reduced"`` (the profile ``make test`` runs) or ``"full"`` (this benchmark). Each
profile returns a flat JSON-able dict of counts that includes ``ok`` (bool: no violation) and the
keys the report needs (see :data:`REPORT_KEYS`). Output: ``DIR/reliability.json``,
``DIR/reliability.md`` and ``DIR/reliability.png``.
"""

from __future__ import annotations

import importlib
import json
import platform
import time
from pathlib import Path

# profile -> (module, function)
PROFILES: dict[str, tuple[str, str]] = {
    "fuzz": ("kvmemory_lab.fuzz", "run_fuzz_profile"),
    "crash": ("kvmemory_lab.harness.crash", "run_crash_profile"),
    "concurrency": ("kvmemory_lab.harness.concurrency", "run_concurrency_profile"),
}
# the counts the issue asks the report to carry, per profile (a profile may return more)
REPORT_KEYS: dict[str, tuple[str, ...]] = {
    "fuzz": ("sequences_tried", "steps", "invariant_violations"),
    "crash": ("kills", "kills_survived", "messages_lost", "resumed_from_blob", "reprefilled",
              "orphans_collected", "corrupt_blobs_loaded"),
    "concurrency": ("threads", "turns", "mismatches", "evictions", "peak_bytes", "budget_bytes",
                    "budget_exceeded"),
}


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/reliability"),
                        help="output folder (default benchmarks/results/reliability)")
    parser.add_argument("--quick", action="store_true", help="run the reduced profiles (what make test runs)")
    parser.add_argument("--profiles", default=",".join(PROFILES),
                        help=f"comma-separated subset of {','.join(PROFILES)} (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="scratch folder for databases and blobs (default: OUT/work)")


def run(args, console) -> int:
    """Run the selected profiles and write the report; exit status 1 when any profile found a violation.

    Raises:
        SystemExit: (via argparse conventions, status 2) an unknown profile name; the message lists the valid ones.
    """
    names = [n.strip() for n in args.profiles.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROFILES]
    if unknown:
        console.print(f"[red]unknown profile(s) {unknown}; choose from {sorted(PROFILES)}[/red]")
        return 2
    size = "reduced" if args.quick else "full"
    workdir = args.workdir or args.out / "work"
    result = {"meta": _meta(size, args.seed), "profiles": {}}
    for name in names:
        module, function = PROFILES[name]
        started = time.perf_counter()
        profile = getattr(importlib.import_module(module), function)
        counts = profile(size, seed=args.seed, workdir=workdir / name, progress=True)
        counts["seconds"] = round(time.perf_counter() - started, 1)
        result["profiles"][name] = counts
        console.print(f"{name}: {'ok' if counts.get('ok') else 'VIOLATIONS'} {counts}")
    write_outputs(args.out, result, console)
    return 0 if all(p.get("ok") for p in result["profiles"].values()) else 1


def _meta(size: str, seed: int) -> dict:
    import torch

    return {"size": size, "seed": seed, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpu_threads": torch.get_num_threads(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_outputs(out: Path, result: dict, console) -> None:
    """Write ``reliability.json``, ``reliability.md`` and ``reliability.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "reliability.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "reliability.md").write_text(markdown(result))
    _plot(result, out / "reliability.png")
    console.print(f"wrote {out / 'reliability.json'}, reliability.md, reliability.png")


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# Reliability report ({meta['size']} profiles, seed {meta['seed']})", "",
             f"torch {meta['torch']}, Python {meta['python']}, {meta['cpu_threads']} CPU threads, "
             f"started {meta['started']}." + (f" {meta['note']}" if meta.get("note") else ""), ""]
    for name, counts in result["profiles"].items():
        lines += [f"## {name}: {'no violations' if counts.get('ok') else 'VIOLATIONS FOUND'} "
                  f"({counts.get('seconds', 0):.0f} s)", "", "| count | value |", "|---|---|"]
        keys = list(REPORT_KEYS.get(name, ())) + [k for k in counts if k not in REPORT_KEYS.get(name, ())]
        lines += [f"| {k} | {counts[k]} |" for k in keys if k in counts and k not in ("ok", "seconds")]
        lines.append("")
    return "\n".join(lines)


def _plot(result: dict, path: Path) -> None:
    """One panel per profile: its report counts as horizontal bars (violations in red)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = result["profiles"]
    fig, axes = plt.subplots(1, max(1, len(profiles)), figsize=(5 * max(1, len(profiles)), 3.5), squeeze=False)
    bad = ("invariant_violations", "messages_lost", "corrupt_blobs_loaded", "mismatches", "budget_exceeded")
    for ax, (name, counts) in zip(axes[0], profiles.items(), strict=False):
        keys = [k for k in REPORT_KEYS.get(name, ()) if isinstance(counts.get(k), (int, float))]
        ax.barh(keys, [float(counts[k]) for k in keys], color=["tab:red" if k in bad else "tab:blue" for k in keys])
        ax.set_title(f"{name} ({'ok' if counts.get('ok') else 'violations'})")
        ax.set_xscale("symlog")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
