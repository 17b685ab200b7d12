"""Micro-benchmark: one-token (M=1) linear kernels for SmolLM2-135M's shapes on this CPU.

Weights rotate over enough copies (>= 192 MB) that they come from DRAM as in a real decode step
(the L3 is 32 MB: a single repeated weight would sit in cache and flatter every kernel).
Kernels:
  fp32 / bf16 dense F.linear; int8 per-row (aten._weight_int8pack_mm) with bf16 / fp32
  activations; int4 group-32 (aten._weight_int4pack_mm_for_cpu) with bf16 / fp32 activations;
  q4 compiled: the GGUF Q4_1 layout (two nibbles per byte, fp16 d and m per 32) dequantized
  inside one torch.compile'd reduction with fp32 activations (exact fp32 arithmetic);
  int8 compiled: per-row int8 dequantized inside a compiled reduction, fp32 activations.
Prints microseconds per call (median of 5 blocks) and GB/s of weight bytes.
Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/engine_prototype/micro_linear.py [--threads N]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv 960x576": (960, 576), "o 576x576": (576, 576), "gate_up 3072x576": (3072, 576),
          "down 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576)}
WORKING_SET = 192e6


def q4_gemv(x, qp, d, m):
    """x fp32 [1, K]; qp uint8 [N, K/32, 16] (byte j: element j low nibble, j+16 high nibble);
    d, m fp16 [N, K/32]: w = d*q + m. Returns fp32 [1, N]."""
    n, g, _ = qp.shape
    q = torch.stack([qp & 15, qp >> 4], dim=2).float()  # [N, G, 2, 16]
    w = q * d.float()[:, :, None, None] + m.float()[:, :, None, None]
    return (w * x.view(1, g, 2, 16)).sum(dim=(1, 2, 3))[None]


def int8_gemv(x, q, scale):
    return ((q.float() * x).sum(-1) * scale)[None]


def timeit(fn, copies, inner=20, blocks=5):
    fn(*copies[0])
    out = []
    for _ in range(blocks):
        t = time.perf_counter()
        for i in range(inner):
            fn(*copies[i % len(copies)])
        out.append((time.perf_counter() - t) / inner)
    return statistics.median(out)


def int4_pack(w):
    n, k = w.shape
    wg = w.reshape(n, k // 32, 32)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.clamp(torch.round((wg - lo[..., None]) / scale[..., None]), 0, 15).to(torch.int32)
    return q, scale, lo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cq4, c8 = torch.compile(q4_gemv, dynamic=False), torch.compile(int8_gemv, dynamic=False)
    print(f"threads {args.threads}  load {open('/proc/loadavg').read().split()[:3]}")
    print(f"{'shape':22s} {'kernel':22s} {'us':>8s} {'GB/s':>6s}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.02
        q, scale, lo = int4_pack(w)
        w = ((q.float() * scale[..., None]) + lo[..., None]).reshape(n, k)  # exactly 4-bit representable
        x = torch.randn(1, k)
        xb = x.bfloat16()
        ncopies = max(2, int(WORKING_SET // (n * k * 4)))
        qp = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
        d16, m16 = scale.half(), lo.half()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k), 1)
        sz = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous()
        s8 = w.abs().amax(1) / 127
        q8 = torch.round(w / s8[:, None]).to(torch.int8)
        kernels = {
            "fp32 dense": (lambda a, b: F.linear(a, b), lambda: (x, w.clone()), n * k * 4),
            "bf16 dense": (lambda a, b: F.linear(a, b), lambda: (xb, w.bfloat16()), n * k * 2),
            "int8 aten (bf16 x)": (lambda a, b, c: torch.ops.aten._weight_int8pack_mm(a, b, c),
                                   lambda: (xb, q8.clone(), s8.bfloat16()), n * k),
            "int8 aten (fp32 x)": (lambda a, b, c: torch.ops.aten._weight_int8pack_mm(a, b, c),
                                   lambda: (x, q8.clone(), s8), n * k),
            "int4 aten (bf16 x)": (lambda a, b, c: torch.ops.aten._weight_int4pack_mm_for_cpu(a, b, 32, c),
                                   lambda: (xb, packed.clone(), sz.bfloat16()), n * k // 2),
            "int4 aten (fp32 x)": (lambda a, b, c: torch.ops.aten._weight_int4pack_mm_for_cpu(a, b, 32, c),
                                   lambda: (x, packed.clone(), sz), n * k // 2),
            "q4 compiled (fp32 x)": (cq4, lambda: (x, qp.clone(), d16, m16), n * k // 2 + n * k // 32 * 4),
            "int8 compiled (fp32 x)": (c8, lambda: (x, q8.clone(), s8), n * k),
        }
        ref = F.linear(x.double(), w.double())
        for kname, (fn, make, nbytes) in kernels.items():
            if "fp32 x" in kname and "aten" in kname and n > 10000:
                continue  # the scalar fallback takes seconds here
            copies = [make() for _ in range(ncopies if "aten (fp32" not in kname else 2)]
            sec = timeit(fn, copies, inner=10 if n > 10000 else 20)
            err = (fn(*copies[0]).double() - ref).abs().max().item() / ref.abs().max().item()
            print(f"{name:22s} {kname:22s} {sec * 1e6:8.1f} {nbytes / sec / 1e9:6.1f}   rel.err {err:.1e}")


if __name__ == "__main__":
    main()
