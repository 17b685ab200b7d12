"""Block-level persistence and many workers: content-addressed token blocks shared between
checkpoints and threads, exactness in the block key, integrity, retention / GC, strict erase
reaching every block, and several workers (registries) resuming threads from the newest stored
state over one checkpoint database and one shared block store (filesystem, Redis, Postgres)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, RemoveMessage, SystemMessage
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, MessagesState, StateGraph

from kvmemory.persistence import CacheState
from kvmemory.threads import ThreadCaches
from langchain_kvmemory.blockpersist import LeaseTimeout
from langchain_kvmemory.blockstore import FilesystemBlockStore
from langchain_kvmemory.checkpointer import CACHE_KEY, KVCheckpointSaver
from langchain_kvmemory.kvblocks import decode_block, encode_state, identity_digest
from servers import postgres_store, postgres_url, private_redis, redis_store  # noqa: F401  (fixtures)
from support import tiny_model

B = 16  # rows per block: small, so short chats span several blocks


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _as_dicts(messages) -> list[dict]:
    roles = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}
    return [{"role": roles[m.type], "content": m.content, "id": m.id} for m in messages]


def _graph(registry: ThreadCaches, saver, reports: list, erase: str | None = None):
    def answer(state: MessagesState, config):
        with registry.lease(config["configurable"]["thread_id"]) as session:
            reports.append(session.prepare(_as_dicts(state["messages"]), erase=erase))
            text = session.generate(6).text
        return {"messages": [AIMessage(text, id=f"a{len(state['messages'])}")]}

    builder = StateGraph(MessagesState)
    builder.add_node("answer", answer)
    builder.add_edge(START, "answer")
    return builder.compile(checkpointer=saver)


TURNS = [[SystemMessage("You are brief.", id="sys"), HumanMessage("Name a colour of the sky at noon.", id="u1")],
         [HumanMessage("And at sunset?", id="u2")], [HumanMessage("And at midnight, in winter?", id="u3")],
         [HumanMessage("Which one do you like best?", id="u4")]]


class Worker:
    """One worker: its own registry (live caches) and its own connection to the shared database."""

    def __init__(self, model, tokenizer, db, store, name, **kwargs):
        self.saver_cm = SqliteSaver.from_conn_string(str(db))
        inner = self.saver_cm.__enter__()
        self.saver = KVCheckpointSaver(inner, ThreadCaches(model, tokenizer), block_store=store, block_tokens=B,
                                       worker_id=name, **kwargs)
        self.reports: list = []
        self.graph = _graph(self.saver.threads, self.saver, self.reports)

    def turn(self, messages, thread="t"):
        config = {"configurable": {"thread_id": thread}}
        with self.saver.lease_thread(thread, ttl_s=10):
            self.graph.invoke({"messages": messages}, config)
        return self.reports[-1]

    def close(self):
        self.saver_cm.__exit__(None, None, None)


def _single_worker(model, tokenizer, tmp_path, turns=TURNS):
    w = Worker(model, tokenizer, tmp_path / "single.sqlite", FilesystemBlockStore(tmp_path / "single"), "solo")
    reports = [w.turn(t) for t in turns]
    w.close()
    return reports


# ------------------------------------------------------------------- blocks
def _state(n=40, exact=40, versions="v0") -> CacheState:
    torch.manual_seed(0)
    layers = [(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)) for _ in range(3)]
    return CacheState(token_ids=list(range(100, 100 + n)), messages=[], tools=None, exact_rows=exact, layers=layers,
                      model_name="m", model_dtype="torch.float32", weights_digest="w",
                      adapter_versions={"layer_versions": [versions] * 3, "versions": {}})


def test_block_keys_chain_tokens_identity_and_exactness():
    a, b = encode_state(_state(40), B), encode_state(_state(40), B)
    assert [x.key for x in a.blocks] == [x.key for x in b.blocks] and [x.rows for x in a.blocks] == [16, 16, 8]
    longer = encode_state(_state(56), B)  # same prefix: its full blocks are the same blocks
    assert [x.key for x in longer.blocks[:2]] == [x.key for x in a.blocks[:2]]
    assert longer.blocks[2].key != a.blocks[2].key  # the partial tail grew: another block
    other_adapter = encode_state(_state(40, versions="v1"), B)
    assert not {x.key for x in other_adapter.blocks} & {x.key for x in a.blocks}
    stale = encode_state(_state(40, exact=20), B)  # rows 20.. stale after a repair
    assert stale.blocks[0].key == a.blocks[0].key and stale.blocks[0].exact
    assert stale.blocks[1].key != a.blocks[1].key and not stale.blocks[1].exact  # same tokens, not the same block
    # a block decodes only under its own chain position (parent and identity are in the key)
    data = a.block_bytes[a.blocks[1].store_key]
    keys, _, tokens = decode_block(data, a.blocks[1], a.blocks[0].key, identity_digest(_state(40), B))
    assert tokens == list(range(116, 132)) and torch.equal(keys[:, :, :, :], torch.stack(
        [k[0, :, 16:32] for k, _ in _state(40).layers]))
    with pytest.raises(Exception, match="not the block its manifest names"):
        decode_block(data, a.blocks[1], a.blocks[1].key, identity_digest(_state(40), B))


# ---------------------------------------------------------- one worker, storage
def test_the_default_layout_is_blocks_next_to_the_database_and_a_restart_resumes_from_them(tmp_path, tokenizer, llama):
    db = tmp_path / "d.sqlite"
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(llama, tokenizer)) as saver:
        reports: list = []
        _graph(saver.threads, saver, reports).invoke({"messages": TURNS[0]}, {"configurable": {"thread_id": "t"}})
        entry = saver.get_tuple({"configurable": {"thread_id": "t"}}).metadata[CACHE_KEY]
        assert saver.blocks is not None and entry["layout"] == "blocks" and entry["blocks"]
    assert any((tmp_path / "d.sqlite.kvcache").rglob("*"))
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(llama, tokenizer)) as saver:  # a new process
        reports = []
        _graph(saver.threads, saver, reports).invoke({"messages": TURNS[1]}, {"configurable": {"thread_id": "t"}})
        assert saver.restored_from.get("t") and not saver.restore_failures
        assert reports[-1].reused_tokens > 0  # resumed from the stored rows, not re-prefilled
    with pytest.raises(ValueError, match="layout"):
        KVCheckpointSaver(SqliteSaver.from_conn_string(":memory:").__enter__(), layout="pages", blob_dir=tmp_path)


def test_consecutive_checkpoints_and_threads_share_blocks(tmp_path, tokenizer, llama):
    store = FilesystemBlockStore(tmp_path / "blocks")
    w = Worker(llama, tokenizer, tmp_path / "c.sqlite", store, "w1")
    reports = [w.turn(t) for t in TURNS[:3]]
    w.turn(TURNS[0], thread="other")  # same system prompt and first question
    states = []  # distinct cache states of thread t, oldest first
    for tup in reversed(list(w.saver.list({"configurable": {"thread_id": "t"}}))):
        entry = tup.metadata.get(CACHE_KEY)
        if entry and (not states or states[-1]["sha256"] != entry["sha256"]):
            states.append(entry)
    assert len(states) == 3 and all(e["layout"] == "blocks" and e["writer"] == "w1" for e in states)
    for old, new, report in zip(states, states[1:], reports[1:]):
        unchanged = report.reused_tokens // B  # blocks wholly inside the rows the next turn reused
        assert unchanged >= 1 and new["blocks"][:unchanged] == old["blocks"][:unchanged]
    other = w.saver.get_tuple({"configurable": {"thread_id": "other"}}).metadata[CACHE_KEY]
    same_prompt = reports[0].prompt_tokens // B
    assert same_prompt >= 1 and other["blocks"][:same_prompt] == states[0]["blocks"][:same_prompt]
    block_keys = {k.split("/")[1] for k, _ in store.list("block/")}
    assert block_keys == {b for e in [*states, other] for b in e["blocks"]}  # each block stored once
    assert sum(len(e["blocks"]) for e in [*states, other]) > len(block_keys)
    w.close()


def test_retention_keeps_the_newest_states_and_gc_frees_the_rest(tmp_path, tokenizer, llama):
    store = FilesystemBlockStore(tmp_path / "blocks")
    w = Worker(llama, tokenizer, tmp_path / "r.sqlite", store, "w1", keep_states=1)
    last = [w.turn(t) for t in TURNS][-1]
    before = {k for k, _ in store.list("")}
    newest = w.saver.get_tuple({"configurable": {"thread_id": "t"}}).metadata[CACHE_KEY]
    assert w.saver.collect_garbage(grace_s=3600) == []  # the grace period protects fresh writes
    removed = set(w.saver.collect_garbage(grace_s=0))
    after = {k for k, _ in store.list("")}
    assert after == {f"manifest/{newest['sha256']}"} | {f"block/{b}" for b in newest["blocks"]}
    assert removed == before - after and len(removed) >= 3  # older manifests and partial tails
    w.close()
    w2 = Worker(llama, tokenizer, tmp_path / "r.sqlite", store, "w2")  # the newest state still restores
    report = w2.turn([HumanMessage("Thanks.", id="u5")])
    assert report.reused_tokens >= last.prompt_tokens - 1 and not w2.saver.restore_failures
    assert w2.saver.blocks.stats.history[0]["fetched"] == len(newest["blocks"])
    w2.close()


# --------------------------------------------------------------- many workers
@pytest.mark.parametrize("backend", ["fs", "redis_store", "postgres_store"])
def test_two_workers_resume_from_the_newest_state_and_fetch_only_missing_blocks(tmp_path, tokenizer, llama,
                                                                                 backend, request):
    store = FilesystemBlockStore(tmp_path / "blocks") if backend == "fs" else request.getfixturevalue(backend)
    single = _single_worker(llama, tokenizer, tmp_path)
    db = tmp_path / "shared.sqlite"
    a, b = Worker(llama, tokenizer, db, store, "A"), Worker(llama, tokenizer, db, store, "B")
    route = [a, b, a, b]
    reports = [w.turn(t) for w, t in zip(route, TURNS)]
    for got, want in zip(reports, single):  # as if one worker had run every turn
        assert got.reused_tokens == want.reused_tokens and got.recomputed_tokens == want.recomputed_tokens
        assert got.operator == want.operator and got.fallback is None
    # turn 3 on A: its live cache (turn 1) was out of date; it loaded B's state, reusing its own blocks
    history = a.saver.blocks.stats.history
    assert len(history) == 1 and history[0]["reused"] >= 1 and history[0]["fetched"] >= 1
    assert history[0]["fetched"] < history[0]["blocks"]  # only the blocks it lacked
    assert b.saver.blocks.stats.restores == 2 and not a.saver.restore_failures and not b.saver.restore_failures
    a.close(), b.close()


def test_a_worker_keeps_its_live_cache_when_it_wrote_the_newest_state(tmp_path, tokenizer, llama):
    store = FilesystemBlockStore(tmp_path / "blocks")
    a = Worker(llama, tokenizer, tmp_path / "k.sqlite", store, "A")
    a.turn(TURNS[0])
    a.turn(TURNS[1])
    assert a.saver.blocks.stats.restores == 0 and a.saver.blocks.stats.live_kept >= 1
    a.close()


def test_a_damaged_block_resumes_from_the_last_good_message_and_reports_it(tmp_path, tokenizer, llama):
    store = FilesystemBlockStore(tmp_path / "blocks")
    db = tmp_path / "d.sqlite"
    a, b = Worker(llama, tokenizer, db, store, "A"), Worker(llama, tokenizer, db, store, "B")
    a.turn(TURNS[0])
    a.turn(TURNS[1])
    entry = a.saver.get_tuple({"configurable": {"thread_id": "t"}}).metadata[CACHE_KEY]
    victim = store.path(f"block/{entry['blocks'][-2]}")
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    report = b.turn(TURNS[2])
    failure = b.saver.restore_failures["t"]
    assert failure.startswith("partial: mismatch") and "resumed from" in failure
    resumed = b.saver.blocks.stats.history[0]
    assert resumed["error"].startswith("mismatch") and 0 < resumed["rows"] <= len(entry["blocks"][:-2]) * B
    assert report.reused_tokens >= resumed["rows"] - 1 and report.fallback is None  # the rest was recomputed
    damaged = f"block/{entry['blocks'][-2]}"  # deleted when found damaged; a later writer may store it whole
    assert not store.exists(damaged) or store.get(damaged) != bytes(data)
    a.close(), b.close()


def test_a_missing_manifest_falls_back_to_reprefill_without_losing_messages(tmp_path, tokenizer, llama):
    store = FilesystemBlockStore(tmp_path / "blocks")
    db = tmp_path / "m.sqlite"
    a, b = Worker(llama, tokenizer, db, store, "A"), Worker(llama, tokenizer, db, store, "B")
    a.turn(TURNS[0])
    entry = a.saver.get_tuple({"configurable": {"thread_id": "t"}}).metadata[CACHE_KEY]
    store.delete(f"manifest/{entry['sha256']}")
    report = b.turn(TURNS[1])
    assert b.saver.restore_failures["t"].startswith("missing") and report.reused_tokens == 0
    messages = b.graph.get_state({"configurable": {"thread_id": "t"}}).values["messages"]
    assert [m.id for m in messages] == ["sys", "u1", "a2", "u2", "a4"]
    a.close(), b.close()


def test_a_lease_keeps_a_second_worker_out_until_released(tmp_path, tokenizer, llama):
    store = FilesystemBlockStore(tmp_path / "blocks")
    a = Worker(llama, tokenizer, tmp_path / "l.sqlite", store, "A")
    b = Worker(llama, tokenizer, tmp_path / "l.sqlite", store, "B")
    order = []
    with a.saver.lease_thread("t", ttl_s=5):
        with pytest.raises(LeaseTimeout, match="leased by another worker"):
            with b.saver.lease_thread("t", wait_s=0.2):
                raise AssertionError("entered a thread another worker holds")
        waiter = threading.Thread(target=lambda: (b.saver.lease_thread("t", wait_s=10).__enter__(), order.append("B")))
        waiter.start()
        time.sleep(0.3)
        order.append("A done")
    waiter.join(5)
    assert order == ["A done", "B"]
    with pytest.raises(ValueError, match="layout"):
        KVCheckpointSaver(a.saver.saver, blob_dir=tmp_path / "x", layout="blobs").lease_thread("t")
    a.close(), b.close()


# ----------------------------------------------------------------- strict erase
SECRET = "The vault code is QX-7731-ZEBRA-PLUM."


def test_strict_erase_reaches_every_block_after_the_deleted_message(tmp_path, tokenizer, llama):
    store = FilesystemBlockStore(tmp_path / "blocks")
    w = Worker(llama, tokenizer, tmp_path / "e.sqlite", store, "A")
    w.graph = _graph(w.saver.threads, w.saver, w.reports, erase="strict")
    config = {"configurable": {"thread_id": "t"}}
    prefix = [SystemMessage("You are brief. " * 4, id="sys"), HumanMessage("Hello there, how are you?", id="u0")]
    w.turn([*prefix, HumanMessage(SECRET, id="secret")])
    w.turn([HumanMessage("Name a fruit.", id="u1")])
    before = w.saver.get_tuple(config).metadata[CACHE_KEY]
    start = w.saver.threads.session("t").rendered.segments[2].token_start
    w.graph.update_state(config, {"messages": [RemoveMessage(id="secret")]})
    w.turn([HumanMessage("Next.", id="u2")])
    report = w.saver.erase_reports["t"]
    assert report.messages == ["secret"] and report.blobs_deleted and report.refs_dropped > 0
    left = {k.split("/")[1] for k, _ in store.list("block/")}
    influenced = {b for i, b in enumerate(before["blocks"]) if (i + 1) * B > start}
    clean = {b for i, b in enumerate(before["blocks"]) if (i + 1) * B <= start}
    assert influenced and clean and not influenced & left  # every block the secret reached is gone
    assert clean <= left  # blocks before it stay (they never saw it)
    for path in (tmp_path / "blocks").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    w.close()


# -------------------------------------------------------- PostgresSaver + Redis
def test_postgres_saver_with_redis_blocks_two_workers(tokenizer, llama, tmp_path, postgres_url, redis_store):
    import uuid

    from langgraph.checkpoint.postgres import PostgresSaver

    single = _single_worker(llama, tokenizer, tmp_path, TURNS[:3])
    thread = f"pg-{uuid.uuid4().hex[:8]}"
    workers, contexts = [], []
    for name in "AB":
        cm = PostgresSaver.from_conn_string(postgres_url)
        inner = cm.__enter__()
        inner.setup()
        contexts.append(cm)
        saver = KVCheckpointSaver(inner, ThreadCaches(llama, tokenizer), block_store=redis_store, block_tokens=B,
                                  worker_id=name)
        reports: list = []
        workers.append((saver, _graph(saver.threads, saver, reports), reports))
    config = {"configurable": {"thread_id": thread}}
    for (saver, graph, reports), turn in zip([workers[0], workers[1], workers[0]], TURNS[:3]):
        with saver.lease_thread(thread, ttl_s=10):
            graph.invoke({"messages": turn}, config)
    got = [workers[0][2][0], workers[1][2][0], workers[0][2][1]]
    assert [r.reused_tokens for r in got] == [r.reused_tokens for r in single]
    assert workers[0][0].blocks.stats.history[0]["reused"] >= 1
    workers[0][0].delete_thread(thread)
    for cm in contexts:
        cm.__exit__(None, None, None)


# --------------------------------------------------------------- lost reuse
def test_blocks_flushed_between_workers_are_named_by_the_resuming_call_only(tmp_path, tokenizer, llama, redis_store):
    db = tmp_path / "f.sqlite"
    a, b = Worker(llama, tokenizer, db, redis_store, "A"), Worker(llama, tokenizer, db, redis_store, "B")
    a.turn(TURNS[0])
    a.turn(TURNS[1])
    redis_store.clear()  # e.g. FLUSHDB, or the server restarted without persistence
    resumed = b.turn(TURNS[2])
    assert resumed.reused_tokens == 0 and b.saver.restore_failures["t"].startswith("missing")
    assert resumed.fallback == (f"the thread's cached blocks could not be restored (block store: "
                                f"{b.saver.restore_failures['t']}): re-prefilled from the checkpointed messages")
    assert b.turn(TURNS[3]).fallback is None  # served from the live cache: the restore is not reported again
    a.close(), b.close()


def test_an_unreachable_block_store_reprefills_and_says_why(tmp_path, tokenizer, llama, private_redis, caplog):
    from langchain_kvmemory.blockstore import RedisBlockStore

    url, stop = private_redis
    db = tmp_path / "u.sqlite"
    a = Worker(llama, tokenizer, db, RedisBlockStore(url), "A")
    a.turn(TURNS[0])
    b = Worker(llama, tokenizer, db, RedisBlockStore(url), "B")
    stop()  # the block store goes down before B loads the thread (the checkpoints stay reachable)
    config = {"configurable": {"thread_id": "t"}}
    with caplog.at_level(logging.WARNING, logger="langchain_kvmemory.checkpointer"):
        b.graph.invoke({"messages": TURNS[1]}, config)  # no thread lease: it lives in the store that is down
    report, failure = b.reports[-1], b.saver.restore_failures["t"]
    assert failure.startswith("unreachable: redis:") and "ConnectionError" in failure
    assert report.reused_tokens == 0 and report.fallback == (
        f"the thread's cached blocks could not be restored (block store: {failure}): "
        "re-prefilled from the checkpointed messages")
    assert "stored cache not used (unreachable" in caplog.text
    assert "live cache not persisted" in caplog.text  # the write after the turn failed too: logged, turn kept
    assert "ConnectionError" in b.saver.persist_failures["t"]
    messages = b.graph.get_state(config).values["messages"]
    assert [m.id for m in messages] == ["sys", "u1", "a2", "u2", "a4"]
    b.graph.invoke({"messages": TURNS[2]}, config)
    assert b.reports[-1].fallback is None  # served from the live cache
    a.close(), b.close()


# ------------------------------------------------------------------ real model
@pytest.mark.real_model
def test_real_model_workers_retention_and_a_damaged_block(tmp_path, real):
    """The embedded model: two workers (own chat models) over one SQLite file and a shared block
    store with retention 1; a damaged block of the newest state; answers as one worker's."""
    from langchain_kvmemory.chat_model import ChatKVMemory
    from kvmemory_lab.harness.workers import build_graph

    turns = [[SystemMessage("You are brief.", id="sys"), HumanMessage("Name a colour of the sky.", id="u1")],
             [HumanMessage("Name a fruit.", id="u2")], [HumanMessage("Name an animal.", id="u3")],
             [HumanMessage("Name a city.", id="u4")]]
    config = {"configurable": {"thread_id": "t"}}

    def run(db, store, route, damage_before=None):
        workers = {}
        for name in sorted(set(route)):
            cm = SqliteSaver.from_conn_string(str(db))
            llm = ChatKVMemory(model=real, max_tokens=6)
            saver = KVCheckpointSaver(cm.__enter__(), llm, block_store=store, block_tokens=16, keep_states=1,
                                      worker_id=name)
            workers[name] = (cm, saver, build_graph(llm, saver))
        answers = []
        for i, (name, turn) in enumerate(zip(route, turns)):
            _, saver, graph = workers[name]
            if i == damage_before:
                entry = saver.saver.get_tuple(config).metadata[CACHE_KEY]  # the inner saver: no restore yet
                path = store.path(f"block/{entry['blocks'][-2]}")  # one the other worker lacks
                path.write_bytes(path.read_bytes()[:-10])  # truncated
            with saver.lease_thread("t"):
                out = graph.invoke({"messages": turn}, config)
            answers.append((out["messages"][-1].content, out["messages"][-1].usage_metadata))
            saver.collect_garbage(grace_s=0)
        stats = {n: w[1].blocks.stats for n, w in workers.items()}
        failures = {n: dict(w[1].restore_failures) for n, w in workers.items()}
        for cm, _, _ in workers.values():
            cm.__exit__(None, None, None)
        return answers, stats, failures

    one, _, _ = run(tmp_path / "one.sqlite", FilesystemBlockStore(tmp_path / "one"), ["A"] * 4)
    store = FilesystemBlockStore(tmp_path / "shared")
    two, stats, failures = run(tmp_path / "two.sqlite", store, ["A", "B", "A", "B"], damage_before=3)
    assert [a for a, _ in two] == [a for a, _ in one]  # the same answers as one worker
    for (_, got), (_, want) in zip(two[:3], one[:3]):  # turns 2-3: every token a single worker reused
        assert got["input_token_details"]["cache_read"] == want["input_token_details"]["cache_read"]
    assert stats["A"].restores == 1 and stats["A"].blocks_reused >= 1  # A fetched only what it lacked
    resumed = stats["B"].history[-1]
    assert resumed["error"].startswith("mismatch") and 0 < resumed["rows"] < two[3][1]["input_tokens"]
    assert failures["B"]["t"].startswith("partial: mismatch")
    assert two[3][1]["input_token_details"]["cache_read"] >= resumed["rows"] - 1  # the rest recomputed


