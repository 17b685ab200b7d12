"""Strict erase: the live cache recomputes everything the deleted text could influence (Replay
from the edit point, old rows overwritten) and the checkpoint store keeps no snapshot of it (SQLite
rows rewritten and vacuumed, KV blobs shredded). Checked byte-for-byte and tensor-by-tensor."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from langchain_core.messages import HumanMessage, RemoveMessage, SystemMessage
from langgraph.graph import START, MessagesState, StateGraph
from safetensors.torch import load

from kvmemory import kvcache
from kvmemory.edits import common_prefix_length
from kvmemory.engine import forward_rows
from kvmemory.models import LoadedModel
from kvmemory.session import KVSession
from langchain_kvmemory.chat_model import ChatKVMemory
from langchain_kvmemory.checkpointer import KVCheckpointSaver
from support import QUERY, history, tiny_model, without

SECRET = "The vault code is QX-7731-ZEBRA-PLUM."


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _reprefill_rows(model, ids: list[int]):
    cache = kvcache.new_cache(model.config)
    logits = forward_rows(model, cache, torch.tensor(ids), 0)
    return cache, logits


# ------------------------------------------------------------------ session
def test_strict_delete_recomputes_every_row_after_the_edit_point(llama, tokenizer):
    msgs = history() + [QUERY]
    session = KVSession(llama, tokenizer, "shift")
    session.prepare(msgs)
    old_layers = kvcache.layer_tensors(session.cache)  # the live tensors themselves, not copies
    old_ids = list(session.token_ids)

    shifted = session.fork()
    shifted.delete_message("t2")  # a plain Shift keeps rows computed with the deleted text
    report = session.delete_message("t2", erase="strict")

    f = common_prefix_length(old_ids, session.token_ids)
    assert report.operator == "replay" and report.erased["messages"] == ["t2"]
    assert report.erased["from_row"] <= f and report.reused_tokens == report.erased["from_row"]
    assert report.erased["rows_recomputed"] == len(session.token_ids) - report.erased["from_row"]
    assert session.pending_erasures == ["t2"]
    ref, logits = _reprefill_rows(llama, session.token_ids)
    for (k, v), (rk, rv) in zip(kvcache.layer_tensors(session.cache), kvcache.layer_tensors(ref)):
        torch.testing.assert_close(k, rk, rtol=0, atol=1e-4)
        torch.testing.assert_close(v, rv, rtol=0, atol=1e-4)
    # what strict erase is for: a Shift keeps deeper-layer rows that saw the deleted text
    # (layer 0 rows depend only on token and position, so they agree anyway)
    shift_gap = max(float((sv[:, :, f:] - rv[:, :, f:]).abs().max())
                    for (_, sv), (_, rv) in zip(kvcache.layer_tensors(shifted.cache)[1:], kvcache.layer_tensors(ref)[1:]))
    assert shift_gap > 1e-3
    torch.testing.assert_close(session.next_logits, logits, rtol=0, atol=1e-4)
    for k, v in old_layers:  # the old storage is overwritten, not just dropped
        assert k[:, :, report.erased["from_row"]:].abs().sum() == 0 == v[:, :, report.erased["from_row"]:].abs().sum()


def test_strict_replace_erases_the_old_content_and_bad_modes_are_refused(llama, tokenizer):
    session = KVSession(llama, tokenizer, "sur@5")
    session.prepare(history() + [QUERY])
    report = session.replace_message("t1", "[cleared]", erase="strict")
    assert report.erased["messages"] == ["t1"] and report.operator == "replay"
    assert session.prepare(session.messages + [{"role": "user", "content": "more", "id": "u9"}],
                           erase="strict").erased is None  # an append erases nothing
    with pytest.raises(ValueError, match="'strict' or 'none'"):
        session.delete_message("t2", erase="yes")
    with pytest.raises(ValueError, match="dirty"):
        session.delete_message("t2", policy="dirty", erase="strict")
    assert session.policy.label == "sur@5"  # the session policy itself is unchanged


def test_strict_erase_recomputes_retained_cachereforge_states(tokenizer):
    """Boundary hidden states retained for CacheReforge are state too: after a strict erase they
    equal a fresh prefill's, and the old ones are overwritten from the edit point."""
    from peft import LoraConfig, get_peft_model

    from kvmemory.reforge.state import ReforgeConfig

    model = get_peft_model(tiny_model("llama", num_hidden_layers=4),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"], layers_to_transform=[2])).eval()
    msgs = history() + [QUERY]
    session = KVSession(model, tokenizer, "sur@5", reforge=ReforgeConfig())
    session.prepare(msgs)
    old = {layer: b.hidden for layer, b in session.reforge.boundaries.states.items()}
    assert old, "the LoRA model retains boundary states"
    report = session.delete_message("t2", erase="strict")
    fresh = KVSession(model, tokenizer, "reprefill", reforge=ReforgeConfig())
    fresh.prepare(without(msgs, "t2"))
    start = report.erased["from_row"]
    assert report.erased["boundary_rows_overwritten"] == sum(h.shape[1] - start for h in old.values())
    for layer, hidden in old.items():
        assert hidden[:, start:].abs().sum() == 0
        torch.testing.assert_close(session.reforge.boundaries.states[layer].hidden,
                                   fresh.reforge.boundaries.states[layer].hidden, rtol=0, atol=1e-5)


# ------------------------------------------------------------- in a graph
def _chat_graph(llm, saver):
    def answer(state: MessagesState):
        return {"messages": [llm.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("answer", answer)
    builder.add_edge(START, "answer")
    return builder.compile(checkpointer=saver)


def _load(path: Path) -> dict[str, torch.Tensor]:
    return load(path.read_bytes())  # copies: a memory-mapped load would see the shredded file


def _blob_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.safetensors"))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t[0].transpose(0, 1).reshape(t.shape[2], -1)  # [1, heads, N, dim] -> [N, heads*dim]


def _rows_after_divergence(blob: dict, new_ids: list[int]) -> dict[str, torch.Tensor]:
    """Per stored K/V tensor, the rows computed after the first token that differs from the
    post-erase prompt (they saw the deleted text), flattened to ``[rows, heads*dim]``. Layer 0
    sees no context (its rows are a function of token and position; values and the zero key of a
    padding token do not even depend on the position), so rows of tokens that also occur in the
    new prompt are left out there."""
    old_ids = blob["token_ids"].tolist()
    f = common_prefix_length(old_ids, new_ids)
    tokens = set(new_ids)
    fresh = torch.tensor([old_ids[p] not in tokens for p in range(f, len(old_ids))], dtype=torch.bool)
    out = {}
    for name, t in blob.items():
        if name.startswith("layers."):
            rows = _flat(t)[f:]
            out[name] = rows[fresh] if name.startswith("layers.0.") and fresh.numel() else rows
    return out


def _closest(stored: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> float:
    """Smallest max-abs distance between any stored row and any pre-erase row (same tensor name)."""
    best = float("inf")
    for name, s in stored.items():
        o = old[name]
        if s.numel() and o.numel():
            best = min(best, float(torch.cdist(s, o, p=float("inf")).min()))
    return best


def _erase_in_graph(loaded: LoadedModel, tmp_path: Path, turns: list[str]):
    """Three turns, the first holding SECRET; then RemoveMessage + a new turn under strict erase."""
    db = tmp_path / "chk.sqlite"
    llm = ChatKVMemory(model=loaded, max_tokens=4, erase="strict")
    config = {"configurable": {"thread_id": f"t-{uuid.uuid4().hex[:6]}"}}
    with KVCheckpointSaver.from_sqlite(db, llm, layout="blobs") as saver:
        graph = _chat_graph(llm, saver)
        secret = HumanMessage(SECRET + " " + turns[0], id="secret")
        graph.invoke({"messages": [SystemMessage("You are brief.", id="sys"), secret]}, config)
        for i, text in enumerate(turns[1:]):
            graph.invoke({"messages": [HumanMessage(text, id=f"u{i}")]}, config)
        before = {p: _load(p) for p in _blob_files(Path(str(db) + ".kvcache"))}
        assert SECRET.encode() in db.read_bytes() + _wal(db)  # the check below can fail
        kept = [m for m in graph.get_state(config).values["messages"] if m.id != "secret"]

        graph.update_state(config, {"messages": [RemoveMessage(id="secret")]})
        out = graph.invoke({"messages": [HumanMessage("What did I ask first?", id="last")]}, config)
        session = llm.threads.session(config["configurable"]["thread_id"])
        history_states = [s.values.get("messages", []) for s in graph.get_state_history(config)]
        stored_meta = saver.get_tuple(config).metadata
    return db, before, kept, out, session, history_states, stored_meta


def _wal(db: Path) -> bytes:
    wal = Path(str(db) + "-wal")
    return wal.read_bytes() if wal.exists() else b""


def _check_erased(model, db, before, kept, out, session, history_states, stored_meta, atol):
    meta = out["messages"][-1].response_metadata["erase"]
    store = meta["stores"][0]
    assert meta["messages"] == ["secret"] and meta["rows_recomputed"] > 0
    assert store["checkpoints_rewritten"] > 0 and store["writes_rewritten"] > 0 and store["blobs_deleted"] > 0
    assert store["deferred"] == [] and store["sqlite"] == "vacuumed, WAL truncated"
    # no message the user did not delete is lost; no stored state holds the deleted one
    assert [m.content for m in out["messages"][: len(kept)]] == [m.content for m in kept]
    assert all(m.id != "secret" for msgs in history_states for m in msgs) and len(history_states) > 4
    # bytes: the deleted text is gone from the database, its WAL and every blob file
    blob_dir = Path(str(db) + ".kvcache")
    for path in [db, *blob_dir.rglob("*")]:
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET.encode() not in _wal(db)
    # tensors: no stored K/V row equals (or is close to) a row computed after the deleted text
    after = [_load(p) for p in _blob_files(blob_dir)]
    assert after and "kvmemory_cache" in stored_meta, "the thread's new cache is stored"
    for blob in after:
        new_ids = blob["token_ids"].tolist()
        stored = {n: _flat(t) for n, t in blob.items() if n.startswith("layers.")}
        for old in before.values():
            gap = _closest(stored, _rows_after_divergence(old, new_ids))
            assert gap > atol, f"a stored row is within {gap} of a pre-erase row"
            if "next_logits" in old and "next_logits" in blob:
                assert not torch.allclose(old["next_logits"], blob["next_logits"], atol=atol)
    # the live thread now holds exactly a Re-prefill of what remains
    ref, _ = _reprefill_rows(model, session.token_ids)
    for (k, v), (rk, rv) in zip(kvcache.layer_tensors(session.cache), kvcache.layer_tensors(ref)):
        torch.testing.assert_close(k, rk, rtol=0, atol=1e-4)
        torch.testing.assert_close(v, rv, rtol=0, atol=1e-4)
    assert session.exact_rows == len(session.token_ids)


def test_strict_erase_in_a_sqlite_graph_leaves_no_trace(tmp_path, tokenizer, llama):
    loaded = LoadedModel(llama, tokenizer, "tiny-llama", Path("tiny-llama"), torch.float32)
    result = _erase_in_graph(loaded, tmp_path, ["Remember it.", "Name a colour.", "Name a fruit."])
    _check_erased(llama, *result, atol=1e-5)


def test_erase_is_deferred_while_the_message_is_still_in_the_graph_state(tmp_path, tokenizer, llama):
    """A call that only leaves a message out (the state still holds it) recomputes the cache but
    deletes no stored snapshot: the user did not delete that message."""
    loaded = LoadedModel(llama, tokenizer, "tiny-llama", Path("tiny-llama"), torch.float32)
    llm = ChatKVMemory(model=loaded, max_tokens=3, erase="strict")
    config = {"configurable": {"thread_id": "window"}}

    def windowed(state: MessagesState):
        return {"messages": [llm.invoke(state["messages"][-1:])]}  # only the last message goes to the model

    builder = StateGraph(MessagesState)
    builder.add_node("answer", windowed)
    builder.add_edge(START, "answer")
    with KVCheckpointSaver.from_sqlite(tmp_path / "w.sqlite", llm) as saver:
        graph = builder.compile(checkpointer=saver)
        graph.invoke({"messages": [HumanMessage(SECRET, id="secret")]}, config)
        answer = graph.get_state(config).values["messages"][1].id  # held in the cache with the question
        out = graph.invoke({"messages": [HumanMessage("Next.", id="n")]}, config)
        store = out["messages"][-1].response_metadata["erase"]["stores"][0]
        assert sorted(store["deferred"]) == sorted(["secret", answer]) and store["checkpoints_rewritten"] == 0
        assert graph.get_state(config).values["messages"][0].content == SECRET
        assert SECRET.encode() in (tmp_path / "w.sqlite").read_bytes() + _wal(tmp_path / "w.sqlite")


@pytest.mark.real_model
def test_real_model_strict_erase_in_a_sqlite_graph(tmp_path, real):
    result = _erase_in_graph(real, tmp_path, ["Keep it safe.", "Say hi."])
    _check_erased(real.model, *result, atol=1e-5)



def test_other_savers_are_purged_when_idle_through_the_public_api(tmp_path, tokenizer, llama):
    """InMemorySaver cannot be rewritten atomically during a run: the chat model defers, an
    explicit ``erase_messages`` on the idle thread rewrites it through list / delete_thread / put."""
    from langgraph.checkpoint.memory import InMemorySaver

    loaded = LoadedModel(llama, tokenizer, "tiny-llama", Path("tiny-llama"), torch.float32)
    llm = ChatKVMemory(model=loaded, max_tokens=3, erase="strict")
    config = {"configurable": {"thread_id": "mem"}}
    saver = KVCheckpointSaver(InMemorySaver(), llm, blob_dir=tmp_path / "blobs")
    graph = _chat_graph(llm, saver)
    graph.invoke({"messages": [HumanMessage(SECRET, id="secret"), HumanMessage("Hi.", id="h")]}, config)
    graph.update_state(config, {"messages": [RemoveMessage(id="secret")]})
    out = graph.invoke({"messages": [HumanMessage("Next.", id="n")]}, config)
    assert out["messages"][-1].response_metadata["erase"]["stores"][0]["deferred"] == ["secret"]
    assert saver.pending_erasures("mem") == ["secret"]

    report = saver.erase_messages("mem", saver.pending_erasures("mem"))
    assert report.checkpoints_rewritten > 0 and report.blobs_deleted and not report.deferred
    assert saver.pending_erasures("mem") == []
    states = [s.values.get("messages", []) for s in graph.get_state_history(config)]
    assert len(states) > 3 and all(m.id != "secret" for msgs in states for m in msgs)
    assert [m.content for m in graph.get_state(config).values["messages"][:2]] == ["Hi.", out["messages"][1].content]
    for path in (tmp_path / "blobs").rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes()
    graph.invoke({"messages": [HumanMessage("Still there?", id="s2")]}, config)  # the thread continues


def test_strict_replace_in_the_graph_state_keeps_only_the_new_version(tmp_path, tokenizer, llama):
    """``update_state`` with the same id replaces a message: its old content leaves every stored
    snapshot, the new content stays in the thread."""
    loaded = LoadedModel(llama, tokenizer, "tiny-llama", Path("tiny-llama"), torch.float32)
    llm = ChatKVMemory(model=loaded, max_tokens=3, erase="strict")
    config = {"configurable": {"thread_id": "replace"}}
    db = tmp_path / "r.sqlite"
    with KVCheckpointSaver.from_sqlite(db, llm) as saver:
        graph = _chat_graph(llm, saver)
        graph.invoke({"messages": [HumanMessage(SECRET, id="secret"), HumanMessage("Hi.", id="h")]}, config)
        graph.update_state(config, {"messages": [HumanMessage("[redacted]", id="secret")]})
        out = graph.invoke({"messages": [HumanMessage("Next.", id="n")]}, config)
        erase = out["messages"][-1].response_metadata["erase"]
        assert erase["messages"] == ["secret"] and erase["stores"][0]["checkpoints_rewritten"] > 0
        assert erase["stores"][0]["deferred"] == ["secret"]  # its new version stays in the state
        assert out["messages"][0].content == "[redacted]" and out["messages"][1].content == "Hi."
        contents = [m.content for s in graph.get_state_history(config) for m in s.values.get("messages", [])]
        assert SECRET not in contents and "[redacted]" in contents
    for path in [db, *Path(str(db) + ".kvcache").rglob("*")]:
        assert not path.is_file() or SECRET.encode() not in path.read_bytes()
    assert SECRET.encode() not in _wal(db)


async def test_async_sqlite_saver_is_purged_by_an_explicit_erase(tmp_path, tokenizer, llama):
    loaded = LoadedModel(llama, tokenizer, "tiny-llama", Path("tiny-llama"), torch.float32)
    llm = ChatKVMemory(model=loaded, max_tokens=3, erase="strict")
    config = {"configurable": {"thread_id": "async"}}
    db = tmp_path / "a.sqlite"
    async with KVCheckpointSaver.afrom_sqlite(db, llm) as saver:
        graph = _chat_graph(llm, saver)
        await graph.ainvoke({"messages": [HumanMessage(SECRET, id="secret"), HumanMessage("Hi.", id="h")]}, config)
        await graph.aupdate_state(config, {"messages": [RemoveMessage(id="secret")]})
        await graph.ainvoke({"messages": [HumanMessage("Next.", id="n")]}, config)
        assert saver.pending_erasures("async") == ["secret"]  # not rewritten during the run
        assert SECRET.encode() in db.read_bytes() + _wal(db)
        report = await saver.aerase_messages("async", saver.pending_erasures("async"))
        assert report.checkpoints_rewritten > 0 and report.sqlite == "vacuumed, WAL truncated"
        assert [m.content for m in (await graph.aget_state(config)).values["messages"]][0] == "Hi."
    for path in [db, *Path(str(db) + ".kvcache").rglob("*")]:
        assert not path.is_file() or SECRET.encode() not in path.read_bytes()
    assert SECRET.encode() not in _wal(db)


def test_a_put_during_a_call_leaves_the_erasures_to_the_caller(tmp_path, tokenizer, llama):
    """A checkpoint written in the background while a call holds the thread does not take the
    call's erasures (the caller purges and reports them); the next put on the idle thread does."""
    from langgraph.checkpoint.base import empty_checkpoint

    from kvmemory.threads import ThreadCaches

    registry = ThreadCaches(llama, tokenizer, "sur@5")
    messages = [{"role": "user", "content": SECRET, "id": "secret"}, {"role": "user", "content": "Hi.", "id": "h"}]
    config = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    with KVCheckpointSaver.from_sqlite(tmp_path / "p.sqlite", registry) as saver:
        with registry.lease("t") as session:
            session.prepare(messages)
            session.prepare(messages[1:], erase="strict")
            assert session.pending_erasures == ["secret"]
            saver.put(config, empty_checkpoint(), {}, {})
            assert session.pending_erasures == ["secret"] and "t" not in saver.erase_reports
        saver.put(config, empty_checkpoint(), {}, {})
        assert registry.session("t").pending_erasures == [] and saver.erase_reports["t"].messages == ["secret"]


def test_a_graph_driving_the_registry_directly_is_purged_at_the_next_put(tmp_path, tokenizer, llama):
    """Without the chat model, the erasures a session queues are purged when the saver stores
    the next checkpoint of the thread."""
    from kvmemory.threads import ThreadCaches

    registry = ThreadCaches(llama, tokenizer, "sur@5")
    roles = {"human": "user", "ai": "assistant", "system": "system"}

    def answer(state: MessagesState, config):
        with registry.lease(config["configurable"]["thread_id"]) as session:
            session.prepare([{"role": roles[m.type], "content": m.content, "id": m.id} for m in state["messages"]],
                            erase="strict")
            text = session.generate(3).text
        return {"messages": [HumanMessage(text, id=f"ans-{len(state['messages'])}")]}

    builder = StateGraph(MessagesState)
    builder.add_node("answer", answer)
    builder.add_edge(START, "answer")
    config = {"configurable": {"thread_id": "direct"}}
    db = tmp_path / "d.sqlite"
    with KVCheckpointSaver.from_sqlite(db, registry) as saver:
        graph = builder.compile(checkpointer=saver)
        graph.invoke({"messages": [HumanMessage(SECRET, id="secret"), HumanMessage("Hi.", id="h")]}, config)
        graph.update_state(config, {"messages": [RemoveMessage(id="secret")]})
        graph.invoke({"messages": [HumanMessage("Next.", id="n")]}, config)
        report = saver.erase_reports["direct"]
        assert report.messages == ["secret"] and report.checkpoints_rewritten > 0 and not report.deferred
        assert registry.session("direct").pending_erasures == [] and saver.pending_erasures("direct") == []
    assert SECRET.encode() not in db.read_bytes() + _wal(db)
