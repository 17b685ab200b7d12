"""Block stores: where the blocks of persisted KV caches live, shared by every worker.

A block store is a small key -> bytes store plus leases. Keys are short ASCII paths
(``block/<64 hex>``, ``manifest/<64 hex>``); values are opaque bytes that carry their own sha256
(see :mod:`.kvblocks`), so a store needs no integrity logic of its own. Three stores ship:

- :class:`FilesystemBlockStore` (default, embedded): one file per key, written to a temporary
  name, fsynced and renamed into place (a crash leaves the whole value or none).
- :class:`RedisBlockStore`: one Redis string per key (``redis`` client, e.g. Debian's
  ``redis-server``); write times in a sorted set for the garbage collector's grace period.
- :class:`PostgresBlockStore`: one ``bytea`` row per key in table ``kvmemory_blocks`` of a
  PostgreSQL database (the same database as LangGraph's ``PostgresSaver``).

The interface (:class:`BlockStore`) is what another store (e.g. S3-compatible object storage)
implements: ``put`` (first writer wins), ``get``, ``exists``, ``delete``, ``list``, and the three
lease calls. A lease is a named lock with an owner and an expiry: a worker that dies stops
renewing it, and another worker may take it once it expired. Values are immutable once written:
a key names one content, so ``put`` of an existing key is a no-op.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, Iterator

from kvmemory.errors import KVMemoryError

from .blobs import fsync_dir
from .erase import shred_file

log = logging.getLogger(__name__)

_KEY = re.compile(r"^[a-z0-9_-]+(/[a-z0-9_-]+)*$")


class BlockMissing(KVMemoryError, KeyError):
    """No value is stored under the key (never written, deleted, or collected)."""


def check_key(key: str) -> str:
    """Keys are lowercase ASCII paths (``[a-z0-9_-]`` parts joined by ``/``).

    Raises:
        ValueError: anything else (names the fix)."""
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(f"bad block store key {key!r}: use lowercase [a-z0-9_-] parts joined by '/', "
                         "e.g. 'block/<sha256 hex>'")
    return key


def store_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says a store's server could not be reached (connection refused or lost,
    timeout), as opposed to a bad value or a bug: callers then carry on without the store (the
    thread re-prefills from its checkpointed messages) instead of losing the turn."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    redis = sys.modules.get("redis")  # only a store built on it can have raised its errors
    if redis is not None and isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return True
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and isinstance(exc, psycopg.OperationalError)


class BlockStore(ABC):
    """Key -> immutable bytes, plus leases with a timeout. Implementations must be safe to use
    from several threads and several processes at once.

    Values: ``put`` stores ``data`` under ``key`` unless the key exists (first writer wins; the
    value of a key never changes). ``get`` raises :class:`BlockMissing` for an absent key.
    ``delete(key, shred=True)`` also makes the old bytes unrecoverable where the backend allows
    (overwrite + fsync for files, ``VACUUM`` for Postgres, plain ``DEL`` for Redis, see each).
    ``list(prefix)`` yields ``(key, written_at)`` (seconds since the epoch) for the garbage
    collector's grace period.

    Leases: ``acquire_lease(name, owner, ttl_s)`` succeeds when nobody else holds ``name`` or
    the holder's lease expired; ``renew_lease`` extends a held lease (False when it was lost);
    ``release_lease`` frees it if ``owner`` still holds it.
    """

    @abstractmethod
    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` unless present. Returns whether it was written."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The bytes under ``key``. Raises BlockMissing when absent."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a value."""

    @abstractmethod
    def delete(self, key: str, *, shred: bool = False) -> bool:
        """Remove ``key``; ``shred`` also destroys the old bytes where the backend can. Returns
        whether a value existed."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[tuple[str, float]]:
        """``(key, written_at)`` for every key starting with ``prefix``."""

    @abstractmethod
    def acquire_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        """Take lease ``name`` for ``owner`` for ``ttl_s`` seconds (re-entrant for the same owner)."""

    @abstractmethod
    def renew_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        """Extend ``owner``'s lease by ``ttl_s`` from now; False when ``owner`` no longer holds it."""

    @abstractmethod
    def release_lease(self, name: str, owner: str) -> None:
        """Free ``name`` if ``owner`` holds it (a lease taken over by another owner stays)."""

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        """``{key: bytes}`` for the present ``keys`` (absent ones are left out). Backends with a
        batch read override this."""
        out = {}
        for key in keys:
            try:
                out[key] = self.get(key)
            except BlockMissing:
                continue  # left out: the caller recomputes what is missing
        return out

    def nbytes(self, prefix: str = "") -> int:
        """Bytes of the values under keys starting with ``prefix`` (backends override with a
        size query that reads no values)."""
        return sum(len(v) for v in self.get_many(k for k, _ in self.list(prefix)).values())

    def close(self) -> None:
        """Release connections (the store is unusable afterwards)."""

    def describe(self) -> str:
        return type(self).__name__


