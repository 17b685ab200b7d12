"""Indexed packed attention and fused K/V scatter in Triton (paper Appendix 13.2).

Packed refresh (§3.3) evaluates attention for B selected query rows at absolute positions
``u_1 < … < u_B``; query row r reads every cached K/V row ``j <= u_r`` (eq. 22). The kernel
tiles 16 packed query rows × 64 K/V positions, keeps an FP32 online softmax, maps query head h
to K/V head ``h // (H_q / H_kv)`` (grouped-query attention) and reads the cache through its
strides, so cache views need no copy. A per-refresh plan records, for every query tile, the
number of complete-prefix tiles visible to all its rows and the total tile count (eqs. 23–24);
it is built once on the host in O(B) and reused by every layer.

Launching needs a CUDA GPU, or ``TRITON_INTERPRET=1`` set before this module is imported (the
interpreter runs on CPU tensors; slow, meant for tests on tiny shapes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import TritonUnavailableError

BLOCK_M = 16  # packed query rows per tile
BLOCK_N = 64  # K/V positions per tile
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read by @triton.jit at decoration time


def unavailable_reason(device: torch.device | str = "cpu") -> str | None:
    """Why the kernels cannot launch for tensors on ``device`` (None: they can)."""
    device = torch.device(device)
    if INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1":
        return None  # the interpreter runs on CPU tensors
    if device.type == "cuda" and torch.cuda.is_available():
        return None
    if not torch.cuda.is_available():
        return (
            "the Triton backend needs an NVIDIA GPU; on a CPU-only machine use backend='sdpa' (the default), "
            "or set TRITON_INTERPRET=1 before importing kvmemory.kernels to run the kernels in the (slow) interpreter"
        )
    return f"the Triton backend runs on CUDA tensors; the cache is on {device}: move the model to a GPU or use backend='sdpa'"


def check_available(device: torch.device | str) -> None:
    """Raises TritonUnavailableError (naming the fix) unless the kernels can launch on ``device``."""
    reason = unavailable_reason(device)
    if reason:
        raise TritonUnavailableError(reason)


@dataclass(frozen=True)
class AttentionPlan:
    """Per-refresh launch metadata (eqs. 23–24), built once and reused across layers.

    ``positions``: int32 ``[B]`` sorted absolute positions of the packed rows; ``n_full`` /
    ``n_total``: int32 ``[T]`` per query tile of 16 rows, complete-prefix and total 64-row K/V
    tiles; ``kv_length``: ``u_B + 1`` rows read at most. All tensors live on the cache's device.
    """

    positions: torch.Tensor
    n_full: torch.Tensor
    n_total: torch.Tensor
    kv_length: int

    @property
    def rows(self) -> int:
        return int(self.positions.shape[0])


def build_plan(positions: torch.Tensor, device: torch.device | str | None = None) -> AttentionPlan:
    """Plan for packed rows at ``positions`` (LongTensor ``[B]``, strictly increasing, >= 0).

    For query tile t with first/last positions u_min, u_max: ``n_full = floor((u_min+1)/64)``
    (eq. 23), ``n_total = ceil((u_max+1)/64)`` (eq. 24). O(B) on the host; one upload.

    Raises:
        ValueError: empty, negative or not strictly increasing positions.
    """
    pos = positions.detach().to("cpu", torch.long)
    if pos.ndim != 1 or pos.numel() == 0:
        raise ValueError(f"positions must be a non-empty 1-D tensor, got shape {tuple(pos.shape)}")
    if int(pos[0]) < 0 or (pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all())):
        raise ValueError("positions must be non-negative and strictly increasing (sort and deduplicate them)")
    first = pos[::BLOCK_M]
    last = pos[torch.clamp(torch.arange(BLOCK_M - 1, pos.numel() + BLOCK_M - 1, BLOCK_M), max=pos.numel() - 1)]
    n_full = torch.div(first + 1, BLOCK_N, rounding_mode="floor")
    n_total = torch.div(last + 1 + BLOCK_N - 1, BLOCK_N, rounding_mode="floor")
    dev = torch.device(device) if device is not None else positions.device
    return AttentionPlan(
        positions=pos.to(dev, torch.int32),
        n_full=n_full.to(dev, torch.int32),
        n_total=n_total.to(dev, torch.int32),
        kv_length=int(pos[-1]) + 1,
    )


@triton.jit
def _attend_tile(q, k_base, v_base, t, pos, row_ok, last_col, d, d_ok, m_i, l_i, acc,
                 stride_kn, stride_kd, stride_vn, stride_vd, qk_scale,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr, QK_FP32: tl.constexpr):
    """One 64-row K/V tile of the online softmax; MASKED tiles apply the per-row test j <= u_r."""
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols <= last_col
    k = tl.load(k_base + cols[None, :] * stride_kn + d[:, None] * stride_kd,
                mask=d_ok[:, None] & col_ok[None, :], other=0.0)
    if IEEE:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    elif QK_FP32:  # bf16 products are exact in fp32: same result as a bf16 dot with fp32 accumulation
        s = tl.dot(q.to(tl.float32), k.to(tl.float32))
    else:
        s = tl.dot(q, k)
    visible = row_ok[:, None] & col_ok[None, :]
    if MASKED:
        visible = visible & (cols[None, :] <= pos[:, None])
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    v = tl.load(v_base + cols[:, None] * stride_vn + d[None, :] * stride_vd,
                mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    # probabilities stay FP32: P·V in IEEE FP32 (fp32 operands) or TF32x3 (fp16/bf16 operands)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p, v.to(tl.float32), input_precision="tf32x3")
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _packed_attention_kernel(
    Q, K, V, O, POS, NFULL, NTOTAL,
    stride_qh, stride_qm, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    stride_oh, stride_om, stride_od,
    n_rows, head_dim, qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr, QK_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP  # grouped-query mapping of transformers' repeat_kv
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    pos = tl.load(POS + rows, mask=row_ok, other=-1)
    last_col = tl.max(pos, axis=0)
    q = tl.load(Q + head * stride_qh + rows[:, None] * stride_qm + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_full = tl.load(NFULL + tile)
    n_total = tl.load(NTOTAL + tile)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    for t in range(0, n_full):  # complete-prefix tiles: visible to every row of the tile (eq. 23)
        m_i, l_i, acc = _attend_tile(q, k_base, v_base, t, pos, row_ok, last_col, d, d_ok, m_i, l_i, acc,
                                     stride_kn, stride_kd, stride_vn, stride_vd, qk_scale,
                                     BLOCK_N=BLOCK_N, MASKED=False, IEEE=IEEE, QK_FP32=QK_FP32)
    for t in range(n_full, n_total):  # partially visible tiles, up to eq. 24
        m_i, l_i, acc = _attend_tile(q, k_base, v_base, t, pos, row_ok, last_col, d, d_ok, m_i, l_i, acc,
                                     stride_kn, stride_kd, stride_vn, stride_vd, qk_scale,
                                     BLOCK_N=BLOCK_N, MASKED=True, IEEE=IEEE, QK_FP32=QK_FP32)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + head * stride_oh + rows[:, None] * stride_om + d[None, :] * stride_od, out,
             mask=row_ok[:, None] & d_ok[None, :])


def packed_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """Causal attention of packed query rows against a cache (eq. 22).

    Args:
        query: ``[1, H_q, B, d]`` fresh queries of the packed rows (any strides).
        keys, values: ``[1, H_kv, N, d]`` the layer's cache (fresh rows already written), any
            strides, N >= ``plan.kv_length``; H_q must be a multiple of H_kv.
        plan: from :func:`build_plan` for the same B positions.
        scale: softmax scale (the model's ``scaling``, usually ``d ** -0.5``).

    Returns:
        ``[1, H_q, B, d]`` in ``query.dtype``: row r = softmax(q_r K[0:u_r]ᵀ · scale) V[0:u_r].

    Raises:
        ValueError: shape mismatch; TritonUnavailableError: no GPU and no interpreter.
    """
    _check_shapes(query, keys, values, plan)
    check_available(query.device)
    _, hq, b, d = query.shape
    hkv = keys.shape[1]
    out = torch.empty((hq, b, d), dtype=torch.float32, device=query.device)
    q, k, v = query[0], keys[0], values[0]
    grid = (triton.cdiv(b, BLOCK_M), hq)
    _packed_attention_kernel[grid](
        q, k, v, out, plan.positions, plan.n_full, plan.n_total,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        b, d, scale * 1.4426950408889634,  # exp2-based softmax: fold log2(e) into the scale
        GROUP=hq // hkv, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(d)),
        IEEE=query.dtype == torch.float32,
        # the interpreter's tl.dot mis-reads bf16 operands (measured: errors ~1e10), so upcast there
        QK_FP32=INTERPRETED and query.dtype == torch.bfloat16,
        num_warps=4, num_stages=2,
    )
    return out.to(query.dtype)[None]  # cast in torch: round-to-nearest (the interpreter truncates)


def _check_shapes(query, keys, values, plan: AttentionPlan) -> None:
    if query.ndim != 4 or keys.ndim != 4 or query.shape[0] != 1 or keys.shape[0] != 1:
        raise ValueError(f"expected [1, H, rows, d] tensors (batch 1), got {tuple(query.shape)} and {tuple(keys.shape)}")
    if keys.shape != values.shape:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ")
    if query.shape[1] % keys.shape[1] or query.shape[3] != keys.shape[3]:
        raise ValueError(f"query heads/dim {tuple(query.shape)} do not fit K/V {tuple(keys.shape)} (GQA needs H_q % H_kv == 0)")
    if query.shape[2] != plan.rows or keys.shape[2] < plan.kv_length:
        raise ValueError(
            f"plan for {plan.rows} rows up to position {plan.kv_length - 1} does not fit query rows "
            f"{query.shape[2]} / cache length {keys.shape[2]}: rebuild the plan for this refresh"
        )
    if query.dtype != keys.dtype or keys.dtype != values.dtype:
        raise ValueError(f"query/keys/values dtypes differ: {query.dtype}, {keys.dtype}, {values.dtype}")


@triton.jit
def _kv_scatter_kernel(
    K, V, KN, VN, POS,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    stride_knh, stride_knm, stride_knd,
    stride_vnh, stride_vnm, stride_vnd,
    head_dim, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    pos = tl.load(POS + row)
    k = tl.load(KN + head * stride_knh + row * stride_knm + d * stride_knd, mask=d_ok)
    v = tl.load(VN + head * stride_vnh + row * stride_vnm + d * stride_vnd, mask=d_ok)
    tl.store(K + head * stride_kh + pos * stride_kn + d * stride_kd, k, mask=d_ok)
    tl.store(V + head * stride_vh + pos * stride_vn + d * stride_vd, v, mask=d_ok)


def scatter_kv(
    keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor, plan: AttentionPlan
) -> None:
    """Write fresh rows into the cache in one launch: ``keys[:, :, u_r] = new_keys[:, :, r]`` (eq. 21).

    Args:
        keys, values: ``[1, H_kv, N, d]`` cache tensors, written in place (any strides).
        new_keys, new_values: ``[1, H_kv, B, d]`` fresh K/V of the packed rows, same dtype.

    Raises:
        ValueError: shape/dtype mismatch; TritonUnavailableError: no GPU and no interpreter.
    """
    if new_keys.shape != new_values.shape or new_keys.shape[:2] != keys.shape[:2] or new_keys.shape[3] != keys.shape[3]:
        raise ValueError(f"fresh K/V {tuple(new_keys.shape)} do not fit cache {tuple(keys.shape)}")
    if new_keys.shape[2] != plan.rows or keys.shape[2] < plan.kv_length:
        raise ValueError("the plan does not match these rows: rebuild it for this refresh")
    if new_keys.dtype != keys.dtype or new_values.dtype != values.dtype:
        raise ValueError(f"fresh K/V dtype {new_keys.dtype} differs from the cache's {keys.dtype}")
    check_available(keys.device)
    k, v, kn, vn = keys[0], values[0], new_keys[0], new_values[0]
    d = k.shape[2]
    _kv_scatter_kernel[(plan.rows, k.shape[0])](
        k, v, kn, vn, plan.positions,
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        kn.stride(0), kn.stride(1), kn.stride(2),
        vn.stride(0), vn.stride(1), vn.stride(2),
        d, BLOCK_D=triton.next_power_of_2(d),
    )
