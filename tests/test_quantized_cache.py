"""Caches that cannot be written row by row (transformers ``QuantizedCache``, or any cache whose
layers are not plain tensor layers): strict erase and CacheReforge maintenance take the exact
fallback (Re-prefill into a fresh cache of the same kind, reported), and memory accounting counts
the storage they really hold.

Backends: transformers' own ``fp8`` backend (pure PyTorch, no extra package; quanto and hqq are
not installed here) and a minimal int8 backend built on transformers' public ``QuantizedLayer``
(packed payload + full-precision residual buffer, the quanto / hqq layout)."""

from __future__ import annotations

import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import QuantizedCache
from transformers.cache_utils import Cache, QuantizedLayer

from kvmemory import kvcache
from kvmemory.engine import forward_rows
from kvmemory_lab.invariants import memory_violations
from kvmemory.reforge.state import ReforgeConfig
from kvmemory.session import KVSession
from support import QUERY, history, tiny_model, without

MSGS = history() + [QUERY]
ATOL = 1e-5  # fp32; the fallback and the reference run the same forwards on the same kind of cache


class Int8ResidualLayer(QuantizedLayer):
    """Per-tensor int8 payload + a 16-row full-precision residual buffer (test backend)."""

    def __init__(self):
        super().__init__(nbits=8, residual_length=16)

    def _quantize(self, tensor, axis):
        scale = tensor.abs().amax().clamp(min=1e-8) / 127
        return (tensor / scale).round().to(torch.int8), scale

    def _dequantize(self, qtensor):
        data, scale = qtensor
        return data.float() * scale


def fp8_cache(config):
    return QuantizedCache("fp8", config)


def int8_cache(config):
    return Cache(layers=[Int8ResidualLayer() for _ in range(config.num_hidden_layers)])


BACKENDS = {"fp8": fp8_cache, "int8-residual": int8_cache}


def nonzero(t: torch.Tensor) -> bool:
    return bool(t.float().abs().sum() > 0)  # fp8 has no sum of its own


def layer_kinds(cache) -> list[type]:
    return [type(layer) for layer in cache.layers]


def fresh(model, tokenizer, factory, msgs, **kwargs) -> KVSession:
    """The reference: a fresh session prefilling ``msgs`` into an empty cache of the same kind."""
    s = KVSession(model, tokenizer, "reprefill", cache_factory=factory, **kwargs)
    s.prepare(msgs)
    return s


def assert_same_cache_content(model, a: KVSession, b: KVSession) -> None:
    """Next-token logits agree, and so does one decode step through each cache (it reads the
    stored, quantized rows: equal logits mean equal cache contents)."""
    torch.testing.assert_close(a.next_logits, b.next_logits, rtol=0, atol=ATOL)
    token = torch.tensor([int(torch.argmax(b.next_logits))])
    n = len(b.token_ids)
    step_a = forward_rows(model, kvcache.clone_cache(a.cache), token, n)
    step_b = forward_rows(model, kvcache.clone_cache(b.cache), token, n)
    torch.testing.assert_close(step_a, step_b, rtol=0, atol=ATOL)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def lora_llama(layer: int, module: str):
    model = tiny_model("llama", num_hidden_layers=4)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=[module],
                                            layers_to_transform=[layer])).eval()


