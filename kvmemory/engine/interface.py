"""What an engine is: the one owner of computing cache rows, and what it tells its callers.

Executors and sessions decide *which* rows to compute (a decoded token, an appended turn, the
refresh set of a repair); an :class:`Engine` computes them into a cache. Every implementation
answers the same verbs, so callers never ask which engine they hold:

- :class:`~kvmemory.engine.reference.TransformersEngine`: the model's own forward (every model;
  the reference every other engine is compared with);
- :class:`~kvmemory.engine.llama.QuantizedLlama`: a Llama decoder over the GGUF blocks its
  weights came from (the ``"q4_1"`` family);
- :class:`~kvmemory.engine.graphs.GraphDecoder`: a decoded token as one captured CUDA graph.

Capability queries (``unsupported_reason``, a ``None`` from ``refresh_rows`` or ``block_linears``)
say what an engine cannot run, so the caller takes another path with the reason instead of a
wrong cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class EngineStatus:
    """Which engine computes a model's rows: ``name`` (an engine of ``ENGINES`` other than ``"auto"``),
    for transformers ``reason`` why the fast engine does not run (None when it was not asked), and
    for the block engine the ``isa`` its kernel was built for (``"avx512"``, ``"avx2"``,
    ``"portable"``; a detail of the name, not compared)."""

    name: str
    reason: str | None = None
    isa: str | None = field(default=None, compare=False)

    def as_dict(self) -> dict:
        return {"name": self.name, "reason": self.reason, "isa": self.isa}


@dataclass
class ForwardResult:
    """Logits ``[vocab]`` (fp32) predicting the token after the last computed position, when the
    last interval ends at the end of the prompt; None otherwise."""

    next_logits: torch.Tensor | None
    forwarded_tokens: int


@dataclass
class BlockLinears:
    """An engine's linears on its weight blocks, each a callable fp32 ``[m, in] -> [m, out]``:
    per layer ``(qkv, o, gate_up, down)`` (q, k, v and gate, up fused in the model's row order)
    and the output ``head``."""

    layers: list[tuple[Callable, Callable, Callable, Callable]]
    head: Callable


@runtime_checkable
class Engine(Protocol):
    """The verbs every engine answers (see the module docstring). ``kind``: the engine's name in
    reports (``"transformers"``, ``"q4_1"``, ``"cuda_graphs"``, ...)."""

    kind: str

    def unsupported_reason(self, cache=None) -> str | None:
        """Why this engine cannot compute rows now, for ``cache`` when given (its layer kinds)
        and in any case (weights changed since the engine was built, an adapter attached);
        None when it can."""

    def forward_rows(self, cache, token_ids: torch.Tensor, start: int, capacity: int | None = None,
                     every_row: bool = False) -> torch.Tensor:
        """Compute rows ``[start, start+n)`` for ``token_ids`` (LongTensor ``[n]``) against
        ``cache``, which holds exactly ``start`` rows, and append them. ``capacity``: rows the
        cache is expected to reach (allocated at once). Returns fp32 logits ``[vocab]`` for the
        token after the last input, or with ``every_row`` ``[n, vocab]``."""

    def refresh_rows(self, cache, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The packed refresh (paper §3.3, eqs. 21-22) of the rows at ``positions`` (LongTensor
        ``[B]``, strictly increasing; ``token_ids`` ``[B]`` their tokens) in one call, in place on
        ``cache``. Returns fp32 logits ``[vocab]`` after the last position, or None when this
        engine does not run such a refresh (nothing written: the packed executor runs it)."""

    def gather_rows(self, cache, rows: torch.Tensor):
        """A new cache whose row j copies ``cache``'s row ``rows[j]`` (LongTensor ``[n]``; -1 = a
        zero placeholder), in the engine's own storage where it has one (later appends then copy
        nothing)."""

    def block_linears(self, rows: int) -> BlockLinears | None:
        """The engine's linears on its weight blocks for a computation of ``rows`` new rows, when
        it would run such an input on them; None otherwise (use the model's own modules)."""
