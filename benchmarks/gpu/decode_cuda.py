"""GPU decode check for a lent CUDA machine (prepared; CPU stays kvmemory's tested default).

Measures, on the embedded SmolLM2-135M-Instruct, one-token decode steps at a given context:
  eager     - transformers' forward on a DynamicCache (what kvmemory's transformers engine runs)
  graphs    - the same step on a StaticCache under torch.compile(mode="reduce-overhead"), i.e.
              CUDA graphs: the GPU counterpart of the CPU engine's one-call decode step
and checks that both give the same logits (fp32: 1e-3; bf16: reported). Prints one JSON line.

    python benchmarks/gpu/decode_cuda.py --context 2048 --steps 64 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import DynamicCache, StaticCache

from kvmemory.models import load_model


def _steps(step, ids, start: int, n: int) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = None
    for i in range(n):
        logits = step(ids[:, start + i : start + i + 1], start + i)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0), logits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    args = parser.parse_args()
    loaded = load_model(dtype=args.dtype, engine="transformers")
    model = loaded.model.cuda()
    total = args.context + 2 * args.steps + 8
    ids = torch.randint(100, 40000, (1, total), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    out = {"context": args.context, "steps": args.steps, "dtype": args.dtype, "gpu": torch.cuda.get_device_name()}

    def run(cache, step_fn):
        with torch.no_grad():
            model(input_ids=ids[:, : args.context], cache=cache, use_cache=True)
            step_fn(ids[:, args.context : args.context + 1], args.context)  # warm-up / capture
            return _steps(step_fn, ids, args.context + 1, args.steps)

    def eager_step(cache):
        def step(tok, pos):
            return model(input_ids=tok, position_ids=torch.tensor([[pos]], device="cuda"), cache=cache,
                         use_cache=True).logits[0, -1].float()
        return step

    dynamic = DynamicCache(config=model.config)
    out["eager_tok_s"], eager_logits = run(dynamic, eager_step(dynamic))
    static = StaticCache(config=model.config, max_cache_len=total)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)

    def graph_step(tok, pos):
        return compiled(input_ids=tok, position_ids=torch.tensor([[pos]], device="cuda"), cache=static,
                        use_cache=True).logits[0, -1].float()

    t0 = time.perf_counter()
    out["graphs_tok_s"], graph_logits = run(static, graph_step)
    out["compile_and_run_s"] = round(time.perf_counter() - t0, 1)
    out["max_abs_logit_diff"] = float((eager_logits - graph_logits).abs().max())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
