"""Triton packed attention and K/V scatter (Appendix 13.2) against an explicit FP64 causal oracle,
in Triton's interpreter on tiny shapes: causal gaps, tails, GQA, strides, plan changes."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before kvmemory.kernels is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

from kvmemory import kernels  # noqa: E402

# the tolerances (Appendix 13.5); fp32 is checked tighter
TOLERANCES = {torch.bfloat16: (2e-3, 2e-2), torch.float16: (2.5e-4, 3e-3), torch.float32: (1e-5, 1e-5)}


def oracle(q, k, v, positions, scale):
    """FP64 attention of query row r over cache rows j <= positions[r] (eq. 22)."""
    group = q.shape[1] // k.shape[1]
    kd, vd = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q.double() @ kd.transpose(-1, -2) * scale
    visible = torch.arange(k.shape[2])[None] <= positions[:, None]
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vd


def _inputs(dtype, heads, kv_heads, n, head_dim, b, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, b, head_dim, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, n, head_dim, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, n, head_dim, generator=g).to(dtype)
    return q, k, v


CASES = {
    # name: (heads, kv_heads, n, head_dim, positions)
    "gaps-and-tail": (4, 2, 200, 16, [0, 3, 4, 5, 63, 64, 65, 100, 101, 102, 150, 151, 152, 153, 154, 155, 156, 170, 199]),
    "one-row-first": (2, 2, 70, 16, [0]),
    "dense-block": (6, 2, 130, 32, list(range(90, 130))),
    "mqa-far-apart": (4, 1, 300, 16, [5, 140, 299]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_attention_matches_fp64_oracle(case, dtype):
    heads, kv_heads, n, head_dim, pos = CASES[case]
    positions = torch.tensor(pos)
    q, k, v = _inputs(dtype, heads, kv_heads, n, head_dim, len(pos))
    out = kernels.packed_attention(q, k, v, kernels.build_plan(positions), head_dim**-0.5)
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), oracle(q, k, v, positions, head_dim**-0.5), atol=atol, rtol=rtol)


def test_non_contiguous_strides():
    """Queries transposed from [B, H, d], K/V as a head-strided view of a wider buffer."""
    positions = torch.tensor([2, 3, 40, 41, 42, 77, 95])
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 7, 4, 16, generator=g).to(torch.bfloat16).transpose(1, 2)  # [1, 4, 7, 16]
    wide = torch.randn(1, 2, 130, 16, generator=g).to(torch.bfloat16)
    k, v = wide[:, :, :96], torch.randn(1, 96, 2, 16, generator=g).to(torch.bfloat16).transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    out = kernels.packed_attention(q, k, v, kernels.build_plan(positions), 0.25)
    torch.testing.assert_close(out.double(), oracle(q, k, v, positions, 0.25), atol=2e-3, rtol=2e-2)


def test_plan_counts_follow_eqs_23_24():
    positions = torch.tensor(list(range(60, 76)) + [127, 128, 300])
    plan = kernels.build_plan(positions)
    # tile 0: u_min 60 -> floor(61/64) = 0 full tiles; u_max 75 -> ceil(76/64) = 2 tiles
    # tile 1: u_min 127 -> floor(128/64) = 2; u_max 300 -> ceil(301/64) = 5
    assert plan.n_full.tolist() == [0, 2] and plan.n_total.tolist() == [2, 5]
    assert plan.kv_length == 301 and plan.rows == 19
    with pytest.raises(ValueError, match="strictly increasing"):
        kernels.build_plan(torch.tensor([3, 3, 4]))


def test_plan_changes_between_launches():
    """A new selection needs its own plan: results follow the plan, and a plan for other rows is refused."""
    q, k, v = _inputs(torch.float16, 4, 2, 160, 16, 5)
    first, second = torch.tensor([1, 2, 3, 80, 159]), torch.tensor([60, 61, 62, 63, 64])
    for positions in (first, second, first):
        out = kernels.packed_attention(q, k, v, kernels.build_plan(positions), 0.25)
        torch.testing.assert_close(out.double(), oracle(q, k, v, positions, 0.25), atol=2.5e-4, rtol=3e-3)
    with pytest.raises(ValueError, match="rebuild the plan"):
        kernels.packed_attention(q[:, :, :3], k, v, kernels.build_plan(first), 0.25)


def test_scatter_writes_only_selected_rows():
    positions = torch.tensor([0, 7, 8, 63, 64, 99])
    keys, values = _inputs(torch.bfloat16, 2, 2, 100, 16, 100, seed=3)[1:]
    before_k, before_v = keys.clone(), values.clone()
    new_k = torch.randn(1, 6, 2, 16).to(torch.bfloat16).transpose(1, 2)  # strided source
    new_v = torch.randn(1, 2, 6, 16).to(torch.bfloat16)
    kernels.scatter_kv(keys, values, new_k, new_v, kernels.build_plan(positions))
    assert torch.equal(keys[:, :, positions], new_k) and torch.equal(values[:, :, positions], new_v)
    rest = torch.ones(100, dtype=torch.bool)
    rest[positions] = False
    assert torch.equal(keys[:, :, rest], before_k[:, :, rest]) and torch.equal(values[:, :, rest], before_v[:, :, rest])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the kernels may launch")
def test_without_gpu_or_interpreter_the_error_names_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(kernels.TritonUnavailableError, match="TRITON_INTERPRET=1.*|backend='sdpa'") as err:
        kernels.check_available("cpu")
    assert "backend='sdpa'" in str(err.value) and "TRITON_INTERPRET=1" in str(err.value)
