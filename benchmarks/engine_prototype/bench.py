"""Driver: decode tok/s (ctx 32 and 2,000), prefill 2,000, fidelity, compile time for named
variants, each interleaved with the eager fp32 DynamicCache baseline (kvmemory today).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/engine_prototype/bench.py --out NAME VARIANT [VARIANT ...] [--quick]

Variants (see VARIANTS below):
  hf-bf16                 eager bf16, DynamicCache
  hf-fp32-static / hf-bf16-static           eager, transformers StaticCache
  hf-fp32-static-c / hf-bf16-static-c       StaticCache, one-token step under torch.compile
  tao-int8 / tao-int4 (+ "-c": compiled)    torchao weight-only int8 (per row) / int4 (group 32,
                                            CPU tinygemm) on the transformers model, StaticCache
  eng-{fp32,bf16,int8,q4,q4b}[-c][-mask]    our engine (benchmarks/engine_prototype/engine.py): fused weights, one
                                            pre-allocated K and V buffer; q4 = the GGUF's own
                                            Q4_1 linears + Q8_0 head in fp32 (exact); q4b = the
                                            same blocks through aten's int4 kernel, bf16
                                            activations (lossy); -c compiled step (dynamic
                                            length slice, or -mask: max_len mask)
  eng-q4-c-ingraph        as eng-q4-c with the argmax inside the compiled step (no per-token
                          host int until the token is yielded)

Compile time = the first compiled step (dynamo + inductor + C++ build; cold unless the inductor
FX cache in $TORCHINDUCTOR_CACHE_DIR already holds the graph). Recompiles are counted from
dynamo's unique-graph counter around each variant's own calls after warm-up.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch._dynamo.utils import counters

import common
from engine import Engine
from hf_variants import HFStatic

MAX_LEN = max(common.CONTEXTS) + common.DECODE_TOKENS + common.FORCED_STEPS + 48
_models: dict = {}


def loaded(dtype: str):
    if dtype not in _models:
        _models[dtype] = common.load(dtype)
    return _models[dtype]


def model(dtype: str):
    return loaded(dtype).model


def fresh_model(dtype: str):
    return common.load(dtype).model  # torchao quantizes in place: never share


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


class Compiled:
    """Wraps a variant whose ``step`` runs a compiled function: warm-up (compile) before timing,
    then counts recompiles during the measured calls."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.recompiles, self.compile_s = 0, None

    def prefill(self, ids):
        logits = self.inner.prefill(ids)
        if self.compile_s is None:
            self.warmup(ids.shape[0])
        return logits

    def warmup(self, n):
        g0, t = graphs(), time.perf_counter()
        self.inner.step(42)
        self.compile_s = time.perf_counter() - t
        t = time.perf_counter()
        self.inner.step(43)  # a second position: an int-specialised graph recompiles here
        self.second_s = time.perf_counter() - t
        self.warm_graphs = graphs() - g0
        self.inner.reset(n)

    def reset(self, length):
        self.inner.reset(length)

    def step(self, token):
        g0 = graphs()
        logits = self.inner.step(token)
        self.recompiles += graphs() - g0
        return logits

    def __getattr__(self, name):  # greedy() when the inner variant has one
        if name == "greedy" and hasattr(self.inner, "greedy"):
            def greedy(logits, n):
                g0 = graphs()
                out = self.inner.greedy(logits, n)
                self.recompiles += graphs() - g0
                return out
            return greedy
        raise AttributeError(name)

    def report(self):
        return {"compile_s": round(self.compile_s, 1), "second_call_s": round(self.second_s, 2),
                "graphs_at_warmup": self.warm_graphs, "recompiles_after_warmup": self.recompiles}


