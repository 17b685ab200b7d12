"""Where one eager decode step's time goes (fp32, DynamicCache, as kvmemory runs today).

Three views of the same step, at context 32 and 2,000:
  * wall time of one step (median of 20);
  * torch.profiler self-CPU time per aten op, grouped: GEMM (addmm/mm/bmm/linear kernels),
    attention (SDPA kernels), cache growth (cat), other ops; the rest of the wall time is Python
    and dispatcher work between ops (module calls, mask/rope construction, profiler overhead);
  * a *dispatch-only twin*: the same architecture (30 layers, 9/3 heads, same op sequence) with
    every width shrunk to near zero (head_dim 8, hidden 72, MLP 64, vocab 512), so its step costs
    only the per-op overhead. twin time / real time = the share of the step that is overhead.

Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/engine_prototype/profile_step.py   (~1-2 min)
"""
import json
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

import common

GEMM = ("aten::addmm", "aten::mm", "aten::bmm", "aten::_weight_int8pack_mm", "mkldnn::")
ATTN = ("scaled_dot_product", "_flash_attention")
CACHE = ("aten::cat",)


def step_times(variant, token, n=20):
    times = []
    for _ in range(n):
        variant.reset(variant.pos - 1) if times else None
        t = time.perf_counter()
        variant.step(token)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def twin_model(config):
    cfg = config.__class__(**{**config.to_dict(), "hidden_size": 72, "head_dim": 8, "intermediate_size": 64,
                              "vocab_size": 512})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def profile_step(variant, token, steps=10):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            variant.reset(variant.pos - 1)
            variant.step(token)
        wall_us = (time.perf_counter() - t) / steps * 1e6
    groups, calls = defaultdict(float), 0
    for ev in prof.key_averages():
        name, self_us = ev.key, ev.self_cpu_time_total / steps
        calls += ev.count / steps  # every aten call, nested ones included
        kind = ("gemm" if name.startswith(GEMM) else "attention" if any(a in name for a in ATTN)
                else "cache_cat" if name in CACHE else "other_ops")
        groups[kind] += self_us
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    table = [(e.key, round(e.self_cpu_time_total / steps), round(e.count / steps, 1)) for e in top]
    return dict(groups={k: round(v) for k, v in groups.items()}, op_calls=round(calls), profiled_wall_us=round(wall_us),
                top_ops=table)


def main():
    print("load", common.loadavg())
    lm = common.load("fp32")
    ids = common.contexts(lm.tokenizer)
    twin = twin_model(lm.model.config)
    report = {}
    for ctx, prompt in ids.items():
        real = common.EagerDynamic(lm.model, "real")
        small = common.EagerDynamic(twin, "twin")
        real.prefill(prompt)
        small.prefill(prompt % 512)  # the twin has a 512-token vocabulary
        for v in (real, small):  # one step so that reset(pos - 1) is valid
            v.step(42)
        t_real, t_twin = [], []
        for _ in range(3):  # interleaved
            t_real.append(step_times(real, 42, 7))
            t_twin.append(step_times(small, 42, 7))
        prof = profile_step(real, 42)
        r = dict(step_ms=round(statistics.median(t_real) * 1e3, 2), twin_step_ms=round(statistics.median(t_twin) * 1e3, 2),
                 overhead_share=round(statistics.median(t_twin) / statistics.median(t_real), 2), profile_us=prof,
                 load=common.loadavg())
        report[ctx] = r
        print(f"ctx {ctx}: step {r['step_ms']} ms, dispatch-only twin {r['twin_step_ms']} ms "
              f"(overhead share {r['overhead_share']}), ops/step {prof['op_calls']}")
        g = prof["groups"]
        tot = prof["profiled_wall_us"]
        print(f"   profiled step {tot} us: " + ", ".join(f"{k} {v} us ({v / tot:.0%})" for k, v in g.items())
              + f", outside aten ops (Python, module calls, profiler) {tot - sum(g.values())} us ({(tot - sum(g.values())) / tot:.0%})")
        for name, us, count in prof["top_ops"]:
            print(f"     {name:50s} {us:8d} us  x{count}")
    common.RESULTS.mkdir(exist_ok=True)
    (common.RESULTS / "profile_step.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