# ------------------------------------------------------------- filesystem
class FilesystemBlockStore(BlockStore):
    """One file per key under ``root`` (``block/ab/abcd…``: two-hex-digit shard folders).

    Writes are atomic (temporary file, fsync, rename, folder fsync). Leases are JSON files
    changed under an ``fcntl`` lock, so they hold between processes of one machine (not across
    machines on a network filesystem: use Redis or Postgres there).
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        if self.root.is_file():
            raise ValueError(f"block store root {self.root} is a file: pass a folder (created if missing)")

    def path(self, key: str) -> Path:
        parts = check_key(key).split("/")
        *folders, name = parts
        return self.root.joinpath(*folders, name[:2], name)

    def put(self, key: str, data: bytes) -> bool:
        target = self.path(key)
        if target.is_file():
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(target.parent)
        return True

    def get(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            raise BlockMissing(key) from None

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str, *, shred: bool = False) -> bool:
        path = self.path(key)
        if shred:
            return shred_file(path)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    def list(self, prefix: str = "") -> Iterator[tuple[str, float]]:
        if not self.root.is_dir():
            return
        for path in self.root.rglob("*"):
            if not path.is_file() or path.name.startswith(".") or path.parent.name == "leases":
                continue
            rel = path.relative_to(self.root).parts
            key = "/".join([*rel[:-2], rel[-1]])
            if key.startswith(prefix):
                try:
                    yield key, path.stat().st_mtime
                except FileNotFoundError:
                    continue

    def nbytes(self, prefix: str = "") -> int:
        total = 0
        for key, _ in self.list(prefix):
            try:
                total += self.path(key).stat().st_size
            except FileNotFoundError:
                continue
        return total

    def temp_files(self) -> list[Path]:
        """Leftovers of writes killed between the temporary write and the rename."""
        return sorted(self.root.rglob(".tmp-*")) if self.root.is_dir() else []

    # leases: leases/<name>.json = {"owner", "expires"}; read-modify-write under an flock
    def _lease_op(self, name: str, change) -> bool:
        folder = self.root / "leases"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = folder / f"{check_key(name).replace('/', '_')}.json"
            try:
                held = json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                held = None
            ok, new = change(held, time.time())
            if new is None:
                path.unlink(missing_ok=True)
            elif new is not held:
                path.write_text(json.dumps(new))
            return ok

    def acquire_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        def change(held, now):
            if held is None or held["owner"] == owner or held["expires"] <= now:
                return True, {"owner": owner, "expires": now + ttl_s}
            return False, held
        return self._lease_op(name, change)

    def renew_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        def change(held, now):
            if held is not None and held["owner"] == owner and held["expires"] > now:
                return True, {"owner": owner, "expires": now + ttl_s}
            return False, held
        return self._lease_op(name, change)

    def release_lease(self, name: str, owner: str) -> None:
        self._lease_op(name, lambda held, now: (True, None) if held and held["owner"] == owner else (False, held))

    def describe(self) -> str:
        return f"filesystem:{self.root}"


# ------------------------------------------------------------------ Redis
_RENEW = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"""
_RELEASE = """if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"""
_ACQUIRE = """local h = redis.call('get', KEYS[1])
if h == false or h == ARGV[1] then redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0"""


