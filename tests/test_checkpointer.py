"""The content-addressed blob store and the LangGraph checkpointer that persists live caches:
conformance, restart resumption, and detection of missing / truncated / mismatching blobs."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from pathlib import Path

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import START, MessagesState, StateGraph

from kvmemory.threads import ThreadCaches
from langchain_kvmemory.blobs import BlobError, BlobRef, BlobStore
from langchain_kvmemory.checkpointer import CACHE_KEY, KVCheckpointSaver
from support import tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


# ------------------------------------------------------------------ blob store
def _tensors(n: int = 5) -> dict[str, torch.Tensor]:
    torch.manual_seed(n)
    return {"a": torch.randn(2, n), "ids": torch.arange(n)}


def test_blob_round_trip_is_content_addressed_and_leaves_no_temporary_files(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    ref = store.put(_tensors(), {"format": "x"})
    assert store.put(_tensors(), {"format": "x"}) == ref  # same bytes, same name, stored once
    assert store.digests() == {ref.sha256}
    tensors, meta = store.get(ref)
    assert torch.equal(tensors["a"], _tensors()["a"]) and meta == {"format": "x"}
    assert not [p for p in (tmp_path / "blobs").rglob("*") if p.name.startswith(".tmp-")]
    assert store.put(_tensors(6)) != ref


@pytest.mark.parametrize("damage, reason", [("delete", "missing"), ("truncate", "truncated"), ("flip", "mismatch")])
def test_damaged_blobs_are_detected(tmp_path, damage, reason):
    store = BlobStore(tmp_path)
    ref = store.put(_tensors())
    path = store.path(ref.sha256)
    data = path.read_bytes()
    if damage == "delete":
        path.unlink()
    elif damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(BlobError) as err:
        store.get(ref)
    assert err.value.reason == reason


def test_bad_references_are_rejected():
    with pytest.raises(BlobError, match="64 lowercase hex"):
        BlobRef.from_dict({"sha256": "abc", "size": 3})
    with pytest.raises(BlobError, match="sha256 and size"):
        BlobRef.from_dict({"size": 3})


def test_garbage_collection_keeps_referenced_and_recent_blobs(tmp_path):
    store = BlobStore(tmp_path)
    keep, old, recent = store.put(_tensors(1)), store.put(_tensors(2)), store.put(_tensors(3))
    for ref in (keep, old):
        os.utime(store.path(ref.sha256), (0, 0))  # written long ago
    assert store.collect_garbage({keep.sha256}, grace_s=60) == [old.sha256]
    assert store.digests() == {keep.sha256, recent.sha256}


# ---------------------------------------------------------------- conformance
@checkpointer_test(name="KVCheckpointSaver(AsyncSqliteSaver)")
async def kv_sqlite_saver():
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        async with AsyncSqliteSaver.from_conn_string(os.path.join(folder, "c.sqlite")) as inner:
            yield KVCheckpointSaver(inner, ThreadCaches(tiny_model("llama"), _TOKENIZER[0]), blob_dir=folder)


_TOKENIZER: list = []


async def test_conformance_base_capabilities(tokenizer):
    _TOKENIZER[:] = [tokenizer]
    report = await validate(kv_sqlite_saver)
    assert report.passed_all_base(), report
    assert sum(report.results[c].tests_passed for c in ("put", "put_writes", "get_tuple", "list", "delete_thread")) >= 58
    # extended: copy_thread is implemented over the wrapped saver's public methods
    assert report.results["copy_thread"].detected and report.results["copy_thread"].passed, report


# --------------------------------------------------------- live caches in a graph
def _as_dicts(messages) -> list[dict]:
    roles = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}
    return [{"role": roles[m.type], "content": m.content, "id": m.id} for m in messages]


def _graph(registry: ThreadCaches, saver, reports: list):
    """One model node that answers from the thread's live cache (what the chat model does)."""

    def answer(state: MessagesState, config):
        with registry.lease(config["configurable"]["thread_id"]) as session:
            reports.append(session.prepare(_as_dicts(state["messages"])))
            text = session.generate(6).text
        return {"messages": [AIMessage(text)]}

    builder = StateGraph(MessagesState)
    builder.add_node("answer", answer)
    builder.add_edge(START, "answer")
    return builder.compile(checkpointer=saver)


