"""Helpers shared by the benchmark modules: option types, machine facts, timing, ratios and the plot backend."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path


def int_list(text: str, least: int = 1) -> list[int]:
    """argparse type: ``"2048,4096"`` -> ``[2048, 4096]`` (integers >= ``least``, default positive).

    Raises:
        argparse.ArgumentTypeError: a non-integer or smaller item, or an empty list.
    """
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 1,4,16 (got {text!r})") from None
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"expected integers >= {least} (got {text!r})")
    return values


def count_list(text: str) -> list[int]:
    """argparse type: :func:`int_list` of integers >= 0 (``"0,2"``)."""
    return int_list(text, least=0)


def load_average() -> list[float]:
    """1/5/15-minute load averages now (other jobs share the CPU: recorded before and after a run)."""
    return [round(x, 2) for x in os.getloadavg()]


def machine_name() -> str:
    """The CPU model (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux
        lines = []
    for line in lines:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# the CPU features that decide the engine's speed (its kernel's instruction set, int8 / bf16 paths)
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile",
              "asimd", "sve")


def simd_flags() -> list[str]:
    """Which of :data:`SIMD_FLAGS` this CPU has, as Linux lists them (``/proc/cpuinfo``; empty
    where it is not readable). Every speed figure names them: a figure from an AVX-512 machine
    says nothing about an AVX2-only one."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.split(":")[0].strip() in ("flags", "Features")), set())
    return [flag for flag in SIMD_FLAGS if flag in flags]


def median_ms(fn, repeats: int, clock=time.perf_counter) -> float:
    """Median ms of ``repeats`` calls of ``fn`` after one untimed warm-up call (``clock``:
    ``time.perf_counter`` for wall time, ``time.process_time`` for this process's CPU time)."""
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def time_ratio(median: dict, num, den) -> str:
    """``median[num] / median[den]`` formatted as ``"1.23×"``; empty when either is missing or 0."""
    if num not in median or den not in median or not median[den]:
        return ""
    return f"{median[num] / median[den]:.2f}×"


def agg_pyplot():
    """``matplotlib.pyplot`` on the headless Agg backend (benchmarks write PNG files only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def table_cell(x, spec: str = ".2f") -> str:
    """A markdown table cell: ``x`` formatted with ``spec``, or "–" for a missing value."""
    return "–" if x is None else format(x, spec)
