"""KVCheckpointSaver keeps the contract of the LangGraph saver it wraps: in-memory SQLite with a
blob folder, savers that keep only the newest checkpoint (ShallowPostgresSaver and its async
form), the optional deletions (prune, delete_for_runs) present exactly when the wrapped saver
has them, public attributes such as ``setup`` read through, and context managers that close
what the wrapper opened. Real SQLite, the real PostgreSQL server on localhost (.ci/services.sh)
and, in the graphs, the embedded model."""

from __future__ import annotations

import uuid
import warnings

import psycopg
import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.conformance.capabilities import Capability, DetectedCapabilities
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

from kvmemory.threads import ThreadCaches
from langchain_kvmemory import ChatKVMemory
from langchain_kvmemory.checkpointer import CACHE_KEY, KVCheckpointSaver
from servers import postgres_url  # noqa: F401  (fixture)
from support import tiny_loaded

TURN1 = [SystemMessage("You are brief.", id="sys"), HumanMessage("Name a colour of the sky at noon.", id="u1")]
TURN2 = [HumanMessage("And at sunset?", id="u2")]
TURN3 = [HumanMessage("And at night?", id="u3")]
OPTIONAL = {Capability.PRUNE, Capability.DELETE_FOR_RUNS}  # deletions a saver may leave unimplemented


@pytest.fixture
def pg_url(postgres_url):  # noqa: F811
    """The PostgreSQL URL with a schema of its own first on the search path (dropped afterwards):
    LangGraph's savers create unqualified tables, and the shallow savers' differ from the others'."""
    schema = f"kvmtest_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    yield f"{postgres_url}{'&' if '?' in postgres_url else '?'}options=-csearch_path%3D{schema}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded("saver-contract")


def chat_graph(chat, saver, **compile_kwargs):
    builder = StateGraph(MessagesState)
    builder.add_node("answer", lambda state: {"messages": [chat.invoke(state["messages"])]})
    builder.add_edge(START, "answer")
    return builder.compile(checkpointer=saver, **compile_kwargs)


