"""Batched decoding: one kernel call decodes a token for each of several threads' caches, each
row bit for bit the row the thread's own decode step gives (same arithmetic, every block read
once for all rows), on every instruction set the CPU runs and on the embedded model."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvmemory import kvcache
from kvmemory.engine import DecodeBatcher, engine_for
from kvmemory.engine.quantized import ISAS
from kvmemory.errors import InputError
from kvmemory.session import KVSession
from test_engine_qwen import _mixed_qwen2, _runnable


def _prefilled(fast, prompts: list[torch.Tensor]) -> list:
    caches = []
    for ids in prompts:
        cache = kvcache.new_cache(fast.model.config)
        fast.forward_rows(cache, ids, 0, capacity=ids.shape[0] + 16)
        caches.append(cache)
    return caches


def assert_batched_equals_alone(fast, prompts: list[torch.Tensor], steps: int, vocab: int, drafts: bool = False) -> None:
    """Greedy decode every prompt alone (one forward per step) and all together (one batched call
    per step) from identical caches: every step's logits and every cached row equal exactly.
    ``drafts``: cache i's step s also verifies (i + s) % 4 draft tokens (up to 4 rows a cache)."""
    alone, together = _prefilled(fast, prompts), _prefilled(fast, prompts)
    tokens = [int(ids[-1]) for ids in prompts]  # each thread's next token: its prompt's last
    starts = [int(ids.shape[0]) for ids in prompts]
    gen = torch.Generator().manual_seed(len(prompts))
    for step in range(steps):
        inputs = [torch.tensor([t] + (torch.randint(0, 1000, ((i + step) % 4,), generator=gen).tolist() if drafts else []))
                  for i, t in enumerate(tokens)]
        want = [fast.forward_rows(c, inputs[i], starts[i], capacity=starts[i] + 4 * steps, every_row=True)
                for i, c in enumerate(alone)]
        got = fast.decode_batch(together, inputs, starts, [s + 4 * steps for s in starts])
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.shape == (inputs[i].shape[0], vocab)
            assert torch.equal(g, w), f"step {step}, cache {i}: max diff {(g - w).abs().max().item()}"
        starts = [s + ids.shape[0] for s, ids in zip(starts, inputs)]
        tokens = [int(w[-1].argmax()) % 1000 for w in want]
    for a, b in zip(alone, together):
        for la, lb in zip(a.layers, b.layers):
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 3, 6])
def test_batched_rows_equal_each_threads_own_step_on_every_isa(isa, threads, monkeypatch):
    """A random Qwen2 mixing every block form with biases; 1, 3 and 6 threads' caches of
    different lengths (6 > the 4 rows one pass of the blocks takes)."""
    monkeypatch.setenv("KVMEMORY_ISA", _runnable(isa))
    fast = _mixed_qwen2()
    gen = torch.Generator().manual_seed(threads)
    prompts = [torch.randint(0, 1000, (20 + 13 * i,), generator=gen) for i in range(threads)]
    assert_batched_equals_alone(fast, prompts, steps=5, vocab=1024)


@pytest.mark.parametrize("isa", ISAS)
def test_drafts_batch_with_other_threads_rows_on_every_isa(isa, monkeypatch):
    """Threads verifying 0-3 draft tokens beside others' single tokens: each thread's rows equal
    its own forward of the token and its draft."""
    monkeypatch.setenv("KVMEMORY_ISA", _runnable(isa))
    fast = _mixed_qwen2()
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1000, (20 + 13 * i,), generator=gen) for i in range(5)]
    assert_batched_equals_alone(fast, prompts, steps=4, vocab=1024, drafts=True)


def test_a_batch_takes_at_most_four_tokens_of_a_cache():
    fast = _mixed_qwen2()
    cache = _prefilled(fast, [torch.arange(10)])[0]
    with pytest.raises(InputError, match="forward_rows"):
        fast.decode_batch([cache], [torch.arange(5)], [10])


@pytest.mark.real_model
def test_batched_rows_equal_each_threads_own_step_on_the_embedded_model(real):
    fast = engine_for(real.model, kvcache.new_cache(real.model.config))
    assert fast.kind == "q4_1"
    prompts = [torch.tensor(real.tokenizer(text)["input_ids"]) for text in
               ("The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a small village by the sea,",
                "List three colours:")]
    assert_batched_equals_alone(fast, prompts, steps=6, vocab=real.model.config.vocab_size)


# ---- sessions decoding at the same time (the batcher) ----

QUESTIONS = ["Name three fruits.", "What is the capital of Italy?", "Write a haiku about rain.",
             "Count from one to five.", "What colour is the sky?", "Say hello in French.",
             "Give me a word that rhymes with cat.", "What is two plus two?"]


def _answers_alone(real, questions, tokens: int, lookup: int = 0) -> list[tuple[list[int], torch.Tensor]]:
    out = []
    for q in questions:
        s = KVSession(real.model, real.tokenizer, prompt_lookup=lookup)
        s.prepare([{"role": "user", "content": q}])
        out.append((s.generate(tokens).token_ids, s._row_logits[1].clone()))
    return out


