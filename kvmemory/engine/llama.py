"""The quantized Llama / Qwen2 engine: the model's forward over GGUF blocks, writing a pre-allocated cache.

One call, :meth:`QuantizedLlama.forward_rows`, computes rows ``[start, start+n)`` of every layer
against the cached rows ``[0, start)`` and appends them: a decoded token (n = 1), a draft to check,
an appended turn, a Re-prefill and the sequential executor's intervals that start at the end of a
cache are all this call. It computes what transformers' ``LlamaForCausalLM`` computes with the
same weights:

- short inputs (fewer than ``dense_from_rows``: 96 rows exact, 24 with a lossy setting) run in one
  C++ call through every layer (``LlamaDecoder.step`` / ``rows``): linears on the GGUF blocks
  the weights were dequantized from (:mod:`.gguf_blocks`; verified equal when the engine is
  built; Qwen2's q/k/v biases added), the model's norm weights, rotary angles from the model's own module, grouped-query attention over
  the cached rows (causal within the new rows);
- long ones (prefill), where FLOPs bound the time, run layer by layer on the model's own dense
  fp32 weights (or bf16 copies) and its norm modules, with SDPA. When the dense weights are
  released (:meth:`QuantizedLlama.release_dense`, which ``load_model`` does), each linear is
  dequantized from its blocks for the call instead (:mod:`.dense`; the same values).

Differences to transformers are fp32 summation order only (tested: logits within 1e-3 absolute,
rows within 1e-4 relative). The weights are checked before every call: an in-place change to a
parameter (training, ``load_state_dict``) disables the engine for that model instead of running
stale blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # Qwen2's is the same function

from ..errors import InputError
from .base import BufferedEngine
from .buffers import CacheBuffers
from .dense import DenseWeights, sources
from .interface import BlockLinears
from .quantized import FusedBlocks, Q4Linear, Q8Linear, kernel, on_huge_pages

# Inputs of this many rows or more run layer by layer on the dense weights (compute-bound GEMMs);
# fewer run in one call on the blocks. The exact engine's crossover, measured on its kernels: 43
# appended rows 133 vs 220 ms at 2 K cached rows, 367 vs 449 ms at 8 K; 96 rows 876 vs 1,138 ms
# at 8 K; 128 rows even at 8 K. The lossy settings keep 24 (int8 activations only on short inputs,
# bf16 GEMMs from 24 rows).
DENSE_FROM_ROWS = 24
EXACT_DENSE_FROM_ROWS = 96
# A batched call takes up to this many rows per cache (a decoded token and its draft): the
# kernel's rows per pass of the blocks, so each row keeps the one-row arithmetic (LlamaDecoder::batch_rows).
BATCH_TOKENS = 4


@dataclass
class _Layer:
    qkv: FusedBlocks  # fused q, k, v rows (transformers' row order) and their biases (Qwen2)
    o: FusedBlocks
    gate_up: FusedBlocks  # fused gate, up rows
    down: FusedBlocks
    module: torch.nn.Module  # the transformers decoder layer: norms and dense weights

    def __post_init__(self):  # a plain block linear is a fused one of one part
        for name in ("qkv", "o", "gate_up", "down"):
            if not isinstance(getattr(self, name), FusedBlocks):
                setattr(self, name, FusedBlocks.of([getattr(self, name)]))

    def linears(self) -> list[FusedBlocks]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def modules(self) -> list[list[torch.nn.Linear]]:
        """The transformers linears each of :meth:`linears` fuses, in its row order."""
        attn, mlp = self.module.self_attn, self.module.mlp
        return [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]]


class QuantizedLlama(BufferedEngine):
    """A Llama / Qwen2 decoder on GGUF blocks (see the module docstring), an
    :class:`~kvmemory.engine.interface.Engine`. Build with :func:`kvmemory.engine.attach`, which
    verifies the blocks against the model's weights."""

    def __init__(self, model, layers: list[_Layer], head: FusedBlocks | Q4Linear | Q8Linear,
                 int8_activations: bool = False, bf16_prefill: bool = False):
        text = model.config.get_text_config()
        head = head if isinstance(head, FusedBlocks) else FusedBlocks.of([head])
        fused = [f for layer in layers for f in layer.linears()] + [head]
        moved = iter(on_huge_pages([p for f in fused for p in f.parts]))
        fused = [FusedBlocks([next(moved) for _ in f.parts], f.bias) for f in fused]
        self.layers = [_Layer(*fused[4 * i:4 * i + 4], layer.module) for i, layer in enumerate(layers)]
        self.head = fused[-1]
        self.int8 = int8_activations  # the block path (decode, short appends, head) rounds activations to int8
        self.kind = "q4_1" + ("_int8" if int8_activations else "") + ("_bf16" if bf16_prefill else "")
        self.dense_from_rows = DENSE_FROM_ROWS if int8_activations or bf16_prefill else EXACT_DENSE_FROM_ROWS
        # the dense path (>= dense_from_rows rows) in bf16: oneDNN's bf16 GEMMs (AVX512-BF16 / AMX)
        # on bf16 copies of the weights (fused like the blocks), fp32 in and out
        self.bf16 = [_bf16_weights(l.module) for l in layers] if bf16_prefill else None
        self.heads = text.num_attention_heads
        self.kv_heads = text.num_key_value_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.heads
        self.scale = layers[0].module.self_attn.scaling
        super().__init__(model, CacheBuffers(self.kv_heads, self.head_dim, torch.float32, torch.device("cpu")))
        # one kernel module (one ISA, see kernel_isa) for every product of this engine
        self.lib = kernel()
        self.isa = self.lib.isa()
        self.decoder = self._decoder()
        self.dense: DenseWeights | None = None  # the released dense weights (release_dense)

    def release_dense(self) -> int:
        """Drop the model's dense linear weights (and an untied head's), which this engine's
        blocks hold bit for bit; whatever needs one dequantizes it (:mod:`.dense`). Returns the
        bytes freed (0 when already released)."""
        if self.dense is None:
            found = {}
            for layer in self.layers:
                for fused, modules in zip(layer.linears(), layer.modules()):
                    found.update(sources(fused, modules))
            head, embedding = self.model.lm_head, self.model.get_input_embeddings()
            if head.weight.data_ptr() != embedding.weight.data_ptr():  # a tied head is the embedding table, which stays
                found.update(sources(self.head, [head]))
            self.dense = DenseWeights(self.lib, found)
        freed = self.dense.release()
        if freed:
            self._own_the_rest()
        return freed

    def _own_the_rest(self) -> None:
        """Copy the tensors that stay (embedding, norms, biases) out of the safetensors file
        mapping transformers loaded them into: the mapping closes, instead of keeping every
        released weight's pages resident (the 0.5B: 2.9 -> 1.5 GiB resident). The decoder is
        rebuilt on the copies."""
        released = {id(m.weight) for m in self.dense.modules}
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            if id(tensor) not in released:
                tensor.data = tensor.data.clone()
        self.decoder = self._decoder()

    def restore_dense(self, reason: str) -> None:
        """Bring the released dense weights back for good (logged with ``reason``)."""
        if self.dense is not None:
            self.dense.restore(reason)

    def _weight(self, linear) -> torch.Tensor:
        """A linear's fp32 weight: the module's own, or dequantized for this call when released
        (into this thread's scratch buffer: use it before the next call)."""
        return self.dense.of(linear, scratch=True) if self.dense is not None else linear.weight

    def _decoder(self):
        """The compiled one-token decoder over the same blocks and the model's norm weights."""

        linears = [f.kernel_tensors() for layer in self.layers for f in layer.linears()]
        norms_in = [l.module.input_layernorm.weight.detach() for l in self.layers]
        norms_post = [l.module.post_attention_layernorm.weight.detach() for l in self.layers]
        eps = self.layers[0].module.input_layernorm.variance_epsilon
        return self.lib.LlamaDecoder(
            linears, norms_in, norms_post, self.model.model.norm.weight.detach(), self.head.kernel_tensors(),
            self.heads, self.kv_heads, self.head_dim, float(eps), float(self.scale), self.int8,
        )

    @property
    def nbytes(self) -> int:
        """Bytes the engine holds besides the model: the blocks (codes + fp32 scales) and, with a
        bf16 prefill, the bf16 weight copies."""
        copies = sum(w.numel() * w.element_size() for d in self.bf16 or [] for w in d.values())
        return copies + self.head.nbytes + sum(f.nbytes for l in self.layers for f in l.linears())

    def block_linears(self, rows: int) -> BlockLinears | None:
        """This engine's linears on its blocks, as :meth:`forward_rows` runs them for short inputs
        (the engine's int8 setting included), when ``rows`` new rows would run on them (fewer
        than ``dense_from_rows``: weight bytes bound such an input, and the blocks are 1/5 of the
        dense weights' bytes); None otherwise. Same products as the dense weights up to fp32
        summation order."""
        if rows >= self.dense_from_rows:
            return self._dense_linears() if self.dense is not None and self.dense.released else None

        def bound(blocks):
            return lambda x: blocks(x, int8=self.int8, lib=self.lib)

        layers = [tuple(bound(f) for f in l.linears()) for l in self.layers]
        return BlockLinears(layers, bound(self.head))

    def _dense_linears(self) -> BlockLinears:
        """The modules' linears on dense weights dequantized per call (released weights; the
        products of the modules' own weights)."""

        def linear(*modules):
            if len(modules) == 1:
                return lambda x: F.linear(x, self._weight(modules[0]), modules[0].bias)
            return lambda x: torch.cat([F.linear(x, self._weight(m), m.bias) for m in modules], dim=-1)

        layers = [tuple(linear(*modules) for modules in layer.modules()) for layer in self.layers]
        return BlockLinears(layers, lambda x: self.head(x, int8=self.int8, lib=self.lib))  # a few rows: the blocks

    @torch.no_grad()
    def forward_rows(self, cache, token_ids: torch.Tensor, start: int, capacity: int | None = None,
                     every_row: bool = False) -> torch.Tensor:
        """Compute and append rows ``[start, start+n)`` for ``token_ids`` (LongTensor ``[n]``).

        ``cache``: a ``DynamicCache`` of plain layers holding exactly ``start`` rows.
        ``capacity``: rows to allocate at once if the storage must grow (see ``CacheBuffers.reserve``).
        Returns fp32 logits ``[vocab]`` predicting the token after the last input, or with
        ``every_row`` ``[n, vocab]``, row i predicting the token after input i.
        """
        n = token_ids.shape[0]
        storage = self.buffers.reserve(cache, start, n, capacity)
        body = self.model.model
        hidden = body.embed_tokens(token_ids)  # [n, hidden]
        positions = torch.arange(start, start + n)[None]
        cos, sin = body.rotary_emb(hidden[None], positions)
        if n == 1:  # one decoded token: the whole decoder in one kernel call
            logits = self.decoder.step(hidden[0], storage.all_keys, storage.all_values, cos[0, 0], sin[0, 0], start)
            self.buffers.publish(cache, storage, start + 1)
            return logits[None] if every_row else logits
        if n < self.dense_from_rows:  # a short append or a draft to verify: one kernel call as well
            logits = self.decoder.rows(hidden, storage.all_keys, storage.all_values, cos[0].contiguous(),
                                       sin[0].contiguous(), positions[0], every_row)
            self.buffers.publish(cache, storage, start + n)
            return logits if every_row else logits[0]
        mask = _causal_mask(start, n)
        for i, layer in enumerate(self.layers):
            bf16 = self.bf16[i] if self.bf16 else None
            hidden = self._layer(layer, hidden, storage.keys[i], storage.values[i], start, cos, sin, mask, bf16)
        self.buffers.publish(cache, storage, start + n)
        rows = hidden if every_row else hidden[-1:]
        logits = self.head(body.norm(rows), int8=self.int8, lib=self.lib)
        return logits if every_row else logits[0]

    @torch.no_grad()
    def decode_batch(self, caches: list, token_ids: list[torch.Tensor], starts: list[int],
                     capacities: list[int | None] | None = None) -> list[torch.Tensor]:
        """The pending rows of B caches in one kernel call (batched decoding): every linear reads
        its blocks once for all rows, each cache's rows attend to that cache.

        ``caches``: B plain caches, cache i holding exactly ``starts[i]`` rows (the same rules as
        :meth:`forward_rows`); ``token_ids``: B LongTensors ``[m_i]`` (a decoded token, with its
        draft tokens to verify: m_i <= 4). Returns B fp32 logits ``[m_i, vocab]``, row j after
        input j: bit for bit what ``forward_rows(caches[i], token_ids[i], starts[i],
        every_row=True)`` returns (same arithmetic, run at the same thread count).

        Raises:
            RuntimeError: the int8-activation engine (batched decoding is exact fp32 only).
            InputError: an input of more than 4 tokens.
        """
        counts = [int(ids.shape[0]) for ids in token_ids]
        if max(counts) > BATCH_TOKENS:
            raise InputError(f"decode_batch takes up to {BATCH_TOKENS} tokens per cache (got {max(counts)}); "
                             "forward longer inputs with forward_rows")
        capacities = capacities or [None] * len(caches)
        storages = [self.buffers.reserve(c, s, m, cap) for c, s, m, cap in zip(caches, starts, counts, capacities)]
        body = self.model.model
        hidden = body.embed_tokens(torch.cat(token_ids))  # [R, hidden]
        positions = torch.cat([torch.arange(s, s + m) for s, m in zip(starts, counts)])
        cos, sin = body.rotary_emb(hidden[None], positions[None])
        logits = self.decoder.batch_rows(hidden, [s.all_keys for s in storages], [s.all_values for s in storages],
                                         cos[0].contiguous(), sin[0].contiguous(), positions, counts, True)
        for cache, storage, start, m in zip(caches, storages, starts, counts):
            self.buffers.publish(cache, storage, start + m)
        return list(logits.split(counts))

    @torch.no_grad()
    def refresh_rows(self, cache, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The packed layer-major refresh (paper §3.3, eqs. 21-22) of a few rows in one kernel call:
        at every layer the rows at ``positions`` (LongTensor ``[B]``, strictly increasing) get
        fresh K/V, written into the cache first; then each attends to its
        causal prefix of the updated cache. Same recurrence as
        :func:`kvmemory.executors.packed.run_packed` on this engine's blocks (fp32 summation order
        aside).

        ``cache``: a cache whose rows this engine's storage holds (``gather_rows`` made it), rows
        written in place. ``token_ids``: LongTensor ``[B]``, the tokens at ``positions``.
        Returns fp32 logits ``[vocab]`` after the last position, or None when the storage does not
        back ``cache`` or B >= ``dense_from_rows`` (nothing written; refresh another way).
        """
        storage = self.buffers.owned(cache)
        if storage is None or positions.numel() >= self.dense_from_rows:
            return None
        body = self.model.model
        hidden = body.embed_tokens(token_ids)
        cos, sin = body.rotary_emb(hidden[None], positions[None])
        logits = self.decoder.rows(hidden, storage.all_keys, storage.all_values, cos[0].contiguous(),
                                   sin[0].contiguous(), positions.contiguous(), False)
        return logits[0]

    def _layer(self, layer: _Layer, hidden, keys, values, start, cos, sin, mask, bf16=None):
        """One decoder layer over many new rows on the model's dense weights (fp32, or the bf16
        copies)."""
        module = layer.module
        if bf16 is not None:
            return self._layer_bf16(layer, bf16, hidden, keys, values, start, cos, sin, mask)
        attn, mlp = module.self_attn, module.mlp
        x = module.input_layernorm(hidden)
        q, k, v = (F.linear(x, self._weight(p), p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        out = self._self_attention(q, k, v, keys, values, start, cos, sin, mask)
        hidden = hidden + F.linear(out, self._weight(attn.o_proj))
        x = module.post_attention_layernorm(hidden)
        gate, up = F.linear(x, self._weight(mlp.gate_proj)), F.linear(x, self._weight(mlp.up_proj))
        return hidden + F.linear(mlp.act_fn(gate) * up, self._weight(mlp.down_proj))

    def _self_attention(self, q, k, v, keys, values, start, cos, sin, mask):
        """Rotate ``q``/``k`` (rows ``[n, heads * head_dim]``) to their positions, write ``k``/``v``
        into the layer's buffers at ``start`` and attend over rows ``[0, start + n)`` (SDPA)."""
        n = q.shape[0]
        q = q.view(n, self.heads, self.head_dim).transpose(0, 1)[None]
        k = k.view(n, self.kv_heads, self.head_dim).transpose(0, 1)[None]
        v = v.view(n, self.kv_heads, self.head_dim).transpose(0, 1)[None]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        end = start + n
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        attn = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=mask,
                                              scale=self.scale, is_causal=mask is None, enable_gqa=True)
        return attn[0].transpose(0, 1).reshape(n, self.heads * self.head_dim)

    def _layer_bf16(self, layer: _Layer, weights: dict, hidden, keys, values, start, cos, sin, mask):
        """:meth:`_layer` with the linears in bf16 (norms, RoPE, attention fp32)."""
        module = layer.module
        attn = module.self_attn
        sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        q, k, v = _bf16_linear(module.input_layernorm(hidden), weights["qkv"], layer.qkv.bias).split(sizes, dim=-1)
        out = self._self_attention(q, k, v, keys, values, start, cos, sin, mask)
        hidden = hidden + _bf16_linear(out, weights["o"])
        gate, up = _bf16_linear(module.post_attention_layernorm(hidden), weights["gate_up"]).split(
            module.mlp.gate_proj.out_features, dim=-1)
        return hidden + _bf16_linear(module.mlp.act_fn(gate) * up, weights["down"])


def _bf16_weights(module) -> dict[str, torch.Tensor]:
    """bf16 copies of a decoder layer's linear weights (q, k, v fused; gate, up fused)."""
    attn, mlp = module.self_attn, module.mlp
    fused = {"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "o": [attn.o_proj],
             "gate_up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]}
    return {name: torch.cat([m.weight.detach() for m in mods]).to(torch.bfloat16).contiguous() for name, mods in fused.items()}


def _bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = F.linear(x.to(torch.bfloat16), weight).float()
    return y if bias is None else y + bias


def _causal_mask(start: int, n: int) -> torch.Tensor | None:
    """Boolean ``[n, start+n]`` (True = attend) for n new rows after ``start`` > 0 cached ones;
    None for a prefill from row 0 (SDPA's causal kernel)."""
    if start == 0:
        return None
    rows = torch.arange(start, start + n)[:, None]
    return torch.arange(start + n)[None, :] <= rows
