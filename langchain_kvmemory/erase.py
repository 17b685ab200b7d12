"""Strict erase in the checkpoint store: remove deleted messages from every stored snapshot.

After a strict-erase repair (``erase="strict"``, see ``KVSession.prepare``) the live cache holds
nothing derived from the deleted messages; this module makes the store agree:

- checkpoints and pending writes whose values hold a deleted message are rewritten without it
  (same checkpoint ids and parents, so the thread and its history stay usable and no other
  message is lost);
- KV blobs that may derive from the deleted text are overwritten with zeros, fsynced and
  unlinked: every blob whose stored messages include a deleted id, and every blob of the thread
  holding stale rows (``exact_rows`` < rows: a Shift / SUR repair may carry deleted content);
  checkpoint metadata stops referencing them (the thread re-prefills on a restart if needed);
- SQLite keeps deleted bytes in free pages and in its write-ahead log: the rewrite runs with
  ``PRAGMA secure_delete``, then ``VACUUM`` and ``wal_checkpoint(TRUNCATE)``.

``SqliteSaver`` (langgraph-checkpoint-sqlite 3.1.2 has ``delete_thread`` only: no ``prune`` or
``delete_for_runs``) is rewritten in place in one transaction under the saver's lock, so it is
safe while a run of the thread is in progress. Any other saver is rewritten through its public
``list`` / ``delete_thread`` / ``put`` / ``put_writes`` (call that only while the thread is idle;
an ``AsyncSqliteSaver`` is vacuumed afterwards).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from langchain_core.messages import BaseMessage
from langgraph.checkpoint.base import BaseCheckpointSaver

from .blobs import BlobRef, BlobStore, header_metadata

log = logging.getLogger(__name__)


@dataclass
class EraseReport:
    """What a store purge did. Counts are stored items; ``blobs_deleted`` are sha256 digests;
    ``deferred``: ids still in the thread's newest checkpoint (not removed from the graph state:
    only left out of one model call, or replaced in place): that version is kept, older versions
    with other content are purged, and the id is checked again at later puts; with a saver that
    cannot be rewritten during a run, every id waits for an explicit call. ``sqlite``: the
    VACUUM / WAL truncation result (None for other savers)."""

    thread_id: str
    messages: list[str]
    checkpoints_rewritten: int = 0
    writes_rewritten: int = 0
    blobs_deleted: list[str] = field(default_factory=list)
    refs_dropped: int = 0
    deferred: list[str] = field(default_factory=list)
    sqlite: str | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["blobs_deleted"] = len(self.blobs_deleted)
        return out


# ------------------------------------------------------------------ values
_ABSENT = object()


@dataclass(frozen=True)
class Erasure:
    """Which stored messages go: those with an id in ``ids``, except the version the thread's
    newest checkpoint still holds (``current``: id -> content), which the user did not delete
    (a replaced message keeps its new content; a message only left out of a call stays)."""

    ids: frozenset[str]
    current: dict = field(default_factory=dict)

    def hits(self, message: BaseMessage) -> bool:
        return message.id in self.ids and self.current.get(message.id, _ABSENT) != message.content

    def hits_stored(self, held: dict) -> bool:
        """For a message dict of a blob's metadata (``{"id", "content", ...}``)."""
        return held.get("id") in self.ids and self.current.get(held.get("id"), _ABSENT) != held.get("content")