TURN1 = [SystemMessage("You are brief.", id="sys"), HumanMessage("Name a colour of the sky at noon.", id="u1")]
TURN2 = [HumanMessage("And at sunset?", id="u2")]
CONFIG = {"configurable": {"thread_id": "t-1"}}


def _turn_one(model, tokenizer, db) -> tuple[str, int]:
    reports: list = []
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(model, tokenizer), layout="blobs") as saver:
        out = _graph(saver.threads, saver, reports).invoke({"messages": TURN1}, CONFIG)
        meta = saver.get_tuple(CONFIG).metadata
    assert reports[0].reused_tokens == 0  # first turn: a plain prefill
    assert meta[CACHE_KEY]["tokens"] > reports[0].prompt_tokens  # prompt + decoded answer rows
    return out["messages"][-1].content, reports[0].prompt_tokens


def _turn_two_in_new_process(model, tokenizer, db):
    """A fresh registry and connection: nothing of turn one is live any more."""
    reports: list = []
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(model, tokenizer), layout="blobs") as saver:
        out = _graph(saver.threads, saver, reports).invoke({"messages": TURN2}, CONFIG)
        return reports[0], out["messages"], saver


def _without_restart(model, tokenizer, db):
    """Both turns on one live registry: the reuse a restart must match."""
    reports: list = []
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(model, tokenizer), layout="blobs") as saver:
        graph = _graph(saver.threads, saver, reports)
        graph.invoke({"messages": TURN1}, CONFIG)
        graph.invoke({"messages": TURN2}, CONFIG)
    return reports[1]


def test_restart_resumes_from_the_stored_cache(tmp_path, tokenizer, llama):
    live = _without_restart(llama, tokenizer, tmp_path / "live.sqlite")
    db = tmp_path / "chk.sqlite"
    _, first_prompt = _turn_one(llama, tokenizer, db)
    assert (tmp_path / "chk.sqlite.kvcache").is_dir()
    report, messages, saver = _turn_two_in_new_process(llama, tokenizer, db)
    assert report.reused_tokens == live.reused_tokens >= first_prompt - 1  # as if the process never stopped
    assert report.recomputed_tokens == live.recomputed_tokens
    assert report.operator != "reprefill" and report.fallback is None
    assert not saver.restore_failures
    assert [m.content for m in messages[:2]] == [m.content for m in TURN1] and len(messages) == 5


@pytest.mark.parametrize("damage", ["delete", "truncate", "flip"])
def test_damaged_blob_falls_back_to_reprefill_and_keeps_messages(tmp_path, tokenizer, llama, damage, caplog):
    db = tmp_path / "chk.sqlite"
    answer, _ = _turn_one(llama, tokenizer, db)
    for path in (tmp_path / "chk.sqlite.kvcache").rglob("*.safetensors"):
        data = path.read_bytes()
        if damage == "delete":
            path.unlink()
        elif damage == "truncate":
            path.write_bytes(data[:100])
        else:
            path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with caplog.at_level(logging.WARNING, logger="langchain_kvmemory.checkpointer"):
        report, messages, saver = _turn_two_in_new_process(llama, tokenizer, db)
    expected = {"delete": "missing", "truncate": "truncated", "flip": "mismatch"}[damage]
    assert saver.restore_failures["t-1"].startswith(expected)
    assert "re-prefills" in caplog.text
    assert report.reused_tokens == 0  # rebuilt from the checkpointed messages
    assert [m.content for m in messages] == [m.content for m in TURN1] + [answer, TURN2[0].content, messages[-1].content]


