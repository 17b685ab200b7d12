"""The quantized engine: same results as transformers' forward on the same weights, and every
guarantee of the session on top of it (Replay equals Re-prefill, forks, exports, adapters)."""

from __future__ import annotations

import pytest
import torch

from kvmemory import InputError, KVSession, engine, kvcache, load_model
from kvmemory.engine.buffers import CacheBuffers
from kvmemory.engine.quantized import Q4Linear, Q8Linear
from kvmemory.errors import EngineUnsupportedError
from kvmemory.executors.sequential import forward_rows
from kvmemory.models import embedded_gguf_path
from support import QUERY, history, reprefill_logits, tiny_model, without

# fp32 with another summation order than transformers' GEMMs: measured 2e-5 .. 5e-5 on logits of
# magnitude ~20 (30 layers); a wrong row, position or weight moves logits by > 0.1.
LOGITS_ATOL = 1e-3
ROWS_ATOL = 1e-4


def _random_q4(rows: int, width: int, seed: int = 0) -> Q4Linear:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, width // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(rows, width // 32, generator=g) * 0.02
    mins = -torch.rand(rows, width // 32, generator=g) * 0.1
    return Q4Linear(codes, scales, mins)


@pytest.mark.parametrize("rows,m", [(37, 1), (64, 3), (21, 13)])
def test_q4_kernel_equals_the_dequantized_product(rows, m):
    weight = _random_q4(rows, 96)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(weight(x), x @ weight.dequantize().T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 10])
def test_q8_kernel_equals_the_dequantized_product(m):
    g = torch.Generator().manual_seed(2)
    weight = Q8Linear(torch.randint(-128, 128, (45, 64), generator=g, dtype=torch.int8), torch.rand(45, 2, generator=g))
    x = torch.randn(m, 64, generator=g)
    torch.testing.assert_close(weight(x), x @ weight.dequantize().T, atol=1e-4, rtol=1e-5)


def test_embedded_model_runs_on_its_gguf_blocks(real):
    assert real.engine == engine.EngineStatus("q4_1")
    assert engine.status(real.model).name == "q4_1"


def _prompt(real, n: int) -> torch.Tensor:
    text = " ".join(m["content"] for m in history()) * 4
    ids = real.tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[:n])


def test_prefill_append_and_decode_equal_transformers(real):
    ids = _prompt(real, 160)
    fast = kvcache.new_cache(real.model.config)
    assert engine.engine_for(real.model, fast) is not None
    logits = [forward_rows(real.model, fast, ids[:120], 0), forward_rows(real.model, fast, ids[120:125], 120)]
    logits += [forward_rows(real.model, fast, ids[i : i + 1], i) for i in range(125, 160)]
    # reference: transformers' own forward (no cache) at each position
    with torch.no_grad():
        ref = real.model(input_ids=ids[None]).logits[0].float()
    ends = [119, 124] + list(range(125, 160))
    for got, end in zip(logits, ends):
        torch.testing.assert_close(got, ref[end], atol=LOGITS_ATOL, rtol=0)
    plain = kvcache.new_cache(real.model.config)
    with torch.no_grad():
        real.model(input_ids=ids[None], cache=plain, use_cache=True)
    for (k, v), (k2, v2) in zip(kvcache.layer_tensors(fast), kvcache.layer_tensors(plain)):
        torch.testing.assert_close(k, k2, atol=ROWS_ATOL, rtol=0)
        torch.testing.assert_close(v, v2, atol=ROWS_ATOL, rtol=0)


def test_greedy_answers_equal_the_transformers_engine(real):
    messages = history()
    fast = KVSession(real.model, real.tokenizer)
    fast.prepare(messages)
    fast_answer = fast.generate(24).token_ids
    engine.attach(real.model, embedded_gguf_path(), "transformers")
    try:
        slow = KVSession(real.model, real.tokenizer)
        report = slow.prepare(messages)
        assert report.engine == {"name": "transformers", "reason": None}
        assert slow.generate(24).token_ids == fast_answer
    finally:
        engine.attach(real.model, embedded_gguf_path(), "q4_1")


def test_replay_after_a_deletion_on_engine_rows_equals_reprefill(real):
    session = KVSession(real.model, real.tokenizer, policy="replay")
    session.prepare(history() + [QUERY])
    session.generate(12)
    report = session.prepare(without(history() + [QUERY], "t1"))
    assert report.engine["name"] == "q4_1"
    torch.testing.assert_close(session.next_logits, reprefill_logits(real.model, session.token_ids), atol=LOGITS_ATOL, rtol=0)
    session.check_invariants()


def test_forks_and_exports_do_not_share_engine_buffers(real):
    session = KVSession(real.model, real.tokenizer)
    session.prepare(history())
    session.generate(4)
    other = session.fork()
    rows = len(other.token_ids)
    before = [k.clone() for k, _ in kvcache.layer_tensors(other.cache)]
    session.generate(6)  # writes rows after the fork's last row into the session's own buffer
    for k, (k2, _) in zip(before, kvcache.layer_tensors(other.cache)):
        assert torch.equal(k, k2)
    assert other.generate(6).token_ids == session.token_ids[rows : rows + 6]


def test_a_replaced_layer_gets_a_fresh_buffer():
    buffers = CacheBuffers(kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    cache = kvcache.from_tensors([(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))])
    storage = buffers.reserve(cache, 3, 1)
    buffers.publish(cache, storage, 4)
    kept = cache.layers[0].keys
    cache.crop(-2)  # someone else replaces the published view
    again = buffers.reserve(cache, 2, 1)
    assert again.all_keys.data_ptr() != storage.all_keys.data_ptr()
    again.all_keys[0, :, :, 2] = 7.0
    assert not (kept == 7.0).any()
    with pytest.raises(ValueError, match="holds 2 rows"):
        buffers.reserve(cache, 5, 1)


def test_modified_weights_and_adapters_fall_back_to_transformers():
    loaded = load_model()
    model = loaded.model
    ids = torch.tensor([1, 2, 3, 4, 5])
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.mul_(1.01)
    status = engine.status(model)
    assert status.name == "transformers" and "modified in place" in status.reason
    cache = kvcache.new_cache(model.config)
    assert engine.engine_for(model, cache) is None
    torch.testing.assert_close(forward_rows(model, cache, ids, 0), reprefill_logits(model, ids), atol=1e-4, rtol=0)
    with pytest.raises(EngineUnsupportedError, match="not the GGUF file's blocks"):
        engine.attach(model, embedded_gguf_path(), "q4_1")


def test_a_lora_adapter_runs_on_transformers(real):
    peft = pytest.importorskip("peft")
    loaded = load_model()
    model = peft.get_peft_model(loaded.model, peft.LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False))
    status = engine.status(loaded.model)
    assert status.name == "transformers" and "LoRA" in status.reason
    session = KVSession(model, loaded.tokenizer)
    report = session.prepare(history()[:2])
    assert report.engine["name"] == "transformers"
    torch.testing.assert_close(session.next_logits, reprefill_logits(model, session.token_ids), atol=1e-4, rtol=0)


def test_bad_engine_requests_say_why():
    with pytest.raises(InputError, match="engine must be one of"):
        load_model(engine="fast")
    tiny = tiny_model("llama")
    with pytest.raises(EngineUnsupportedError, match="no GGUF file"):
        engine.attach(tiny, "/nonexistent.gguf", "q4_1")
    assert engine.attach(tiny, embedded_gguf_path(), "auto").name == "transformers"
    assert "not the GGUF file's blocks" in engine.status(tiny).reason or "shape" in engine.status(tiny).reason
