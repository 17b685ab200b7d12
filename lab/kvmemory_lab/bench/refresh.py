"""``kvmemory bench refresh``: matched-work refresh timing (paper §4.4, Appendix 13.3).

A random-token prompt of N + 8 tokens is prefilled, 8 tokens at N/8 are deleted and the suffix
keys are Shifted (not timed). B = 64 positions are then refreshed in R = 1, 4, 16 equal intervals
centred on N/2 and spread over [N/4, 3N/4], so the causal-pair count M(U) = Σ(u+1) is identical
for every R within a length (65,568 at 2 K, 262,176 at 8 K). Each executor turns the shifted cache
into an independent refreshed cache; timed: the output copy, planning/mask building and all-layer
recomputation. Warm-ups, then interleaved timed trials in a random order; medians reported.

Executors: ``sequential`` (prefix copies, the paper's reference), ``direct`` (in place, no prefix
copies), ``oneshot`` (one native forward with a 4-D mask), ``packed-sdpa`` and, on a GPU,
``packed-triton``. Output: ``refresh.json`` (meta + a list of rows with executor, context, R,
median_ms), ``refresh.md`` and ``refresh.png`` (time vs R).
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .common import agg_pyplot, int_list, load_average, time_ratio

DELETED = 8
EXECUTORS = ("sequential", "direct", "oneshot", "packed-sdpa", "packed-triton")
# random-weight configs for the GPU table (Qwen3-8B's shape, Appendix 13.3) and a CPU smoke test
RANDOM_CONFIGS = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=40960),
}


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder (default benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="2 K context only, for a fast check")
    parser.add_argument("--contexts", type=int_list, default=[2048, 8192], help="context lengths N in tokens (default 2048,8192)")
    parser.add_argument("--intervals", type=int_list, default=[1, 4, 16], help="interval counts R (default 1,4,16)")
    parser.add_argument("--positions", type=int, default=64, help="refreshed positions B (default 64)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up runs per executor and R (default 2)")
    parser.add_argument("--trials", type=int, default=7, help="timed interleaved trials (default 7, at least 7 for the table)")
    parser.add_argument("--executors", type=_names, default=None, help=f"subset of {','.join(EXECUTORS)} (default: all that run here)")
    parser.add_argument("--model", default=None, help="local model folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16"], help="default fp32 on CPU, bf16 with --random-config")
    parser.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), default=None,
                        help="random-weight Qwen3 model instead of --model (qwen3-8b for the GPU table)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable on a shared machine)")
    parser.add_argument("--seed", type=int, default=0)


def _names(text: str) -> list[str]:
    import argparse

    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in EXECUTORS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown executor(s) {bad or text!r}: choose from {', '.join(EXECUTORS)}")
    return names


@dataclass
class Row:
    """One (executor, context, R) cell: median and every timed trial in ms."""

    executor: str
    context: int
    R: int
    median_ms: float
    trials_ms: list[float] = field(default_factory=list)
    positions: int = 0
    causal_pairs: int = 0
    max_abs_diff_vs_sequential: float | None = None


def refresh_positions(n: int, intervals: int, b: int) -> list[int]:
    """B positions in R equal intervals, symmetric about N/2 with spacing N/(2R): Σ(u+1) = B(N/2+1/2)
    for every R (matched causal-pair counts, §4.4).

    Raises:
        ValueError: B not divisible by R, or intervals that overlap / leave [N/8+1, N).
    """
    if b % intervals:
        raise ValueError(f"B = {b} positions cannot be split into {intervals} equal intervals")
    width = b // intervals
    spacing = 2 * (n // (4 * intervals))  # even, so the symmetric starts are integers
    starts = [n // 2 - width // 2 + (2 * k - (intervals - 1)) * spacing // 2 for k in range(intervals)]
    positions = [s + j for s in starts for j in range(width)]
    if intervals > 1 and spacing <= width or starts[0] <= n // 8 or positions[-1] >= n:
        raise ValueError(f"cannot place {intervals} intervals of {width} in the suffix of N = {n}")
    return positions


def run(args, console) -> int:
    from kvmemory.models import resolve_dtype

    torch.set_num_threads(args.threads)
    if args.trials < 1 or args.warmup < 0 or args.positions < 1:
        console.print("[red]--trials must be >= 1, --warmup >= 0, --positions >= 1[/red]")
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype or ("bf16" if args.random_config else "fp32"))
    contexts = [2048] if args.quick else args.contexts
    executors = args.executors or [e for e in EXECUTORS if e != "packed-triton" or device.type == "cuda"]
    for n in contexts:
        for r in args.intervals:
            try:
                refresh_positions(n, r, args.positions)
            except ValueError as exc:
                console.print(f"[red]{exc}: change --contexts/--intervals/--positions[/red]")
                return 2
    load_at_start = load_average()
    model, name = _load(args, device, dtype)
    rows: list[Row] = []
    for n in contexts:
        rows += _bench_context(model, n, args, executors, device, console)
    meta = _meta(args, name, dtype, device, contexts, executors)
    meta["loadavg"] = load_at_start  # 1/5/15-minute load when the run started (other jobs share the CPU)
    _write(args.out, meta, rows, console)
    return 0


def _load(args, device, dtype):
    if args.random_config:
        from transformers import AutoModelForCausalLM, Qwen3Config

        torch.manual_seed(args.seed)
        config = Qwen3Config(**RANDOM_CONFIGS[args.random_config])
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval(), f"random {args.random_config}"
    from kvmemory.models import load_model

    lm = load_model(args.model, dtype)
    return lm.model.to(device), lm.name


def shifted_cache(model, n: int, seed: int, device):
    """Prefill N + 8 random tokens, delete 8 at N/8 and Shift the suffix keys (eq. 2).

    Returns:
        ``(cache, token_ids)``: N rows, LongTensor ``[N]`` on ``device``.
    """
    from kvmemory import kvcache
    from kvmemory.engine import forward_rows
    from kvmemory.shift import RotaryShifter

    g = torch.Generator().manual_seed(seed + n)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(100, vocab - 100, (n + DELETED,), generator=g).to(device)
    cache = kvcache.new_cache(model.config)
    for start in range(0, n + DELETED, 1024):  # chunked prefill keeps attention scores small
        forward_rows(model, cache, ids[start : start + 1024], start)
    cut = n // 8
    keep = torch.cat([torch.arange(cut), torch.arange(cut + DELETED, n + DELETED)]).to(device)
    shifted = kvcache.gather_rows(cache, keep)
    shifter = RotaryShifter(model)
    old, new = torch.arange(cut + DELETED, n + DELETED), torch.arange(cut, n)
    coeffs = shifter.coefficients(old, new)
    for layer in shifted.layers:
        layer.keys[:, :, cut:] = shifter.apply(layer.keys[:, :, cut:], coeffs)
    return shifted, ids[keep]


def _executor(name: str, model, ids, positions):
    """A function cache -> refreshed independent cache for executor ``name``."""
    from kvmemory import kvcache
    from kvmemory.executors.sequential import run_direct, run_oneshot, run_sequential
    from kvmemory.executors.packed import run_packed
    from kvmemory.selection import to_intervals

    intervals = to_intervals(positions)
    pos = torch.tensor(positions)

    def copy(cache):  # one full copy, as the packed executor makes for its output
        return kvcache.from_tensors(kvcache.layer_tensors(cache))

    def in_copy(fn, arg):
        def go(cache):
            out = copy(cache)
            fn(model, out, ids, arg)
            return out
        return go

    if name == "sequential":
        return in_copy(run_sequential, intervals)
    if name == "direct":
        return in_copy(run_direct, intervals)
    if name == "oneshot":
        return in_copy(run_oneshot, pos)
    backend = name.split("-", 1)[1]
    return lambda cache: run_packed(model, cache, ids, pos, backend=backend)[0]


def _bench_context(model, n: int, args, executors, device, console) -> list[Row]:
    t0 = time.perf_counter()
    cache, ids = shifted_cache(model, n, args.seed, device)
    console.print(f"N = {n}: prefill + Shift {time.perf_counter() - t0:.1f} s")
    cells = {}
    for r in args.intervals:
        positions = refresh_positions(n, r, args.positions)
        for name in executors:
            cells[(name, r)] = (_executor(name, model, ids, positions), positions)
    diffs = _warm_up_and_check(cells, cache, args.warmup, device)
    samples = {key: [] for key in cells}
    order = list(cells)
    rng = random.Random(args.seed)
    for trial in range(args.trials):
        rng.shuffle(order)
        for key in order:
            samples[key].append(_timed(cells[key][0], cache, device))
        console.print(f"  trial {trial + 1}/{args.trials} done")
    rows = []
    for (name, r), times in samples.items():
        positions = cells[(name, r)][1]
        rows.append(Row(name, n, r, statistics.median(times), [round(t, 3) for t in times], len(positions),
                        sum(u + 1 for u in positions), diffs.get((name, r))))
    return sorted(rows, key=lambda row: (EXECUTORS.index(row.executor), row.R))


def _warm_up_and_check(cells, cache, warmup: int, device) -> dict:
    """Run every cell ``warmup`` times (at least once) and return each executor's largest |ΔK|, |ΔV|
    against the sequential executor's output for the same R (a fidelity check, not timed)."""
    outputs = {}
    for key, (fn, _) in cells.items():
        for _ in range(max(1, warmup)):
            out = fn(cache)
        outputs[key] = out
        if device.type == "cuda":
            torch.cuda.synchronize()
    diffs = {}
    for (name, r), out in outputs.items():
        ref = outputs.get(("sequential", r))
        if ref is not None:
            diffs[(name, r)] = max(
                max((a.float() - b.float()).abs().max().item() for a, b in ((la.keys, lb.keys), (la.values, lb.values)))
                for la, lb in zip(out.layers, ref.layers)
            )
    return diffs


