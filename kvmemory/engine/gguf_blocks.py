"""GGUF tensors read into the kernel's block forms, exactly.

The kernel (``quantized_linear.cpp``) multiplies by 4-bit codes with an fp32 scale and min per
32 weights (:class:`~kvmemory.engine.quantized.Q4Linear`) or by signed-byte codes with an fp32
scale per 32 or 16 weights, and optionally a min per 32 (:class:`~kvmemory.engine.quantized.Q8Linear`).
F16 linears keep their fp16 values (:class:`~kvmemory.engine.quantized.F16Linear`). The block types
llama.cpp's Llama / Qwen2 GGUFs ship map onto them without changing a single weight value:

========  =============================================  ====================================
GGUF      its weights                                     kernel form
========  =============================================  ====================================
Q4_1      d * q + m (q 4-bit, per 32)                     Q4: scale d, min m
Q4_0      d * (q - 8)                                     Q4: scale d, min -8 d
Q4_K      d * sc_s * q - dmin * m_s (8 sub-blocks of 32)  Q4: scale d * sc_s, min -(dmin * m_s)
Q8_0      d * q (q int8, per 32)                          Q8: scale d
Q5_0      d * (q - 16) (q 5-bit)                          Q8: code q - 16, scale d
Q6_K      d * sc_s * (q - 32) (16 sub-blocks of 16)       Q8 per 16: code q - 32, scale d * sc_s
Q5_K      d * sc_s * q - dmin * m_s (q 5-bit, per 32)     Q8 with mins: code q, scale d * sc_s,
                                                          min -(dmin * m_s)
========  =============================================  ====================================

Every product above is exact in fp32 (an fp16 mantissa times a small integer), so the
dequantized blocks equal bit for bit what ``gguf.quants.dequantize`` (and so transformers'
GGUF loader) gives; :func:`kvmemory.engine.build.build` checks it weight by weight. Other types
(Q2_K, Q3_K, IQ*, BF16, ...) are not read: the engine then refuses the model with the reason. F16
linears are kept as their fp16 values (:class:`~kvmemory.engine.quantized.F16Linear`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..paths import cache_root
from .quantized import F16Linear, Q4Linear, Q8Linear

READ_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0", "F16")  # and F32 tensors (norms, biases)


def _f16(raw: np.ndarray) -> np.ndarray:
    """fp16 values stored as byte pairs ``[..., 2]`` -> fp32 ``[...]``."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _q4_pairs(values: np.ndarray) -> np.ndarray:
    """4-bit codes ``[..., 32]`` (uint8 0..15) in GGUF's Q4 byte order: byte i holds code i in its
    low nibble and code i + 16 in its high nibble -> ``[..., 16]``."""
    return values[..., :16] | (values[..., 16:] << 4)


def _q4_linear(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray) -> Q4Linear:
    rows = codes.shape[0]
    return Q4Linear(torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, -1))),
                    torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, -1), dtype=np.float32)),
                    torch.from_numpy(np.ascontiguousarray(mins.reshape(rows, -1), dtype=np.float32)))


def _q8_linear(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None = None) -> Q8Linear:
    rows = codes.shape[0]
    fp32 = [torch.from_numpy(np.ascontiguousarray(x.reshape(rows, -1), dtype=np.float32))
            for x in ((scales,) if mins is None else (scales, mins))]
    return Q8Linear(torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, -1).astype(np.int8))), *fp32)


def read_q4_1(raw: np.ndarray) -> Q4Linear:
    """``raw`` uint8 ``[rows, blocks * 20]``: fp16 d, fp16 m, 16 code bytes per block."""
    b = raw.reshape(raw.shape[0], -1, 20)
    return _q4_linear(b[..., 4:], _f16(b[..., 0:2]), _f16(b[..., 2:4]))


