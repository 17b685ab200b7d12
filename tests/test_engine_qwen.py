"""The block engine on the GGUF types Qwen2 / Llama files ship (Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, F16
beside Q4_1 / Q8_0): each type read into the kernel's forms dequantizes bit for bit to what gguf-py
(and so transformers' GGUF loader) gives; 16-value byte blocks multiply right on every ISA; a
decoder mixing forms per linear, with Qwen2's q/k/v biases, computes transformers' rows; and
the real Qwen2.5-Coder-0.5B GGUF runs on the engine with rows equal to transformers' forward."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kvmemory import engine, kvcache
from kvmemory.engine.gguf_blocks import read_f16, read_q4_0, read_q4_1, read_q4_k, read_q5_0, read_q5_k, read_q6_k, read_q8_0
from kvmemory.engine.llama import QuantizedLlama, _Layer
from kvmemory.engine.quantized import ISAS, F16Linear, FusedBlocks, Q4Linear, Q8Linear, cpu_isas, kernel
from kvmemory.engine.reference import TransformersEngine
from kvmemory.errors import ModelNotFoundError
from kvmemory.models import load_model
from support import assert_engine_matches_forward, tiny_model

# fp32 with another summation order than transformers' GEMMs, relative to the largest logit: the
# real model (measured <= 1e-6), and random blocks, whose full-range codes amplify rounding from
# layer to layer (measured 1.2e-5); a wrong block, bias or row moves logits by > 1e-2 relative
ROWS_RTOL = 1e-5
RANDOM_RTOL = 1e-4
LINEAR_RTOL = 1e-5  # a linear's products against x @ dequantize(W).T (a wrong nibble moves them > 1e-2)

# block bytes of each type and where its fp16 fields lie (set to finite values in random blocks)
LAYOUTS = {
    "Q4_0": (18, [0], read_q4_0), "Q4_1": (20, [0, 2], read_q4_1), "Q4_K": (144, [0, 2], read_q4_k),
    "Q5_0": (22, [0], read_q5_0), "Q5_K": (176, [0, 2], read_q5_k), "Q6_K": (210, [208], read_q6_k),
    "Q8_0": (34, [0], read_q8_0), "F16": (2, [], read_f16),
}
WEIGHTS_PER_BLOCK = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
BYTE_FORM = ("Q5_0", "Q5_K", "Q6_K", "Q8_0")  # read into signed-byte codes (Q8Linear)


def _random_raw(kind: str, rows: int, width: int, seed: int = 0) -> np.ndarray:
    """Random blocks of ``kind`` for a ``[rows, width]`` weight: random bytes, fp16 fields finite."""
    size, halves, _ = LAYOUTS[kind]
    rng = np.random.default_rng(seed)
    if kind == "F16":  # values, not blocks
        return (rng.standard_normal((rows, width)) * 0.05).astype(np.float16).view(np.uint8)
    blocks = width // WEIGHTS_PER_BLOCK.get(kind, 32)
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in halves:
        raw[..., at:at + 2] = (rng.standard_normal((rows, blocks, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, blocks * size)


def _runnable(isa: str) -> str:
    if isa not in cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernel (it runs {', '.join(cpu_isas())})")
    return isa


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_each_type_reads_into_the_kernel_forms_bit_for_bit(kind):
    raw = _random_raw(kind, rows=6, width=512)
    blocks = LAYOUTS[kind][2](raw)
    expected = gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(6, 512)
    assert isinstance(blocks, F16Linear if kind == "F16" else Q8Linear if kind in BYTE_FORM else Q4Linear)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32)))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K"])
def test_byte_blocks_beyond_q8_0_multiply_right_on_each_isa(kind, isa):
    """Q6_K's form (a scale per 16 weights) and Q5_K's (a min per 32 beside the scale): one row
    (decode, 70 output rows: the 4-row SIMD path and its remainder) and several rows, against
    x @ dequantize(W).T. Q5_K: a dropped min term shows, and int8 activations where VNNI runs."""
    lib = kernel(_runnable(isa))
    weight = LAYOUTS[kind][2](_random_raw(kind, rows=70, width=512, seed=3))
    assert (weight.block, weight.has_mins) == ((16, False) if kind == "Q6_K" else (32, True))
    g = torch.Generator().manual_seed(0)
    for m in (1, 5, 11):
        x = torch.randn(m, 512, generator=g)
        ref = (x.double() @ weight.dequantize().double().T).float()
        got = weight(x, lib=lib)
        torch.testing.assert_close(got, ref, atol=LINEAR_RTOL * ref.abs().max().item(), rtol=0)
        if weight.has_mins:
            without_mins = Q8Linear(weight.codes, weight.scales)(x, lib=lib)
            assert (without_mins - ref).abs().max() > 1e-2 * ref.abs().max()
    if weight.has_mins and lib.has_vnni():
        got = weight(x[:1], int8=True, lib=lib)
        torch.testing.assert_close(got, ref[:1], atol=2e-2 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("isa", ISAS)
def test_f16_weights_multiply_right_on_each_isa(isa):
    """An F16 linear (fp16 values, no blocks; a width that is not a multiple of the SIMD steps):
    one row and several rows against x @ W.T, the same bits either way."""
    lib = kernel(_runnable(isa))
    weight = read_f16(_random_raw("F16", rows=37, width=520, seed=6))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 520, generator=g)
    ref = (x.double() @ weight.dequantize().double().T).float()
    got = weight(x, lib=lib)
    torch.testing.assert_close(got, ref, atol=LINEAR_RTOL * ref.abs().max().item(), rtol=0)
    assert torch.equal(weight(x[3:4], lib=lib), got[3:4])


def _mixed_qwen2(heads: int = 8, head_dim: int = 64) -> QuantizedLlama:
    """A 2-layer random Qwen2 (q/k/v biases, one KV head for ``heads`` query heads: more than one
    attention pass takes, as the 0.5B's 7 at head_dim 64 and the 1.5B's 6 at 128; widths
    multiples of 256 for the K types) whose linears are random blocks of several types, one form
    per linear as a Q4_K_M file mixes them, and whose fp32 weights are their dequantized values."""
    model = tiny_model("qwen2", hidden_size=512, intermediate_size=768, num_attention_heads=heads,
                       num_key_value_heads=1, head_dim=head_dim, vocab_size=1024, tie_word_embeddings=False)
    seed = iter(range(100))

    def blocks(linear, kind):
        out, width = linear.weight.shape
        found = LAYOUTS[kind][2](_random_raw(kind, out, width, next(seed)))
        linear.weight.data.copy_(found.dequantize())
        return found

    layers = []
    for module, kinds in zip(model.model.layers, [("Q4_K", "Q6_K", "Q5_0", "Q4_0"), ("Q5_0", "Q8_0", "Q5_K", "F16")]):
        attn, mlp = module.self_attn, module.mlp
        for p in (attn.q_proj, attn.k_proj, attn.v_proj):
            p.bias.data.normal_(0, 0.5)
        q, k, v = blocks(attn.q_proj, kinds[0]), blocks(attn.k_proj, kinds[0]), blocks(attn.v_proj, kinds[1])
        bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()
        layers.append(_Layer(FusedBlocks.of([q, k, v], bias), blocks(attn.o_proj, kinds[2]),
                             FusedBlocks.of([blocks(mlp.gate_proj, kinds[3]), blocks(mlp.up_proj, kinds[2])]),
                             blocks(mlp.down_proj, kinds[1]), module))
    return QuantizedLlama(model, layers, blocks(model.lm_head, "Q6_K"))


@pytest.mark.parametrize("heads, head_dim", [(8, 64), (6, 128)])
@pytest.mark.parametrize("isa", ISAS)
def test_a_decoder_mixing_block_forms_with_biases_equals_transformers(isa, heads, head_dim, monkeypatch):
    """Prefill (dense path), a short append and a draft (one decoder call), decoded tokens and a
    packed refresh of scattered rows: logits equal transformers' forward on the same weights."""
    monkeypatch.setenv("KVMEMORY_ISA", _runnable(isa))
    fast = _mixed_qwen2(heads, head_dim)
    assert fast.isa == isa and len(fast.layers[0].qkv.parts) == 2  # q, k fused; v in another form
    ids = torch.randint(0, 1024, (140,), generator=torch.Generator().manual_seed(1))
    cache, ref = assert_engine_matches_forward(fast, ids, prefill=120, draft=7, rtol=RANDOM_RTOL)
    scale = ref.abs().max().item()

    rows = torch.tensor([3, 50, 90, 139])  # overwrite rows with the same tokens: the refresh recomputes them
    before = [layer.keys[..., :140, :].clone() for layer in cache.layers]
    for layer in cache.layers:
        layer.keys[..., rows, :] = 0
    last = fast.refresh_rows(cache, ids[rows], rows)
    assert last is not None
    torch.testing.assert_close(last, ref[139], atol=RANDOM_RTOL * scale, rtol=0)
    for layer, keys in zip(cache.layers, before):
        torch.testing.assert_close(layer.keys[..., :140, :], keys, atol=1e-4 * keys.abs().max().item(), rtol=0)


