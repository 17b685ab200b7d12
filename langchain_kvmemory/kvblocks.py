"""A thread's cache state as content-addressed token blocks plus a small manifest.

The rows of a cache state are cut at absolute positions 0, B, 2B, … (``block_tokens`` = B; the
last block may be shorter). Each block holds the K/V rows of its tokens for every layer and is
stored under a key that is a hash chain, the idea vLLM uses for its prefix blocks:

    exact block:  key_i = sha256(key_{i-1}, identity, "exact", token ids of block i)
    stale block:  key_i = sha256(identity, "stale", first row, token ids of block i, sha256 of its rows)

``identity`` digests the model (name, base-weights digest, dtype), the block size and the
adapter version of every cache layer, so rows computed by other weights or another adapter never
share a key. ``kind`` keeps exactness in the key: a block whose rows all equal a Re-prefill's
(rows below ``exact_rows``) is ``exact`` and its key depends only on its token prefix, so
consecutive checkpoints of a thread and threads with the same prefix (system prompt, tools) share
it. A block holding any stale row (after Shift / SUR) is ``stale``: its key covers the sha256 of
its own bytes, so it is never "the same block" as exact rows of the same tokens, and it is
content-addressed rather than chained (a later refresh of one stale row changes that row's
block only; the unchanged stale blocks after it keep their keys and are shared).

Every stored value (block or manifest) is ``sha256(payload) || payload`` with a safetensors
payload, so a reader proves what it loaded is what was written (truncation, bit rot) and, for a
block, recomputes the chain key from the block's own header (so a block under the wrong key is
caught too). The manifest holds everything else of the state (messages, tools, exact_rows,
pending logits, adapter records) and the list of block keys; it is stored under
``manifest/<sha256 of its bytes>``, and checkpoints name it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from kvmemory.errors import CacheStateError
from kvmemory.persistence import CacheState

from .blobs import BlobError, header_metadata
from .blockstore import BlockMissing, BlockStore

BLOCK_FORMAT = "kvmemory.block/1"
MANIFEST_FORMAT = "kvmemory.manifest/1"
DEFAULT_BLOCK_TOKENS = 128
ROOT = "0" * 64  # the chain's parent of block 0


def identity_digest(state: CacheState, block_tokens: int) -> str:
    """Digest of what every row of ``state`` depends on besides its tokens: model name, base
    weights digest, dtype, block size and the adapter version of each cache layer."""
    versions = (state.adapter_versions or {}).get("layer_versions")
    parts = [state.model_name, state.weights_digest, state.model_dtype, block_tokens, versions]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def chain_key(parent: str, identity: str, kind: str, tokens: list[int], payload_sha: str = "", start: int = 0) -> str:
    """The hex key of a block: sha256 over its parent's key (exact blocks; "" for stale ones), the
    identity, ``exact``/``stale``, its token ids, and for stale blocks its first row and its
    payload's sha256."""
    text = json.dumps([parent, identity, kind, tokens, payload_sha, start], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def seal(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest() + payload


def unseal(data: bytes, what: str) -> bytes:
    """The payload of a sealed value. Raises BlobError (``truncated`` / ``mismatch``)."""
    if len(data) < 40:
        raise BlobError("truncated", f"{what} has {len(data)} bytes: too short to be a stored value")
    payload = data[32:]
    if hashlib.sha256(payload).digest() != data[:32]:
        raise BlobError("mismatch", f"{what} does not match its sha256 (damaged or truncated)")
    return payload


@dataclass(frozen=True)
class BlockRef:
    """One block of a state: ``key`` (64 hex), first row ``start``, ``rows``, and ``exact``."""

    key: str
    start: int
    rows: int
    exact: bool

    @property
    def store_key(self) -> str:
        return f"block/{self.key}"


@dataclass
class EncodedState:
    """A state cut into blocks: the manifest (sealed bytes, its store key) and the blocks (with
    their sealed bytes, made lazily: a block already in the store is not serialised)."""

    manifest_key: str
    manifest: bytes
    blocks: list[BlockRef]
    block_bytes: dict[str, bytes]

    @property
    def manifest_sha(self) -> str:
        return self.manifest_key.split("/", 1)[1]


def rows_digest(keys: torch.Tensor, values: torch.Tensor) -> str:
    """sha256 of a block's K/V bytes (the safetensors header is not byte-stable: its metadata
    order varies between calls, so a content address must hash the tensors themselves)."""
    h = hashlib.sha256()
    for t in (keys, values):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _block_rows(state: CacheState, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.stack([k[0, :, start:end] for k, _ in state.layers]).contiguous()
    values = torch.stack([v[0, :, start:end] for _, v in state.layers]).contiguous()
    return keys, values


def _block_payload(keys, values, tokens, start: int, parent: str, identity: str, kind: str) -> bytes:
    meta = {"format": BLOCK_FORMAT, "parent": parent, "identity": identity, "kind": kind, "start": str(start),
            "tokens": json.dumps(tokens)}
    return save_safetensors({"keys": keys, "values": values}, metadata=meta)


def encode_state(state: CacheState, block_tokens: int = DEFAULT_BLOCK_TOKENS, *,
                 message_starts: list[int] | None = None, is_stored=None) -> EncodedState:
    """Cut ``state`` into blocks of ``block_tokens`` rows and build its manifest.

    Args:
        is_stored: ``is_stored(store_key) -> bool``: blocks already stored are not serialised
            again.
        message_starts: token offset of each message (lets a strict erase find the first block a
            message influences, and a damaged block resume at a message boundary).

    Raises:
        ValueError: ``block_tokens`` < 1.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1 (got {block_tokens})")
    identity = identity_digest(state, block_tokens)
    n, parent = len(state.token_ids), ROOT
    blocks, data = [], {}
    for start in range(0, n, block_tokens):
        end = min(n, start + block_tokens)
        exact = end <= state.exact_rows
        tokens = state.token_ids[start:end]
        if exact:
            key = chain_key(parent, identity, "exact", tokens)
            if is_stored is None or not is_stored(f"block/{key}"):
                data[f"block/{key}"] = seal(_block_payload(*_block_rows(state, start, end), tokens, start, parent,
                                                           identity, "exact"))
        else:
            keys, values = _block_rows(state, start, end)
            key = chain_key("", identity, "stale", tokens, rows_digest(keys, values), start)
            if is_stored is None or not is_stored(f"block/{key}"):
                data[f"block/{key}"] = seal(_block_payload(keys, values, tokens, start, "", identity, "stale"))
        blocks.append(BlockRef(key, start, end - start, exact))
        parent = key
    manifest = _manifest_bytes(state, blocks, block_tokens, identity, message_starts)
    return EncodedState(f"manifest/{hashlib.sha256(manifest).hexdigest()}", manifest, blocks, data)


def _manifest_bytes(state, blocks, block_tokens, identity, message_starts) -> bytes:
    tensors = {"token_ids": torch.tensor(state.token_ids, dtype=torch.long)}
    if state.next_logits is not None:
        tensors["next_logits"] = state.next_logits.contiguous()
    meta = {k: v for k, v in state.metadata().items() if k != "format"}
    meta.update({"format": MANIFEST_FORMAT, "block_tokens": str(block_tokens), "identity": identity,
                 "blocks": json.dumps([[b.key, b.start, b.rows, int(b.exact)] for b in blocks]),
                 "message_starts": json.dumps(message_starts)})
    return seal(save_safetensors(tensors, metadata=meta))


@dataclass
class Manifest:
    """A decoded manifest: the state without its rows, and the blocks that hold them."""

    state: CacheState  # layers empty
    blocks: list[BlockRef]
    block_tokens: int
    identity: str
    message_starts: list[int] | None


def decode_manifest(data: bytes, what: str = "manifest") -> Manifest:
    """Raises BlobError (``truncated``/``mismatch``/``unreadable``) or CacheStateError."""
    payload = unseal(data, what)
    try:
        tensors = load_safetensors(payload)
        meta = header_metadata(payload)
    except (SafetensorError, ValueError) as exc:
        raise BlobError("unreadable", f"{what} is not a safetensors payload ({exc})") from exc
    if meta.get("format") != MANIFEST_FORMAT:
        raise CacheStateError(f"{what} has format {meta.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    try:
        blocks = [BlockRef(str(k), int(s), int(r), bool(e)) for k, s, r, e in json.loads(meta["blocks"])]
        state = CacheState.from_parts({"token_ids": tensors["token_ids"], **({"next_logits": tensors["next_logits"]}
                                       if "next_logits" in tensors else {})}, {**meta, "format": "kvmemory.thread-state/2"})
        return Manifest(state, blocks, int(meta["block_tokens"]), meta["identity"],
                        json.loads(meta.get("message_starts", "null")))
    except (KeyError, ValueError, TypeError) as exc:
        raise CacheStateError(f"{what} is incomplete ({exc!r})") from exc


def manifest_messages(data: bytes) -> dict:
    """Messages, exact_rows, rows, block list and message starts of a sealed manifest (the
    header only; for strict erase). Raises BlobError when the value is damaged."""
    payload = unseal(data, "manifest")
    meta = header_metadata(payload)
    blocks = [BlockRef(str(k), int(s), int(r), bool(e)) for k, s, r, e in json.loads(meta.get("blocks", "[]"))]
    return {"messages": json.loads(meta.get("messages", "[]")), "exact_rows": int(meta.get("exact_rows", 0)),
            "rows": sum(b.rows for b in blocks), "blocks": blocks,
            "message_starts": json.loads(meta.get("message_starts", "null"))}


def decode_block(data: bytes, ref: BlockRef, parent: str, identity: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(keys [L, H, rows, D], values, token ids)`` of a sealed block, after checking its sha256,
    its header and that its chain key is ``ref.key``.

    Raises:
        BlobError: ``truncated`` / ``mismatch`` (bytes), ``unreadable`` (not a block), or
            ``mismatch`` when the block's chain key is not ``ref.key``."""
    what = f"block {ref.key[:12]}…"
    payload = unseal(data, what)
    try:
        tensors = load_safetensors(payload)
        meta = header_metadata(payload)
        tokens = json.loads(meta["tokens"])
    except (SafetensorError, ValueError, KeyError) as exc:
        raise BlobError("unreadable", f"{what} is not a kvmemory block ({exc})") from exc
    kind = meta.get("kind")
    stale = kind == "stale"
    parent = "" if stale else parent  # stale blocks are content-addressed, not chained
    payload_sha = rows_digest(tensors["keys"], tensors["values"]) if stale else ""
    start = ref.start if stale else 0
    if kind not in ("exact", "stale") or meta.get("parent") != parent or meta.get("identity") != identity or \
            (stale and meta.get("start") != str(ref.start)) or len(tokens) != ref.rows or \
            chain_key(parent, identity, kind, tokens, payload_sha, start) != ref.key:
        raise BlobError("mismatch", f"{what} is not the block its manifest names (chain key differs)")
    return tensors["keys"], tensors["values"], tokens


def load_rows(store: BlockStore, manifest: Manifest, have: dict[str, tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, BlobError | None]:
    """The state's rows, block by block: from ``have`` (``block key -> (keys, values)`` already in
    memory, e.g. the worker's live cache) or fetched from ``store`` (one batched read).

    Returns:
        ``(layers, blocks_fetched, error)``: ``layers`` covers the leading blocks that loaded
        (all of them when ``error`` is None); ``error`` is the first damaged or missing block's
        problem (a damaged block is deleted from the store, so the next writer stores it again).
    """
    wanted = [b.store_key for b in manifest.blocks if b.key not in have]
    fetched = store.get_many(wanted)
    keys, values, parent, error = [], [], ROOT, None
    for ref in manifest.blocks:
        if ref.key in have:
            k, v = have[ref.key]
        else:
            data = fetched.get(ref.store_key)
            if data is None:
                error = BlobError("missing", f"block {ref.key[:12]}… is missing from {store.describe()}")
                break
            try:
                k, v, _ = decode_block(data, ref, parent, manifest.identity)
            except BlobError as exc:
                store.delete(ref.store_key)
                error = exc
                break
        keys.append(k)
        values.append(v)
        parent = ref.key
    if not keys:
        return [], len(fetched), error
    k_all, v_all = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # [L, H, N, D]
    layers = [(k_all[i].unsqueeze(0).contiguous(), v_all[i].unsqueeze(0).contiguous()) for i in range(k_all.shape[0])]
    return layers, len([k for k in wanted if k in fetched]), error


def block_rows(layers: list[tuple[torch.Tensor, torch.Tensor]], blocks: list[BlockRef]
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``block key -> (keys [L, H, rows, D], values)`` sliced from live cache layers (views)."""
    out = {}
    for b in blocks:
        if b.start + b.rows > layers[0][0].shape[2]:
            break
        out[b.key] = (torch.stack([k[0, :, b.start:b.start + b.rows] for k, _ in layers]),
                      torch.stack([v[0, :, b.start:b.start + b.rows] for _, v in layers]))
    return out


def exact_block_keys(token_ids: list[int], exact_rows: int, identity: str, block_tokens: int) -> list[BlockRef]:
    """The exact blocks a cache holds, from its token ids alone: every block whose rows all lie
    below ``exact_rows`` (no tensor is read; the keys are the chain over the token prefix)."""
    blocks, parent = [], ROOT
    for start in range(0, len(token_ids), block_tokens):
        end = min(len(token_ids), start + block_tokens)
        if end > exact_rows:
            break
        key = chain_key(parent, identity, "exact", token_ids[start:end])
        blocks.append(BlockRef(key, start, end - start, True))
        parent = key
    return blocks


def fetch_manifest(store: BlockStore, sha: str) -> Manifest:
    """Raises BlobError (``missing`` and the decode errors) or CacheStateError."""
    key = f"manifest/{sha}"
    try:
        data = store.get(key)
    except BlockMissing:
        raise BlobError("missing", f"manifest {sha[:12]}… is missing from {store.describe()}") from None
    try:
        return decode_manifest(data, f"manifest {sha[:12]}…")
    except BlobError:
        store.delete(key)
        raise
