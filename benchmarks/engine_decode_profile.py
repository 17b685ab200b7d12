"""Where a decoded token's time goes on the quantized engine, exact (``q4_1``) vs int8 activations
(``q4_1_int8``): each linear of one layer and the head (one row and a few rows), the whole
one-token step at several cache lengths, and the split of a 2 K-row step into linears, head,
attention over the cached rows and the rest (norms, RoPE, activation quantization, copies).
Without VNNI (an AVX2 build, e.g. ``KVMEMORY_ISA=avx2``) only ``q4_1`` is profiled.

Times are medians of CPU time (``time.process_time``; with one thread this is the thread's own
time, so a busy neighbour inflates it less than wall time) unless ``--threads`` > 1, where wall
time is used. The step is timed on a random cache (attention costs the same for any values).
Output: ``profile.json`` and ``profile.md`` in ``--out``.

    OMP_NUM_THREADS=2 PYTHONPATH=.:lab .venv/bin/python benchmarks/engine_decode_profile.py --threads 2 \\
        --out benchmarks/results/agent_engine_vnni/profile
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from kvmemory_lab.bench.common import median_ms

ENGINES = ("q4_1", "q4_1_int8")
CONTEXTS = (16, 512, 2048, 8192)
FEW_ROWS = 8


def linear_times(engine, clock, repeats: int, int8: bool) -> list[dict]:
    layer = engine.layers[0]
    rows = []
    for name, blocks in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up), ("down", layer.down), ("head", engine.head)):
        out_features, in_features = blocks.shape
        dense = blocks.dequantize()
        reps = max(5, repeats // 20) if name == "head" else repeats
        for m in (1, FEW_ROWS):
            x = torch.randn(m, in_features)
            rows.append({
                "linear": name, "out": out_features, "in": in_features, "rows": m,
                "fp32_blocks_ms": median_ms(lambda: blocks(x), reps, clock),
                "int8_blocks_ms": median_ms(lambda: blocks(x, int8=True), reps, clock) if int8 else None,
                "dense_fp32_ms": median_ms(lambda: x @ dense.T, max(5, reps // 4), clock),
            })
    return rows


def step_times(engine, clock, repeats: int) -> dict[int, float]:
    capacity = max(CONTEXTS) + 1
    keys = torch.randn(len(engine.layers), 1, engine.kv_heads, capacity, engine.head_dim) * 0.5
    values = torch.randn_like(keys)
    hidden = torch.randn(engine.model.config.hidden_size)
    cos, sin = torch.ones(engine.head_dim), torch.zeros(engine.head_dim)
    return {n: median_ms(lambda: engine.decoder.step(hidden, keys, values, cos, sin, n), repeats, clock) for n in CONTEXTS}


def forward_rows_overhead(lm, engine, clock, repeats: int) -> float:
    """ms per decoded token that forward_rows adds around the step (embedding, RoPE angles, buffers)."""
    from kvmemory import kvcache
    from kvmemory.engine import forward_rows

    cache = kvcache.new_cache(lm.model.config)
    forward_rows(lm.model, cache, torch.arange(100, 116), 0, capacity=16 + repeats + 2)
    state = {"row": 16}

    def one():
        forward_rows(lm.model, cache, torch.tensor([7]), state["row"])
        state["row"] += 1

    return median_ms(one, repeats, clock)


def breakdown(linears: list[dict], steps: dict[int, float], layers: int, column: str) -> dict:
    per_layer = sum(r[column] for r in linears if r["rows"] == 1 and r["linear"] != "head")
    head = next(r[column] for r in linears if r["rows"] == 1 and r["linear"] == "head")
    small = steps[min(CONTEXTS)]
    return {
        "linears_ms": per_layer * layers, "head_ms": head,
        "attention_2k_ms": steps[2048] - small, "attention_8k_ms": steps[8192] - small,
        "rest_ms": small - per_layer * layers - head,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per linear (steps: repeats / 10)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    from kvmemory import load_model
    from kvmemory import kvcache
    from kvmemory.engine import engine_for
    from kvmemory.engine.quantized import kernel

    load_before = [round(x, 2) for x in os.getloadavg()]
    vnni = kernel().has_vnni()
    result = {"threads": args.threads, "clock": clock.__name__, "isa": kernel().isa(), "load_before": load_before, "engines": {}}
    for name in ENGINES if vnni else ENGINES[:1]:
        lm = load_model(engine=name)
        engine = engine_for(lm.model, kvcache.new_cache(lm.model.config))
        linears = linear_times(engine, clock, args.repeats, vnni)
        steps = step_times(engine, clock, max(5, args.repeats // 10))
        overhead = forward_rows_overhead(lm, engine, clock, max(5, args.repeats // 10)) - steps[min(CONTEXTS)]
        result["engines"][name] = {
            "linears": linears, "step_ms": steps, "python_overhead_ms": overhead,
            "breakdown": breakdown(linears, steps, len(engine.layers), "int8_blocks_ms" if engine.int8 else "fp32_blocks_ms"),
        }
        del lm, engine
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(result, indent=1))
    (args.out / "profile.md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    engines = result["engines"]
    first = next(iter(engines.values()))
    lines = [
        f"# Decode profile: {' vs '.join(engines)} ({result.get('isa', '?')} kernel build)",
        "",
        f"{result['threads']} thread(s), medians of {result['clock']}; load {result['load_before']} before, "
        f"{result['load_after']} after.",
        "",
        "| linear [out x in] | rows | fp32 blocks ms | int8 blocks ms | speed-up | dense fp32 ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in first["linears"]:
        int8 = r["int8_blocks_ms"]
        lines.append(f"| {r['linear']} [{r['out']} x {r['in']}] | {r['rows']} | {r['fp32_blocks_ms']:.3f} | "
                     + (f"{int8:.3f} | {r['fp32_blocks_ms'] / int8:.2f}x" if int8 is not None else "– | –") + f" | {r['dense_fp32_ms']:.3f} |")
    lines += ["", "| one decoded token (LlamaDecoder.step), ms | " + " | ".join(f"{n} rows" for n in CONTEXTS) + " |",
              "|---|" + "---|" * len(CONTEXTS)]
    for name, data in engines.items():
        lines.append(f"| {name} | " + " | ".join(f"{data['step_ms'][n]:.2f}" for n in CONTEXTS) + " |")
    lines += ["", "| split of a step, ms | linears (30 layers) | head | attention at 2 K | attention at 8 K | rest | forward_rows around the step |",
              "|---|---|---|---|---|---|---|"]
    for name, data in engines.items():
        b = data["breakdown"]
        lines.append(f"| {name} | {b['linears_ms']:.2f} | {b['head_ms']:.2f} | {b['attention_2k_ms']:.2f} | "
                     f"{b['attention_8k_ms']:.2f} | {b['rest_ms']:.2f} | {data['python_overhead_ms']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