def _timed(fn, cache, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(cache)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000.0


def _meta(args, name, dtype, device, contexts, executors) -> dict:
    import transformers

    return {
        "model": name, "dtype": str(dtype).replace("torch.", ""), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "threads": args.threads, "cpu_count": os.cpu_count(),
        "contexts": contexts, "intervals": args.intervals, "positions": args.positions, "deleted": DELETED,
        "warmup": args.warmup, "trials": args.trials, "executors": executors, "seed": args.seed,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "protocol": "paper §4.4: B positions in R intervals, matched causal pairs, warm-ups then interleaved trials, medians",
    }


def _write(out: Path, meta: dict, rows: list[Row], console) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta["loadavg_end"] = load_average()
    (out / "refresh.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    table = markdown_table(meta, rows)
    (out / "refresh.md").write_text(table)
    plot(rows, out / "refresh.png", meta)
    console.print(table)
    console.print(f"wrote {out / 'refresh.json'}, refresh.md, refresh.png")


def markdown_table(meta: dict, rows: list[Row]) -> str:
    """Median ms per executor × context × R, the packed speed-ups and the §4.4 targets."""
    median = {(r.executor, r.context, r.R): r.median_ms for r in rows}
    contexts, intervals = sorted({r.context for r in rows}), sorted({r.R for r in rows})
    executors = [e for e in EXECUTORS if any(r.executor == e for r in rows)]
    lines = [
        f"# Refresh timing ({meta['model']}, {meta['dtype']}, {meta['device']} {meta['device_name']}, "
        f"{meta['threads']} thread(s))",
        "",
        f"B = {meta['positions']} positions in R intervals, matched causal pairs; median of {meta['trials']} "
        f"interleaved trials after {meta['warmup']} warm-ups; load average {meta['loadavg'][0]:.1f} at start, "
        f"{meta['loadavg_end'][0]:.1f} at the end ({meta['cpu_count']} CPUs). Times in ms.",
        "",
        "| N | R | " + " | ".join(executors) + " | sequential / packed |",
        "|---|---|" + "---|" * len(executors) + "---|",
    ]
    for n in contexts:
        for r in intervals:
            cells = [f"{median[(e, n, r)]:.1f}" if (e, n, r) in median else "" for e in executors]
            ratio = time_ratio(median, ("sequential", n, r), ("packed-sdpa", n, r))
            lines.append(f"| {n} | {r} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "Targets (paper §4.4 protocol):"]
    for n in contexts:
        hi, lo = max(intervals), min(intervals)
        speedup = time_ratio(median, ("sequential", n, hi), ("packed-sdpa", n, hi))
        flat = time_ratio(median, ("packed-sdpa", n, hi), ("packed-sdpa", n, lo))
        lines.append(f"- N = {n}: packed vs sequential-with-copies at R = {hi}: {speedup} (target ≥ 8× at 2 K on CPU); "
                     f"packed R = {hi} / R = {lo}: {flat} (target ≤ 1.2×)")
    diffs = [r.max_abs_diff_vs_sequential for r in rows if r.max_abs_diff_vs_sequential is not None]
    if diffs:
        lines.append(f"- largest |ΔK|, |ΔV| of any executor vs sequential over all layers: {max(diffs):.2e}")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path, meta: dict) -> None:
    """Median refresh time vs R, one line per executor, one panel per context (log y)."""
    plt = agg_pyplot()
    contexts = sorted({r.context for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, n in zip(axes[0], contexts):
        for name in EXECUTORS:
            pts = sorted((r.R, r.median_ms) for r in rows if r.executor == name and r.context == n)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="intervals R", ylabel="median refresh time (ms)",
               title=f"N = {n}, B = {meta['positions']}")
        ax.set_xticks(sorted({r.R for r in rows}), labels=[str(x) for x in sorted({r.R for r in rows})])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{meta['model']} ({meta['dtype']}, {meta['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