class RedisBlockStore(BlockStore):
    """Blocks as Redis strings ``<namespace>:<key>``; write times in the sorted set
    ``<namespace>:written``; leases as ``<namespace>:lease:<name>`` strings with a PX expiry (Redis
    expires a dead worker's lease by itself).

    Args:
        url: e.g. ``redis://localhost:6379/0``.
        namespace: key prefix, so several deployments can share one server.

    Strict erase deletes the key; a server with RDB/AOF persistence keeps the old bytes in its
    files until its next save / AOF rewrite (run ``BGREWRITEAOF`` for an immediate purge).
    """

    def __init__(self, url: str = "redis://localhost:6379/0", *, namespace: str = "kvmemory"):
        import redis

        self.url, self.namespace = url, namespace
        self.client = redis.Redis.from_url(url)
        self.client.ping()  # fail here, with the URL, rather than at the first checkpoint
        self._acquire = self.client.register_script(_ACQUIRE)
        self._renew = self.client.register_script(_RENEW)
        self._release = self.client.register_script(_RELEASE)

    def _k(self, key: str) -> str:
        return f"{self.namespace}:{check_key(key)}"

    def put(self, key: str, data: bytes) -> bool:
        pipe = self.client.pipeline(transaction=True)  # MULTI/EXEC: a listed key always has its value
        pipe.set(self._k(key), data, nx=True)
        pipe.zadd(f"{self.namespace}:written", {key: time.time()}, nx=True)  # keeps the first write time
        return bool(pipe.execute()[0])

    def get(self, key: str) -> bytes:
        data = self.client.get(self._k(key))
        if data is None:
            raise BlockMissing(key)
        return data

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        keys = list(keys)
        if not keys:
            return {}
        values = self.client.mget([self._k(k) for k in keys])
        return {k: v for k, v in zip(keys, values) if v is not None}

    def exists(self, key: str) -> bool:
        return bool(self.client.exists(self._k(key)))

    def delete(self, key: str, *, shred: bool = False) -> bool:
        pipe = self.client.pipeline()
        pipe.delete(self._k(key))
        pipe.zrem(f"{self.namespace}:written", key)
        return bool(pipe.execute()[0])

    def list(self, prefix: str = "") -> Iterator[tuple[str, float]]:
        for member, score in self.client.zscan_iter(f"{self.namespace}:written", match=f"{prefix}*"):
            yield member.decode(), float(score)

    def nbytes(self, prefix: str = "") -> int:
        keys = [k for k, _ in self.list(prefix)]
        pipe = self.client.pipeline()
        for key in keys:
            pipe.strlen(self._k(key))
        return sum(pipe.execute()) if keys else 0

    def acquire_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        return bool(self._acquire(keys=[self._k(f"lease/{name}")], args=[owner, int(ttl_s * 1000)]))

    def renew_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        return bool(self._renew(keys=[self._k(f"lease/{name}")], args=[owner, int(ttl_s * 1000)]))

    def release_lease(self, name: str, owner: str) -> None:
        self._release(keys=[self._k(f"lease/{name}")], args=[owner])

    def clear(self) -> None:
        """Delete every key of this namespace (tests and benchmarks start from an empty store)."""
        for key in self.client.scan_iter(match=f"{self.namespace}:*"):
            self.client.delete(key)

    def close(self) -> None:
        self.client.close()

    def describe(self) -> str:
        return f"redis:{self.url} ({self.namespace})"


# --------------------------------------------------------------- Postgres
_SCHEMA = """
CREATE TABLE IF NOT EXISTS {blocks} (key text PRIMARY KEY, data bytea NOT NULL, written_at double precision NOT NULL);
CREATE TABLE IF NOT EXISTS {leases} (name text PRIMARY KEY, owner text NOT NULL, expires_at double precision NOT NULL);
"""
_NOW = "extract(epoch from clock_timestamp())"  # the server's clock: workers' clocks may differ


