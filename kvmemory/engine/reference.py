"""The reference engine: the model's own transformers forward.

It runs every model, cache layout, dtype, device and adapter transformers runs, and it is what
every other engine's rows are compared with. It has no storage of its own and no one-call
refresh: the packed executor refreshes rows through the model's modules instead.
"""

from __future__ import annotations

import torch

from .. import kvcache
from .interface import BlockLinears


class TransformersEngine:
    """:class:`~kvmemory.engine.interface.Engine` on ``model``'s own forward."""

    kind = "transformers"

    def __init__(self, model):
        self.model = model

    def unsupported_reason(self, cache=None) -> str | None:
        return None

    def forward_rows(self, cache, token_ids: torch.Tensor, start: int, capacity: int | None = None,
                     every_row: bool = False) -> torch.Tensor:
        """See :meth:`Engine.forward_rows`; ``capacity`` is not used (transformers grows its cache)."""
        n = token_ids.shape[0]
        positions = torch.arange(start, start + n, device=token_ids.device)[None]
        with torch.no_grad():
            out = self.model(
                input_ids=token_ids[None],
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=n if every_row else 1,
            )
        return out.logits[0].float() if every_row else out.logits[0, -1].float()

    def refresh_rows(self, cache, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
        return None

    def gather_rows(self, cache, rows: torch.Tensor):
        return kvcache.gather_rows(cache, rows)

    def block_linears(self, rows: int) -> BlockLinears | None:
        return None