class EngineVariant:
    def __init__(self, name, engine: Engine, compile_kwargs=None, ingraph=False):
        self.name, self.engine, self.pos = name, engine, 0
        self.mask = engine.attention == "mask"
        fn = self._step_argmax if ingraph else engine.decode_step
        self._step = torch.compile(fn, **compile_kwargs) if compile_kwargs is not None else fn
        self.ingraph = ingraph

    def _step_argmax(self, token, pos):
        logits = self.engine.decode_step(token, pos)
        return logits, torch.argmax(logits).reshape(1)

    def _pos(self):
        return torch.tensor([self.pos]) if self.mask else self.pos

    @torch.no_grad()
    def prefill(self, ids):
        logits = self.engine.forward_rows(ids, 0)
        self.pos = ids.shape[0]
        return logits

    def reset(self, length):
        self.pos = length  # rows past the cursor are overwritten by the next writes

    @torch.no_grad()
    def step(self, token):
        out = self._step(torch.tensor([token]), self._pos())
        self.pos += 1
        return out[0] if self.ingraph else out

    @torch.no_grad()
    def greedy_ingraph(self, logits, n):
        token, tokens = torch.argmax(logits).reshape(1), []
        for _ in range(n):
            tokens.append(token)
            _, token = self._step(token, self._pos())
            self.pos += 1
        return [int(t) for t in tokens]


def engine_variant(spec: str):
    """eng-{fmt}[-c][-mask][-ingraph]"""
    parts = spec.split("-")
    fmt = parts[1]
    compiled, mask, ingraph = "c" in parts, "mask" in parts, "ingraph" in parts
    wfmt, head = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "int8": ("int8", "int8"),
                  "q4": ("q4_1", "q8_0"), "q4b": ("q4_1-bf16", "q8_0-bf16")}[fmt]
    cache_dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    eng = Engine(model("fp32"), fmt=wfmt, head=head, max_len=MAX_LEN, cache_dtype=cache_dtype,
                 attention="mask" if mask else "slice")
    kwargs = ({"dynamic": not mask} if compiled else None)
    v = EngineVariant(spec, eng, kwargs, ingraph=ingraph)
    if ingraph:
        v.greedy = v.greedy_ingraph
    return Compiled(v) if compiled else v


def torchao_model(kind: str):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    m = fresh_model("fp32")
    if kind == "int8":
        quantize_(m, Int8WeightOnlyConfig())
    else:
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        m = m.to(torch.bfloat16)  # the CPU tinygemm int4 kernel here runs bf16 activations
        quantize_(m, PrototypeInt4WeightOnlyConfig(group_size=32))
    return m


def hf_variant(spec: str):
    parts = spec.split("-")
    compiled = parts[-1] == "c"
    if parts[0] == "tao":
        m = torchao_model(parts[1])
    else:
        m = model(parts[1])
    if parts[0] == "hf" and "static" not in parts:
        return common.EagerDynamic(m, spec)
    v = HFStatic(m, spec, MAX_LEN, {} if compiled else None)
    return Compiled(v) if compiled else v


def build(spec: str):
    return engine_variant(spec) if spec.startswith("eng-") else hf_variant(spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="1 rep, 8 tokens (smoke test)")
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args()
    print("load", common.loadavg(), "threads", torch.get_num_threads())
    base = common.EagerDynamic(model("fp32"), "eager fp32 DynamicCache (today)")
    ids = common.contexts(loaded("fp32").tokenizer)
    variants = []
    for spec in args.variants:
        t = time.perf_counter()
        variants.append(build(spec))
        print(f"built {spec} in {time.perf_counter() - t:.1f} s")
    kw = dict(reps=1, decode_tokens=8) if args.quick else {}
    rows = common.measure(base, variants, ids, measure_prefill=not args.no_prefill, **kw)
    for v in variants:
        if isinstance(v, Compiled):
            rows[v.name].extra.update(v.report())
    summary = common.summarize(rows, base.name)
    common.print_table(summary)
    common.save(args.out + ("_quick" if args.quick else ""), summary,
                {"variants": args.variants, "max_len": MAX_LEN})


if __name__ == "__main__":
    main()
