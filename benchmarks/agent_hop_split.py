"""Where each hop of the agent benchmark's chat spends its time on kvmemory: ``KVSession.prepare``
(the repair report's selection, Shift and refresh ms, and the rest: rendering, diffing, the key
rotation) and the answer after it, timed apart. Same chat, tools, policy, engine, prompt lookup
and 20-token greedy answers (stop tokens masked) as ``kvmemory bench agent``; each run is a fresh
session taking the steps in order, medians over ``--runs``. Output: ``split.json`` and
``split.md`` in ``--out``, with the CPU flags, kernel build, threads and load averages.

    PYTHONPATH=.:lab .venv/bin/python benchmarks/agent_hop_split.py --out benchmarks/results/agent_avx2_cpu_2k/split
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvmemory.engine import kernel_isa
from kvmemory_lab.bench.agent import SEARCH_TOOL, agent_chat
from kvmemory_lab.bench.agent_systems import KVMemorySystem, ModelPool
from kvmemory_lab.bench.common import load_average, machine_name, simd_flags
from kvmemory_lab.demo_cases import default_data_dir
from kvmemory_lab.gguf_models import resolve_model

STEPS = ("first", "repeat", "append", "delete")
FIELDS = ("prepare_ms", "selection_ms", "shift_ms", "refresh_ms", "answer_ms", "answer_ms_per_token")


def one_run(system: KVMemorySystem, steps: dict, answer_tokens: int) -> dict[str, dict]:
    """A fresh session through every step: per step the prepare and answer times (ms)."""
    system.start()
    out = {}
    for step in STEPS:
        t0 = time.perf_counter()
        report = system.session.prepare(steps[step])
        t1 = time.perf_counter()
        system._answer(answer_tokens)  # the benchmark's own answer loop
        t2 = time.perf_counter()
        out[step] = {"prepare_ms": (t1 - t0) * 1e3, "selection_ms": report.selection_ms, "shift_ms": report.shift_ms,
                     "refresh_ms": report.refresh_ms, "answer_ms": (t2 - t1) * 1e3,
                     "answer_ms_per_token": (t2 - t1) * 1e3 / (answer_tokens - 1),
                     "recomputed_tokens": report.recomputed_tokens}
    return out


def markdown(meta: dict, medians: dict) -> str:
    lines = [f"# Agent hops split: prepare vs answer ({meta['model']}, {meta['context']} tokens)", "",
             f"Command: `{meta['command']}`", "",
             f"{meta['date']} on {meta['machine']}, CPU flags {' '.join(meta['cpu_flags'])}, kernel {meta['kernel_isa']}, "
             f"{meta['threads']} thread(s), load {meta['loadavg_start']} before, {meta['loadavg_end']} after. "
             f"Medians of {meta['runs']} runs; policy {meta['policy']}, prompt lookup {meta['lookup']}, "
             f"{meta['answer_tokens']}-token answers (the answer's first token comes with prepare).", "",
             "| step | recomputed tokens | prepare | selection | Shift | refresh | answer | answer per token |",
             "|---|---|---|---|---|---|---|---|"]
    for step, m in medians.items():
        lines.append(f"| {step} | {m['recomputed_tokens']} | " + " | ".join(f"{m[f]:,.1f}" for f in FIELDS) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="as kvmemory bench agent --model (default: the embedded model)")
    parser.add_argument("--context", type=int, default=2048, help="chat size in tokens (default 2048)")
    parser.add_argument("--runs", type=int, default=5, help="fresh sessions, medians reported (default 5)")
    parser.add_argument("--answer-tokens", type=int, default=20)
    parser.add_argument("--policy", default="sur@5")
    parser.add_argument("--lookup", type=int, default=2, help="prompt lookup draft tokens (default 2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loadavg_start = load_average()
    pool = ModelPool(resolve_model(args.model))
    lm = pool.get("fp32", "auto")
    room = lm.model.config.get_text_config().max_position_embeddings - args.answer_tokens
    chat = agent_chat(default_data_dir(), lm.tokenizer, args.context, room)
    system = KVMemorySystem({"engine": "kvmemory", "policy": args.policy, "dtype": "fp32", "rows": lm.engine.name,
                             "lookup": args.lookup}, lm, [SEARCH_TOOL])
    system.call(chat.steps["first"][:4], 2)  # warm-up, as the benchmark's
    runs = [one_run(system, chat.steps, args.answer_tokens) for _ in range(args.runs)]
    medians = {step: {f: statistics.median(r[step][f] for r in runs) for f in FIELDS + ("recomputed_tokens",)}
               for step in STEPS}
    meta = {"command": "PYTHONPATH=.:lab .venv/bin/python benchmarks/agent_hop_split.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
            "model": str(args.model or "SmolLM2-135M-Instruct"), "context": args.context, "runs": args.runs,
            "policy": args.policy, "lookup": args.lookup, "answer_tokens": args.answer_tokens, "threads": args.threads,
            "engine": lm.engine.name, "kernel_isa": kernel_isa(), "machine": machine_name(), "cpu_flags": simd_flags(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "loadavg_start": loadavg_start,
            "loadavg_end": load_average()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "split.json").write_text(json.dumps({"meta": meta, "medians": medians, "runs": runs}, indent=1))
    (args.out / "split.md").write_text(markdown(meta, medians))
    print(markdown(meta, medians))


if __name__ == "__main__":
    main()
