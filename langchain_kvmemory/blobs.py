"""A content-addressed store of safetensors blobs (one file per distinct cache state).

A blob's name is the sha256 of its bytes, so identical states are stored once and a reader can
prove that what it loaded is what was written. Files are written to a temporary name in the same
folder, flushed to disk and renamed into place (``os.replace`` is atomic on POSIX and Windows), so
a crash leaves either the whole blob or no blob, never half of one under the final name. The
folder is fsynced after the rename, so a blob named by a checkpoint that the database committed
afterwards survives a power loss too. A crash between the temporary write and the rename leaves
a ``.tmp-*`` file; a crash between the rename and the checkpoint leaves a blob no checkpoint
names; :meth:`BlobStore.collect_garbage` removes both once they are older than its grace period.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from kvmemory.errors import KVMemoryError

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"


class BlobError(KVMemoryError, RuntimeError):
    """A stored blob cannot be used: missing, truncated, or its bytes do not match its sha256.

    ``reason`` is one of ``missing``, ``truncated``, ``mismatch``, ``unreadable``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class BlobRef:
    """Where a blob is and what it must be: ``sha256`` (hex, 64 chars) and ``size`` (bytes)."""

    sha256: str
    size: int

    def to_dict(self) -> dict:
        return {"sha256": self.sha256, "size": self.size}

    @classmethod
    def from_dict(cls, data) -> "BlobRef":
        """Raises BlobError (``unreadable``) on anything but ``{"sha256": <64 hex>, "size": int}``."""
        try:
            sha, size = str(data["sha256"]), int(data["size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise BlobError("unreadable", f"bad blob reference {data!r}: expected sha256 and size") from exc
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise BlobError("unreadable", f"bad blob reference {data!r}: sha256 must be 64 lowercase hex digits")
        return cls(sha, size)


class BlobStore:
    """Safetensors files named by their sha256 under ``root/<first two hex digits>/``.

    Args:
        root: the store's folder (created on first write).
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.temp_files_removed = 0  # stale temporary files deleted by collect_garbage (crash leftovers)

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / f"{sha256}{SUFFIX}"

    def put(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> BlobRef:
        """Serialise ``tensors`` (+ string ``metadata``) as safetensors and store them once.

        Returns:
            the blob's reference; an identical blob already present is not rewritten.

        Raises:
            OSError: the folder cannot be written (disk full, permissions).
        """
        data = save_safetensors(tensors, metadata=metadata)
        ref = BlobRef(hashlib.sha256(data).hexdigest(), len(data))
        target = self.path(ref.sha256)
        if _holds(target, ref):
            os.utime(target)  # fresh mtime: the garbage collector's grace period starts again
            return ref
        # a damaged file under the blob's name (bit rot, a partial copy) is replaced, not trusted
        self._mkdirs(target.parent)
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=SUFFIX, dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # the bytes are on disk before the name points at them
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(target.parent)  # the rename itself is durable before a checkpoint names the blob
        return ref

    def _mkdirs(self, folder: Path) -> None:
        if folder.is_dir():
            return
        new_root = not self.root.is_dir()
        folder.mkdir(parents=True, exist_ok=True)
        fsync_dir(self.root)  # a new shard folder's entry must survive a power loss too
        if new_root:
            fsync_dir(self.root.parent)

    def get(self, ref: BlobRef) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Load and verify a blob: size, then sha256 of the bytes, then the safetensors header.

        Returns:
            ``(tensors, metadata)`` (CPU tensors, string metadata).

        Raises:
            BlobError: ``missing`` (no file), ``truncated`` (fewer bytes than recorded),
                ``mismatch`` (bytes differ from the recorded sha256), ``unreadable`` (not
                safetensors despite a matching hash, e.g. written by another tool).
        """
        path = self.path(ref.sha256)
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise BlobError("missing", f"cache blob {path} is missing") from exc
        if len(data) < ref.size:
            raise BlobError("truncated", f"cache blob {path} has {len(data)} bytes, {ref.size} were written")
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != ref.size or digest != ref.sha256:
            raise BlobError("mismatch", f"cache blob {path} does not match its sha256 (got {digest[:12]}…, "
                                        f"{len(data)} bytes; expected {ref.sha256[:12]}…, {ref.size} bytes)")
        try:
            tensors = load_safetensors(data)
            metadata = header_metadata(data)
        except (SafetensorError, ValueError) as exc:
            raise BlobError("unreadable", f"cache blob {path} is not a safetensors file ({exc})") from exc
        return tensors, metadata

    def digests(self) -> set[str]:
        """sha256 of every blob in the store."""
        if not self.root.is_dir():
            return set()
        return {p.name[: -len(SUFFIX)] for p in self.root.glob(f"??/*{SUFFIX}") if not p.name.startswith(".")}

    def temp_files(self) -> list[Path]:
        """Temporary files of writes that never reached their rename (a crash or kill mid-``put``)."""
        if not self.root.is_dir():
            return []
        return sorted(self.root.glob(f"??/{TEMP_PREFIX}*"))

    def collect_garbage(self, keep: set[str], *, grace_s: float = 300.0) -> list[str]:
        """Delete blobs not in ``keep`` whose file is older than ``grace_s`` seconds, and temporary
        files (``.tmp-*``, left by a crash between write and rename) older than ``grace_s``.

        The grace period protects a blob written by a concurrent ``put`` whose checkpoint is not
        committed yet (blobs are written before the checkpoint that references them).

        Returns:
            the deleted digests.
        """
        now, removed = time.time(), []
        for sha in self.digests() - set(keep):
            if _unlink_if_older(self.path(sha), now - grace_s):
                removed.append(sha)
        temps = [p for p in self.temp_files() if _unlink_if_older(p, now - grace_s)]
        self.temp_files_removed += len(temps)
        if removed or temps:
            log.info("kvmemory: removed %d unreferenced cache blobs and %d stale temporary files from %s",
                     len(removed), len(temps), self.root)
        return removed


def _unlink_if_older(path: Path, cutoff: float) -> bool:
    try:
        if path.stat().st_mtime > cutoff:
            return False
        path.unlink()
        return True
    except FileNotFoundError:
        return False  # removed concurrently


def _holds(target: Path, ref: BlobRef) -> bool:
    """Whether ``target`` already holds exactly the blob ``ref`` (size, then sha256 of its bytes)."""
    try:
        if target.stat().st_size != ref.size:
            return False
        return hashlib.sha256(target.read_bytes()).hexdigest() == ref.sha256
    except FileNotFoundError:
        return False


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in ``folder`` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # e.g. Windows or filesystems that refuse fsync on folders: nothing more to do
        return
    finally:
        os.close(fd)


def header_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors buffer (the format's documented JSON header)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return dict(header.get("__metadata__") or {})
