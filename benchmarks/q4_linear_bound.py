"""Is the engine's one-row Q4_1 linear bound by memory or by its arithmetic on this CPU?

The same kernel (``q4_1_linear``, one activation row, the build ``kernel_isa()`` names) multiplies
random blocks of three sizes: one that stays in L2 (256 x 576), the embedded model's
``gate_up`` (3072 x 576) and one far beyond L3 (196,608 x 576, ~85 MB). If the kernel were bound
by memory, the in-cache matrix would stream much faster than the big one; if by its arithmetic,
both run at about the same blocks per second, below what a plain read of the same bytes
(``torch.sum`` of an fp32 tensor) streams. Medians of wall time, 1 and 2 threads. Output:
``bound.json`` and ``bound.md`` in ``--out`` with the CPU flags and load averages.

    PYTHONPATH=.:lab .venv/bin/python benchmarks/q4_linear_bound.py --out benchmarks/results/agent_avx2_cpu_2k/bound
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvmemory.engine.quantized import kernel, kernel_isa
from kvmemory_lab.bench.common import load_average, machine_name, median_ms, simd_flags

K = 576
SIZES = ((256, 2000, "in L2"), (3072, 500, "gate_up"), (196_608, 15, "beyond L3"))  # (rows, repeats, label)


def random_blocks(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 blocks of a [rows, K] matrix: codes (two per byte), fp32 scales and mins per 32."""
    return (torch.randint(0, 256, (rows, K // 2), dtype=torch.uint8), torch.rand(rows, K // 32),
            torch.rand(rows, K // 32))


def measure(threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    lib, x, out = kernel(), torch.randn(1, K), []
    for rows, repeats, label in SIZES:
        codes, scales, mins = random_blocks(rows)
        nbytes = codes.numel() + 4 * (scales.numel() + mins.numel())
        ms = median_ms(lambda: lib.q4_1_linear(x, codes, scales, mins), repeats)
        out.append({"threads": threads, "what": f"q4_1_linear, {label}", "rows": rows, "ms": ms,
                    "gb_s": nbytes / ms / 1e6, "g_blocks_s": rows * K / 32 / ms / 1e6})
    stream = torch.rand(nbytes // 4)  # the big matrix's bytes, read once by a plain reduction
    ms = median_ms(stream.sum, 15)
    out.append({"threads": threads, "what": "torch.sum, the same bytes (fp32)", "rows": None, "ms": ms,
                "gb_s": stream.numel() * 4 / ms / 1e6, "g_blocks_s": None})
    return out


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# One-row Q4_1 linear: memory or arithmetic ({meta['kernel_isa']} build)", "",
             f"Command: `{meta['command']}`", "",
             f"{meta['date']} on {meta['machine']}, CPU flags {' '.join(meta['cpu_flags'])}; load {meta['loadavg_start']} "
             f"before, {meta['loadavg_end']} after. K = {K}; medians of wall time.", "",
             "| threads | what | rows | ms | GB/s | G blocks/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        blocks = "–" if r["g_blocks_s"] is None else f"{r['g_blocks_s']:.2f}"
        lines.append(f"| {r['threads']} | {r['what']} | {r['rows'] or '–'} | {r['ms']:.3f} | {r['gb_s']:.1f} | {blocks} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    loadavg_start = load_average()
    rows = measure(1) + measure(2)
    meta = {"command": f"PYTHONPATH=.:lab .venv/bin/python benchmarks/q4_linear_bound.py --out {args.out}",
            "kernel_isa": kernel_isa(), "machine": machine_name(), "cpu_flags": simd_flags(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "loadavg_start": loadavg_start,
            "loadavg_end": load_average()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bound.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "bound.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