def achat_graph(chat, saver, **compile_kwargs):
    async def answer(state):
        return {"messages": [await chat.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("answer", answer)
    builder.add_edge(START, "answer")
    return builder.compile(checkpointer=saver, **compile_kwargs)


def config(thread: str = "t-1") -> dict:
    return {"configurable": {"thread_id": thread}}


def stored_states(saver) -> set[str]:
    """sha256 of every cache state in the saver's store: its blobs, or (block layout) its manifests."""
    if saver.blocks is not None:
        return {key.split("/", 1)[1] for key, _ in saver.blocks.store.list("manifest/")}
    return saver.store.digests()


def cache_read(message) -> int:
    return message.usage_metadata["input_token_details"].get("cache_read", 0)


# ------------------------------------------------------------ in-memory SQLite
@pytest.mark.real_model
def test_from_sqlite_in_memory_uses_the_given_blob_dir(tmp_path, real):
    chat = ChatKVMemory(model=real, max_tokens=4)
    with KVCheckpointSaver.from_sqlite(":memory:", chat, blob_dir=tmp_path / "blobs") as saver:
        graph = chat_graph(chat, saver)
        graph.invoke({"messages": TURN1}, config())
        out = graph.invoke({"messages": TURN2}, config())
        stored = saver.get_tuple(config()).metadata[CACHE_KEY]
        assert stored["sha256"] in stored_states(saver) and any((tmp_path / "blobs").rglob("*"))
    assert cache_read(out["messages"][-1]) > 0
    with pytest.raises(ValueError, match="blob_dir="):
        KVCheckpointSaver.from_sqlite(":memory:", chat).__enter__()


# ------------------------------------------------------- newest-checkpoint-only savers
@pytest.mark.real_model
def test_shallow_postgres_saver_resumes_an_interrupted_turn_and_a_restart(tmp_path, real, pg_url):
    """Human in the loop on ShallowPostgresSaver: the run stops before the model node (its newest
    checkpoint names no cache yet) and is resumed; a restarted process resumes from the blob."""
    from langgraph.checkpoint.postgres import ShallowPostgresSaver

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # shallow savers are deprecated upstream
        manager = ShallowPostgresSaver.from_conn_string(pg_url)
        inner = manager.__enter__()
    try:
        chat = ChatKVMemory(model=real, max_tokens=4)
        inner.setup()
        saver = KVCheckpointSaver(inner, chat, blob_dir=tmp_path)
        graph = chat_graph(chat, saver, interrupt_before=["answer"])
        graph.invoke({"messages": TURN1}, config())
        assert CACHE_KEY not in saver.get_tuple(config()).metadata
        first = graph.invoke(None, config())["messages"][-1]  # resume the interrupted run
        assert first.type == "ai" and first.content
        restarted = ChatKVMemory(model=real, max_tokens=4)  # nothing of the thread is live any more
        again = KVCheckpointSaver(inner, restarted, blob_dir=tmp_path)
        chat_graph(restarted, again).invoke({"messages": TURN2}, config())
        resumed = chat_graph(restarted, again).invoke({"messages": TURN3}, config())["messages"][-1]
        assert again.restore_failures == {} and again.restored_from["t-1"]
        assert cache_read(resumed) >= first.usage_metadata["input_tokens"]
        assert saver.keeps_history is False  # detected: only the newest checkpoint was searched
    finally:
        manager.__exit__(None, None, None)


@pytest.mark.real_model
async def test_async_shallow_postgres_saver_resumes_an_interrupted_turn(tmp_path, real, pg_url):
    from langgraph.checkpoint.postgres.aio import AsyncShallowPostgresSaver

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        manager = AsyncShallowPostgresSaver.from_conn_string(pg_url)
        inner = await manager.__aenter__()
    try:
        chat = ChatKVMemory(model=real, max_tokens=4)
        await inner.setup()
        saver = KVCheckpointSaver(inner, chat, blob_dir=tmp_path)
        graph = achat_graph(chat, saver, interrupt_before=["answer"])
        await graph.ainvoke({"messages": TURN1}, config())
        first = (await graph.ainvoke(None, config()))["messages"][-1]
        assert first.type == "ai" and first.content
        restarted = ChatKVMemory(model=real, max_tokens=4)
        again = KVCheckpointSaver(inner, restarted, blob_dir=tmp_path)
        resumed = (await achat_graph(restarted, again).ainvoke({"messages": TURN2}, config()))["messages"][-1]
        assert again.restore_failures == {} and cache_read(resumed) >= first.usage_metadata["input_tokens"]
    finally:
        await manager.__aexit__(None, None, None)


# --------------------------------------------------------- optional deletions
@pytest.mark.real_model
def test_prune_passes_through_and_shreds_the_blobs_only_pruned_checkpoints_named(tmp_path, real, pg_url):
    from langgraph.checkpoint.postgres import PostgresSaver

    with PostgresSaver.from_conn_string(pg_url) as inner:
        chat = ChatKVMemory(model=real, max_tokens=4)
        saver = KVCheckpointSaver(inner, chat, blob_dir=tmp_path)
        saver.setup()  # the wrapped saver's own setup
        graph = chat_graph(chat, saver)
        for turn in (TURN1, TURN2, TURN3):
            graph.invoke({"messages": turn}, config())
        named = {t.metadata[CACHE_KEY]["sha256"] for t in saver.list(config()) if CACHE_KEY in t.metadata}
        assert len(named) == 3 and stored_states(saver) == named
        newest = saver.get_tuple(config())
        saver.prune(["t-1"])  # keep_latest
        assert [t.config for t in saver.list(config())] == [newest.config]
        assert stored_states(saver) == {newest.metadata[CACHE_KEY]["sha256"]}
        assert "t-1" in chat.threads  # the live cache belongs to the kept checkpoint
        saver.prune(["t-1"], strategy="delete")
        assert saver.get_tuple(config()) is None and stored_states(saver) == set()
        assert "t-1" not in chat.threads


@pytest.mark.real_model
async def test_aprune_passes_through_on_the_async_postgres_saver(tmp_path, real, pg_url):
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    async with AsyncPostgresSaver.from_conn_string(pg_url) as inner:
        chat = ChatKVMemory(model=real, max_tokens=4)
        saver = KVCheckpointSaver(inner, chat, blob_dir=tmp_path)
        await saver.setup()  # async, as the wrapped saver defines it
        graph = achat_graph(chat, saver)
        for turn in (TURN1, TURN2):
            await graph.ainvoke({"messages": turn}, config())
        newest = await saver.aget_tuple(config())
        await saver.aprune(["t-1"])
        assert [t.config async for t in saver.alist(config())] == [newest.config]
        assert stored_states(saver) == {newest.metadata[CACHE_KEY]["sha256"]}


def test_capabilities_follow_the_wrapped_saver(tmp_path, tiny, pg_url):
    from langgraph.checkpoint.postgres import PostgresSaver
    from langgraph.checkpoint.sqlite import SqliteSaver

    registry = ThreadCaches(tiny.model, tiny.tokenizer)
    with SqliteSaver.from_conn_string(str(tmp_path / "c.sqlite")) as sqlite, \
            PostgresSaver.from_conn_string(pg_url) as postgres:
        over_sqlite = KVCheckpointSaver(sqlite, registry, blob_dir=tmp_path)
        over_postgres = KVCheckpointSaver(postgres, registry, blob_dir=tmp_path)
        over_postgres.setup()
        for wrapper, inner in ((over_sqlite, sqlite), (over_postgres, postgres)):
            found, own = (DetectedCapabilities.from_instance(s).detected for s in (wrapper, inner))
            assert {c for c in found if c in OPTIONAL} == {c for c in own if c in OPTIONAL}
            assert isinstance(wrapper, KVCheckpointSaver) and type(wrapper).__name__ == "KVCheckpointSaver"
        # PostgresSaver implements prune but not aprune (LangGraph's capability check reads the async one)
        assert type(over_postgres).prune is not BaseCheckpointSaver.prune
        assert type(over_postgres).aprune is BaseCheckpointSaver.aprune
        assert over_sqlite.keeps_history is True
        assert KVCheckpointSaver(sqlite, registry, blob_dir=tmp_path, keeps_history=False).keeps_history is False
        with pytest.raises(ValueError, match="keeps_history"):
            KVCheckpointSaver(sqlite, registry, blob_dir=tmp_path, keeps_history="no")
        with pytest.raises(NotImplementedError):
            over_sqlite.prune(["t-1"])
        with pytest.raises(NotImplementedError):
            over_postgres.delete_for_runs(["run-1"])  # not implemented by langgraph-checkpoint-postgres 3.2


def test_public_attributes_of_the_wrapped_saver_read_through(tmp_path, tiny, pg_url):
    from langgraph.checkpoint.postgres import PostgresSaver

    with psycopg.connect(pg_url, autocommit=True, prepare_threshold=0,
                         row_factory=psycopg.rows.dict_row) as conn:
        saver = KVCheckpointSaver(PostgresSaver(conn), ThreadCaches(tiny.model, tiny.tokenizer), blob_dir=tmp_path)
        saver.setup()
        assert saver.conn is conn
        tables = {r["tablename"] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = "
                                                         "current_schema()")}
        assert {"checkpoints", "checkpoint_writes", "checkpoint_blobs"} <= tables
        with pytest.raises(AttributeError):
            saver._cursor  # private names of the wrapped saver are not forwarded


# ------------------------------------------------------------- context managers
def test_with_closes_the_block_store_the_saver_opened_and_enters_the_saver(tiny, pg_url):
    registry = ThreadCaches(tiny.model, tiny.tokenizer)
    with KVCheckpointSaver(InMemorySaver(), registry, block_store=pg_url) as saver:
        assert not saver.blocks.store.conn.closed
    assert saver.blocks.store.conn.closed


async def test_async_with_returns_the_wrapper_and_closes_what_it_opened(tiny, pg_url):
    registry = ThreadCaches(tiny.model, tiny.tokenizer)
    wrapper = KVCheckpointSaver(InMemorySaver(), registry, block_store=pg_url)
    async with wrapper as saver:
        assert saver is wrapper
        await saver.aput({"configurable": {"thread_id": "t-1", "checkpoint_ns": ""}},
                         _empty_checkpoint(), {}, {})
        assert (await saver.aget_tuple(config())) is not None
    assert wrapper.blocks.store.conn.closed


def _empty_checkpoint():
    from langgraph.checkpoint.base import empty_checkpoint

    return empty_checkpoint()


# ----------------------------------------------------------- deleting threads
def test_delete_thread_keeps_blobs_another_thread_still_names(tmp_path, tiny):
    chat = ChatKVMemory(model=tiny, max_tokens=3)
    with KVCheckpointSaver.from_sqlite(tmp_path / "c.sqlite", chat) as saver:
        chat_graph(chat, saver).invoke({"messages": TURN1}, config("a"))
        saver.copy_thread("a", "b")
        shared = saver.get_tuple(config("b")).metadata[CACHE_KEY]["sha256"]
        saver.delete_thread("a")
        assert stored_states(saver) == {shared}  # the copy still names it
        restarted = ChatKVMemory(model=tiny, max_tokens=3)
        again = KVCheckpointSaver(saver.saver, restarted, blob_dir=tmp_path / "c.sqlite.kvcache")
        out = chat_graph(restarted, again).invoke({"messages": TURN2}, config("b"))
        assert again.restored_from["b"] == shared and cache_read(out["messages"][-1]) > 0
        again.delete_thread("b")
        assert stored_states(again) == set()


def test_delete_thread_in_the_block_layout_shreds_its_manifests_and_leaves_blocks_to_gc(tmp_path, tiny):
    chat = ChatKVMemory(model=tiny, max_tokens=3)
    with KVCheckpointSaver.from_sqlite(tmp_path / "c.sqlite", chat, block_store=tmp_path / "blocks",
                                       block_tokens=8) as saver:
        graph = chat_graph(chat, saver)
        graph.invoke({"messages": TURN1}, config("a"))
        graph.invoke({"messages": TURN2}, config("a"))
        store = saver.blocks.store
        assert len(list(store.list("manifest/"))) == 2 and list(store.list("block/"))
        saver.delete_thread("a")
        assert list(store.list("manifest/")) == []  # they hold the thread's messages: gone at once
        assert list(store.list("block/"))  # may be shared with other threads and workers: left to GC
        assert saver.collect_garbage(grace_s=0) and list(store.list("block/")) == []


async def test_delete_blocks_shreds_the_deleted_threads_own_blocks_and_keeps_shared_ones(tmp_path, tiny):
    """delete_blocks=True (one server over a folder): deleting a thread also shreds at once the
    blocks no other thread's checkpoint or live cache names; blocks shared with the other thread
    stay, and that thread resumes from them after a restart."""
    chat = ChatKVMemory(model=tiny, max_tokens=3)
    path, blocks = tmp_path / "c.sqlite", tmp_path / "blocks"
    async with KVCheckpointSaver.afrom_sqlite(path, chat, block_store=blocks, block_tokens=8,
                                              delete_blocks=True) as saver:
        graph = achat_graph(chat, saver)
        for thread, last in (("a", TURN2), ("b", TURN3)):
            await graph.ainvoke({"messages": TURN1}, config(thread))
            await graph.ainvoke({"messages": last}, config(thread))
        store = saver.blocks.store

        async def named(thread):
            return {k for t in [t async for t in saver.alist(config(thread))]
                    for k in (t.metadata.get(CACHE_KEY) or {}).get("blocks", [])}

        a, b = await named("a"), await named("b")
        assert a - b and a & b  # the same first turn: shared leading blocks
        await saver.adelete_thread("a")
        assert {k.split("/", 1)[1] for k, _ in store.list("block/")} == b
    restarted = ChatKVMemory(model=tiny, max_tokens=3)
    async with KVCheckpointSaver.afrom_sqlite(path, restarted, block_store=blocks, block_tokens=8) as again:
        out = await achat_graph(restarted, again).ainvoke({"messages": [HumanMessage("And at dawn?", id="u4")]},
                                                          config("b"))
        assert "b" in again.restored_from and cache_read(out["messages"][-1]) > 0
        assert not again.restore_failures


def test_delete_blocks_must_be_a_bool(tmp_path, tiny):
    with pytest.raises(ValueError, match="delete_blocks"):
        KVCheckpointSaver(InMemorySaver(), ThreadCaches(tiny.model, tiny.tokenizer), block_store=tmp_path,
                          delete_blocks="yes")
