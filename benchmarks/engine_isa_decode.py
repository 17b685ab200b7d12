"""One decoded token on the quantized engine per kernel instruction set (avx512, avx2, portable:
each this CPU runs), next to transformers' forward, at ~2 K cached rows.

Each variant decodes the same token at the same position again and again: ``forward_rows`` of
one token after the cache is cropped back to the prompt (the engine zeroes the cut row, like the
crop before a new turn); transformers runs ``model(input_ids, cache)`` on a plain cache, cropped
the same way. Rounds are interleaved (one call of every variant per round) so that a busy
neighbour slows all of them alike; the figure is the median wall time. Output: ``decode.json``
and ``decode.md`` in ``--out`` with the CPU flags, thread counts and load averages.

    .venv/bin/python benchmarks/engine_isa_decode.py --out benchmarks/results/engine_isa
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line.partition(":")[2].strip() for line in info if line.startswith("flags")), "")
    except OSError:
        return ""


def engines_per_isa(model) -> dict:
    """The embedded model's engine built on each ISA this CPU runs (KVMEMORY_ISA per build)."""
    from kvmemory.engine.build import build
    from kvmemory.engine.quantized import cpu_isas
    from kvmemory.models import embedded_gguf_path

    built = {}
    for isa in cpu_isas():
        os.environ["KVMEMORY_ISA"] = isa
        built[isa] = build(model, embedded_gguf_path())
    os.environ.pop("KVMEMORY_ISA")
    return built


def decode_calls(model, engines: dict, prompt: torch.Tensor, token: torch.Tensor) -> dict:
    """name -> a callable decoding ``token`` after ``prompt`` (one call = one timed token)."""
    from kvmemory import kvcache

    n = prompt.shape[0]
    plain = kvcache.new_cache(model.config)
    with torch.no_grad():
        model(input_ids=prompt[None], cache=plain, use_cache=True)
    rows = [(k.clone(), v.clone()) for k, v in kvcache.layer_tensors(plain)]
    calls = {}
    for isa, engine in engines.items():
        cache = kvcache.from_tensors([(k.clone(), v.clone()) for k, v in rows])
        kvcache.crop_to(cache, n - 1)  # the engine recomputes the last prompt row: the rows move into its buffer
        engine.forward_rows(cache, prompt[-1:], n - 1, capacity=n + 1)
        calls[f"engine {isa}"] = _repeat(lambda cache=cache, engine=engine: engine.forward_rows(cache, token, n), cache, n)

    def transformers_step():
        with torch.no_grad():
            model(input_ids=token[None], cache=plain, use_cache=True)

    calls["transformers"] = _repeat(transformers_step, plain, n)
    return calls


def _repeat(step, cache, n: int):
    from kvmemory import kvcache

    def call():
        step()
        kvcache.crop_to(cache, n)
    return call


def time_rounds(calls: dict, rounds: int) -> dict:
    for call in calls.values():  # warm-up
        call()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: {"median_ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3} for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=2048, help="cached rows before the decoded token")
    parser.add_argument("--rounds", type=int, default=15, help="timed calls per variant and thread count")
    parser.add_argument("--threads", default="2,1")
    args = parser.parse_args()
    from kvmemory import load_model
    from kvmemory.engine.quantized import cpu_isas, isa_flags, kernel

    lm = load_model(engine="transformers")
    vocab = lm.model.config.vocab_size
    prompt = torch.randint(100, vocab, (args.rows,), generator=torch.Generator().manual_seed(0))
    token = torch.tensor([1234])
    result = {
        "model": "embedded SmolLM2-135M-Instruct (fp32)", "cached_rows": args.rows, "rounds": args.rounds,
        "torch": torch.__version__, "machine": platform.machine(), "cpu_flags": cpu_flags(),
        "isas": list(cpu_isas()), "builds": {isa: kernel(isa).isa() for isa in cpu_isas()},
        "flags": {isa: " ".join(isa_flags(isa)) or "(none)" for isa in cpu_isas()},
        "load_before": [round(x, 2) for x in os.getloadavg()], "threads": {},
    }
    torch.set_num_threads(max(int(t) for t in args.threads.split(",")))
    engines = engines_per_isa(lm.model)
    calls = decode_calls(lm.model, engines, prompt, token)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        result["threads"][str(threads)] = time_rounds(calls, args.rounds)
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(result, indent=1))
    (args.out / "decode.md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    names = list(next(iter(result["threads"].values())))
    lines = [
        f"# One decoded token per kernel ISA at {result['cached_rows']} cached rows",
        "",
        f"{result['model']}, torch {result['torch']}, {result['machine']}; median (min) wall ms of "
        f"{result['rounds']} interleaved rounds; load average {result['load_before']} before, "
        f"{result['load_after']} after.",
        "",
        "| threads | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for threads, times in result["threads"].items():
        lines.append(f"| {threads} | " + " | ".join(f"{times[n]['median_ms']:.1f} ({times[n]['min_ms']:.1f})" for n in names) + " |")
    lines += ["", "Compiler flags per ISA: " + "; ".join(f"{isa}: `{flags}`" for isa, flags in result["flags"].items()), "",
              f"CPU flags: `{result['cpu_flags']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
