"""The quantized kernel built for each instruction set this CPU runs (avx512, avx2, portable):
every build computes the same products and the same decoder rows as transformers (fp32
summation order only), and the dispatch picks, forces and refuses ISAs as documented."""

from __future__ import annotations

import pytest
import torch

from kvmemory import engine, kvcache
from kvmemory.engine import quantized, restore_dense
from kvmemory.engine.build import build
from kvmemory.engine.llama import QuantizedLlama, _Layer
from kvmemory.engine.quantized import ISAS, KernelUnavailableError, Q4Linear, Q8Linear, cpu_isas, kernel, kernel_isa
from kvmemory.models import embedded_gguf_path
from support import assert_engine_matches_forward, history, tiny_model

# as in test_engine.py: fp32 with another summation order than transformers' GEMMs
LOGITS_ATOL = 1e-3
ROWS_ATOL = 1e-4
# a linear's products against x @ dequantize(W).T, relative to the largest product (measured
# <= 4e-7 on every build; a wrong nibble, block or row moves them by > 1e-2)
LINEAR_RTOL = 1e-5


def _runnable(isa: str) -> str:
    """``isa`` when this CPU runs it; skips the test otherwise (with the reason)."""
    if isa not in cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernel (it runs {', '.join(cpu_isas())})")
    return isa


def _built_on(model, isa: str, monkeypatch) -> QuantizedLlama:
    """The embedded model's engine with its kernel built for ``isa`` (KVMEMORY_ISA), beside the one
    load_model attached: that one released the dense weights, which this one verifies and prefills with."""
    restore_dense(model)
    monkeypatch.setenv("KVMEMORY_ISA", isa)
    built = build(model, embedded_gguf_path())
    assert built.isa == isa and kernel_isa() == isa
    return built


def _prompt(real, n: int) -> torch.Tensor:
    text = " ".join(m["content"] for m in history()) * 12
    ids = real.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= n
    return torch.tensor(ids[:n])


def _assert_product(got: torch.Tensor, x: torch.Tensor, weight) -> None:
    ref = (x.double() @ weight.dequantize().double().T).float()
    scale = ref.abs().max().item()
    torch.testing.assert_close(got, ref, atol=LINEAR_RTOL * scale, rtol=0)


@pytest.mark.parametrize("isa", ISAS)
def test_each_build_reports_its_isa(isa):
    lib = kernel(_runnable(isa))
    assert lib.isa() == isa
    assert kernel(isa) is lib  # built once per ISA
    assert not lib.has_vnni() or isa == "avx512"


@pytest.mark.parametrize("isa", ISAS)
def test_linears_equal_the_dequantized_product_at_the_model_shapes(real, isa):
    """Every linear of the embedded model (fused qkv, o, fused gate-up, down, the Q8_0 head) on
    M = 1, 2, 3, 8, 9 rows: the one-row kernel, the several-row kernels and a partial 8-row pass."""
    lib = kernel(_runnable(isa))
    blocks = engine.engine_for(real.model, kvcache.new_cache(real.model.config))
    layer = blocks.layers[3]
    g = torch.Generator().manual_seed(5)
    for weight in (layer.qkv, layer.o, layer.gate_up, layer.down, blocks.head):
        for m in (1, 2, 3, 8, 9):
            x = torch.randn(m, weight.shape[1], generator=g)
            _assert_product(weight(x, lib=lib), x, weight)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,m", [(37, 1), (64, 3), (21, 13), (5, 2)])
def test_odd_shapes_equal_the_dequantized_product(isa, rows, m):
    """Row counts that leave remainders of the 4-row and 2-row passes, M past one 8-row pass."""
    lib = kernel(_runnable(isa))
    g = torch.Generator().manual_seed(rows)
    q4 = Q4Linear(torch.randint(0, 256, (rows, 48), generator=g, dtype=torch.uint8),
                  torch.rand(rows, 3, generator=g) * 0.02, -torch.rand(rows, 3, generator=g) * 0.1)
    q8 = Q8Linear(torch.randint(-128, 128, (rows, 96), generator=g, dtype=torch.int8), torch.rand(rows, 3, generator=g))
    x = torch.randn(m, 96, generator=g)
    _assert_product(q4(x, lib=lib), x, q4)
    _assert_product(q8(x, lib=lib), x, q8)


