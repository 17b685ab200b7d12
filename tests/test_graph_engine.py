"""The ``"cuda_graphs"`` engine off a GPU: its decode step is the packed traversal over capacity
buffers with a position mask (what a CUDA graph records), run eagerly here. It must compute what
the model's own forward computes; on a GPU the graph replays exactly these kernels."""

from __future__ import annotations

import pytest
import torch

from kvmemory import InputError, KVSession, engine, kvcache, load_model
from kvmemory.engine import graphs
from kvmemory.errors import EngineUnsupportedError
from kvmemory.engine import forward_rows
from kvmemory.models import embedded_gguf_path
from support import QUERY, history, reprefill_logits, tiny_loaded, tiny_model, without

TINY_ATOL = 1e-5  # fp32, 2 layers: attention over zero-weighted spare rows changes only the sum order
REAL_ATOL = 1e-3  # fp32, 30 layers (as the CPU engine's tolerance)


def _reference_steps(model, ids: torch.Tensor, prefill: int) -> tuple[list[torch.Tensor], list]:
    """Logits of a prefill then one token at a time, and the final K/V, on the model's forward."""
    cache = kvcache.new_cache(model.config)
    logits = [forward_rows(model, cache, ids[:prefill], 0)]
    logits += [forward_rows(model, cache, ids[i : i + 1], i) for i in range(prefill, ids.shape[0])]
    return logits, kvcache.layer_tensors(cache)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_graph_step_computes_what_the_model_forward_computes(family):
    model = tiny_model(family)
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(1))
    expected, rows = _reference_steps(model, ids, 30)
    decoder = graphs.GraphDecoder(model, capture=False)
    cache = kvcache.new_cache(model.config)
    got = [decoder.forward_rows(cache, ids[:30], 0, capacity=64)]
    got += [decoder.forward_rows(cache, ids[i : i + 1], i) for i in range(30, 40)]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=TINY_ATOL, rtol=0)
    for (k, v), (k2, v2) in zip(kvcache.layer_tensors(cache), rows):
        torch.testing.assert_close(k, k2, atol=TINY_ATOL, rtol=0)
        torch.testing.assert_close(v, v2, atol=TINY_ATOL, rtol=0)
    every = decoder.forward_rows(cache, ids[:3], 40, every_row=True)  # a draft: every row's logits
    assert every.shape == (3, 49152)


def test_the_graph_step_on_the_real_model_equals_its_forward(real):
    engine.attach(real.model, None, "transformers")
    try:
        ids = torch.tensor(real.tokenizer("The lighthouse keeper wrote down the weather every hour.")["input_ids"])
        expected, _ = _reference_steps(real.model, ids, ids.shape[0] - 4)
        decoder = graphs.GraphDecoder(real.model, capture=False)
        cache = kvcache.new_cache(real.model.config)
        got = [decoder.forward_rows(cache, ids[:-4], 0)]
        got += [decoder.forward_rows(cache, ids[i : i + 1], i) for i in range(ids.shape[0] - 4, ids.shape[0])]
    finally:
        engine.attach(real.model, embedded_gguf_path(), "auto")
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=REAL_ATOL, rtol=0)


def test_a_session_on_the_graph_engine_repairs_and_answers_like_transformers(monkeypatch):
    """Attached (the GPU check stubbed out: here the step runs eagerly), every append and decoded
    token runs on the engine: answers, a deletion repair and Replay equal the transformers
    engine's; an adapter-like module swap hands the model back to transformers."""
    reference = tiny_loaded("graph-reference")
    loaded = tiny_loaded("graph-engine")
    monkeypatch.setattr(graphs, "unsupported_reason", lambda model: None)
    assert engine.attach(loaded.model, None, "cuda_graphs").name == "cuda_graphs"
    sessions = [KVSession(m.model, m.tokenizer, policy="sur@5") for m in (reference, loaded)]
    answers = []
    for session in sessions:
        session.prepare(history() + [QUERY])
        first = session.generate(5).token_ids
        session.prepare(without(history() + [QUERY], "t1"))
        answers.append((first, session.generate(5).token_ids))
        session.check_invariants()
    assert answers[0] == answers[1]
    assert isinstance(engine.engine_for(loaded.model, sessions[1].cache), graphs.GraphDecoder)
    torch.testing.assert_close(sessions[1].next_logits, sessions[0].next_logits, atol=TINY_ATOL, rtol=0)
    replay = KVSession(loaded.model, loaded.tokenizer, policy="replay")
    replay.prepare(history() + [QUERY])
    replay.prepare(without(history() + [QUERY], "t1"))
    torch.testing.assert_close(replay.next_logits, reprefill_logits(loaded.model, replay.token_ids), atol=TINY_ATOL, rtol=0)
    loaded.model.model.layers[0].mlp.down_proj = torch.nn.Linear(128, 64, bias=False)
    assert engine.status(loaded.model).name == "transformers"
    assert "replaced" in engine.status(loaded.model).reason


def test_the_graph_engine_says_how_to_attach_it(real):
    with pytest.raises(EngineUnsupportedError, match=r"model.to\('cuda'\)"):
        engine.attach(tiny_model(), None, "cuda_graphs")
    before = engine.status(real.model)
    with pytest.raises(EngineUnsupportedError, match="keeps engine 'q4_1'"):
        engine.attach(real.model, None, "cuda_graphs")
    assert engine.status(real.model) == before  # a refused request leaves the working engine
    with pytest.raises(InputError, match="ChatKVMemory\\(device='cuda', engine='cuda_graphs'\\)"):
        load_model(engine="cuda_graphs")
