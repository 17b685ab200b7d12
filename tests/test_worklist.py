"""Several benchmark processes on one output folder: claims, stale claims, no double records."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvmemory_lab.bench.worklist import append_record, claim, done_ids, release


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_live_claim_blocks_and_a_stale_one_is_taken_over(tmp_path):
    claims = tmp_path / ".claims"
    assert claim(claims, "case-a")
    assert (claims / "case-a").read_text() == str(os.getpid())
    claims.joinpath("case-b").write_text(str(os.getppid()))  # held by a live process (our parent)
    assert not claim(claims, "case-b")
    claims.joinpath("case-c").write_text(str(_dead_pid()))  # its process is gone
    assert claim(claims, "case-c") and (claims / "case-c").read_text() == str(os.getpid())
    release(claims, "case-a")
    release(claims, "case-b")  # not ours: stays
    assert not (claims / "case-a").exists() and (claims / "case-b").exists()
    assert sorted(p.name for p in claims.iterdir()) == ["case-b", "case-c"]  # no temp files left


def test_append_is_once_per_case_and_torn_lines_are_ignored(tmp_path):
    path = tmp_path / "cases.jsonl"
    assert append_record(path, {"case_id": "x", "v": 1})
    assert not append_record(path, {"case_id": "x", "v": 2})  # a second run of the same case
    with path.open("a") as f:
        f.write('{"case_id": "y", "v"')  # a crash mid-line
    assert done_ids(path) == {"x"}
    assert append_record(path, {"case_id": "y", "v": 3})  # the rerun of y starts on a new line
    assert done_ids(path) == {"x", "y"}
    assert [json.loads(line)["v"] for line in path.read_text().splitlines()[:1]] == [1]
