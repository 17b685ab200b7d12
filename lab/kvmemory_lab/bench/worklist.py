"""Resumable case lists shared by several benchmark processes on one output folder.

A process claims a case before running it (a claim file holding its pid, created atomically by
``os.link``) and appends the finished record to the JSONL under an exclusive lock, skipping a
case id already written. Several plain invocations on the same folder thus split the remaining
cases between them (one torch thread each uses one core each), and a crashed or interrupted
process leaves a stale claim that the next one takes over once that pid is gone.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path


def done_ids(path: Path) -> set[str]:
    """Case ids already in the JSONL ``path`` (a torn last line from a crash is ignored)."""
    done = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                done.add(json.loads(line)["case_id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return done


def claim(claims: Path, case_id: str) -> bool:
    """Take ``case_id`` for this process; False while another live process holds it.

    A claim whose process no longer exists (crash, Ctrl-C) is removed and taken over.
    """
    claims.mkdir(parents=True, exist_ok=True)
    path = claims / case_id
    tmp = claims / f".{case_id}.{os.getpid()}"
    tmp.write_text(str(os.getpid()))
    try:
        for _ in range(2):
            try:
                os.link(tmp, path)  # atomic: the claim appears with its pid already written
                return True
            except FileExistsError:
                if _alive(_holder(path)):
                    return False
                path.unlink(missing_ok=True)  # stale: its process is gone
        return False
    finally:
        tmp.unlink(missing_ok=True)


def release(claims: Path, case_id: str) -> None:
    """Drop this process's claim on ``case_id`` (after its record is written)."""
    path = claims / case_id
    if _holder(path) == os.getpid():
        path.unlink(missing_ok=True)


def append_record(path: Path, record: dict) -> bool:
    """Append ``record`` (with a ``case_id``) as one JSONL line under an exclusive lock.

    Returns False (and writes nothing) when the case id is already in the file, so that two
    processes that ran the same case never count it twice.
    """
    with path.open("a+") as sink:
        fcntl.flock(sink, fcntl.LOCK_EX)
        try:
            if record["case_id"] in done_ids(path):
                return False
            sink.seek(0, os.SEEK_END)
            if sink.tell() and not path.read_bytes().endswith(b"\n"):
                sink.write("\n")  # end a line torn by a crash so this record stays readable
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
            return True
        finally:
            fcntl.flock(sink, fcntl.LOCK_UN)


def _holder(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