@pytest.mark.parametrize("isa", ISAS)
def test_decoder_on_each_isa_equals_transformers(real, isa, monkeypatch):
    """Prefill (dense), a 5-row append and a 3-row draft (the decoder's ``rows``), then decoded
    tokens (``step``) past 512 cached rows (attention split over two chunks): logits and K/V
    equal transformers' forward."""
    fast_engine = _built_on(real.model, _runnable(isa), monkeypatch)
    ids = _prompt(real, 536)
    cache = kvcache.new_cache(real.model.config)
    logits = [fast_engine.forward_rows(cache, ids[:520], 0), fast_engine.forward_rows(cache, ids[520:525], 520)]
    logits += list(fast_engine.forward_rows(cache, ids[525:528], 525, every_row=True))
    logits += [fast_engine.forward_rows(cache, ids[i:i + 1], i) for i in range(528, 536)]
    plain = kvcache.new_cache(real.model.config)
    with torch.no_grad():
        ref = real.model(input_ids=ids[None], cache=plain, use_cache=True).logits[0].float()
    for got, end in zip(logits, [519, 524, 525, 526, 527, *range(528, 536)]):
        torch.testing.assert_close(got, ref[end], atol=LOGITS_ATOL, rtol=0)
    for (k, v), (k2, v2) in zip(kvcache.layer_tensors(cache), kvcache.layer_tensors(plain)):
        torch.testing.assert_close(k, k2, atol=ROWS_ATOL, rtol=0)
        torch.testing.assert_close(v, v2, atol=ROWS_ATOL, rtol=0)


