"""One decoded token as a captured CUDA graph: the decode path for a model on a GPU.

A one-token forward of a small model on a GPU is bound by kernel launches, not by the hardware:
transformers' eager forward issues a few hundred small kernels per token from Python. The
``"cuda_graphs"`` engine captures the whole step once and replays it with one launch per token.
A graph needs fixed shapes and addresses, so:

- the cache's K/V rows live in the engine's capacity buffers (:class:`~.buffers.CacheBuffers` on
  the GPU), published to the ``DynamicCache`` as views, as on the CPU engine;
- the step is the packed executor's layer-major traversal (paper §3.3) for one row at the end of
  the cache: at every layer the row's fresh K/V are written at its position, then it attends
  over the whole capacity with an additive mask computed inside the graph from the position
  (spare rows after it never count);
- the token id and position are copied into static input tensors before each replay.

A graph is captured per buffer (again after a buffer grows; ``stream_tokens`` reserves prompt +
answer limit, so at most once per answer) and dropped with it. Several rows (a prefill, an
appended turn, a draft) run the same traversal eagerly. Results equal the model's forward up to
floating-point summation order. The weights are checked before every call
(:class:`~.watch.WeightWatch`): an adapter or an in-place write disables the engine and
transformers computes instead (:func:`kvmemory.engine.status` says why).

Without a GPU the class runs the same traversal eagerly (``capture=False``): that is what the
CPU tests compare with transformers; the engine itself attaches only to models on CUDA.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..capabilities import packed_unsupported_reason
from .base import BufferedEngine
from .buffers import CacheBuffers
from .interface import BlockLinears
from .traversal import packed_hidden_states
from .watch import has_lora


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    token: torch.Tensor  # static input [1]
    position: torch.Tensor  # static input [1]
    logits: torch.Tensor  # static output [vocab]


def unsupported_reason(model) -> str | None:
    """Why the ``"cuda_graphs"`` engine cannot be built for ``model`` (None: it can)."""
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda" or not torch.cuda.is_available():
        return "the model is not on one CUDA device (move it first: model.to('cuda'))"
    if has_lora(model):
        return "a LoRA adapter is attached"
    reason = packed_unsupported_reason(model)
    return f"the decode step is the packed executor's traversal, which cannot run it: {reason}" if reason else None


class GraphDecoder(BufferedEngine):
    """The ``"cuda_graphs"`` engine (see the module docstring), an
    :class:`~kvmemory.engine.interface.Engine`. ``capture``: record and replay a CUDA graph for
    one-token steps (default: when the model is on CUDA)."""

    kind = "cuda_graphs"

    def __init__(self, model, capture: bool | None = None):
        text = model.config.get_text_config()
        weight = next(model.parameters())
        self.capture = weight.device.type == "cuda" if capture is None else capture
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        super().__init__(model, CacheBuffers(text.num_key_value_heads, head_dim, weight.dtype, weight.device))
        self._graphs: "weakref.WeakKeyDictionary[torch.Tensor, _Graph]" = weakref.WeakKeyDictionary()  # per K buffer

    def refresh_rows(self, cache, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """No one-call refresh: the packed executor runs it on the model's modules."""
        return None

    def block_linears(self, rows: int) -> BlockLinears | None:
        """No weight blocks: the model's own (dense) modules."""
        return None

    @torch.no_grad()
    def forward_rows(self, cache, token_ids: torch.Tensor, start: int, capacity: int | None = None,
                     every_row: bool = False) -> torch.Tensor:
        """Compute and append rows ``[start, start+n)`` for ``token_ids`` (LongTensor ``[n]``), as
        :meth:`kvmemory.engine.llama.QuantizedLlama.forward_rows`: fp32 logits ``[vocab]`` after
        the last input, or ``[n, vocab]`` with ``every_row``."""
        n = token_ids.shape[0]
        storage = self.buffers.reserve(cache, start, n, capacity)
        device = storage.all_keys.device
        if n == 1 and self.capture and not every_row:
            logits = self._replay(storage, token_ids.to(device), start)
        else:
            positions = torch.arange(start, start + n, device=device)
            logits = self._rows(storage, token_ids.to(device), positions, every_row)
        self.buffers.publish(cache, storage, start + n)
        return logits

    def _rows(self, storage, token_ids: torch.Tensor, positions: torch.Tensor, every_row: bool) -> torch.Tensor:
        """The packed traversal of ``token_ids`` at ``positions`` over the storage's whole
        capacity (no host synchronisation inside: it is what a graph records)."""
        keys, values = storage.all_keys.unbind(0), storage.all_values.unbind(0)
        layers = SimpleNamespace(layers=[SimpleNamespace(keys=k, values=v) for k, v in zip(keys, values)])
        visible = torch.arange(storage.capacity, device=positions.device)[None] <= positions[:, None]
        mask = torch.zeros(visible.shape, dtype=storage.all_keys.dtype, device=positions.device)
        mask = mask.masked_fill_(~visible, float("-inf"))[None, None]

        def write(layer_keys, layer_values, k, v):
            layer_keys.index_copy_(2, positions, k)
            layer_values.index_copy_(2, positions, v)

        def attend(q, layer_keys, layer_values, scale):
            return F.scaled_dot_product_attention(q, layer_keys, layer_values, attn_mask=mask, scale=scale, enable_gqa=True)

        hidden = packed_hidden_states(self.model, layers, token_ids[None], positions, attend, write)
        rows = hidden[0] if every_row else hidden[0, -1:]
        logits = self.model.get_output_embeddings()(self.model.get_decoder().norm(rows)).float()
        return logits if every_row else logits[0]

    def _replay(self, storage, token_ids: torch.Tensor, start: int) -> torch.Tensor:
        graph = self._graphs.get(storage.all_keys)
        if graph is None:
            graph = self._graphs[storage.all_keys] = self._record(storage, token_ids, start)
        graph.token.copy_(token_ids)
        graph.position.fill_(start)
        graph.graph.replay()
        return graph.logits.clone()  # the static output is overwritten by the next replay

    def _record(self, storage, token_ids: torch.Tensor, start: int) -> _Graph:
        """Capture the one-token step on this storage. The warm-up (allocations, library handles)
        runs on a side stream first, as CUDA graphs require; it writes the same row the replay
        then writes again."""
        token = token_ids.clone()
        position = torch.full((1,), start, dtype=torch.long, device=token.device)
        side = torch.cuda.Stream(token.device)
        side.wait_stream(torch.cuda.current_stream(token.device))
        with torch.cuda.stream(side):
            self._rows(storage, token, position, False)
        torch.cuda.current_stream(token.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._rows(storage, token, position, False)
        return _Graph(graph, token, position, logits)