def read_q4_0(raw: np.ndarray) -> Q4Linear:
    """``raw`` uint8 ``[rows, blocks * 18]``: fp16 d, 16 code bytes (w = d * (q - 8))."""
    b = raw.reshape(raw.shape[0], -1, 18)
    d = _f16(b[..., 0:2])
    return _q4_linear(b[..., 2:], d, -8 * d)


def read_q4_k(raw: np.ndarray) -> Q4Linear:
    """``raw`` uint8 ``[rows, super-blocks * 144]``: fp16 d, fp16 dmin, 12 bytes of 6-bit scales
    and mins (eight sub-blocks of 32), 128 code bytes (sub-block 2j in the low nibbles of bytes
    32j..32j+31, sub-block 2j+1 in their high nibbles)."""
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    b = raw.reshape(-1, 144)
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, m = (x.reshape(-1, 8).astype(np.float32) for x in Q4_K.get_scale_min(b[:, 4:16]))
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    values = (qs & 0x0F).reshape(-1, 8, 32)  # [super-blocks, sub-block, 32] in weight order
    codes = _q4_pairs(values).reshape(rows, -1)
    return _q4_linear(codes, (d * sc).reshape(rows, -1), (-(dmin * m)).reshape(rows, -1))


def read_q5_k(raw: np.ndarray) -> Q8Linear:
    """``raw`` uint8 ``[rows, super-blocks * 176]``: fp16 d, fp16 dmin, 12 bytes of 6-bit scales
    and mins (as Q4_K), 32 bytes of high bits (bit s of byte i: weight i of sub-block s), 128 bytes
    of low nibbles (as Q4_K); w = d * sc_s * q - dmin * m_s with q 5-bit, per 32 weights."""
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    b = raw.reshape(-1, 176)
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, m = (x.reshape(-1, 8).astype(np.float32) for x in Q4_K.get_scale_min(b[:, 4:16]))
    low = (b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (b[:, 16:48].reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 0x01
    codes = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).reshape(rows, -1)
    return _q8_linear(codes, (d * sc).reshape(rows, -1), (-(dmin * m)).reshape(rows, -1))


def read_f16(raw: np.ndarray) -> F16Linear:
    """``raw`` fp16 ``[rows, in]``, or its bytes uint8 ``[rows, in * 2]`` (an F16 tensor: its
    values, no blocks)."""
    raw = np.ascontiguousarray(raw)
    return F16Linear(torch.from_numpy(raw.view(np.float16) if raw.dtype == np.uint8 else raw.astype(np.float16)))


def read_q8_0(raw: np.ndarray) -> Q8Linear:
    """``raw`` uint8 ``[rows, blocks * 34]``: fp16 d, 32 signed bytes."""
    b = raw.reshape(raw.shape[0], -1, 34)
    return _q8_linear(b[..., 2:].view(np.int8), _f16(b[..., 0:2]))


def read_q5_0(raw: np.ndarray) -> Q8Linear:
    """``raw`` uint8 ``[rows, blocks * 22]``: fp16 d, 32 high bits (one per weight, little
    endian), 16 bytes of low nibbles in Q4 order; w = d * (q - 16)."""
    b = raw.reshape(raw.shape[0], -1, 22)
    high = np.unpackbits(np.ascontiguousarray(b[..., 2:6]), axis=-1, bitorder="little")  # [..., 32]
    low = np.concatenate([b[..., 6:] & 0x0F, b[..., 6:] >> 4], axis=-1)
    codes = (low | (high << 4)).astype(np.int16) - 16
    return _q8_linear(codes, _f16(b[..., 0:2]))


def read_q6_k(raw: np.ndarray) -> Q8Linear:
    """``raw`` uint8 ``[rows, super-blocks * 210]``: 128 bytes of low nibbles, 64 bytes of high
    bit pairs, 16 int8 sub-block scales, fp16 d; w = d * sc_s * (q - 32) per 16 weights."""
    rows = raw.shape[0]
    b = raw.reshape(-1, 210)
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    low = (ql & 0x0F).reshape(-1, 2, 4, 32)
    high = (qh & 0x03).reshape(-1, 2, 4, 32)
    codes = (low | (high << 4)).astype(np.int16).reshape(rows, -1) - 32
    scales = b[:, 192:208].view(np.int8).astype(np.float32) * _f16(b[:, 208:210])[:, None]
    return _q8_linear(codes, scales.reshape(rows, -1))


_READERS = {"Q4_0": read_q4_0, "Q4_1": read_q4_1, "Q4_K": read_q4_k, "Q5_0": read_q5_0,
            "Q5_K": read_q5_k, "Q6_K": read_q6_k, "Q8_0": read_q8_0, "F16": read_f16}


def read_gguf_blocks(path: Path) -> dict[str, Q4Linear | Q8Linear | F16Linear | torch.Tensor]:
    """Every tensor of a GGUF file by its GGUF name: the :data:`READ_TYPES` as blocks (F16 as
    :class:`F16Linear`; a 1-D F16 tensor, a norm or bias, as fp32), F32 as tensors. Other types are
    skipped (the caller finds them missing and says so)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out: dict[str, Q4Linear | Q8Linear | F16Linear | torch.Tensor] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind == "F16" and len(t.data.shape) == 1:
            out[t.name] = torch.from_numpy(np.array(t.data, dtype=np.float32))
        elif kind in _READERS:
            out[t.name] = _READERS[kind](np.asarray(t.data))
        elif kind == "F32":
            out[t.name] = torch.from_numpy(np.array(t.data, dtype=np.float32))
    return out


def load_gguf_blocks(path: Path) -> dict[str, Q4Linear | Q8Linear | F16Linear | torch.Tensor]:
    """:func:`read_gguf_blocks`, through a safetensors copy in kvmemory's cache folder (parsing
    and unpacking a GGUF takes 10 s and more; the copy loads in about a second). The copy is
    keyed by the file's name, size and modification time and written atomically."""
    from safetensors.torch import load_file, save_file

    stat = path.stat()
    copy = cache_root() / "blocks" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-v3.safetensors"
    if copy.is_file():
        return _from_flat(load_file(str(copy)))
    blocks = read_gguf_blocks(path)
    copy.parent.mkdir(parents=True, exist_ok=True)
    partial = copy.with_suffix(f".{os.getpid()}.partial")
    save_file(_to_flat(blocks), str(partial))
    os.replace(partial, copy)
    return blocks


