"""Benchmarks behind ``kvmemory bench <name>``.

Each benchmark lives in its own module of this package and exposes
``add_arguments(parser)`` and ``run(args, console) -> int`` (exit status). Register a new one
in :data:`BENCHMARKS`; the CLI imports a module only when its benchmark runs.
"""

from __future__ import annotations

# name -> (module under kvmemory.bench, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "refresh": ("refresh", "refresh timing: sequential, direct, one-shot and packed executors (paper §4.4)"),
    "reforge": ("reforge", "CacheReforge: 32 LoRA updates, six cache-maintenance methods vs fresh prefill"),
    "quality": ("quality", "repair fidelity on Erasing-NIAH / multi-hop QA: 14 allocators x budgets, paired bootstrap"),
}
