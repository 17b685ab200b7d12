"""A LangGraph checkpointer that also keeps each thread's live KV cache across process restarts.

``KVCheckpointSaver`` wraps any LangGraph saver (by default the SQLite savers of
``langgraph-checkpoint-sqlite``) and adds one thing: whenever a checkpoint of a thread is stored,
the thread's live cache (token ids, per-layer K/V, the messages it holds) is written out of line
as a safetensors blob in a content-addressed store next to the database, and the blob's sha256
and size go into the checkpoint's metadata under ``"kvmemory_cache"``.

The link to the chat model is its thread registry (:class:`kvmemory.threads.ThreadCaches`):

- ``put`` / ``aput`` export the thread's cache state from the registry (skipped when nothing
  changed since the last put of that thread, so tool steps cost no K/V write);
- ``get_tuple`` / ``aget_tuple`` (LangGraph reads the thread's latest checkpoint at the start of
  every run) import the newest stored blob into the registry when the thread is not live in this
  process, so the next turn resumes from it (``cache_read`` > 0, no Re-prefill).

A missing, truncated or mismatching blob, or one computed by another model, is detected (size,
sha256, layout and base-weights digest checks), logged with its reason and recorded in :attr:`restore_failures`; the
thread then simply re-prefills from the checkpointed messages (a thread with no blob at all,
e.g. after a crash before its first blob was written, is recorded with reason ``none``), and the
repair report of its next call says why in ``fallback`` (that call only). A block store that
does not answer (reason ``unreachable``) is handled the same way, and a cache it could not store
after a turn is logged and recorded in :attr:`persist_failures`: the turn is never lost. The
blob a thread resumed from is in :attr:`restored_from`. Checkpoints themselves are always stored
and read by the wrapped saver unchanged: a blob problem never loses a message.

Crash safety: a blob is complete under its name before the checkpoint naming it is written (see
:mod:`.blobs`); a crash in between leaves an unreferenced blob or a temporary file, which
:meth:`KVCheckpointSaver.collect_garbage` removes. When the registry evicts a thread (memory
budget), the saver writes the thread's state first and names that blob in the thread's next
checkpoint, so the thread resumes from exactly the state it had, even when the eviction came
between its model call and that call's checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from contextlib import asynccontextmanager, contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Literal, Sequence

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
)

from kvmemory.errors import CacheStateError, InputError, InputTypeError
from kvmemory.persistence import CacheState, export_state
from kvmemory.threads import ThreadCaches

from .blobs import BlobError, BlobRef, BlobStore
from .blockpersist import BlockPersistence
from .blockstore import BlockStore, open_block_store, store_unreachable
from .kvblocks import DEFAULT_BLOCK_TOKENS
from .erase import Erasure, EraseReport, current_versions, is_sqlite_saver, purge_generic, purge_sqlite, shred, \
    sqlite_refs, tainted_blobs

log = logging.getLogger(__name__)

CACHE_KEY = "kvmemory_cache"  # checkpoint metadata key holding {"sha256", "size", "tokens"}
BLOB_DIR_SUFFIX = ".kvcache"  # <database file>.kvcache/ holds the blobs


def registry_of(holder: Any) -> ThreadCaches:
    """The thread registry of ``holder``: a ThreadCaches, or an object (such as the chat model)
    exposing one as ``.threads`` or ``.caches``.

    Raises:
        TypeError: ``holder`` has no thread registry.
    """
    if isinstance(holder, ThreadCaches):
        return holder
    for name in ("threads", "caches"):
        found = getattr(holder, name, None)
        if isinstance(found, ThreadCaches):
            return found
    raise TypeError(
        f"{type(holder).__name__} has no kvmemory thread registry: pass the chat model (ChatKVMemory) "
        "or its ThreadCaches as caches="
    )


def _thread_and_ns(config: RunnableConfig) -> tuple[str | None, str]:
    conf = (config or {}).get("configurable", {})
    tid = conf.get("thread_id")
    return (None if tid is None else str(tid)), conf.get("checkpoint_ns", "")


class KVCheckpointSaver(BaseCheckpointSaver):
    """Wraps ``saver`` and persists each thread's live KV cache beside its checkpoints.

    Args:
        saver: any LangGraph checkpoint saver; all checkpoint storage is delegated to it.
        caches: the chat model (or its :class:`ThreadCaches`) whose live caches are persisted;
            None stores checkpoints only (a plain pass-through).
        blob_dir: folder of the cache store on this machine (token blocks, or blobs with
            ``layout="blobs"``); default ``<database>.kvcache`` next to the file of a
            ``SqliteSaver`` (required for other savers and in-memory databases unless
            ``block_store`` is given).
        search_depth: how many older checkpoints of a thread to look through for the newest
            blob reference when the requested checkpoint has none.
        keeps_history: whether ``saver`` keeps a thread's older checkpoints (answers
            ``list(before=...)``); None detects it: False for savers that keep only the newest
            checkpoint (LangGraph's ``ShallowPostgresSaver`` / ``AsyncShallowPostgresSaver``),
            whose newest checkpoint alone is searched for a blob reference.
        block_store: the store of the content-addressed token blocks (a
            :class:`~.blockstore.BlockStore`, a folder, or a ``redis://`` / ``postgresql://``
            URL; default: the filesystem store in ``blob_dir``); see :mod:`.blockpersist`. A
            shared store is what several workers need: each resumes a thread from the newest
            stored state.
        block_tokens: rows per block (block layout).
        keep_states: retention (block layout): :meth:`collect_garbage` keeps the blocks of the
            newest ``keep_states`` cache states of each thread (None: all that checkpoints name).
        worker_id: this worker's name in checkpoint metadata and leases (block layout).
        layout: ``"blocks"`` (default: consecutive states and threads share unchanged blocks) or
            ``"blobs"`` (one self-contained blob per stored state, the earlier layout; kept as the
            reference the persistence benchmark compares with).
        delete_blocks: block layout: deleting checkpoints (``delete_thread``, ``prune``,
            ``delete_for_runs``) also shreds at once the blocks that their states named and that
            no remaining checkpoint, evicted state or live cache of this saver names (blocks
            shared with other threads stay). For a block store this process alone writes (one
            server over a folder); default False leaves blocks to :meth:`collect_garbage`,
            whose grace period protects other workers' writes in flight.

    The wrapped saver's contract is kept: ``prune`` / ``aprune`` / ``delete_for_runs`` /
    ``adelete_for_runs`` exist exactly when ``saver`` implements them (so LangGraph's capability
    checks see the same saver), and any other public attribute of ``saver`` (``setup``,
    ``conn``, ``from_conn_string`` connections' ``cursor`` ...) is read through from it, sync or
    async as ``saver`` defines it. Deleting checkpoints (``delete_thread``, ``prune``,
    ``delete_for_runs``) also shreds the blobs (block layout: the manifests) that only they
    referenced; blocks are left to :meth:`collect_garbage`, whose grace period protects other
    workers' writes in flight (``delete_blocks`` shreds the unshared ones at once). ``with`` /
    ``async with`` enter the wrapped saver when it is a context manager and close, on exit, the
    block store this saver opened from a URL or folder.

    Raises:
        ValueError: no ``blob_dir`` nor ``block_store``, and no folder can be derived from ``saver``, or bad
            ``block_tokens`` / ``keep_states``.
        TypeError: ``caches`` has no thread registry.
        InputTypeError (TypeError): ``saver`` is not a LangGraph checkpoint saver.
        InputError (ValueError): ``search_depth`` not an int >= 1, ``blob_dir`` is a file, or
            ``keeps_history`` not a bool / None.
    """

    def __new__(cls, saver: BaseCheckpointSaver | None = None, *args, **kwargs):
        # the optional deletions exist on the wrapper's type exactly when the wrapped saver has them
        missing = frozenset(m for m in OPTIONAL_METHODS if isinstance(saver, BaseCheckpointSaver)
                            and not _overrides(saver, m))
        return super().__new__(_variant(cls, missing))

    def __init__(
        self,
        saver: BaseCheckpointSaver,
        caches: Any = None,
        *,
        blob_dir: str | Path | None = None,
        search_depth: int = 8,
        block_store: BlockStore | str | Path | None = None,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        keep_states: int | None = None,
        worker_id: str | None = None,
        layout: Literal["blocks", "blobs"] = "blocks",
        keeps_history: bool | None = None,
        delete_blocks: bool = False,
    ):
        _check_saver_arguments(saver, blob_dir, search_depth)
        block_store = _block_store_for(layout, block_store, blob_dir, saver)
        super().__init__(serde=saver.serde)
        self.saver = saver
        self.threads = registry_of(caches) if caches is not None else None
        self.blocks: BlockPersistence | None = None
        self._opened: list = []  # what this saver opened itself and closes on exit
        self._entered = False
        if block_store is not None:
            store = block_store if isinstance(block_store, BlockStore) else open_block_store(block_store)
            if store is not block_store:
                self._opened.append(store)
            self.blocks = BlockPersistence(store, block_tokens=block_tokens, keep_states=keep_states,
                                           worker_id=worker_id)
        self.store = None if self.blocks is not None else \
            BlobStore(blob_dir if blob_dir is not None else _default_blob_dir(saver))
        self.search_depth = search_depth
        if keeps_history is not None and not isinstance(keeps_history, bool):
            raise InputError(f"keeps_history must be True, False or None to detect it (got {keeps_history!r})")
        self.keeps_history = _keeps_history(saver) if keeps_history is None else keeps_history
        if not isinstance(delete_blocks, bool):
            raise InputError(f"delete_blocks must be True or False (got {delete_blocks!r})")
        self.delete_blocks = delete_blocks
        self.restore_failures: dict[str, str] = {}  # thread id -> why its stored cache was not used
        self.restored_from: dict[str, str] = {}  # thread id -> sha256 of the verified blob it resumed from
        self.persist_failures: dict[str, str] = {}  # thread id -> why its last checkpoint names no live cache
        self._stored: dict[str, tuple[tuple, BlobRef, dict]] = {}  # thread id -> (fingerprint, blob, metadata entry)
        self._rejected: set[tuple[str, str]] = set()  # (thread id, sha256) found unusable: not retried
        self.erase_reports: dict[str, EraseReport] = {}  # thread id -> its last strict-erase purge
        self._pending_erase: dict[str, set[str]] = {}  # ids erased but still in the thread's newest checkpoint
        self._evicted: dict[str, tuple[BlobRef, dict]] = {}  # thread id -> (blob, metadata entry) when evicted
        self._erase_lock = threading.RLock()
        self._block_lock = threading.Lock()  # block writes vs delete_blocks (innermost: takes no other lock)
        if self.threads is not None:
            self.threads.erase_stores.add(self)
            self._persist_on_evict()

    # ------------------------------------------------------------ builders
    @classmethod
    @contextmanager
    def from_sqlite(cls, path: str | Path, caches: Any = None, **kwargs) -> Iterator["KVCheckpointSaver"]:
        """A saver over ``SqliteSaver`` on the database file ``path`` (blobs in ``<path>.kvcache``);
        the connection closes when the context ends.

        ``path`` may be ``":memory:"`` with ``blob_dir=`` (or ``block_store=``): the checkpoints
        then live as long as the connection, the blobs in that folder.

        Raises:
            ValueError: ``path`` is ``":memory:"`` and neither ``blob_dir`` nor ``block_store``
                is given (an in-memory database has no folder to put blobs next to).
        """
        from langgraph.checkpoint.sqlite import SqliteSaver

        _default_blob_dir_for(path, kwargs)
        with SqliteSaver.from_conn_string(str(path)) as saver, cls(saver, caches, **kwargs) as wrapped:
            yield wrapped

    @classmethod
    @asynccontextmanager
    async def afrom_sqlite(cls, path: str | Path, caches: Any = None, **kwargs) -> AsyncIterator["KVCheckpointSaver"]:
        """Like :meth:`from_sqlite`, over ``AsyncSqliteSaver`` (for ``ainvoke`` / ``astream``)."""
        from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

        _default_blob_dir_for(path, kwargs)
        async with AsyncSqliteSaver.from_conn_string(str(path)) as saver, cls(saver, caches, **kwargs) as wrapped:
            yield wrapped

    # ------------------------------------------------ delegated basics
    def __getattr__(self, name: str) -> Any:
        """Public attributes the wrapper lacks are the wrapped saver's (``setup``, ``conn``,
        ``cursor``, ``storage`` ...); private names are not forwarded."""
        saver = self.__dict__.get("saver")
        if saver is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(saver, name)

    def __enter__(self) -> "KVCheckpointSaver":
        if hasattr(type(self.saver), "__enter__"):
            self.saver.__enter__()
            self._entered = True
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if self._entered:
                self._entered = False
                return self.saver.__exit__(exc_type, exc, tb)
        finally:
            self.close()

    async def __aenter__(self) -> "KVCheckpointSaver":
        if hasattr(type(self.saver), "__aenter__"):
            await self.saver.__aenter__()
            self._entered = True
        elif hasattr(type(self.saver), "__enter__"):
            self.saver.__enter__()
            self._entered = True
        return self

    async def __aexit__(self, exc_type, exc, tb):
        try:
            if self._entered:
                self._entered = False
                if hasattr(type(self.saver), "__aexit__"):
                    return await self.saver.__aexit__(exc_type, exc, tb)
                return self.saver.__exit__(exc_type, exc, tb)
        finally:
            self.close()

    def close(self) -> None:
        """Close what this saver opened itself (a block store built from a URL or folder); the
        wrapped saver and a store passed in as an object belong to the caller."""
        while self._opened:
            self._opened.pop().close()

    @property
    def config_specs(self) -> list:
        return self.saver.config_specs

    def get_next_version(self, current, channel=None):
        return self.saver.get_next_version(current, channel)

    def with_allowlist(self, extra_allowlist):
        inner = self.saver.with_allowlist(extra_allowlist)
        if inner is self.saver:
            return self
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)  # shares the store, registry and bookkeeping
        clone.saver, clone.serde = inner, inner.serde
        return clone

    def get_delta_channel_history(self, *, config, channels):
        return self.saver.get_delta_channel_history(config=config, channels=channels)

    async def aget_delta_channel_history(self, *, config, channels):
        return await self.saver.aget_delta_channel_history(config=config, channels=channels)

    # ------------------------------------------------------------- sync API
    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The wrapped saver's tuple; restores the thread's stored cache if it is not live."""
        tup = self.saver.get_tuple(config)
        if tup is not None and self.blocks is not None:
            if self._is_root_thread(tup):
                self._sync_blocks(tup, self._older_sync(tup))
        elif tup is not None and self._wants_restore(tup):
            ref = self._evicted_ref(tup) or self._newest_ref(tup, self._older_sync(tup))
            if ref is not None:
                self._restore(_thread_and_ns(tup.config)[0], ref)
        return tup

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """The wrapped saver's checkpoints (metadata includes ``kvmemory_cache`` where stored)."""
        return self.saver.list(config, filter=filter, before=before, limit=limit)

    def put(
        self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata, new_versions: ChannelVersions
    ) -> RunnableConfig:
        """Store the thread's live cache as a blob, then the checkpoint (metadata names the blob).
        Messages strictly erased from the thread's live cache are then purged from the store."""
        stored = self.saver.put(config, checkpoint, self._with_cache_ref(config, metadata), new_versions)
        self._purge_after_put(config)
        return stored

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = "") -> None:
        """Delegated unchanged (pending writes hold no cache state)."""
        return self.saver.put_writes(config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        """Delete the thread's checkpoints, forget its live cache and shred the blobs (block
        layout: manifests) no remaining checkpoint references."""
        entries = self._entries(self.saver.list({"configurable": {"thread_id": str(thread_id)}}))
        self.saver.delete_thread(thread_id)
        self._forget(thread_id)
        self._release(entries, lambda: self.saver.list(None))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """The wrapped saver's ``prune`` (present only when it has one); then shreds the blobs
        (block layout: manifests) that only the pruned checkpoints referenced. ``"delete"`` also
        forgets the threads' live caches; ``"keep_latest"`` keeps them (the newest checkpoint,
        which they belong to, stays)."""
        entries = self._entries(t for tid in _thread_list(thread_ids)
                                for t in self.saver.list({"configurable": {"thread_id": tid}}))
        self.saver.prune(thread_ids, strategy=strategy)
        if strategy == "delete":
            for tid in _thread_list(thread_ids):
                self._forget(tid)
        self._release(entries, lambda: self.saver.list(None))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """The wrapped saver's ``delete_for_runs`` (present only when it has one); the threads
        those runs wrote to lose their live caches (which hold the runs' messages) and the blobs
        only the deleted checkpoints referenced are shredded."""
        doomed = [t for run in run_ids for t in self.saver.list(None, filter={"run_id": run})]
        self.saver.delete_for_runs(run_ids)
        for tid in {_thread_and_ns(t.config)[0] for t in doomed}:
            self._forget(tid)
        self._release(self._entries(doomed), lambda: self.saver.list(None))

    # ------------------------------------------------------------ async API
    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Async :meth:`get_tuple` (blob reading and import run in a worker thread)."""
        tup = await self.saver.aget_tuple(config)
        if tup is not None and self.blocks is not None:
            if self._is_root_thread(tup):
                await asyncio.to_thread(self._sync_blocks, tup, await self._older_async(tup))
        elif tup is not None and self._wants_restore(tup):
            ref = self._evicted_ref(tup)
            if ref is None:
                ref = self._newest_ref(tup, await self._older_async(tup))
            if ref is not None:
                await asyncio.to_thread(self._restore, _thread_and_ns(tup.config)[0], ref)
        return tup

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Async :meth:`list`."""
        async for tup in self.saver.alist(config, filter=filter, before=before, limit=limit):
            yield tup

    async def aput(
        self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata, new_versions: ChannelVersions
    ) -> RunnableConfig:
        """Async :meth:`put` (serialising and writing the blob run in a worker thread)."""
        if self._has_live_thread(config):  # serialising K/V is blocking file work: off the event loop
            metadata = await asyncio.to_thread(self._with_cache_ref, config, metadata)
        else:
            metadata = self._with_cache_ref(config, metadata)  # no file work: at most an evicted thread's ref
        stored = await self.saver.aput(config, checkpoint, metadata, new_versions)
        if self._erasures_due(config):
            await asyncio.to_thread(self._purge_after_put, config)
        return stored

    async def aput_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        """Async :meth:`put_writes`."""
        return await self.saver.aput_writes(config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        """Async :meth:`delete_thread`."""
        entries = self._entries([t async for t in self.saver.alist({"configurable": {"thread_id": str(thread_id)}})])
        await self.saver.adelete_thread(thread_id)
        self._forget(thread_id)
        await self._arelease(entries)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Async :meth:`prune`."""
        entries = self._entries([t for tid in _thread_list(thread_ids)
                                 async for t in self.saver.alist({"configurable": {"thread_id": tid}})])
        await self.saver.aprune(thread_ids, strategy=strategy)
        if strategy == "delete":
            for tid in _thread_list(thread_ids):
                self._forget(tid)
        await self._arelease(entries)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Async :meth:`delete_for_runs`."""
        doomed = [t for run in run_ids async for t in self.saver.alist(None, filter={"run_id": run})]
        await self.saver.adelete_for_runs(run_ids)
        for tid in {_thread_and_ns(t.config)[0] for t in doomed}:
            self._forget(tid)
        await self._arelease(self._entries(doomed))

    # ------------------------------------------------- blobs of deleted checkpoints
    @staticmethod
    def _entries(tuples) -> dict[str, dict]:
        """sha256 -> cache entry, for the checkpoints ``tuples``."""
        return {raw["sha256"]: raw for t in tuples
                if isinstance(raw := (t.metadata or {}).get(CACHE_KEY), dict) and "sha256" in raw}

    def _release(self, entries: dict[str, dict], remaining) -> list[str]:
        """Shred the blobs of ``entries`` (deleted checkpoints' references) that no checkpoint
        ``remaining()`` yields (every stored one; read only when there is something to release)
        nor an evicted thread names. Block layout: the manifests (their blocks may be shared:
        they wait for collect_garbage). Returns the shredded sha256s."""
        if not entries:
            return []
        kept = [*self._entries(remaining()).values(), *(entry for _, entry in self._evicted.values())]
        keep = {raw["sha256"] for raw in kept if "sha256" in raw} | {ref.sha256 for ref, _ in self._evicted.values()}
        doomed = sorted(set(entries) - keep)
        with self._erase_lock:  # a strict-erase purge may shred the same files
            if self.blocks is not None:
                gone = [sha for sha in doomed if self.blocks.store.delete(f"manifest/{sha}", shred=True)]
                if self.delete_blocks:
                    self._drop_blocks(entries, kept)
            else:
                gone = [sha for sha in doomed if shred(self.store, sha)]
            for tid, (_, ref, _) in list(self._stored.items()):
                if ref.sha256 in gone:
                    self._stored.pop(tid, None)
        if gone:
            log.info("kvmemory: shredded %d cache blobs only deleted checkpoints referenced", len(gone))
        return gone

    def _drop_blocks(self, released: dict[str, dict], kept: list[dict]) -> list[str]:
        """``delete_blocks``: shred the blocks ``released`` entries name that no ``kept`` entry
        nor live cache of this saver names. Under the block lock, so a state being written now
        either is in ``live_blocks`` already or checks its blocks' presence afterwards."""
        named = {key for raw in released.values() for key in raw.get("blocks", ())}
        with self._block_lock:
            keep = {key for raw in kept for key in raw.get("blocks", ())}
            keep |= {ref.key for _, refs in list(self.blocks.live_blocks.values()) for ref in refs}
            gone = [key for key in sorted(named - keep) if self.blocks.store.delete(f"block/{key}", shred=True)]
        if gone:
            log.info("kvmemory: shredded %d blocks only deleted checkpoints named", len(gone))
        return gone

    async def _arelease(self, entries: dict[str, dict]) -> list[str]:
        if not entries:
            return []
        remaining = [t async for t in self.saver.alist(None)]
        return await asyncio.to_thread(self._release, entries, lambda: remaining)

    # --------------------------------------------------------- copy_thread
    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy all checkpoints and pending writes of a thread (blob references included: the
        copy shares the content-addressed blobs and restores from them on first use). Uses the
        wrapped saver's own ``copy_thread`` when it has one, else its public put/list methods."""
        if _overrides(self.saver, "copy_thread"):
            return self.saver.copy_thread(source_thread_id, target_thread_id)
        tuples = list(self.saver.list({"configurable": {"thread_id": str(source_thread_id)}}))
        for tup in reversed(tuples):  # oldest first, so parents exist before their children
            config, metadata, writes = _copied(tup, str(target_thread_id))
            stored = self.saver.put(config, tup.checkpoint, metadata, tup.checkpoint["channel_versions"])
            for task_id, task_writes in writes:
                self.saver.put_writes(stored, task_writes, task_id)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Async :meth:`copy_thread`."""
        if _overrides(self.saver, "acopy_thread"):
            return await self.saver.acopy_thread(source_thread_id, target_thread_id)
        tuples = [t async for t in self.saver.alist({"configurable": {"thread_id": str(source_thread_id)}})]
        for tup in reversed(tuples):
            config, metadata, writes = _copied(tup, str(target_thread_id))
            stored = await self.saver.aput(config, tup.checkpoint, metadata, tup.checkpoint["channel_versions"])
            for task_id, task_writes in writes:
                await self.saver.aput_writes(stored, task_writes, task_id)

    # ------------------------------------------------------------ strict erase
    def erase_messages(self, thread_id: str, message_ids, *, live_clean: bool = False,
                       during_run: bool = False, recheck: bool = False) -> EraseReport:
        """Strict erase in the store: remove the messages ``message_ids`` of thread ``thread_id``
        from every stored snapshot (see :mod:`langchain_kvmemory.erase`).

        Checkpoints and pending writes holding them are rewritten without them (ids, parents and
        every other message kept); KV blobs that may derive from them are overwritten, fsynced and
        unlinked, and their references dropped; a SQLite database is vacuumed and its WAL
        truncated. The version of a message that the thread's newest checkpoint still holds stays
        (a message replaced in place keeps its new content; one only left out of a model call
        stays whole) and its id is reported as ``deferred``; ``recheck`` (the chat model's call
        during a run, when LangGraph may not have stored the removal yet) checks it again at the
        next ``put``. A live cache of the thread that may hold an erased version (``live_clean``
        False) is dropped; its next turn re-prefills. ``during_run`` (automatic purges): a saver
        that cannot be rewritten atomically (not a SqliteSaver) is left alone and every id waits
        in :meth:`pending_erasures` for a call on the idle thread.

        Returns:
            EraseReport (counts of checkpoints / writes rewritten, blobs deleted, deferred ids).
        Raises:
            sqlite3.Error / OSError: the store could not be rewritten (nothing is reported erased).
        """
        with self._erase_lock:  # the put hook (a background thread) and a model call may purge at once
            return self._erase_messages(str(thread_id), {str(i) for i in message_ids}, live_clean, during_run, recheck)

    def _erase_messages(self, tid: str, ids: set[str], live_clean: bool, during_run: bool,
                        recheck: bool) -> EraseReport:
        report = EraseReport(tid, sorted(ids))
        newest = self.saver.get_tuple({"configurable": {"thread_id": tid, "checkpoint_ns": ""}})
        current = current_versions(newest.checkpoint["channel_values"], ids) if newest is not None else {}
        report.deferred = sorted(current)
        if during_run and not is_sqlite_saver(self.saver):
            waiting = self._pending_erase.setdefault(tid, set())
            fresh, report.deferred = ids - waiting, sorted(ids)
            waiting.update(ids)
            if fresh:
                log.warning("kvmemory: %s cannot be rewritten atomically during a run: call erase_messages(%r, %s) "
                            "while the thread is idle to purge the stored snapshots", type(self.saver).__name__, tid,
                            sorted(ids))
        else:
            self._purge(tid, Erasure(frozenset(ids), current), live_clean, report)
            pending = self._pending_erase.get(tid)
            if pending is not None:
                pending -= ids
            if current and recheck:
                self._pending_erase.setdefault(tid, set()).update(current)
        self.erase_reports[tid] = report
        log.info("kvmemory: strict erase of %s in thread %r: %d checkpoints and %d writes rewritten, %d blobs "
                 "deleted%s", sorted(ids), tid, report.checkpoints_rewritten, report.writes_rewritten,
                 len(report.blobs_deleted), f"; still in the graph state: {report.deferred}" if report.deferred else "")
        return report

    async def aerase_messages(self, thread_id: str, message_ids, *, live_clean: bool = False) -> EraseReport:
        """Async :meth:`erase_messages` (runs in a worker thread; call it while the thread is idle)."""
        return await asyncio.to_thread(self.erase_messages, thread_id, message_ids, live_clean=live_clean)

    def defer_erasures(self, thread_id: str, message_ids) -> None:
        """Keep ``message_ids`` of thread ``thread_id`` for the purge at its next checkpoint (a
        purge that failed now, e.g. a locked database)."""
        self._pending_erase.setdefault(str(thread_id), set()).update(str(i) for i in message_ids)

    def pending_erasures(self, thread_id: str) -> list[str]:
        """Ids strictly erased from the thread's cache whose stored snapshots are not purged yet."""
        return sorted(self._pending_erase.get(str(thread_id), ()))

    def _purge(self, tid: str, ids: Erasure, live_clean: bool, report: EraseReport) -> None:
        sqlite = is_sqlite_saver(self.saver)
        refs = sqlite_refs(self.saver, tid, CACHE_KEY) if sqlite else [
            sha for t in self.saver.list({"configurable": {"thread_id": tid}}) if (sha := _sha_of(t.metadata))]
        if tid in self._evicted:  # the state written at eviction is the thread's blob too
            refs = [*refs, self._evicted[tid][0].sha256]
        if self.blocks is not None:  # manifests are the blobs; blocks they name are shredded too
            tainted, blocks = self.blocks.tainted(ids, set(refs))
        else:
            tainted = tainted_blobs(self.store, ids, refs)
        (purge_sqlite if sqlite else purge_generic)(self.saver, tid, ids, tainted, CACHE_KEY, report)
        if self.blocks is not None:
            report.blobs_deleted = sorted(self.blocks.shred(tainted, blocks))
        else:
            report.blobs_deleted = sorted(sha for sha in tainted if shred(self.store, sha))
        for key, (_, ref, _) in list(self._stored.items()):
            if ref.sha256 in tainted:
                self._stored.pop(key, None)
        if tid in self._evicted and self._evicted[tid][0].sha256 in tainted:
            self._evicted.pop(tid)
        if self.threads is not None and not live_clean:
            session = self.threads.session(tid) if tid in self.threads else None
            held = [{"id": m.key, "content": m.content} for m in session.messages] if session is not None else []
            if session is not None and (any(map(ids.hits_stored, held)) or session.exact_rows < len(session.token_ids)):
                self.threads.drop(tid)

    def _erasures_due(self, config: RunnableConfig) -> bool:
        if not self._has_live_thread(config):
            return False
        tid = _thread_and_ns(config)[0]
        return bool(self.threads.session(tid).pending_erasures or self._pending_erase.get(tid))

    def _purge_after_put(self, config: RunnableConfig) -> None:
        """After a root checkpoint of a live thread: purge what its cache strictly erased since.

        A session's erasures are taken only while its thread is idle: during a call the caller
        holding the lease (the chat model) purges them itself and reports it, so the two never
        race for the same ids."""
        if not self._erasures_due(config):
            return
        tid = _thread_and_ns(config)[0]
        with self.threads.idle(tid) as session:
            taken = session.take_erasures() if session is not None else []
        ids = set(taken) | self._pending_erase.pop(tid, set())
        if ids:
            try:
                self.erase_messages(tid, ids, live_clean=True, during_run=True)
            except (OSError, sqlite3.Error) as exc:
                self._pending_erase.setdefault(tid, set()).update(ids)
                log.warning("kvmemory: strict erase of thread %r not purged from the store yet (%s); retried at "
                            "the next checkpoint", tid, exc)

    # ----------------------------------------------------- blob housekeeping
    def collect_garbage(self, *, grace_s: float = 300.0) -> list[str]:
        """Delete blobs no stored checkpoint references (older than ``grace_s`` seconds).

        Reads every checkpoint's metadata through the wrapped saver. Returns the deleted sha256s
        (block layout: the deleted ``manifest/…`` and ``block/…`` keys, keeping only the blocks of
        each thread's newest ``keep_states`` states; older checkpoints of a thread then no longer
        restore a cache, their messages stay).
        """
        if self.blocks is not None:
            return self.blocks.collect_garbage(self.saver.list(None), self._evicted_entries(), grace_s)
        keep = {_ref_of(t.metadata).sha256 for t in self.saver.list(None) if _ref_of(t.metadata)}
        return self.store.collect_garbage(keep, grace_s=grace_s)

    async def acollect_garbage(self, *, grace_s: float = 300.0) -> list[str]:
        """Async :meth:`collect_garbage`."""
        tuples = [t async for t in self.saver.alist(None)]
        if self.blocks is not None:
            return await asyncio.to_thread(self.blocks.collect_garbage, tuples, self._evicted_entries(), grace_s)
        keep = {_ref_of(t.metadata).sha256 for t in tuples if _ref_of(t.metadata)}
        return await asyncio.to_thread(self.store.collect_garbage, keep, grace_s=grace_s)

    def _evicted_entries(self) -> list[dict]:
        return [entry for _, entry in self._evicted.values() if entry.get("layout") == "blocks"]

    # ------------------------------------------------------- many workers
    def lease_thread(self, thread_id: str, *, ttl_s: float = 30.0, wait_s: float | None = 60.0):
        """Context manager: hold the thread's lease in the shared block store while a run of it
        executes, so no other worker runs it at once (renewed in the background; a dead
        worker's lease expires after ``ttl_s`` seconds and the thread's messages are all in the
        checkpoints). Wrap each ``graph.invoke`` of a thread in it.

        Raises:
            ValueError: the saver uses layout="blobs" (leases need the block layout).
            LeaseTimeout (TimeoutError): another worker held it longer than ``wait_s`` seconds.
        """
        if self.blocks is None:
            raise ValueError('thread leases live in the block store: build the saver with the default layout="blocks" '
                             "(block_store=... for a store shared by the workers)")
        return self.blocks.lease(str(thread_id), ttl_s=ttl_s, wait_s=wait_s)

    # ------------------------------------------------------------ storing
    def _has_live_thread(self, config: RunnableConfig) -> bool:
        tid, ns = _thread_and_ns(config)
        return self.threads is not None and tid is not None and ns == "" and tid in self.threads

    def _with_cache_ref(self, config: RunnableConfig, metadata: CheckpointMetadata) -> CheckpointMetadata:
        """``metadata`` plus the reference of the thread's stored cache (root namespace only:
        subgraph checkpoints share the thread's one cache). A thread evicted since its model call
        names the blob written when it was evicted."""
        tid, ns = _thread_and_ns(config)
        if self.threads is None or tid is None or ns != "":
            return metadata
        if tid not in self.threads:
            held = self._evicted.get(tid)
            return metadata if held is None else {**metadata, CACHE_KEY: held[1]}
        self._evicted.pop(tid, None)  # live again: its live state is newer
        try:
            entry = self._store_thread(tid)
        except Exception as exc:  # the checkpoint matters more than the cache (disk, server): store it anyway
            self.persist_failures[tid] = f"{type(exc).__name__}: {exc}"
            log.warning("kvmemory: thread %r: live cache not persisted (%s); a restart will re-prefill", tid, exc)
            return metadata
        self.persist_failures.pop(tid, None)
        return metadata if entry is None else {**metadata, CACHE_KEY: entry}

    def _present(self, ref: BlobRef) -> bool:
        return self.blocks.present(ref) if self.blocks is not None else self.store.path(ref.sha256).is_file()

    def _store_thread(self, tid: str) -> dict | None:
        """Persist the thread's last committed state: its state when no call runs on it, else (a
        call is mid-way, e.g. LangGraph writing an input checkpoint while the model node runs)
        the blob stored for it last, if any. Never a half-prepared state, never a wait.
        Returns the checkpoint metadata entry naming it, or None."""
        with self.threads.idle(tid) as session:  # never creates one: an evicted thread stays evicted
            if session is None:
                last = self._stored.get(tid)
                return None if last is None or not self._present(last[1]) else last[2]
            if not session.token_ids:
                return None  # nothing cached yet (e.g. the input checkpoint of a new thread)
            return self._write_state(tid, session)

    def _write_state(self, tid: str, session) -> dict:
        """Store ``session``'s state unless unchanged since the last store (e.g. a tool step);
        the caller holds the thread's lock. Returns the metadata entry."""
        fingerprint = session.state_version
        last = self._stored.get(tid)
        if last is not None and last[0] == fingerprint and self._present(last[1]):
            return last[2]
        if self.blocks is not None:
            with self._block_lock:  # a deletion of unnamed blocks sees this state's blocks as live
                ref, entry = self.blocks.write(tid, session, self.threads.model_name, fingerprint)
        else:
            state = export_state(session, self.threads.model_name)
            ref = self.store.put(state.tensors(), state.metadata())
            entry = {**ref.to_dict(), "tokens": len(state.token_ids)}
        self._stored[tid] = (fingerprint, ref, entry)
        return entry

    def _persist_on_evict(self) -> None:
        """Chain onto the registry's ``on_evict`` so an evicted thread's state is written first."""
        previous = self.threads.on_evict

        def on_evict(tid: str, session) -> None:
            self._store_evicted(tid, session)
            if previous is not None:
                previous(tid, session)

        self.threads.on_evict = on_evict

    def _store_evicted(self, tid: str, session) -> None:
        """Write the state of a thread the registry is about to drop (its lock is held, so the state
        is final). Its next checkpoint names this blob and its next run resumes from it, even when
        the eviction came between its model call and that call's checkpoint."""
        if not session.token_ids:
            return
        try:
            entry = self._write_state(tid, session)
        except Exception as exc:  # best effort (disk, server): the thread re-prefills without it
            log.warning("kvmemory: thread %r: evicted cache not persisted (%s); its next turn re-prefills", tid, exc)
            return
        self._evicted[tid] = (self._stored[tid][1], entry)

    def _forget(self, thread_id: str) -> None:
        tid = str(thread_id)
        self._evicted.pop(tid, None)
        self._stored.pop(tid, None)
        self.restore_failures.pop(tid, None)
        self.persist_failures.pop(tid, None)
        self._pending_erase.pop(tid, None)
        self.restored_from.pop(tid, None)
        if self.blocks is not None:
            self.blocks.live_blocks.pop(tid, None)
        if self.threads is not None:
            self.threads.drop(tid)

    # ----------------------------------------------------------- restoring
    def _is_root_thread(self, tup: CheckpointTuple) -> bool:
        tid, ns = _thread_and_ns(tup.config)
        return self.threads is not None and tid is not None and ns == ""

    def _sync_blocks(self, tup: CheckpointTuple, older: list[CheckpointTuple]) -> None:
        """Block layout: make the live cache the newest stored state. The live cache stays when
        it is that state (or newer: this worker wrote the newest state); otherwise the newest
        state is loaded, reusing the live rows of its blocks and fetching the others."""
        tid = _thread_and_ns(tup.config)[0]
        newest = next((c for c in [tup, *older] if CACHE_KEY in (c.metadata or {})), None)
        entry = (newest.metadata or {})[CACHE_KEY] if newest is not None else None
        own = entry is None or entry.get("writer") == self.blocks.worker_id
        live = tid in self.threads
        if live and newest is not tup and tid in self.persist_failures:
            self.blocks.stats.live_kept += 1
            return  # this worker wrote the newest checkpoint but not its cache (store down): the live cache is newer
        if own and tid in self._evicted and not live:
            ref = self._evicted[tid][0]  # written here at eviction: not older than any checkpoint's
        elif entry is None:
            if not live:
                self._reject(tid, "none", f"no stored cache in the thread's last {len(older) + 1} checkpoints")
            return
        else:
            try:
                ref = BlobRef.from_dict(entry)
            except BlobError as exc:
                if not live:
                    self._reject(tid, "unreadable", str(exc))
                return
        if live and (own or (tid in self._stored and self._stored[tid][1].sha256 == ref.sha256)):
            self.blocks.stats.live_kept += 1
            return  # the live cache is the newest state (or this worker's newer one)
        if (tid, ref.sha256) in self._rejected:
            return
        self._evicted.pop(tid, None)
        self._restore_blocks(tid, ref)

    def _restore_blocks(self, tid: str, ref: BlobRef) -> bool:
        """Load the state ``ref`` names into the registry (live rows reused, other blocks fetched)."""
        live = self.threads.get(tid)
        try:
            state, info = self.blocks.load(tid, ref, live)
            session = self.threads.import_state(tid, state)
        except BlobError as exc:
            self._reject(tid, exc.reason, str(exc), ref)  # a live cache stays: the next call repairs it to
            return False                                    # the messages (recomputing what it lacks)
        except CacheStateError as exc:
            self._reject(tid, "incompatible", str(exc), ref)
            return False
        except Exception as exc:
            if not store_unreachable(exc):
                raise
            # not marked rejected: the state may be fine, the next load of the thread tries again
            self._reject(tid, "unreachable", f"{self.blocks.store.describe()}: {type(exc).__name__}: {exc}")
            return False
        fingerprint = session.state_version
        self.blocks.adopt(tid, fingerprint, info["block_refs"])
        if info["error"]:
            self.restore_failures[tid] = f"partial: {info['error']} (resumed from {len(state.token_ids)} rows)"
        else:
            self.restore_failures.pop(tid, None)
            self._stored[tid] = (fingerprint, ref, self.blocks.entry(ref, None, len(state.token_ids),
                                                                     [b.key for b in info["block_refs"]]))
        self.restored_from[tid] = ref.sha256
        log.info("kvmemory: thread %r resumes from stored state %s (%d tokens; %d blocks fetched, %d reused from "
                 "the live cache)", tid, ref.sha256[:12], len(state.token_ids), info["fetched"], info["reused"])
        return True

    def _wants_restore(self, tup: CheckpointTuple) -> bool:
        tid, ns = _thread_and_ns(tup.config)
        return self.threads is not None and tid is not None and ns == "" and tid not in self.threads

    def _older_sync(self, tup: CheckpointTuple) -> list[CheckpointTuple]:
        if CACHE_KEY in (tup.metadata or {}) or not self.keeps_history:
            return []
        return list(self.saver.list(_thread_config(tup), before=tup.config, limit=self.search_depth))

    async def _older_async(self, tup: CheckpointTuple) -> list[CheckpointTuple]:
        if CACHE_KEY in (tup.metadata or {}) or not self.keeps_history:
            return []
        return [t async for t in self.saver.alist(_thread_config(tup), before=tup.config, limit=self.search_depth)]

    def _evicted_ref(self, tup: CheckpointTuple) -> BlobRef | None:
        """The blob written when the thread was evicted in this process (its newest state), if any."""
        held = self._evicted.get(_thread_and_ns(tup.config)[0])
        return None if held is None or (_thread_and_ns(tup.config)[0], held[0].sha256) in self._rejected else held[0]

    def _newest_ref(self, tup: CheckpointTuple, older: list[CheckpointTuple]) -> BlobRef | None:
        """The newest blob reference among ``tup`` and ``older``; None (with the reason recorded in
        :attr:`restore_failures`) when there is none to try."""
        tid = _thread_and_ns(tup.config)[0]
        for candidate in [tup, *older]:
            raw = (candidate.metadata or {}).get(CACHE_KEY)
            if raw is None:
                continue
            try:
                ref = BlobRef.from_dict(raw)
            except BlobError as exc:
                self._reject(tid, "unreadable", str(exc))
                return None
            if (tid, ref.sha256) in self._rejected:
                return None  # already found unusable; restore_failures keeps the reason
            return ref
        # e.g. a crash before the thread's first blob was written: nothing to resume from
        self._reject(tid, "none", f"no stored cache in the thread's last {len(older) + 1} checkpoints")
        return None

    def _restore(self, tid: str, ref: BlobRef) -> bool:
        """Import the blob into the registry; on any problem log why and leave the thread cold."""
        try:
            tensors, metadata = self.store.get(ref)
            state = CacheState.from_parts(tensors, metadata)
            self.threads.import_state(tid, state)
        except BlobError as exc:
            self._reject(tid, exc.reason, str(exc), ref)
            return False
        except CacheStateError as exc:
            self._reject(tid, "incompatible", str(exc), ref)
            return False
        self.restore_failures.pop(tid, None)
        self._evicted.pop(tid, None)
        self.restored_from[tid] = ref.sha256
        self._stored[tid] = (self.threads.session(tid).state_version, ref, {**ref.to_dict(), "tokens": len(state.token_ids)})
        log.info("kvmemory: thread %r resumes from its stored cache (%d tokens, blob %s)",
                 tid, len(state.token_ids), ref.sha256[:12])
        return True

    def _reject(self, tid: str, reason: str, detail: str, ref: BlobRef | None = None) -> None:
        if ref is not None:
            self._rejected.add((tid, ref.sha256))
        self.restore_failures[tid] = f"{reason}: {detail}"
        log.warning("kvmemory: thread %r: stored cache not used (%s: %s); its next turn re-prefills from the "
                    "checkpointed messages", tid, reason, detail)
        if reason != "none":  # a thread that never stored a cache lost nothing
            self._note_lost_reuse(tid)

    def _note_lost_reuse(self, tid: str) -> None:
        """Tell the thread's next call why it does not resume from its stored cache: that call's
        repair report says so in ``fallback`` (once; later calls served from the live cache don't)."""
        live = self.threads.get(tid)
        how = ("repaired from this worker's older live cache" if live is not None and live.token_ids
               else "re-prefilled from the checkpointed messages")
        what, where = ("cached blocks", "block store") if self.blocks is not None else ("stored cache", "blob store")
        self.threads.note_lost_reuse(tid, f"the thread's {what} could not be restored "
                                          f"({where}: {self.restore_failures[tid]}): {how}")


def _sha_of(metadata) -> str | None:
    ref = _ref_of(metadata)
    return ref.sha256 if ref else None


def _ref_of(metadata) -> BlobRef | None:
    raw = (metadata or {}).get(CACHE_KEY)
    try:
        return BlobRef.from_dict(raw) if raw is not None else None
    except BlobError:
        return None


def _overrides(saver: BaseCheckpointSaver, method: str) -> bool:
    return getattr(type(saver), method) is not getattr(BaseCheckpointSaver, method)


# LangGraph saver methods a saver may leave unimplemented (BaseCheckpointSaver's raise NotImplementedError)
OPTIONAL_METHODS = ("prune", "aprune", "delete_for_runs", "adelete_for_runs")
# savers that keep only each thread's newest checkpoint (their list(before=...) is not supported)
NEWEST_ONLY_SAVERS = frozenset({
    "langgraph.checkpoint.postgres.shallow.ShallowPostgresSaver",
    "langgraph.checkpoint.postgres.shallow.AsyncShallowPostgresSaver",
})


@lru_cache(maxsize=None)
def _variant(cls: type, missing: frozenset) -> type:
    """``cls`` with the optional methods in ``missing`` reset to BaseCheckpointSaver's (which
    raise NotImplementedError), so capability checks by type see what the wrapped saver has."""
    if not missing:
        return cls
    reset = {m: getattr(BaseCheckpointSaver, m) for m in missing}
    return type(cls.__name__, (cls,), {**reset, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                        "__doc__": cls.__doc__})


def _keeps_history(saver: BaseCheckpointSaver) -> bool:
    if isinstance(saver, KVCheckpointSaver):
        return saver.keeps_history
    return not any(f"{c.__module__}.{c.__qualname__}" in NEWEST_ONLY_SAVERS for c in type(saver).__mro__)


def _thread_list(thread_ids: Sequence[str]) -> list[str]:
    # a bare string would be iterated per character: the wrapped saver rejects it, so pass it on untouched
    return [] if isinstance(thread_ids, str) else [str(t) for t in thread_ids]


def _copied(tup: CheckpointTuple, target: str) -> tuple[RunnableConfig, CheckpointMetadata, list[tuple[str, list]]]:
    """The put config of ``tup`` in thread ``target`` (same namespace and parent), its metadata
    there (a ``thread_id`` entry, as the LangGraph Agent Server records, names ``target``) and its
    pending writes grouped by task, in their stored order."""
    ns = _thread_and_ns(tup.config)[1]
    parent = (tup.parent_config or {}).get("configurable", {}).get("checkpoint_id")
    config = {"configurable": {"thread_id": target, "checkpoint_ns": ns, **({"checkpoint_id": parent} if parent else {})}}
    grouped: dict[str, list] = {}
    for task_id, channel, value in tup.pending_writes or []:
        grouped.setdefault(task_id, []).append((channel, value))
    metadata = tup.metadata or {}
    if "thread_id" in metadata:
        metadata = {**metadata, "thread_id": target}
    return config, metadata, list(grouped.items())


def _thread_config(tup: CheckpointTuple) -> RunnableConfig:
    tid, ns = _thread_and_ns(tup.config)
    return {"configurable": {"thread_id": tid, "checkpoint_ns": ns}}


def _check_saver_arguments(saver, blob_dir, search_depth) -> None:
    if not isinstance(saver, BaseCheckpointSaver):
        raise InputTypeError(
            f"saver must be a LangGraph checkpoint saver (got {type(saver).__name__}): e.g. "
            "KVCheckpointSaver.from_sqlite(path, llm) or KVCheckpointSaver(SqliteSaver(conn), llm, blob_dir=...)"
        )
    if isinstance(search_depth, bool) or not isinstance(search_depth, int) or search_depth < 1:
        raise InputError(f"search_depth must be an int >= 1 (got {search_depth!r})")
    if blob_dir is not None and Path(blob_dir).is_file():
        raise InputError(f"blob_dir {blob_dir} is a file: pass a folder (created if missing) for the cache blobs")


def _block_store_for(layout: str, block_store, blob_dir, saver):
    """The block store of the block layout (default: the filesystem store in ``blob_dir`` or the
    folder next to a SQLite database); None for the blob layout."""
    if layout not in ("blocks", "blobs"):
        raise InputError(f"layout must be 'blocks' (token blocks, the default) or 'blobs' (one blob per state), "
                         f"got {layout!r}")
    if layout == "blobs":
        if block_store is not None:
            raise InputError("block_store is for layout='blocks': drop one of the two")
        return None
    return block_store if block_store is not None else (blob_dir if blob_dir is not None else _default_blob_dir(saver))


def _default_blob_dir_for(path: str | Path, kwargs: dict) -> None:
    """Set ``kwargs["blob_dir"]`` to ``<path>.kvcache`` unless a blob folder or block store is given."""
    if kwargs.get("blob_dir") is None and kwargs.get("block_store") is None:
        kwargs["blob_dir"] = _blob_dir_for(path)


def _blob_dir_for(path: str | Path) -> Path:
    if str(path) == ":memory:" or str(path).startswith("file::memory:"):
        raise ValueError("an in-memory SQLite database has no folder for cache blobs: pass blob_dir=... (a folder "
                         "that outlives the process if caches should survive it) or block_store=...")
    path = Path(path)
    return path.with_name(path.name + BLOB_DIR_SUFFIX)


def _default_blob_dir(saver: BaseCheckpointSaver) -> Path:
    conn = getattr(saver, "conn", None)
    if isinstance(conn, sqlite3.Connection):
        rows = conn.execute("PRAGMA database_list").fetchall()
        main = next((file for _, name, file in rows if name == "main"), "")
        if main:
            return _blob_dir_for(main)
    raise ValueError(
        f"cannot place cache blobs next to the database of {type(saver).__name__}: pass blob_dir=... "
        "(or build the saver with KVCheckpointSaver.from_sqlite / afrom_sqlite)"
    )
