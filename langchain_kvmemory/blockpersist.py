"""Block-level persistence of live thread caches for :class:`~.checkpointer.KVCheckpointSaver`.

Writes a thread's state as content-addressed blocks (:mod:`.kvblocks`) into a shared
:class:`~.blockstore.BlockStore`, restores it (reusing the rows a worker already holds and
fetching only the blocks it lacks), applies retention (blocks of the newest K cache states of each
thread) and garbage collection, finds what a strict erase must destroy, and leases threads so that
two workers never run one thread at once.

A checkpoint names its state in metadata ``kvmemory_cache``: ``{"sha256": <manifest sha>, "size":
<manifest bytes>, "tokens": N, "layout": "blocks", "blocks": [<block keys>], "writer": <worker
id>}``. ``writer`` tells a worker whether the newest state is its own (then its live cache, which
can only be newer, is kept) or another worker's (then its live cache is used only if it is exactly
that state).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from kvmemory.errors import KVMemoryError
from kvmemory.reforge.versions import base_weights_digest
from kvmemory.persistence import CacheState, export_state

from .blobs import BlobError, BlobRef
from .blockstore import BlockMissing, BlockStore
from .kvblocks import (DEFAULT_BLOCK_TOKENS, BlockRef, EncodedState, block_rows, encode_state, exact_block_keys,
                       fetch_manifest, identity_digest, load_rows, manifest_messages)

log = logging.getLogger(__name__)


class LeaseTimeout(KVMemoryError, TimeoutError):
    """Another worker holds the thread's lease and did not release it in time."""


@dataclass
class RestoreStats:
    """What restores of this worker did (for benchmarks and tests): restores, blocks fetched from
    the store, blocks reused from the live cache, rows recovered, truncations after a damaged or
    missing block."""

    restores: int = 0
    blocks_fetched: int = 0
    blocks_reused: int = 0
    rows_restored: int = 0
    truncated: int = 0
    live_kept: int = 0
    history: list[dict] = field(default_factory=list)