def test_blob_of_another_model_is_rejected(tmp_path, tokenizer, llama):
    db = tmp_path / "chk.sqlite"
    _turn_one(llama, tokenizer, db)
    other = tiny_model("llama", num_hidden_layers=3)  # a different cache layout
    reports: list = []
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(other, tokenizer), layout="blobs") as saver:
        _graph(saver.threads, saver, reports).invoke({"messages": TURN2}, CONFIG)
        assert saver.restore_failures["t-1"].startswith("incompatible")
    assert reports[0].reused_tokens == 0


def test_unchanged_cache_is_not_rewritten_and_delete_thread_drops_it(tmp_path, tokenizer, llama):
    db = tmp_path / "chk.sqlite"
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(llama, tokenizer), layout="blobs") as saver:
        graph = _graph(saver.threads, saver, [])
        graph.invoke({"messages": TURN1}, CONFIG, durability="sync")  # every checkpoint written in step
        refs = [t.metadata.get(CACHE_KEY) for t in saver.list(CONFIG)]
        graph.update_state(CONFIG, {"messages": [HumanMessage("note", id="n1")]})  # no model call
        assert saver.get_tuple(CONFIG).metadata[CACHE_KEY] == refs[0]
        assert saver.store.digests() == {refs[0]["sha256"]}
        saver.delete_thread("t-1")
        assert "t-1" not in saver.threads and saver.get_tuple(CONFIG) is None
        assert saver.store.digests() == set()  # its only blob is shredded with its checkpoints
        assert saver.collect_garbage(grace_s=0) == []


def test_a_put_during_a_running_call_names_the_last_committed_state(tmp_path, tokenizer, llama):
    """LangGraph may write a checkpoint while a model call is half-way (async durability): the
    put neither waits for the call nor persists its half-prepared rows."""
    with KVCheckpointSaver.from_sqlite(tmp_path / "chk.sqlite", ThreadCaches(llama, tokenizer), layout="blobs") as saver:
        graph = _graph(saver.threads, saver, [])
        graph.invoke({"messages": TURN1}, CONFIG, durability="sync")
        committed = saver.get_tuple(CONFIG).metadata[CACHE_KEY]
        entered, leave = threading.Event(), threading.Event()

        def running_call():  # the next prompt prefilled, its answer not decoded yet
            with saver.threads.lease("t-1") as session:
                session.prepare(_as_dicts(TURN1 + [AIMessage("Blue.", id="a1"), *TURN2]))
                entered.set()
                leave.wait(60)

        worker = threading.Thread(target=running_call)
        worker.start()
        try:
            assert entered.wait(60)
            done: list = []
            putter = threading.Thread(target=lambda: done.append(
                graph.update_state(CONFIG, {"messages": [HumanMessage("note", id="n1")]})))
            putter.start()
            putter.join(30)
            assert done, "the checkpoint put waited for the running call"
            assert saver.get_tuple(CONFIG).metadata[CACHE_KEY] == committed
            assert saver.store.digests() == {committed["sha256"]}
        finally:
            leave.set()
            worker.join()
            putter.join()


def test_copied_thread_resumes_from_the_shared_blob(tmp_path, tokenizer, llama):
    db = tmp_path / "chk.sqlite"
    _, first_prompt = _turn_one(llama, tokenizer, db)
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(llama, tokenizer), layout="blobs") as saver:
        saver.copy_thread("t-1", "t-2")
        copied = {"configurable": {"thread_id": "t-2"}}
        assert [t.checkpoint["id"] for t in saver.list(copied)] == [t.checkpoint["id"] for t in saver.list(CONFIG)]
        reports: list = []
        # durability="sync": with LangGraph's default async writes, the input checkpoint may be
        # stored while the model node runs and legitimately capture an intermediate state (a 3rd blob)
        _graph(saver.threads, saver, reports).invoke({"messages": TURN2}, copied, durability="sync")
        assert "t-1" not in saver.threads and not saver.restore_failures
    assert reports[0].reused_tokens >= first_prompt - 1
    assert len(list((tmp_path / "chk.sqlite.kvcache").rglob("*.safetensors"))) == 2  # turn 1 + t-2's turn 2