def _random_block_llama(heads: int, kv_heads: int, head_dim: int) -> QuantizedLlama:
    """A 2-layer random Llama whose linears are random Q4_1 blocks (the head Q8_0) and whose
    fp32 weights are their dequantized values: an engine for attention layouts the embedded
    model lacks (query heads per group other than 3, head_dim other than 64)."""
    model = tiny_model("llama", hidden_size=32 * heads, intermediate_size=256, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=512)
    g = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + head_dim)

    def blocks(linear) -> Q4Linear:
        out, width = linear.weight.shape
        scales = torch.rand(out, width // 32, generator=g) * 0.01 + 0.002
        q4 = Q4Linear(torch.randint(0, 256, (out, width // 2), generator=g, dtype=torch.uint8), scales, -7.5 * scales)
        linear.weight.data.copy_(q4.dequantize())
        return q4

    layers = []
    for module in model.model.layers:
        attn, mlp = module.self_attn, module.mlp
        qkv = Q4Linear.concat([blocks(attn.q_proj), blocks(attn.k_proj), blocks(attn.v_proj)])
        gate_up = Q4Linear.concat([blocks(mlp.gate_proj), blocks(mlp.up_proj)])
        layers.append(_Layer(qkv, blocks(attn.o_proj), gate_up, blocks(mlp.down_proj), module))
    vocab, hidden = model.lm_head.weight.shape
    head = Q8Linear(torch.randint(-128, 128, (vocab, hidden), generator=g, dtype=torch.int8),
                    torch.rand(vocab, hidden // 32, generator=g) * 0.01)
    model.lm_head.weight.data.copy_(head.dequantize())  # tied: the embedding too
    return QuantizedLlama(model, layers, head)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(10, 2, 64), (8, 2, 64), (4, 2, 64), (4, 4, 64), (4, 2, 32)])
def test_attention_layouts_on_each_isa_equal_transformers(isa, heads, kv_heads, head_dim, monkeypatch):
    """Groups of 5 query heads (the per-head path), 4, 2 and 1 (the by-group path) and head_dim
    32 (the generic path): decoder rows and decoded tokens past 512 cached rows equal
    transformers' forward on the dequantized weights."""
    monkeypatch.setenv("KVMEMORY_ISA", _runnable(isa))
    fast_engine = _random_block_llama(heads, kv_heads, head_dim)
    assert fast_engine.isa == isa
    ids = torch.randint(0, 512, (530,), generator=torch.Generator().manual_seed(3))
    assert_engine_matches_forward(fast_engine, ids, prefill=515, draft=7, rtol=ROWS_ATOL)


# ---- the dispatch ----

def test_default_isa_is_the_best_this_cpu_runs(monkeypatch):
    monkeypatch.delenv("KVMEMORY_ISA", raising=False)
    assert kernel_isa() == cpu_isas()[0] and cpu_isas()[-1] == "portable"
    assert kernel().isa() == kernel_isa()


def test_forced_avx2_on_a_cpu_without_avx512_still_runs_the_engine(real, monkeypatch):
    """The dispatch told the CPU lacks AVX-512: the engine attaches ("auto" and by name) on the
    avx2 build, its rows equal transformers', int8 activations are refused with the reason and
    "auto" never picks them."""
    _runnable("avx2")
    gguf = embedded_gguf_path()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(quantized, "cpu_isas", lambda: ("avx2", "portable"))
            patch.delenv("KVMEMORY_ISA", raising=False)
            assert kernel_isa() == "avx2"
            assert engine.attach(real.model, gguf, "auto") == engine.EngineStatus("q4_1")
            patch.setenv("KVMEMORY_ISA", "avx2")
            assert engine.attach(real.model, gguf, "q4_1") == engine.EngineStatus("q4_1")
            with pytest.raises(KernelUnavailableError, match="AVX-512 VNNI"):
                engine.attach(real.model, gguf, "q4_1_int8")
            cache = kvcache.new_cache(real.model.config)
            fast_engine = engine.engine_for(real.model, cache)
            assert fast_engine.isa == "avx2" and fast_engine.kind == "q4_1"
            patch.setenv("KVMEMORY_ISA", "portable")  # an engine keeps the ISA it was built on
            ids = _prompt(real, 140)
            logits = [engine.forward_rows(real.model, cache, ids[:130], 0),
                      engine.forward_rows(real.model, cache, ids[130:134], 130)]
            logits += [engine.forward_rows(real.model, cache, ids[i:i + 1], i) for i in range(134, 140)]
            assert fast_engine.lib.isa() == "avx2"
            with torch.no_grad():
                ref = real.model(input_ids=ids[None]).logits[0].float()
            for got, end in zip(logits, [129, 133, *range(134, 140)]):
                torch.testing.assert_close(got, ref[end], atol=LOGITS_ATOL, rtol=0)
    finally:  # the shared model gets its default engine back
        engine.attach(real.model, gguf, "q4_1")
    assert engine.engine_for(real.model, kvcache.new_cache(real.model.config)).isa == cpu_isas()[0]


def test_auto_keeps_transformers_where_the_kernel_has_no_simd_path(real, monkeypatch):
    """On a CPU with only the portable build (no AVX2; ARM today) the block engine is slower than
    transformers' forward on one thread: "auto" keeps transformers and says why; "q4_1" asked
    for by name still runs there."""
    gguf = embedded_gguf_path()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(quantized, "cpu_isas", lambda: ("portable",))
            patch.delenv("KVMEMORY_ISA", raising=False)
            status = engine.attach(real.model, gguf, "auto")
            assert status.name == "transformers" and "no SIMD path" in status.reason
            assert engine.engine_for(real.model, kvcache.new_cache(real.model.config)).kind == "transformers"
            by_name = engine.attach(real.model, gguf, "q4_1")
            assert by_name == engine.EngineStatus("q4_1") and by_name.isa == "portable"
            assert by_name.as_dict() == {"name": "q4_1", "reason": None, "isa": "portable"}
    finally:  # the shared model gets its default engine back
        engine.attach(real.model, gguf, "q4_1")
    assert engine.status(real.model).isa == cpu_isas()[0]


def test_an_isa_beyond_the_cpu_or_unknown_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(quantized, "cpu_isas", lambda: ("avx2", "portable"))
    monkeypatch.setenv("KVMEMORY_ISA", "avx512")
    with pytest.raises(KernelUnavailableError, match="cannot run the avx512 kernel .*runs avx2, portable"):
        kernel()
    with pytest.raises(KernelUnavailableError, match="cannot run the avx512 kernel"):
        kernel_isa()
    monkeypatch.setenv("KVMEMORY_ISA", "sse9")
    with pytest.raises(KernelUnavailableError, match="must be one of avx512, avx2, portable"):
        kernel()
    monkeypatch.delenv("KVMEMORY_ISA")
    with pytest.raises(KernelUnavailableError, match="cannot run the avx512 kernel"):
        kernel("avx512")


def test_non_x86_machines_run_the_portable_build_only(monkeypatch):
    monkeypatch.setattr(quantized.platform, "machine", lambda: "aarch64")
    assert cpu_isas.__wrapped__() == ("portable",)
