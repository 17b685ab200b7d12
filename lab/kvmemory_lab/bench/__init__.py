"""Benchmarks behind ``kvmemory bench <name>``.

Each benchmark lives in its own module of this package and exposes ``add_arguments(parser)``
and ``run(args, console) -> int`` (exit status). Register a new one in :data:`BENCHMARKS`; the
CLI imports a module only when its benchmark runs.
"""

from __future__ import annotations

# name -> (module under kvmemory_lab.bench, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "refresh": ("refresh", "refresh timing: sequential, direct, one-shot and packed executors (paper §4.4)"),
    "reforge": ("reforge", "CacheReforge: 32 LoRA updates, six cache-maintenance methods vs fresh prefill"),
    "reliability": ("reliability", "reliability: fuzzed edit sequences, SIGKILL crash safety, concurrent threads (report)"),
    "agent": ("agent", "agent hops side by side: kvmemory vs transformers Re-prefill vs llama.cpp (ms, TTFT, decode tok/s)"),
    "agent-loop": ("agent_loop", "create_agent tool loop (six hops) quiet and beside a busy process: kvmemory vs "
                   "transformers Re-prefill vs llama.cpp"),
    "concurrent": ("concurrent", "N threads decoding at once: kvmemory batched vs per-thread vs llama.cpp batched "
                   "(aggregate tok/s, p95 ms per token)"),
    "persistence": ("persistence",
                    "scale-out persistence: bytes stored by token blocks, restore ms, 2 workers with random routing"),
    "server": ("server", "the Agent Server on several processes over PostgreSQL + Redis (langgraph-runtime-pg): "
               "N concurrent threads through langgraph-sdk, latency, tok/s, reuse, lost / failed, one process killed"),
    "quality": ("quality", "repair fidelity on Erasing-NIAH / multi-hop QA: 14 allocators x budgets, paired bootstrap"),
}


def bench_module(name: str) -> str:
    """Absolute import path of a registered benchmark module ``name`` (a key's first field)."""
    return f"kvmemory_lab.bench.{name}"
