"""The block store contract (put / get / exists / delete / list / leases) on every backend:
the filesystem store, and real Redis and PostgreSQL servers."""

from __future__ import annotations

import time

import pytest

from langchain_kvmemory.blockstore import BlockMissing, FilesystemBlockStore, check_key, open_block_store
from servers import postgres_store, redis_store  # noqa: F401  (fixtures)


@pytest.fixture
def fs_store(tmp_path):
    return FilesystemBlockStore(tmp_path / "blocks")


@pytest.fixture(params=["fs_store", "redis_store", "postgres_store"])
def store(request):
    return request.getfixturevalue(request.param)


def test_values_are_write_once_and_listed_with_their_write_time(store):
    t0 = time.time() - 5
    assert store.put("block/aa11", b"first") is True
    assert store.put("block/aa11", b"second") is False  # first writer wins: a key names one content
    assert store.get("block/aa11") == b"first"
    assert store.exists("block/aa11") and not store.exists("block/bb22")
    store.put("manifest/cc33", b"m")
    listed = dict(store.list("block/"))
    assert set(listed) == {"block/aa11"} and t0 <= listed["block/aa11"] <= time.time() + 5
    assert {k for k, _ in store.list("")} == {"block/aa11", "manifest/cc33"}
    assert store.nbytes("block/") == 5 and store.nbytes("") == 6
    assert store.get_many(["block/aa11", "block/missing", "manifest/cc33"]) == {"block/aa11": b"first",
                                                                                "manifest/cc33": b"m"}
    with pytest.raises(BlockMissing):
        store.get("block/bb22")


def test_delete_and_shred_remove_the_value(store):
    store.put("block/dd44", b"x" * 1000)
    store.put("block/ee55", b"y")
    assert store.delete("block/dd44", shred=True) is True
    assert store.delete("block/dd44") is False
    assert store.delete("block/ee55") is True
    assert not store.exists("block/dd44") and list(store.list("block/")) == []
    assert store.put("block/dd44", b"again") is True  # a deleted key can be written anew


def test_a_lease_excludes_other_owners_until_released_or_expired(store):
    assert store.acquire_lease("thread/t1", "w1", 30)
    assert store.acquire_lease("thread/t1", "w1", 30)  # re-entrant for its owner
    assert not store.acquire_lease("thread/t1", "w2", 30)
    assert store.acquire_lease("thread/t2", "w2", 30)  # other threads are free
    assert store.renew_lease("thread/t1", "w1", 30) and not store.renew_lease("thread/t1", "w2", 30)
    store.release_lease("thread/t1", "w2")  # not the holder: no effect
    assert not store.acquire_lease("thread/t1", "w2", 30)
    store.release_lease("thread/t1", "w1")
    assert store.acquire_lease("thread/t1", "w2", 0.3)
    time.sleep(0.6)  # w2 died: its lease expires
    assert not store.renew_lease("thread/t1", "w2", 30)
    assert store.acquire_lease("thread/t1", "w3", 30)


def test_bad_keys_and_roots_are_refused(tmp_path):
    for key in ["Block/A", "../x", "a//b", "", "a b"]:
        with pytest.raises(ValueError, match="lowercase"):
            check_key(key)
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        FilesystemBlockStore(tmp_path / "f")
    assert isinstance(open_block_store(tmp_path / "d"), FilesystemBlockStore)


def test_filesystem_writes_leave_no_temporary_files(fs_store):
    for i in range(5):
        fs_store.put(f"block/{i:02d}ff", bytes(100))
    assert fs_store.temp_files() == []
    assert len(list(fs_store.list())) == 5