# ---- the real file ----

# the 0.5B comes with `make test`; the 1.5B (Q4_K / Q6_K only) where `make models` installed it
@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def qwen_file(request):
    from kvmemory_lab.gguf_models import MODELS, gguf_path

    try:
        return gguf_path(request.param)
    except ModelNotFoundError as exc:
        pytest.skip(f"{exc} ({MODELS[request.param].install_command()})")


@pytest.fixture(scope="module")
def qwen(qwen_file):
    return load_model(qwen_file)


def test_the_qwen_file_runs_on_the_engine_with_transformers_rows(qwen):
    """Qwen2.5-Coder 0.5B (Q5_0 / Q8_0 / Q4_K / Q6_K tensors) and 1.5B (Q4_K / Q6_K), q/k/v
    biases, untied heads: the engine attaches by default, and its prefill, short append, draft
    check and decoded tokens give transformers' logits and K/V rows."""
    assert qwen.engine == engine.EngineStatus("q4_1", isa=cpu_isas()[0])
    prompt = "def fibonacci(n):\n    '''Return the n-th Fibonacci number.'''\n    if n < 2:\n        return n\n"
    ids = torch.tensor(qwen.tokenizer(prompt * 6)["input_ids"][:140])
    fast, ref = kvcache.new_cache(qwen.model.config), kvcache.new_cache(qwen.model.config)
    got, want = [], []
    for start, end, every in [(0, 110, False), (110, 118, True), (118, 119, False), (119, 120, False), (120, 121, False)]:
        got.append(engine.forward_rows(qwen.model, fast, ids[start:end], start, every_row=every).reshape(-1, 151936))
        want.append(TransformersEngine(qwen.model).forward_rows(ref, ids[start:end], start, every_row=every).reshape(-1, 151936))
    assert type(engine.engine_for(qwen.model, fast)).__name__ == "QuantizedLlama"
    got, want = torch.cat(got), torch.cat(want)
    torch.testing.assert_close(got, want, atol=ROWS_RTOL * want.abs().max().item(), rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for a, b in zip(fast.layers, ref.layers):
        torch.testing.assert_close(a.keys[..., :121, :], b.keys, atol=1e-4 * b.keys.abs().max().item(), rtol=0)
        torch.testing.assert_close(a.values[..., :121, :], b.values, atol=1e-4 * b.values.abs().max().item(), rtol=0)


def test_the_qwen_files_have_only_types_the_engine_reads(qwen_file):
    import gguf

    from kvmemory.engine.gguf_blocks import READ_TYPES

    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(qwen_file)).tensors}
    assert kinds <= set(READ_TYPES) | {"F32"} and {"Q4_K", "Q6_K"} <= kinds