# ---------------------------------------------------------- async and conformance
async def test_async_workers_resume_from_the_newest_state(tmp_path, tokenizer, llama):
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    store = FilesystemBlockStore(tmp_path / "blocks")
    db = tmp_path / "a.sqlite"
    single = _single_worker(llama, tokenizer, tmp_path, TURNS[:3])
    reports: list = []
    async with AsyncSqliteSaver.from_conn_string(str(db)) as inner_a, \
            AsyncSqliteSaver.from_conn_string(str(db)) as inner_b:
        savers = [KVCheckpointSaver(inner, ThreadCaches(llama, tokenizer), block_store=store, block_tokens=B,
                                    worker_id=name) for inner, name in ((inner_a, "A"), (inner_b, "B"))]
        graphs = [_graph(s.threads, s, reports) for s in savers]
        for i, turn in enumerate(TURNS[:3]):
            await graphs[i % 2].ainvoke({"messages": turn}, {"configurable": {"thread_id": "t"}})
    assert [r.reused_tokens for r in reports] == [r.reused_tokens for r in single]
    assert savers[0].blocks.stats.restores == 1 and savers[1].blocks.stats.restores == 1


@checkpointer_test(name="KVCheckpointSaver(AsyncSqliteSaver, block store)")
async def kv_block_saver():
    import os
    import tempfile

    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    with tempfile.TemporaryDirectory() as folder:
        async with AsyncSqliteSaver.from_conn_string(os.path.join(folder, "c.sqlite")) as inner:
            yield KVCheckpointSaver(inner, ThreadCaches(tiny_model("llama"), _TOKENIZER[0]),
                                    block_store=os.path.join(folder, "blocks"))


_TOKENIZER: list = []


async def test_conformance_with_a_block_store(tokenizer):
    _TOKENIZER[:] = [tokenizer]
    report = await validate(kv_block_saver)
    assert report.passed_all_base(), report
