"""Test support: a real GGUF rewritten with some tensors in other types (Q5_K, F16), for engine
tests on a real model's weights in block types the packaged files lack. gguf-py reads and writes
the file; it has no Q5_K quantizer, so :func:`quantize_q5_k` is a plain one (min/max per 32
weights, the 6-bit scales and mins of llama.cpp's format), good enough for weights that only need
to be some real Q5_K blocks, not the best ones."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np


def quantize_q5_k(weight: np.ndarray) -> np.ndarray:
    """fp32 ``[rows, K]`` (K a multiple of 256) -> Q5_K blocks, uint8 ``[rows, K / 256 * 176]``:
    fp16 d, fp16 dmin, 12 bytes of packed 6-bit scales and mins, 32 bytes of high bits, 128 bytes
    of low nibbles; w ~= d * sc_s * q - dmin * m_s for each 32-weight sub-block s."""
    rows, width = weight.shape
    w = weight.reshape(-1, 8, 32).astype(np.float32)  # [super-blocks, sub-block, 32]
    low_end = np.minimum(w.min(-1), 0.0)
    step = (w.max(-1) - low_end) / 31
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = (-low_end.min(-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-low_end, dmin32, out=np.zeros_like(step), where=dmin32 > 0)), 0, 63).astype(np.uint8)
    scale, offset = (d32 * sc)[..., None], (dmin32 * mn)[..., None]
    q = np.clip(np.round(np.divide(w + offset, scale, out=np.zeros_like(w), where=scale > 0)), 0, 31).astype(np.uint8)
    packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=-1)
    high = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8)  # bit s of byte i
    low = (q & 0x0F).reshape(-1, 4, 2, 32)
    nibbles = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, high, nibbles], -1)
    return blocks.reshape(rows, width // 256 * 176)


def rewrite_gguf(source: Path, target: Path, types: dict[str, str]) -> Path:
    """Copy ``source`` to ``target`` with every tensor whose name matches a pattern of ``types``
    (regex -> ``"Q5_K"`` or ``"F16"``) re-encoded from its dequantized values; metadata and the
    other tensors unchanged."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        new_type = next((v for pattern, v in types.items() if re.fullmatch(pattern, t.name)), None)
        if new_type is None:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        values = dequantize(np.asarray(t.data), t.tensor_type).reshape(-1, int(t.shape[0]))
        if new_type == "F16":
            writer.add_tensor(t.name, values.astype(np.float16))
        else:
            writer.add_tensor(t.name, quantize_q5_k(values), raw_dtype=gguf.GGMLQuantizationType.Q5_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