class BlockPersistence:
    """The block layout of one saver: writes, restores, retention, erase, leases.

    Args:
        store: the shared block store.
        block_tokens: rows per block (B).
        keep_states: retention: blocks of the newest ``keep_states`` distinct cache states of
            each thread are kept by :meth:`collect_garbage`; None keeps every state any
            checkpoint names.
        worker_id: names this worker in checkpoint metadata and leases (default: random).
    """

    def __init__(self, store: BlockStore, *, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 keep_states: int | None = None, worker_id: str | None = None):
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be an int >= 1 (got {block_tokens!r}); 64-256 suits most models")
        if keep_states is not None and (isinstance(keep_states, bool) or not isinstance(keep_states, int)
                                        or keep_states < 1):
            raise ValueError(f"keep_states must be an int >= 1 or None to keep all (got {keep_states!r})")
        self.store, self.block_tokens, self.keep_states = store, block_tokens, keep_states
        self.worker_id = worker_id or uuid.uuid4().hex[:12]
        self.live_blocks: dict[str, tuple[tuple, list[BlockRef]]] = {}  # tid -> (fingerprint, blocks of live rows)
        self.stats = RestoreStats()
        self.bytes_written = 0
        self.write_ms: list[float] = []

    # ------------------------------------------------------------ writing
    def write(self, tid: str, session, model_name: str, fingerprint: tuple) -> tuple[BlobRef, dict]:
        """Store the session's state as blocks + manifest. Returns the manifest's reference and the
        checkpoint metadata entry. Raises CacheStateError (not exportable) or OSError / store errors."""
        t0 = time.perf_counter()
        state = export_state(session, model_name)
        starts = _message_starts(session)
        encoded = encode_state(state, self.block_tokens, message_starts=starts, is_stored=self.store.exists)
        for key, data in encoded.block_bytes.items():
            if self.store.put(key, data):
                self.bytes_written += len(data)
        if self.store.put(encoded.manifest_key, encoded.manifest):  # after its blocks: a named manifest is whole
            self.bytes_written += len(encoded.manifest)
        self.live_blocks[tid] = (fingerprint, encoded.blocks)
        self.write_ms.append((time.perf_counter() - t0) * 1000)
        ref = BlobRef(encoded.manifest_sha, len(encoded.manifest))
        return ref, self.entry(ref, encoded, len(state.token_ids))

    def entry(self, ref: BlobRef, encoded: EncodedState | None, tokens: int, blocks: list[str] | None = None) -> dict:
        keys = [b.key for b in encoded.blocks] if encoded is not None else list(blocks or [])
        return {**ref.to_dict(), "tokens": tokens, "layout": "blocks", "blocks": keys, "writer": self.worker_id}

    def present(self, ref: BlobRef) -> bool:
        return self.store.exists(f"manifest/{ref.sha256}")

    # ---------------------------------------------------------- restoring
    def load(self, tid: str, ref: BlobRef, live) -> tuple[CacheState, dict]:
        """The state ``ref`` names, with rows from ``live`` (the worker's session of the thread, or
        None) where its blocks match, the other blocks fetched from the store. A damaged or
        missing block ends the state at the last message boundary before it (the rest is
        recomputed by the next call, reported in the returned info).

        Raises:
            BlobError: the manifest is missing / damaged, or the first block already is.
            CacheStateError: the manifest is not a kvmemory manifest.
        """
        manifest = fetch_manifest(self.store, ref.sha256)
        have = self._live_rows(tid, live, manifest) if live is not None else {}
        layers, fetched, error = load_rows(self.store, manifest, have)
        state = manifest.state
        info = {"blocks": len(manifest.blocks), "fetched": fetched, "reused": len(have), "error": None}
        if error is None:
            state.layers = layers
        else:
            state = _truncated(state, layers, manifest.message_starts, error)
            info["error"] = f"{error.reason}: {error}"
        info["block_refs"] = [b for b in manifest.blocks if b.start + b.rows <= len(state.token_ids)]
        self.stats.restores += 1
        self.stats.blocks_fetched += fetched
        self.stats.blocks_reused += len(have)
        self.stats.rows_restored += len(state.token_ids)
        self.stats.truncated += error is not None
        self.stats.history.append({"thread": tid, **{k: v for k, v in info.items() if k != "block_refs"},
                                   "rows": len(state.token_ids)})
        return state, info

    def _live_rows(self, tid: str, live, manifest) -> dict:
        """Rows of ``manifest``'s blocks that the worker's live session already holds: its exact
        blocks (keys from its token ids, exact_rows and identity) and, while the session is
        unchanged since it was stored or restored, its stale blocks too."""
        from kvmemory import kvcache

        wanted = {b.key for b in manifest.blocks}
        mine: list[BlockRef] = []
        known = self.live_blocks.get(tid)
        if known is not None and known[0] == live.state_version:
            mine = known[1]
        elif live.token_ids and (versions := live.reforge.export_versions()) is not None:
            probe = CacheState(token_ids=[], messages=[], tools=None, exact_rows=0, layers=[],
                               model_name=manifest.state.model_name, model_dtype=str(next(live.model.parameters()).dtype),
                               weights_digest=base_weights_digest(live.model), adapter_versions=versions)
            identity = identity_digest(probe, manifest.block_tokens)
            if identity == manifest.identity:
                mine = exact_block_keys(live.token_ids, live.exact_rows, identity, manifest.block_tokens)
        mine = [b for b in mine if b.key in wanted]
        return block_rows(kvcache.layer_tensors(live.cache), mine) if mine else {}

    def adopt(self, tid: str, fingerprint: tuple, blocks: list[BlockRef]) -> None:
        """Record that the live cache of ``tid`` (at ``fingerprint``) holds exactly ``blocks``."""
        self.live_blocks[tid] = (fingerprint, list(blocks))

    # ---------------------------------------------------- retention and GC
    def kept(self, tuples) -> tuple[set[str], set[str]]:
        """Manifests and blocks to keep: per thread, those of its newest ``keep_states`` distinct
        cache states (all when None). ``tuples`` are checkpoint tuples of every thread."""
        per_thread: dict[str, list[tuple[str, dict]]] = {}
        for tup in tuples:
            raw = (tup.metadata or {}).get("kvmemory_cache")
            if isinstance(raw, dict) and raw.get("layout") == "blocks":
                conf = tup.config["configurable"]
                per_thread.setdefault(str(conf["thread_id"]), []).append((conf["checkpoint_id"], raw))
        manifests, blocks = set(), set()
        for states in per_thread.values():
            states.sort(key=lambda s: s[0], reverse=True)  # checkpoint ids are time-ordered (uuid6)
            seen = []
            for _, raw in states:
                if raw["sha256"] in seen:
                    continue
                if self.keep_states is not None and len(seen) >= self.keep_states:
                    break
                seen.append(raw["sha256"])
                blocks.update(raw.get("blocks", []))
            manifests.update(seen)
        return manifests, blocks

    def collect_garbage(self, tuples, extra: list[dict], grace_s: float) -> list[str]:
        """Delete manifests and blocks that no kept state names, written more than ``grace_s``
        seconds ago. ``extra``: metadata entries to keep besides the checkpoints' (evicted
        threads). Returns the deleted keys."""
        manifests, blocks = self.kept(tuples)
        for raw in extra:
            manifests.add(raw["sha256"])
            blocks.update(raw.get("blocks", []))
        keep = {f"manifest/{m}" for m in manifests} | {f"block/{b}" for b in blocks}
        cutoff, removed = time.time() - grace_s, []
        for key, written in list(self.store.list("")):
            if key.startswith(("manifest/", "block/")) and key not in keep and written <= cutoff:
                if self.store.delete(key):
                    removed.append(key)
        if removed:
            log.info("kvmemory: removed %d unreferenced blocks / manifests from %s", len(removed), self.store.describe())
        return removed

    def stored_bytes(self) -> int:
        """Bytes of every manifest and block in the store."""
        return self.store.nbytes("manifest/") + self.store.nbytes("block/")

    # --------------------------------------------------------- strict erase
    def tainted(self, erasure, thread_refs: set[str]) -> tuple[set[str], set[str]]:
        """Manifests and blocks that may hold an erased message's influence: every manifest whose
        messages include one (and its blocks from the first block that message's tokens reach
        onwards: rows attend to every earlier token), and every thread manifest with stale rows
        (its blocks from the first stale row onwards). Unreadable manifests of the thread are
        tainted whole."""
        manifests, blocks = set(), set()
        candidates = {k.split("/", 1)[1] for k, _ in self.store.list("manifest/")} | set(thread_refs)
        for sha in candidates:
            try:
                meta = manifest_messages(self.store.get(f"manifest/{sha}"))
            except BlockMissing:
                continue
            except (BlobError, ValueError, KeyError):
                manifests.add(sha)  # cannot prove it clean
                continue
            first = _first_tainted_row(meta, erasure, sha in thread_refs)
            if first is None:
                continue
            manifests.add(sha)
            blocks.update(b.key for b in meta["blocks"] if b.start + b.rows > first)
        return manifests, blocks

    def shred(self, manifests: set[str], blocks: set[str]) -> list[str]:
        deleted = [m for m in manifests if self.store.delete(f"manifest/{m}", shred=True)]
        deleted += [b for b in blocks if self.store.delete(f"block/{b}", shred=True)]
        for tid, (fp, refs) in list(self.live_blocks.items()):
            if any(r.key in blocks for r in refs):
                self.live_blocks.pop(tid)
        return deleted

    # --------------------------------------------------------------- leases
    @contextmanager
    def lease(self, tid: str, *, ttl_s: float = 30.0, wait_s: float | None = 60.0,
              poll_s: float = 0.05) -> Iterator[str]:
        """Hold thread ``tid``'s lease in the shared store while the block runs (renewed every
        ``ttl_s`` / 3 by a background thread; a dead worker's lease expires after ``ttl_s``).

        Raises:
            LeaseTimeout: another worker held it for more than ``wait_s`` seconds (None: wait forever).
        """
        name, owner = f"thread/{_lease_name(tid)}", f"{self.worker_id}-{uuid.uuid4().hex[:8]}"
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while not self.store.acquire_lease(name, owner, ttl_s):
            if deadline is not None and time.monotonic() > deadline:
                raise LeaseTimeout(f"thread {tid!r} is leased by another worker for more than {wait_s} s: retry later "
                                   f"or raise wait_s (a dead worker's lease expires after its ttl)")
            time.sleep(poll_s)
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(name, owner, ttl_s, stop), daemon=True)
        renewer.start()
        try:
            yield owner
        finally:
            stop.set()
            renewer.join()
            self.store.release_lease(name, owner)

    def _renew(self, name: str, owner: str, ttl_s: float, stop: threading.Event) -> None:
        while not stop.wait(ttl_s / 3):
            try:
                if not self.store.renew_lease(name, owner, ttl_s):
                    log.error("kvmemory: lease %s was lost (expired under load?): another worker may run the thread",
                              name)
                    return
            except Exception:  # a store hiccup: the next tick retries before the ttl runs out
                log.exception("kvmemory: renewing lease %s failed", name)


