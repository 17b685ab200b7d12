"""Which executor refreshes a selection, and running it (paper §4.4, Appendix 13.3).

The paper's measurements support a simple rule: one interval → the direct sequential executor
(slightly faster than packing for a single region), several → the packed executor (one model
traversal instead of R). Users can override it with ``RepairPolicy.executor``. A model the packed
executor does not support is refreshed by the sequential executor instead; the reason is logged
and reported (``RepairReport.executor_fallback``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..capabilities import packed_unsupported_reason
from ..engine import ForwardResult
from .packed import run_packed
from .sequential import run_direct, run_sequential

log = logging.getLogger(__name__)

EXECUTORS = ("auto", "packed", "sequential", "direct")


@dataclass(frozen=True)
class ExecutorChoice:
    """``name``: the executor that runs (``sequential``, ``direct`` or ``packed``); ``fallback``:
    why the requested one was replaced (None when it runs as asked)."""

    name: str
    fallback: str | None = None


def choose_executor(requested: str, n_intervals: int, model, cache: DynamicCache | None = None) -> ExecutorChoice:
    """Apply the choice rule: ``auto`` → ``direct`` for one interval, ``packed`` for several;
    an unsupported ``packed`` or ``direct`` becomes ``sequential`` with the reason (logged).

    Raises:
        ValueError: unknown executor name.
    """
    if requested not in EXECUTORS:
        raise ValueError(f"unknown executor {requested!r}: use one of {', '.join(EXECUTORS)}")
    name = requested
    if requested == "auto":
        name = "direct" if n_intervals <= 1 else "packed"
    reason = None
    if name == "packed":
        reason = packed_unsupported_reason(model)
    elif name == "direct" and cache is not None and any(type(layer) is not DynamicLayer for layer in cache.layers):
        reason = "the cache has layers other than full-attention DynamicLayers"
    if reason:
        log.info("refresh with the sequential executor instead of %s: %s", name, reason)
        return ExecutorChoice("sequential", f"{name} executor not used: {reason}")
    return ExecutorChoice(name)


def run_refresh(
    model,
    cache: DynamicCache,
    token_ids: torch.Tensor,
    intervals: list[tuple[int, int]],
    choice: ExecutorChoice,
    backend: str = "sdpa",
    lower_rows=None,
    lower_layers: int = 0,
) -> ForwardResult:
    """Compute the rows of ``intervals`` with the chosen executor, in place on ``cache``.

    Args / errors as :func:`kvmemory.executors.sequential.run_sequential`; ``backend`` selects the packed
    executor's attention (``"sdpa"`` or ``"triton"``), ``lower_rows`` / ``lower_layers`` its
    two-dimensional budget (see :func:`kvmemory.executors.packed.run_packed`; packed only).

    Raises:
        ValueError: also a two-dimensional budget for another executor than packed.
    """
    if lower_layers and choice.name != "packed":
        raise ValueError(f"a two-dimensional budget (lower_layers) needs the packed executor, not {choice.name}")
    if choice.name == "packed":
        positions = torch.cat([torch.arange(a, b) for a, b in intervals])
        _, result = run_packed(model, cache, token_ids, positions, backend=backend, in_place=True,
                               lower_rows=lower_rows, lower_layers=lower_layers)
        return result
    if choice.name == "direct":
        return run_direct(model, cache, token_ids, intervals)
    return run_sequential(model, cache, token_ids, intervals)


def executor_label(choice: ExecutorChoice, backend: str) -> str:
    """Name for reports: ``sequential``, ``direct``, ``packed-sdpa`` or ``packed-triton``."""
    return f"packed-{backend}" if choice.name == "packed" else choice.name
