"""Dense weights released while the block engine serves a model (kvmemory.engine.dense): every
path that needs a dense weight gets exactly the value the model held."""

from __future__ import annotations

import threading

import pytest
import torch

from kvmemory import kvcache
from kvmemory.engine import release_dense
from kvmemory.engine.quantized import ISAS, kernel
from kvmemory.models import load_model
from kvmemory.reforge.versions import base_weights_digest
from kvmemory.session import KVSession
from test_engine_qwen import LAYOUTS, _mixed_qwen2, _random_raw, _runnable

EMPTY = torch.empty(0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_a_block_weight_dequantizes_to_its_values_bit_for_bit(kind, isa):
    """Every block form, whole and a row range, fresh and into a larger reused buffer."""
    lib = kernel(_runnable(isa))
    blocks = LAYOUTS[kind][2](_random_raw(kind, rows=37, width=512, seed=5))
    expected = blocks.dequantize()
    mins = getattr(blocks, "mins", EMPTY)
    assert torch.equal(lib.dequantize_rows(blocks.codes, blocks.scales, mins, 0, 37, EMPTY), expected)
    buffer = torch.full((40 * 512,), float("nan"))
    assert torch.equal(lib.dequantize_rows(blocks.codes, blocks.scales, mins, 5, 21, buffer), expected[5:21])


@pytest.fixture
def engines():
    """The same random Qwen2 on blocks twice (q/k fused beside v in another form, an untied Q6_K
    head): the first with its dense weights released."""
    released, kept = _mixed_qwen2(), _mixed_qwen2()
    assert released.release_dense() > 0 and released.release_dense() == 0  # once
    return released, kept


def _linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_released_weights_leave_only_the_embedding_and_compute_the_same_rows(engines):
    """Prefill (dense path, dequantized per call), a draft and decoded tokens give the logits and
    K/V of the engine that kept its weights, bit for bit."""
    released, kept = engines
    assert all(m.weight.numel() == 0 for m in _linears(released.model))  # the untied head too
    assert released.model.get_input_embeddings().weight.numel() > 0
    assert released.unsupported_reason() is None  # the weight watch sees the same parameters
    ids = torch.randint(0, 1024, (130,), generator=torch.Generator().manual_seed(2))
    caches = []
    for engine in engines:
        cache = kvcache.new_cache(engine.model.config)
        logits = [engine.forward_rows(cache, ids[:120], 0), *engine.forward_rows(cache, ids[120:126], 120, every_row=True)]
        logits += [engine.forward_rows(cache, ids[i:i + 1], i) for i in range(126, 130)]
        caches.append((cache, torch.stack(logits)))
    (cache_r, logits_r), (cache_k, logits_k) = caches
    assert torch.equal(logits_r, logits_k)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(cache_r.layers, cache_k.layers))


def test_a_long_packed_refresh_runs_on_dequantized_weights(engines):
    """Refreshing more rows than the block path takes: the engine offers per-call dense linears
    (the kept engine's modules compute the same products)."""
    released, kept = engines
    rows = released.dense_from_rows + 10
    dense = released.block_linears(rows)
    assert dense is not None and kept.block_linears(rows) is None
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(3))
    attn = kept.layers[0].module.self_attn
    expected = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    assert torch.equal(dense.layers[0][0](x), expected)
    assert all(m.weight.numel() == 0 for m in _linears(released.model))


def test_transformers_forward_state_dict_and_digest_see_the_weights(engines):
    released, kept = engines
    ids = torch.randint(0, 1024, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(released.model(ids).logits, kept.model(ids).logits)
    assert all(m.weight.numel() == 0 for m in _linears(released.model))  # dropped again after the forward
    state, reference = released.model.state_dict(), kept.model.state_dict()
    assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state)
    assert all(m.weight.numel() == 0 for m in _linears(released.model))
    assert base_weights_digest(released.model) == base_weights_digest(kept.model)


def test_concurrent_forwards_on_released_weights_are_safe(engines):
    """Threads running transformers' forward at once share each materialized weight (counted)."""
    released, kept = engines
    ids = torch.randint(0, 1024, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = kept.model(ids).logits
    failures = []

    def run():
        for _ in range(5):
            with torch.no_grad():
                if not torch.equal(released.model(ids).logits, expected):
                    failures.append("differs")

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and all(m.weight.numel() == 0 for m in _linears(released.model))


def test_training_and_load_state_dict_bring_the_weights_back(engines):
    released, kept = engines
    ids = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(6))
    loss = released.model(ids).logits.float().square().mean()  # autograd keeps what it used
    loss.backward()
    assert released.model.model.layers[0].mlp.down_proj.weight.grad is not None
    released.restore_dense("test")
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(_linears(released.model), _linears(kept.model)))
    assert released.release_dense() > 0
    released.model.load_state_dict(kept.model.state_dict())  # restores first, then writes
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(_linears(released.model), _linears(kept.model)))
    assert not released.dense.released


def test_the_embedded_model_loads_released_and_answers_as_with_its_dense_weights():
    """The real model: load_model releases (all 211 linears but the tied head: ~405 MiB) and a
    2 K prefill gives the logits of the model that kept them, bit for bit."""
    released, kept = load_model(), load_model(keep_dense=True)
    assert released.released_bytes > 400 * 2**20 and kept.released_bytes == 0
    assert release_dense(released.model) == 0
    messages = [{"role": "user", "content": "Tell me about the river and its mills. " * 180}]
    logits = []
    for lm in (released, kept):
        session = KVSession(lm.model, lm.tokenizer)
        session.prepare(messages)
        assert session.cache.get_seq_length() > 1500
        logits.append(session.next_logits)
    assert torch.equal(*logits)


def test_a_write_into_a_released_weight_is_refused_not_lost(engines):
    released, _ = engines
    with torch.no_grad():
        released.model.model.layers[1].mlp.down_proj.weight.mul_(1.01)  # an empty tensor: nothing written
    assert "modified in place" in released.unsupported_reason()
    with pytest.raises(RuntimeError, match="keep_dense=True"):
        released.model(torch.tensor([[1, 2, 3]]))
