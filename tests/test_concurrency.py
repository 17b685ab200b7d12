"""Concurrency: many LangGraph threads against one model and one saver. Caches bit-identical to
solo runs, a memory budget that concurrent calls never exceed, evicted threads that resume from
their blob or re-prefill exactly."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from langchain_core.messages import HumanMessage

from kvmemory import kvcache
from kvmemory.threads import ThreadCaches
from langchain_kvmemory.checkpointer import KVCheckpointSaver
from kvmemory_lab.harness.concurrency import run_case, run_concurrency_profile
from support import answer_graph, history, tiny_loaded, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_a_new_or_half_written_cache_counts_zero_bytes_for_unwritten_layers(llama):
    cache = kvcache.new_cache(llama.config)  # what another thread's fresh session holds
    assert kvcache.cache_nbytes(cache) == 0  # used to raise on layers without tensors yet


def test_a_call_waits_for_room_instead_of_exceeding_the_budget(llama, tokenizer):
    probe = ThreadCaches(llama, tokenizer)
    rows = 100
    reg = ThreadCaches(llama, tokenizer, memory_budget_bytes=int(1.5 * rows * probe.bytes_per_token))
    inside, release, order = threading.Event(), threading.Event(), []

    def first():
        with reg.lease("a", reserve_tokens=rows):
            order.append("a in")
            inside.set()
            release.wait(10)
            order.append("a out")

    def second():
        inside.wait(10)
        with reg.lease("b", reserve_tokens=rows):
            order.append("b in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    inside.wait(10)
    time.sleep(0.3)
    assert order == ["a in"]  # b's reservation does not fit next to a's: it waits
    release.set()
    for t in threads:
        t.join(10)
    assert order == ["a in", "a out", "b in"]


def test_idle_threads_are_evicted_to_admit_a_call(llama, tokenizer):
    probe = ThreadCaches(llama, tokenizer)
    with probe.lease("x") as s:
        s.prepare(history())
    one = probe.memory_bytes
    evicted = []
    reg = ThreadCaches(llama, tokenizer, memory_budget_bytes=int(2.5 * one), on_evict=lambda t, s: evicted.append(t))
    for tid in ("t1", "t2"):
        with reg.lease(tid) as s:
            s.prepare(history())
    with reg.lease("t3", reserve_tokens=one // reg.bytes_per_token) as s:
        assert "t1" not in reg and evicted == ["t1"]  # evicted before t3 ran, not after
        s.prepare(history())
        assert reg.memory_bytes <= reg.memory_budget_bytes


def test_importing_a_stored_cache_makes_room_before_it_loads(llama, tokenizer):
    probe = ThreadCaches(llama, tokenizer)
    with probe.lease("x") as s:
        s.prepare(history())
    one = probe.memory_bytes
    seen = []
    reg = ThreadCaches(llama, tokenizer, memory_budget_bytes=int(1.5 * one),
                       on_evict=lambda tid, s: seen.append((tid, reg.get("t2") is not None and bool(reg.get("t2").token_ids))))
    with reg.lease("t1") as s:
        s.prepare(history())
    reg.import_state("t2", reg.export_state("t1"))  # a restore after a restart or an eviction
    assert seen == [("t1", False)]  # t1 left before t2's rows arrived: the budget held throughout
    assert reg.memory_bytes <= reg.memory_budget_bytes


def test_an_evicted_thread_resumes_from_the_blob_written_when_it_was_evicted(tmp_path, llama, tokenizer):
    reg = ThreadCaches(llama, tokenizer, memory_budget_bytes=None)
    with KVCheckpointSaver.from_sqlite(tmp_path / "chk.sqlite", reg) as saver:
        graph = answer_graph(reg, saver)
        a = {"configurable": {"thread_id": "a"}}
        graph.invoke({"messages": [HumanMessage("Where is the river?", id="h1")]}, a)
        session = reg.get("a")
        ids, layers = list(session.token_ids), [(k.clone(), v.clone()) for k, v in kvcache.layer_tensors(session.cache)]
        reg.memory_budget_bytes = 1  # now everything idle must go
        reg.enforce_budget()
        assert "a" not in reg and "a" in saver._evicted  # persisted before it was dropped
        written = saver._evicted["a"][0].sha256
        reg.memory_budget_bytes = None
        saver.get_tuple(a)  # what LangGraph does at the start of the thread's next run
        assert saver.restored_from["a"] == written and not saver.restore_failures
        restored = reg.get("a")
        assert restored.token_ids == ids
        assert all(torch.equal(k, k2) and torch.equal(v, v2)
                   for (k, v), (k2, v2) in zip(layers, kvcache.layer_tensors(restored.cache)))


@pytest.mark.parametrize("mode", ["blobs", "reprefill"])
def test_eight_threads_on_a_tiny_model_match_their_solo_runs_bit_for_bit(tmp_path, mode):
    counts = run_case(tiny_loaded("concurrency-tiny-llama"), 8, 4, mode, tmp_path, seed=1, max_tokens=6)
    assert counts["errors"] == [] and counts["mismatches"] == 0
    assert counts["threads"] == 8 and counts["turns"] == 32
    assert counts["evictions"] > 0 and counts["peak_bytes"] <= counts["budget_bytes"]
    if mode == "reprefill":
        assert counts["cold_calls"] > 0  # evicted threads re-prefilled, and matched a solo re-prefill


@pytest.mark.real_model
def test_reduced_concurrency_profile_on_the_embedded_model(tmp_path, real):
    from kvmemory_lab.harness import concurrency as concurrency_harness

    counts = concurrency_harness.run_case(real, 8, 2, "blobs", tmp_path, seed=0, max_tokens=4)
    assert counts["errors"] == [] and counts["mismatches"] == 0 and counts["threads"] == 8
    assert counts["evictions"] > 0 and counts["budget_exceeded"] == 0


def test_profile_refuses_an_unknown_size(tmp_path):
    with pytest.raises(ValueError, match="reduced"):
        run_concurrency_profile("huge", seed=0, workdir=tmp_path)