def test_blob_dir_is_required_where_it_cannot_be_derived(tokenizer, llama):
    with pytest.raises(ValueError, match="blob_dir"):
        KVCheckpointSaver.from_sqlite(":memory:").__enter__()
    with pytest.raises(TypeError, match="thread registry"):
        KVCheckpointSaver(_sync_saver(), caches=object(), blob_dir="x")


def _sync_saver():
    from langgraph.checkpoint.sqlite import SqliteSaver

    return SqliteSaver(sqlite3.connect(":memory:", check_same_thread=False))


async def test_async_restart_resumes_from_the_stored_cache(tmp_path, tokenizer, llama):
    db = tmp_path / "chk.sqlite"
    reports: list = []
    async with KVCheckpointSaver.afrom_sqlite(db, ThreadCaches(llama, tokenizer), layout="blobs") as saver:
        await _graph(saver.threads, saver, reports).ainvoke({"messages": TURN1}, CONFIG)
        assert CACHE_KEY in (await saver.aget_tuple(CONFIG)).metadata
    async with KVCheckpointSaver.afrom_sqlite(db, ThreadCaches(llama, tokenizer), layout="blobs") as saver:
        await _graph(saver.threads, saver, reports).ainvoke({"messages": TURN2}, CONFIG)
        assert not saver.restore_failures
    live = _without_restart(llama, tokenizer, tmp_path / "live.sqlite")
    assert reports[1].reused_tokens == live.reused_tokens >= reports[0].prompt_tokens - 1


# ------------------------------------------- the chat model across a real process restart
RESTART_TURN = """
import json, sys
from langchain_core.messages import HumanMessage
from langchain_kvmemory import ChatKVMemory
from langchain_kvmemory.checkpointer import KVCheckpointSaver
sys.path.insert(0, {tests!r})
from test_checkpointer import chat_graph
chat = ChatKVMemory(max_tokens=4)
with KVCheckpointSaver.from_sqlite({db!r}, chat) as saver:
    out = chat_graph(chat, saver).invoke({{"messages": [HumanMessage("And at sunset?", id="u2")]}},
                                         {{"configurable": {{"thread_id": "t-1"}}}})
    print(json.dumps({{"usage": out["messages"][-1].usage_metadata, "repair": out["messages"][-1].response_metadata["repair"],
                      "failures": saver.restore_failures, "n": len(out["messages"])}}))
"""


def chat_graph(chat, saver):
    """A one-node graph around ChatKVMemory (also imported by the restarted process)."""
    builder = StateGraph(MessagesState)
    builder.add_node("answer", lambda state: {"messages": [chat.invoke(state["messages"])]})
    builder.add_edge(START, "answer")
    return builder.compile(checkpointer=saver)


@pytest.mark.real_model
def test_chat_model_resumes_from_the_stored_cache_after_a_process_restart(tmp_path, real):
    import json
    import subprocess
    import sys

    from langchain_kvmemory import ChatKVMemory

    db = tmp_path / "chk.sqlite"
    chat = ChatKVMemory(model=real, max_tokens=4)
    with KVCheckpointSaver.from_sqlite(db, chat) as saver:
        first = chat_graph(chat, saver).invoke({"messages": TURN1}, CONFIG)["messages"][-1]
    script = RESTART_TURN.format(tests=str(Path(__file__).parent), db=str(db))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    prompt1 = first.usage_metadata["input_tokens"]
    assert out["failures"] == {} and out["n"] == 5
    assert out["usage"]["input_token_details"]["cache_read"] >= prompt1  # turn one's rows came from the blob
    assert out["repair"]["operator"] == "refresh" and out["repair"]["fallback"] is None
    assert out["repair"]["recomputed_tokens"] < out["usage"]["input_tokens"] - prompt1 + 2  # only the new turn