@pytest.fixture(scope="module")
def rewritten_embedded():
    """The embedded SmolLM2's GGUF with its ffn_down linears re-encoded as Q5_K and attn_output as
    F16 (types the packaged files lack), written once into kvmemory's cache folder."""
    from kvmemory.models import embedded_gguf_path
    from kvmemory.paths import cache_root

    from gguf_rewrite import rewrite_gguf

    target = cache_root() / "test-gguf" / "smollm2-135m-q5_k-f16.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.partial")
        rewrite_gguf(embedded_gguf_path(), partial, {r"blk\.\d+\.ffn_down\.weight": "Q5_K", r"blk\.\d+\.attn_output\.weight": "F16"})
        partial.replace(target)
    return load_model(target)


@pytest.mark.real_model
def test_a_real_model_with_q5_k_and_f16_linears_runs_on_the_engine(rewritten_embedded):
    """The embedded model's real weights in Q5_K (ffn_down) and F16 (attn_output) beside Q4_1: the
    engine attaches, its linears hold those forms, and prefill, a draft check and decoded tokens
    give transformers' logits and K/V rows."""
    loaded = rewritten_embedded
    assert loaded.engine == engine.EngineStatus("q4_1", isa=cpu_isas()[0])
    layer = engine.engine_for(loaded.model, kvcache.new_cache(loaded.model.config)).layers[0]
    assert isinstance(layer.o.parts[0], F16Linear) and layer.down.parts[0].has_mins
    ids = torch.tensor(loaded.tokenizer("The quick brown fox jumps over the lazy dog. " * 14)["input_ids"][:130])
    vocab = loaded.model.config.vocab_size
    fast, ref = kvcache.new_cache(loaded.model.config), kvcache.new_cache(loaded.model.config)
    got, want = [], []
    for start, end, every in [(0, 110, False), (110, 118, True), (118, 119, False), (119, 120, False)]:
        got.append(engine.forward_rows(loaded.model, fast, ids[start:end], start, every_row=every).reshape(-1, vocab))
        want.append(TransformersEngine(loaded.model).forward_rows(ref, ids[start:end], start, every_row=every).reshape(-1, vocab))
    got, want = torch.cat(got), torch.cat(want)
    torch.testing.assert_close(got, want, atol=ROWS_RTOL * want.abs().max().item(), rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for a, b in zip(fast.layers, ref.layers):
        torch.testing.assert_close(a.keys[..., :120, :], b.keys, atol=1e-4 * b.keys.abs().max().item(), rtol=0)
