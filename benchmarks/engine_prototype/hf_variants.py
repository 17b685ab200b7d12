"""Variants built on the transformers model itself (public API): a pre-allocated ``StaticCache``,
eager or with the one-token step under ``torch.compile``.

The StaticCache keeps per layer ``keys/values [1, kv_heads, max_len, head_dim]`` and a
``cumulative_length`` tensor cursor; the causal mask always spans ``max_len`` rows (rows past the
cursor are masked), so the compiled step sees the same shapes at every position (no recompiles)
but attends over ``max_len`` rows whatever the context.
"""

from __future__ import annotations

import time

import torch
from transformers import StaticCache


class HFStatic:
    def __init__(self, model, name: str, max_len: int, compile_kwargs: dict | None = None):
        self.model, self.name, self.max_len = model, name, max_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.pos = 0
        self.compiled = compile_kwargs is not None
        self._step = torch.compile(self._forward_one, **compile_kwargs) if self.compiled else self._forward_one
        self.compile_s = None

    def _forward_one(self, input_ids, position_ids):
        out = self.model(input_ids=input_ids, position_ids=position_ids, cache=self.cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[0, -1].float()

    def reset(self, length: int):
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)  # rows past the cursor are overwritten next
        self.pos = length

    @torch.no_grad()
    def prefill(self, ids):
        """Eager prefill written into the static buffers (prefill is not compiled)."""
        self.reset(0)
        n = ids.shape[0]
        out = self.model(input_ids=ids[None], position_ids=torch.arange(n)[None], cache=self.cache,
                         use_cache=True, logits_to_keep=1)
        self.pos = n
        return out.logits[0, -1].float()

    @torch.no_grad()
    def step(self, token: int):
        ids = torch.tensor([[token]])
        pos = torch.tensor([[self.pos]])
        if self.compiled and self.compile_s is None:
            t = time.perf_counter()
            logits = self._step(ids, pos)
            self.compile_s = time.perf_counter() - t
        else:
            logits = self._step(ids, pos)
        self.pos += 1
        return logits