def _lease_name(tid: str) -> str:
    import hashlib

    return hashlib.sha256(str(tid).encode()).hexdigest()[:32]




def _message_starts(session) -> list[int] | None:
    rendered = session.rendered
    if rendered is None or len(rendered.segments) != len(session.messages):
        return None
    return [s.token_start for s in rendered.segments]


def _first_tainted_row(meta: dict, erasure, own_thread: bool) -> int | None:
    """First row of a manifest that may carry an erased message's influence, or None."""
    hits = [i for i, m in enumerate(meta["messages"]) if erasure.hits_stored(m)]
    first = None
    if hits:
        starts = meta["message_starts"]
        first = starts[hits[0]] if starts and len(starts) == len(meta["messages"]) else 0
    if own_thread and meta["exact_rows"] < meta["rows"]:
        first = meta["exact_rows"] if first is None else min(first, meta["exact_rows"])
    return first


def _truncated(state: CacheState, layers, starts: list[int] | None, error: BlobError) -> CacheState:
    """``state`` cut at the last message boundary covered by the loaded ``layers`` (the next call
    recomputes the rest). Raises ``error`` when not even one message is covered."""
    rows = layers[0][0].shape[2] if layers else 0
    if not starts or len(starts) != len(state.messages):
        raise error
    k = max((i for i in range(1, len(starts)) if starts[i] <= rows), default=0)
    if k == 0:
        raise error
    cut = starts[k]
    log.warning("kvmemory: a stored block is unusable (%s): resuming from the first %d rows (%d messages); the "
                "rest is recomputed", error, cut, k)
    return CacheState(token_ids=state.token_ids[:cut], messages=state.messages[:k], tools=state.tools,
                      exact_rows=min(state.exact_rows, cut), layers=[(k_[:, :, :cut], v[:, :, :cut]) for k_, v in layers],
                      next_logits=None, model_name=state.model_name, answer_committed=True,
                      model_dtype=state.model_dtype, weights_digest=state.weights_digest,
                      adapter_versions=state.adapter_versions, stale_budget=state.stale_budget)