def _answers_together(real, questions, tokens: int, batcher, delays=None, lookup: int = 0) -> list[tuple[list[int], torch.Tensor]]:
    sessions = [KVSession(real.model, real.tokenizer, prompt_lookup=lookup, batcher=batcher) for _ in questions]
    for s, q in zip(sessions, questions):
        s.prepare([{"role": "user", "content": q}])
    results: list = [None] * len(questions)
    start = threading.Barrier(len(questions))

    def run(i):
        start.wait()
        if delays:
            time.sleep(delays[i])
        results[i] = (sessions[i].generate(tokens).token_ids, sessions[i]._row_logits[1].clone())

    workers = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    return results


@pytest.mark.real_model
@pytest.mark.parametrize("threads", [1, 2, 4, 8])
def test_threads_decoding_together_get_their_answers_alone_bit_for_bit(real, threads):
    batcher = DecodeBatcher(real.model)
    questions = QUESTIONS[:threads]
    alone = _answers_alone(real, questions, 16)
    together = _answers_together(real, questions, 16, batcher)
    for (ids_a, logits_a), (ids_b, logits_b) in zip(alone, together):
        assert ids_a == ids_b and torch.equal(logits_a, logits_b)
    if threads > 1:
        assert batcher.batches > 0 and batcher.batched_rows >= 2 * batcher.batches


@pytest.mark.real_model
def test_threads_joining_mid_answer_get_their_answers_alone(real):
    batcher = DecodeBatcher(real.model)
    questions = QUESTIONS[:4]
    alone = _answers_alone(real, questions, 24)
    together = _answers_together(real, questions, 24, batcher, delays=[0.0, 0.05, 0.1, 0.2])
    for (ids_a, logits_a), (ids_b, logits_b) in zip(alone, together):
        assert ids_a == ids_b and torch.equal(logits_a, logits_b)
    assert batcher.batches > 0


@pytest.mark.real_model
def test_threads_verifying_drafts_batch_them_and_get_their_answers_alone(real, monkeypatch):
    """Prompt lookup on (2 draft tokens): answers that copy their question verify drafts inside
    the batched calls, and every answer and last logits equal the thread's answer alone."""
    batcher = DecodeBatcher(real.model)
    questions = ["Repeat exactly: the quick brown fox jumps over the lazy dog.", "Repeat exactly: red, green, blue, red, green, blue.",
                 "Copy this line: import numpy as np; import torch as th", QUESTIONS[1]]
    alone = _answers_alone(real, questions, 24, lookup=2)
    fast = engine_for(real.model, kvcache.new_cache(real.model.config))
    rows_per_cache: list[int] = []
    decode_batch = fast.decode_batch

    def recording(caches, token_ids, *args, **kwargs):
        rows_per_cache.extend(ids.shape[0] for ids in token_ids)
        return decode_batch(caches, token_ids, *args, **kwargs)

    monkeypatch.setattr(fast, "decode_batch", recording)
    together = _answers_together(real, questions, 24, batcher, lookup=2)
    for (ids_a, logits_a), (ids_b, logits_b) in zip(alone, together):
        assert ids_a == ids_b and torch.equal(logits_a, logits_b)
    assert batcher.batches > 0 and max(rows_per_cache) > 1  # some batch verified a draft


@pytest.mark.real_model
def test_chat_model_calls_from_several_python_threads_batch_their_steps():
    """ChatKVMemory invoked from four Python threads at once (as LangGraph runs branches): each
    reply equals the reply of the same call made alone, and the steps ran batched."""
    from langchain_core.messages import HumanMessage

    from langchain_kvmemory import ChatKVMemory

    llm = ChatKVMemory(max_tokens=32, prompt_lookup=0, batch_decoding=True)
    questions = QUESTIONS[:4]
    alone = [llm.invoke([HumanMessage(q)], thread_id=f"alone-{i}").content for i, q in enumerate(questions)]
    batcher = llm.threads_for().batcher
    before = batcher.batches
    replies: list = [None] * 4
    start = threading.Barrier(4)

    def ask(i):
        start.wait()
        replies[i] = llm.invoke([HumanMessage(questions[i])], thread_id=f"together-{i}").content

    workers = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert replies == alone
    assert batcher.batches > before
    assert ChatKVMemory().threads_for().batcher is None  # opt-in


@pytest.mark.real_model
async def test_chat_model_calls_from_asyncio_tasks_batch_their_steps():
    """Four ainvoke calls gathered on one event loop (LangChain runs each in its executor): the
    replies equal the calls made one at a time, and steps ran batched."""
    import asyncio

    from langchain_core.messages import HumanMessage

    from langchain_kvmemory import ChatKVMemory

    llm = ChatKVMemory(max_tokens=32, prompt_lookup=0, batch_decoding=True)
    questions = QUESTIONS[4:8]
    alone = [llm.invoke([HumanMessage(q)], thread_id=f"solo-{i}").content for i, q in enumerate(questions)]
    batcher = llm.threads_for().batcher
    before = batcher.batches
    replies = await asyncio.gather(*(llm.ainvoke([HumanMessage(q)], thread_id=f"task-{i}")
                                     for i, q in enumerate(questions)))
    assert [r.content for r in replies] == alone
    assert batcher.batches > before