def nudge(model, scale: float = 0.5) -> None:
    """An adapter update: move every LoRA B."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


# ------------------------------------------------------------------ strict erase
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_strict_erase_reprefills_into_a_cache_of_the_same_kind(llama, tokenizer, backend, caplog):
    factory = BACKENDS[backend]
    s = KVSession(llama, tokenizer, "sur@5", cache_factory=factory)
    s.prepare(MSGS)
    kinds, rows = layer_kinds(s.cache), len(s.token_ids)
    old = [t for layer in s.cache.layers for t in kvcache.held_tensors(layer)]
    assert old and any(nonzero(t) for t in old)
    fork = s.fork()
    with caplog.at_level(logging.WARNING, logger="kvmemory.session"):
        report = s.delete_message("t2", erase="strict")

    assert layer_kinds(s.cache) == kinds and s.cache is not fork.cache
    assert kinds[0].__name__ in report.fallback and "Re-prefill" in report.fallback
    assert any(kinds[0].__name__ in r.getMessage() for r in caplog.records)  # logged too
    assert report.erased["from_row"] == 0 and report.erased["rows_overwritten"] == rows
    assert report.erased["rows_recomputed"] == len(s.token_ids) == report.recomputed_tokens
    assert not any(nonzero(t) for t in old)  # the old storage itself is overwritten
    s.check_invariants()
    ref = fresh(llama, tokenizer, factory, without(MSGS, "t2"))
    assert_same_cache_content(llama, s, ref)
    assert fork.memory_bytes > 0 and fork.generate(3).token_ids  # the fork kept its own copy


# ---------------------------------------------------------- CacheReforge maintenance
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("layer,module,action", [(2, "v_proj", "full_suffix"), (3, "down_proj", "reuse")],
                         ids=["cache-layers-invalid", "only-the-logits-stale"])
def test_adapter_update_reprefills_into_a_cache_of_the_same_kind(tokenizer, backend, layer, module, action):
    factory = BACKENDS[backend]
    model = lora_llama(layer, module)
    s = KVSession(model, tokenizer, "replay", reforge=ReforgeConfig(), cache_factory=factory)
    s.prepare(MSGS)
    kinds, stale = layer_kinds(s.cache), s.next_logits
    nudge(model)
    report = s.maintain()

    assert report.action == action and not report.mixed
    assert layer_kinds(s.cache) == kinds
    assert kinds[0].__name__ in report.fallback and "re-prefills" in report.fallback
    ref = fresh(model, tokenizer, factory, MSGS, reforge=ReforgeConfig())
    assert (ref.next_logits - stale).abs().max() > 1e-3, "the update does not matter: the test could not fail"
    assert_same_cache_content(model, s, ref)
    assert s.exact_rows == len(s.token_ids)
    assert s.maintain().fallback is None  # nothing left to maintain, nothing to report


# --------------------------------------------------------------------- memory
def test_memory_bytes_counts_the_fp8_payload(llama, tokenizer):
    s = KVSession(llama, tokenizer, cache_factory=fp8_cache)
    s.prepare(MSGS)
    plain = KVSession(llama, tokenizer)
    plain.prepare(MSGS)
    cfg = llama.config
    elements = cfg.num_hidden_layers * 2 * len(s.token_ids) * cfg.num_key_value_heads * cfg.head_dim
    scales = cfg.num_hidden_layers * 2 * 4  # one fp32 scale per layer for K and for V
    assert s.memory_bytes == elements * 1 + scales  # 1 byte per fp8 element
    assert plain.memory_bytes == elements * 4 and s.memory_bytes < plain.memory_bytes / 3.9
    assert memory_violations(s) == []  # invariant (c) counts the same storage


def test_memory_bytes_counts_payload_and_residual_buffer(llama, tokenizer):
    s = KVSession(llama, tokenizer, cache_factory=int8_cache)
    s.prepare(MSGS)
    s.generate(5)  # decode rows land in the full-precision residual buffer
    cfg, n = llama.config, len(s.token_ids)
    per_row = cfg.num_key_value_heads * cfg.head_dim
    expected = 0
    for layer in s.cache.layers:
        residual = layer.keys.shape[-2]
        assert 0 < residual < n
        expected += 2 * ((n - residual) * per_row * 1 + 4 + residual * per_row * 4)  # int8 + scale, fp32 rows
    assert s.memory_bytes == expected > 0 and memory_violations(s) == []


def test_rows_are_never_cropped_from_a_quantized_cache(llama, tokenizer):
    s = KVSession(llama, tokenizer, cache_factory=fp8_cache)
    s.prepare(MSGS)
    n = kvcache.cache_length(s.cache)
    kvcache.crop_to(s.cache, n)  # nothing to drop: fine
    with pytest.raises(ValueError, match="not croppable"):
        kvcache.crop_to(s.cache, n - 1)
    assert kvcache.cache_length(s.cache) == n


def test_the_call_that_maintains_a_quantized_cache_reports_the_fallback(tokenizer):
    model = lora_llama(2, "v_proj")
    s = KVSession(model, tokenizer, "sur@5", reforge=ReforgeConfig(), cache_factory=BACKENDS["fp8"])
    assert s.prepare(MSGS).adapter is None  # no adapter change before the first call
    nudge(model)
    report = s.prepare(MSGS)
    assert report.adapter["fallback"] and "re-prefills" in report.adapter["fallback"]
    assert report.fallback == report.adapter["fallback"]  # log + report: the call says it was recomputed
    assert s.prepare(MSGS).adapter is None  # nothing changed since: nothing maintained, nothing reported
