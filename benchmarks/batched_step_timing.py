"""Time one batched decode step against the one-row step, on real agent-chat caches.

B threads' caches (each its own ~2 K agent chat of HotpotQA tool results, prefilled once) are
forked, and per step either ``forward_rows`` (B = 1) or ``QuantizedLlama.decode_batch`` (B > 1)
computes ``--tokens`` new rows per cache (1: a decode step; 3: a token with a 2-token draft).
Medians of the steps after the first two, per B and trial. This is the kernel alone:
`kvmemory bench concurrent` measures the same through ``KVSession`` threads and the
:class:`~kvmemory.engine.batching.DecodeBatcher`.

    KVMEMORY_SHARE_CORES=0 .venv/bin/python benchmarks/batched_step_timing.py --model qwen2.5-coder-0.5b

To compare two versions of the kernel, run this from each checkout (``PYTHONPATH=<checkout>``)
alternately on a quiet machine: each source text builds into its own folder.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="qwen2.5-coder-0.5b / -1.5b (default: the embedded model)")
    parser.add_argument("--batches", default="1,2,4", help="rows per step to time (comma list, default 1,2,4)")
    parser.add_argument("--context", type=int, default=2048, help="tokens of each chat (default 2048)")
    parser.add_argument("--steps", type=int, default=16, help="steps per batch size and trial (default 16)")
    parser.add_argument("--tokens", type=int, default=1, help="rows per cache and step, 1-4 (default 1)")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    from kvmemory.engine.registry import engine_for, forward_rows
    from kvmemory.models import load_model
    from kvmemory_lab.bench import concurrent
    from kvmemory_lab.bench.agent import agent_chat
    from kvmemory_lab.bench.common import load_average, simd_flags
    from kvmemory_lab.demo_cases import default_data_dir
    from kvmemory_lab.gguf_models import resolve_model

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    lm = load_model(resolve_model(args.model))
    room = lm.model.config.get_text_config().max_position_embeddings - args.steps * args.tokens - 64
    chats = [agent_chat(default_data_dir(), lm.tokenizer, args.context, room, seed=i).steps["append"]
             for i in range(max(batches))]
    prefilled = [concurrent._prefilled(lm, chat) for chat in chats]
    engine = engine_for(lm.model, prefilled[0].cache)
    print(f"{lm.name}, {args.threads} threads, CPU flags {' '.join(simd_flags())}, load {load_average()}, "
          f"prompts {[len(p.token_ids) for p in prefilled]} tokens")
    for trial in range(args.trials):
        for b in batches:
            forks = [p.fork() for p in prefilled[:b]]
            starts = [len(f.token_ids) for f in forks]
            capacities = [s + args.steps * args.tokens + 8 for s in starts]
            ids = torch.tensor([13] * args.tokens)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                if b == 1:
                    forward_rows(lm.model, forks[0].cache, ids, starts[0], capacity=capacities[0], every_row=True)
                else:
                    engine.decode_batch([f.cache for f in forks], [ids] * b, starts, capacities)
                times.append(time.perf_counter() - t0)
                starts = [s + args.tokens for s in starts]
            print(f"trial {trial} B={b} x {args.tokens} rows: median {statistics.median(times[2:]) * 1000:.1f} ms a step "
                  f"(first {times[0] * 1000:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