class PostgresBlockStore(BlockStore):
    """Blocks as ``bytea`` rows of ``<table>`` (key, data, written_at) and leases as rows of
    ``<table>_leases`` (name, owner, expires_at) in a PostgreSQL database, e.g. the one
    LangGraph's ``PostgresSaver`` uses. Lease expiry uses the server's clock.

    Args:
        conninfo: a libpq connection string / URL (``postgresql://user:pw@host:5432/db``).
        table: table name (created if missing).

    Strict erase deletes the row and runs ``VACUUM`` on the table, so the dead tuple's bytes are
    reclaimed (they may survive in WAL segments until the server recycles them).
    """

    def __init__(self, conninfo: str, *, table: str = "kvmemory_blocks"):
        import psycopg

        if not re.match(r"^[a-z_][a-z0-9_]*$", table):
            raise ValueError(f"bad table name {table!r}: use lowercase letters, digits and _")
        self.conninfo, self.table = conninfo, table
        self.conn = psycopg.connect(conninfo, autocommit=True)
        self._lock = threading.Lock()  # one connection: psycopg serialises, but keep cursors apart
        self._sql(_SCHEMA.format(blocks=table, leases=f"{table}_leases"))

    def _sql(self, query: str, params: tuple = (), fetch: str | None = None):
        with self._lock, self.conn.cursor() as cur:
            cur.execute(query, params)
            if fetch == "one":
                return cur.fetchone()
            if fetch == "all":
                return cur.fetchall()
            return cur.rowcount

    def put(self, key: str, data: bytes) -> bool:
        return self._sql(f"INSERT INTO {self.table} (key, data, written_at) VALUES (%s, %s, {_NOW}) "
                         "ON CONFLICT (key) DO NOTHING", (check_key(key), data)) == 1

    def get(self, key: str) -> bytes:
        row = self._sql(f"SELECT data FROM {self.table} WHERE key = %s", (check_key(key),), "one")
        if row is None:
            raise BlockMissing(key)
        return bytes(row[0])

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        keys = [check_key(k) for k in keys]
        if not keys:
            return {}
        rows = self._sql(f"SELECT key, data FROM {self.table} WHERE key = ANY(%s)", (keys,), "all")
        return {k: bytes(d) for k, d in rows}

    def exists(self, key: str) -> bool:
        return self._sql(f"SELECT 1 FROM {self.table} WHERE key = %s", (check_key(key),), "one") is not None

    def delete(self, key: str, *, shred: bool = False) -> bool:
        deleted = self._sql(f"DELETE FROM {self.table} WHERE key = %s", (check_key(key),)) == 1
        if deleted and shred:
            self._sql(f"VACUUM {self.table}")
        return deleted

    def list(self, prefix: str = "") -> Iterator[tuple[str, float]]:
        rows = self._sql(f"SELECT key, written_at FROM {self.table} WHERE starts_with(key, %s)", (prefix,), "all")
        yield from ((k, float(t)) for k, t in rows)

    def nbytes(self, prefix: str = "") -> int:
        row = self._sql(f"SELECT coalesce(sum(octet_length(data)), 0) FROM {self.table} WHERE starts_with(key, %s)",
                        (prefix,), "one")
        return int(row[0])

    def acquire_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        row = self._sql(
            f"INSERT INTO {self.table}_leases (name, owner, expires_at) VALUES (%s, %s, {_NOW} + %s) "
            f"ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at "
            f"WHERE {self.table}_leases.owner = excluded.owner OR {self.table}_leases.expires_at <= {_NOW} "
            "RETURNING owner", (check_key(name), owner, float(ttl_s)), "one")
        return row is not None

    def renew_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        return self._sql(f"UPDATE {self.table}_leases SET expires_at = {_NOW} + %s WHERE name = %s AND owner = %s "
                         f"AND expires_at > {_NOW}", (float(ttl_s), check_key(name), owner)) == 1

    def release_lease(self, name: str, owner: str) -> None:
        self._sql(f"DELETE FROM {self.table}_leases WHERE name = %s AND owner = %s", (check_key(name), owner))

    def clear(self) -> None:
        """Delete every block and lease row (tests and benchmarks start from an empty store)."""
        self._sql(f"TRUNCATE {self.table}, {self.table}_leases")

    def close(self) -> None:
        self.conn.close()

    def describe(self) -> str:
        return f"postgres:{self.table}"


def open_block_store(spec: str | os.PathLike) -> BlockStore:
    """A store from a URL: ``redis://…`` / ``rediss://…`` → Redis, ``postgresql://…`` /
    ``postgres://…`` → Postgres, anything else is a folder for the filesystem store.

    Raises:
        ValueError: a URL the store cannot use (from the client)."""
    text = str(spec)
    if text.startswith(("redis://", "rediss://", "unix://")):
        return RedisBlockStore(text)
    if text.startswith(("postgresql://", "postgres://")):
        return PostgresBlockStore(text)
    return FilesystemBlockStore(text)
