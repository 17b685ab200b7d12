"""Crash safety of the checkpointer: real SIGKILLs of a process writing checkpoints and KV blobs
(the reduced crash profile, and kills at chosen points), damaged blobs that must never be loaded,
and garbage collection of what a crash leaves behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from langchain_core.messages import HumanMessage, SystemMessage

from kvmemory.threads import ThreadCaches
from langchain_kvmemory.blobs import BlobStore
from langchain_kvmemory.checkpointer import CACHE_KEY, KVCheckpointSaver
from kvmemory_lab.harness.crash import Journal, Life, Tally, spawn_life, check_messages, run_crash_profile
from support import answer_graph, tiny_model

CONFIG = {"configurable": {"thread_id": "t-1"}}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


# ------------------------------------------------------------- real kills, chosen points
def _kill_at(work: Path, point: str) -> Life:
    """A child that ran one clean operation, then a child killed at ``point`` (real SIGKILL)."""
    first = spawn_life(Life(model="tiny-a"), work, seed=3, ops=1)
    assert first.returncode == 0, first.stderr
    killed = spawn_life(Life(model="tiny-a", kill_at=point, hit=1, delay_s=5.0), work, seed=3)
    assert killed.returncode == -signal.SIGKILL
    assert {"event": "kill_point", "point": point} in killed.events, killed.stderr  # died at the point itself
    tally = Tally()
    assert check_messages(work / "chk.sqlite", Journal(work / "journal.jsonl"), tally), tally.errors
    return killed


def _restart(work: Path) -> tuple[Life, dict]:
    restart = spawn_life(Life(model="tiny-a"), work, seed=3, ops=2)
    assert restart.returncode == 0, restart.stderr
    tally = Tally()
    assert check_messages(work / "chk.sqlite", Journal(work / "journal.jsonl"), tally), tally.errors
    for e in restart.events:  # resumed from a verified blob, or re-prefilled with a recorded reason
        if e["event"] == "first_call" and not e["fresh"]:
            assert (e["cache_read"] > 0 and e["restored_from"] and e["rehash_ok"]) or e["failure"], e
    return restart, next(e for e in restart.events if e["event"] == "gc")


def test_kill_between_temp_write_and_rename_leaves_a_temp_file_that_gc_removes(tmp_path):
    store = BlobStore(tmp_path / "chk.sqlite.kvcache")
    _kill_at(tmp_path, "before_rename")
    assert len(store.temp_files()) == 1  # the interrupted write never reached a blob's name
    for path in store.root.rglob("??/[0-9a-f]*.safetensors"):
        store.get(_ref(path))  # every blob under its final name is whole (raises otherwise)
    _, gc = _restart(tmp_path)
    assert gc["temp_files"] == 1 and store.temp_files() == []


def test_kill_between_blob_and_checkpoint_leaves_an_orphan_that_gc_removes(tmp_path):
    store = BlobStore(tmp_path / "chk.sqlite.kvcache")
    _kill_at(tmp_path, "before_checkpoint")
    with KVCheckpointSaver.from_sqlite(tmp_path / "chk.sqlite", layout="blobs") as plain:
        named = {t.metadata[CACHE_KEY]["sha256"] for t in plain.list(None) if CACHE_KEY in t.metadata}
    orphans = store.digests() - named
    assert len(orphans) == 1  # written, but the checkpoint naming it never committed
    _, gc = _restart(tmp_path)
    assert gc["blobs"] == 1 and not orphans & store.digests()


def _ref(path: Path):
    from langchain_kvmemory.blobs import BlobRef

    return BlobRef(path.name.split(".")[0], path.stat().st_size)


# ------------------------------------------------------------- damaged and foreign blobs
@pytest.mark.parametrize("damage", ["truncate", "flip-first", "flip-last", "wrong-model"])
def test_a_damaged_or_foreign_blob_is_never_loaded(tmp_path, tokenizer, llama, damage):
    db = tmp_path / "chk.sqlite"
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(llama, tokenizer, model_name="a"), layout="blobs") as saver:
        answer_graph(saver.threads, saver).invoke({"messages": [SystemMessage("Be brief.", id="s"),
                                                         HumanMessage("Hi?", id="h")]}, CONFIG)
        sha = saver.get_tuple(CONFIG).metadata[CACHE_KEY]["sha256"]
    path = BlobStore(tmp_path / "chk.sqlite.kvcache").path(sha)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 3])
    elif damage.startswith("flip"):
        at = 9 if damage == "flip-first" else len(data) - 1  # header / tensor data
        path.write_bytes(data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:])
    name = "b" if damage == "wrong-model" else "a"
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(llama, tokenizer, model_name=name), layout="blobs") as saver:
        answer_graph(saver.threads, saver).invoke({"messages": [HumanMessage("And now?", id="h2")]}, CONFIG)
        reason = {"truncate": "truncated", "wrong-model": "incompatible"}.get(damage, "mismatch")
        assert saver.restore_failures["t-1"].startswith(reason)
        assert "t-1" not in saver.restored_from  # nothing was loaded from it
        assert saver.threads.session("t-1").last_report.reused_tokens == 0  # re-prefilled instead
        messages = answer_graph(saver.threads, saver).get_state(CONFIG).values["messages"]
        assert [m.id for m in messages][:2] == ["s", "h"] and len(messages) == 5  # nothing lost


def test_storing_the_same_state_again_rewrites_a_damaged_blob(tmp_path):
    store = BlobStore(tmp_path)
    tensors = {"a": torch.arange(64, dtype=torch.float32)}
    ref = store.put(tensors)
    path = store.path(ref.sha256)
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, wrong bytes
    assert store.put(tensors) == ref
    loaded, _ = store.get(ref)  # whole again: the damaged copy was not trusted for deduplication
    assert torch.equal(loaded["a"], tensors["a"])


# ----------------------------------------------------------------------- garbage collection
def test_gc_removes_unreferenced_blobs_and_stale_temp_files_only(tmp_path):
    store = BlobStore(tmp_path)
    keep, orphan = store.put({"a": torch.ones(3)}), store.put({"a": torch.zeros(3)})
    stale = store.path(keep.sha256).parent / ".tmp-stale.safetensors"
    fresh = store.path(keep.sha256).parent / ".tmp-fresh.safetensors"
    stale.write_bytes(b"half a blob")
    fresh.write_bytes(b"a write in progress")
    old = time.time() - 3600
    for path in (store.path(keep.sha256), store.path(orphan.sha256), stale):
        os.utime(path, (old, old))
    assert store.collect_garbage({keep.sha256}, grace_s=60) == [orphan.sha256]
    assert not stale.exists() and fresh.exists() and store.temp_files_removed == 1
    assert store.digests() == {keep.sha256}


def test_a_restart_before_any_blob_was_written_records_why_it_reprefills(tmp_path, tokenizer, llama):
    db = tmp_path / "chk.sqlite"
    with KVCheckpointSaver.from_sqlite(db, layout="blobs") as plain:  # checkpoints only, as if killed before any blob
        answer_graph(ThreadCaches(llama, tokenizer), plain).invoke({"messages": [HumanMessage("Hi?", id="h")]}, CONFIG)
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(llama, tokenizer), layout="blobs") as saver:
        answer_graph(saver.threads, saver).invoke({"messages": [HumanMessage("Again?", id="h2")]}, CONFIG)
        assert saver.restore_failures["t-1"].startswith("none")


# ------------------------------------------------------------------ the reduced profile
@pytest.mark.real_model
def test_reduced_crash_profile_survives_every_kill(tmp_path, real):
    counts = run_crash_profile("reduced", seed=0, workdir=tmp_path)
    assert counts["ok"], counts["errors"]
    assert counts["kills"] >= 7 and counts["kills_survived"] == counts["kills"]
    assert counts["messages_lost"] == 0 and counts["corrupt_blobs_loaded"] == 0 and counts["silent_reprefills"] == 0
    assert counts["kills_embedded_model"] >= 2 and counts["targeted_kills"] >= 3
    assert counts["resumed_from_blob"] > 0 and counts["reprefilled"] > 0  # both outcomes were exercised
    assert counts["orphans_collected"] > 0 and counts["final_orphans"] == 0
    assert counts["corruptions_injected"] > 0