def _to_flat(blocks: dict) -> dict[str, torch.Tensor]:
    flat = {}
    for name, value in blocks.items():
        if isinstance(value, Q4Linear):
            flat.update({f"{name}:q4.codes": value.codes, f"{name}:q4.scales": value.scales, f"{name}:q4.mins": value.mins})
        elif isinstance(value, Q8Linear):
            flat.update({f"{name}:q8.codes": value.codes, f"{name}:q8.scales": value.scales})
            if value.has_mins:
                flat[f"{name}:q8.mins"] = value.mins
        elif isinstance(value, F16Linear):
            flat[f"{name}:f16"] = value.codes
        else:
            flat[f"{name}:f32"] = value.contiguous()
    return flat


def _from_flat(flat: dict[str, torch.Tensor]) -> dict:
    blocks: dict = {}
    for key in flat:
        name, kind = key.split(":")
        if kind == "f32":
            blocks[name] = flat[key]
        elif kind == "f16":
            blocks[name] = F16Linear(flat[key])
        elif kind == "q4.codes":
            blocks[name] = Q4Linear(flat[key], flat[f"{name}:q4.scales"], flat[f"{name}:q4.mins"])
        elif kind == "q8.codes":
            mins = flat.get(f"{name}:q8.mins")
            blocks[name] = Q8Linear(flat[key], flat[f"{name}:q8.scales"], *([] if mins is None else [mins]))
    return blocks