def contains_ids(value: Any, erasure: Erasure) -> bool:
    """Whether ``value`` (channel values, writes, nested lists / dicts) holds an erased message."""
    if isinstance(value, BaseMessage):
        return erasure.hits(value)
    if isinstance(value, dict):
        return any(contains_ids(v, erasure) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(contains_ids(v, erasure) for v in value)
    return False


def without_ids(value: Any, erasure: Erasure) -> Any:
    """``value`` with every erased message removed (lists, tuples and dicts are rebuilt; a
    message on its own becomes an empty list, the no-op update of ``add_messages``)."""
    if isinstance(value, BaseMessage):
        return [] if erasure.hits(value) else value
    if isinstance(value, dict):
        return {k: without_ids(v, erasure) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        kept = [without_ids(v, erasure) for v in value if not (isinstance(v, BaseMessage) and erasure.hits(v))]
        return type(value)(kept) if isinstance(value, tuple) else kept
    return value


def current_versions(channel_values: Any, ids: set[str]) -> dict:
    """id -> content of the messages with an id in ``ids`` found in ``channel_values``."""
    found: dict = {}

    def walk(value: Any) -> None:
        if isinstance(value, BaseMessage):
            if value.id in ids:
                found[value.id] = value.content
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(channel_values)
    return found


# ------------------------------------------------------------------- blobs
def tainted_blobs(store: BlobStore, erasure: Erasure, thread_refs: Iterable[str]) -> set[str]:
    """Blobs that may derive from the erased messages: any blob in ``store`` whose stored
    messages include an erased one, and any of the thread's blobs (``thread_refs``) holding
    stale rows or unreadable. Reads only the safetensors headers."""
    thread_refs = set(thread_refs)
    tainted = set()
    for sha in store.digests() | thread_refs:
        meta = _blob_metadata(store, sha)
        if meta is None:
            tainted.add(sha)  # unreadable: cannot prove it clean
            continue
        if any(erasure.hits_stored(m) for m in meta["messages"]) or (
                sha in thread_refs and meta["exact_rows"] < meta["rows"]):
            tainted.add(sha)
    return tainted


def _blob_metadata(store: BlobStore, sha: str) -> dict | None:
    path = store.path(sha)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            header = head + f.read(n)
        meta = header_metadata(header)
        rows = json.loads(header[8:])["token_ids"]["shape"][0]
        return {"messages": json.loads(meta.get("messages", "[]")), "exact_rows": int(meta.get("exact_rows", 0)),
                "rows": int(rows)}
    except FileNotFoundError:
        return {"messages": [], "exact_rows": 0, "rows": 0}  # nothing stored under that name
    except (OSError, ValueError, KeyError, TypeError):
        return None


def shred(store: BlobStore, sha: str) -> bool:
    """Overwrite a blob file with zeros, fsync and unlink it. Returns whether a file existed."""
    return shred_file(store.path(sha))


def shred_file(path) -> bool:
    """Overwrite a file with zeros, fsync and unlink it. Returns whether a file existed."""
    try:
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.write(bytes(size))
            f.flush()
            os.fsync(f.fileno())
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def _ref_sha(metadata: dict | None, key: str) -> str | None:
    raw = (metadata or {}).get(key)
    try:
        return BlobRef.from_dict(raw).sha256 if raw is not None else None
    except Exception:
        return None


# ------------------------------------------------------------------ SQLite
def is_sqlite_saver(saver: BaseCheckpointSaver) -> bool:
    return isinstance(getattr(saver, "conn", None), sqlite3.Connection) and hasattr(saver, "cursor")


def sqlite_refs(saver, thread_id: str, cache_key: str) -> list[str]:
    """Blob digests referenced by the thread's checkpoints (SqliteSaver)."""
    with saver.cursor(transaction=False) as cur:
        rows = cur.execute("SELECT metadata FROM checkpoints WHERE thread_id = ?", (thread_id,)).fetchall()
    return [sha for (meta,) in rows if (sha := _ref_sha(_json(meta), cache_key))]


def purge_sqlite(saver, thread_id: str, ids: Erasure, tainted: set[str], cache_key: str, report: EraseReport) -> None:
    """Rewrite the thread's rows of a SqliteSaver in place, in one transaction under its lock:
    checkpoints and writes without the erased messages, metadata without tainted blob refs.
    Then VACUUM and truncate the write-ahead log so no deleted page survives in the files."""
    serde = saver.serde
    saver.conn.execute("PRAGMA secure_delete = ON")  # freed cells and pages are zeroed
    with saver.cursor() as cur:
        rows = cur.execute("SELECT checkpoint_ns, checkpoint_id, type, checkpoint, metadata FROM checkpoints "
                           "WHERE thread_id = ?", (thread_id,)).fetchall()
        for ns, cid, type_, blob, meta in rows:
            checkpoint = serde.loads_typed((type_, blob))
            metadata = _json(meta)
            changed = contains_ids(checkpoint, ids) or contains_ids(metadata, ids)
            if _ref_sha(metadata, cache_key) in tainted:
                metadata = {k: v for k, v in metadata.items() if k != cache_key}
                report.refs_dropped += 1
                changed = True
            if not changed:
                continue
            new_type, new_blob = serde.dumps_typed(without_ids(checkpoint, ids))
            new_meta = json.dumps(without_ids(metadata, ids), ensure_ascii=False).encode("utf-8", "ignore")
            cur.execute("UPDATE checkpoints SET type = ?, checkpoint = ?, metadata = ? WHERE thread_id = ? AND "
                        "checkpoint_ns = ? AND checkpoint_id = ?", (new_type, new_blob, new_meta, thread_id, ns, cid))
            report.checkpoints_rewritten += 1
        writes = cur.execute("SELECT checkpoint_ns, checkpoint_id, task_id, idx, type, value FROM writes "
                             "WHERE thread_id = ?", (thread_id,)).fetchall()
        for ns, cid, task, idx, type_, blob in writes:
            value = serde.loads_typed((type_, blob))
            if not contains_ids(value, ids):
                continue
            new_type, new_blob = serde.dumps_typed(without_ids(value, ids))
            cur.execute("UPDATE writes SET type = ?, value = ? WHERE thread_id = ? AND checkpoint_ns = ? AND "
                        "checkpoint_id = ? AND task_id = ? AND idx = ?", (new_type, new_blob, thread_id, ns, cid, task, idx))
            report.writes_rewritten += 1
    rewritten = report.checkpoints_rewritten or report.writes_rewritten or report.refs_dropped
    report.sqlite = vacuum(saver) if rewritten else "nothing to rewrite"


def vacuum(saver) -> str:
    """VACUUM the saver's database and truncate its WAL. Returns a short status."""
    with saver.cursor(transaction=False) as cur:
        try:
            cur.execute("VACUUM")
            busy, _, _ = cur.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.OperationalError as exc:  # another connection holds a read transaction
            log.warning("kvmemory: strict erase: VACUUM / WAL truncation did not run (%s): deleted bytes may stay "
                        "in free pages until the next VACUUM", exc)
            return f"not vacuumed: {exc}"
    return "vacuumed, WAL truncated" if not busy else "vacuumed, WAL busy (another reader)"


def vacuum_async_sqlite(saver) -> str | None:
    """VACUUM + WAL truncation for an ``AsyncSqliteSaver`` (aiosqlite connection and event loop),
    from a worker thread. Returns a status, or None when ``saver`` is not one."""
    conn, loop = getattr(saver, "conn", None), getattr(saver, "loop", None)
    if loop is None or not type(conn).__module__.startswith("aiosqlite"):
        return None

    async def run() -> str:
        async with saver.lock:
            await conn.execute("VACUUM")
            cursor = await conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            busy, _, _ = await cursor.fetchone()
        return "vacuumed, WAL truncated" if not busy else "vacuumed, WAL busy (another reader)"

    try:
        return asyncio.run_coroutine_threadsafe(run(), loop).result()
    except sqlite3.OperationalError as exc:
        log.warning("kvmemory: strict erase: VACUUM did not run (%s): deleted bytes may stay in free pages", exc)
        return f"not vacuumed: {exc}"


def _json(raw) -> dict:
    if raw is None:
        return {}
    return json.loads(raw.decode() if isinstance(raw, (bytes, bytearray)) else raw)


# ----------------------------------------------------------- other savers
def purge_generic(saver: BaseCheckpointSaver, thread_id: str, ids: Erasure, tainted: set[str], cache_key: str,
                  report: EraseReport) -> None:
    """Rewrite a thread through the public saver API: read every checkpoint and pending write,
    delete the thread, put them back (oldest first) without the erased messages and tainted
    blob refs. Not atomic: call it while no run of the thread is in progress."""
    tuples = list(saver.list({"configurable": {"thread_id": thread_id}}))
    if not any(contains_ids(t.checkpoint, ids) or contains_ids(t.pending_writes, ids)
               or _ref_sha(t.metadata, cache_key) in tainted for t in tuples):
        return
    saver.delete_thread(thread_id)
    for tup in reversed(tuples):
        conf = tup.config["configurable"]
        parent = (tup.parent_config or {}).get("configurable", {}).get("checkpoint_id")
        config = {"configurable": {"thread_id": thread_id, "checkpoint_ns": conf.get("checkpoint_ns", ""),
                                   **({"checkpoint_id": parent} if parent else {})}}
        metadata = dict(tup.metadata or {})
        if _ref_sha(metadata, cache_key) in tainted:
            metadata.pop(cache_key)
            report.refs_dropped += 1
        if contains_ids(tup.checkpoint, ids):
            report.checkpoints_rewritten += 1
        checkpoint = without_ids(tup.checkpoint, ids)
        stored = saver.put(config, checkpoint, without_ids(metadata, ids), checkpoint["channel_versions"])
        grouped: dict[str, list] = {}
        for task_id, channel, value in tup.pending_writes or []:
            if contains_ids(value, ids):
                report.writes_rewritten += 1
            grouped.setdefault(task_id, []).append((channel, without_ids(value, ids)))
        for task_id, writes in grouped.items():
            saver.put_writes(stored, writes, task_id)
    report.sqlite = vacuum_async_sqlite(saver) if report.checkpoints_rewritten or report.writes_rewritten \
        or report.refs_dropped else None
