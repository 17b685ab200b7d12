"""What the engines that keep their own cache storage share: the model they were built from, the
watch on its weights, and capacity-backed rows (:class:`~kvmemory.engine.buffers.CacheBuffers`)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .. import kvcache
from .buffers import CacheBuffers
from .watch import WeightWatch, has_lora


class BufferedEngine:
    """Base of :class:`~kvmemory.engine.llama.QuantizedLlama` and
    :class:`~kvmemory.engine.graphs.GraphDecoder` (the capability query and the row gather of
    :class:`~kvmemory.engine.interface.Engine`)."""

    kind: str

    def __init__(self, model, buffers: CacheBuffers):
        self.model = model
        self.buffers = buffers
        self._watched = WeightWatch.of(model)

    def unsupported_reason(self, cache=None) -> str | None:
        """Why this engine cannot compute rows now (None: it can): ``cache`` has layers it does
        not write (sliding-window, quantized), or the weights are no longer the ones it was built
        from (an adapter, training, ``load_state_dict``). Checked before every call."""
        if cache is not None and not kvcache.plain_layers(cache):
            return "the cache has layers other than plain full-attention ones (the engine writes those only)"
        reason = self._watched.stale_reason()
        if reason and has_lora(self.model):
            return "a LoRA adapter is attached (the engine runs base weights only; transformers computes adapters)"
        return reason

    def gather_rows(self, cache, rows: torch.Tensor) -> DynamicCache:
        """:func:`kvmemory.kvcache.gather_rows` (row j of the result copies ``cache``'s row
        ``rows[j]``, LongTensor ``[n]``, -1 = zero placeholder), written into this engine's
        storage: the answer after a repair then appends without copying every row again."""
        target = DynamicCache(config=self.model.config)
        self.buffers.gather(cache, rows, target)
        return target
