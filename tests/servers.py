"""Real Redis and PostgreSQL servers for the scale-out tests (no mocks).

URLs come from ``KVMEMORY_REDIS_URL`` / ``KVMEMORY_POSTGRES_URL`` (defaults: the localhost
servers ``.ci/services.sh`` installs and starts). A server that does not answer is started with
that script first; if it still does not answer, the test fails under CI (``CI`` set) and is
skipped elsewhere, with the command that fixes it.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

REDIS_URL = os.environ.get("KVMEMORY_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("KVMEMORY_POSTGRES_URL", "postgresql://kvmemory:kvmemory@localhost:5432/kvmemory")
SERVICES = Path(__file__).resolve().parents[1] / ".ci" / "services.sh"
_started: list[bool] = []


def _redis_up() -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping())
    except redis.RedisError:
        return False


def _postgres_up() -> bool:
    import psycopg

    try:
        psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
        return True
    except psycopg.Error:
        return False


def require(up) -> None:
    """Make sure a server answers (starting them once with .ci/services.sh), else fail / skip."""
    if up():
        return
    if not _started:
        _started.append(True)
        subprocess.run(["bash", str(SERVICES)], check=False, capture_output=True, timeout=600)
    if up():
        return
    message = f"server not reachable ({REDIS_URL if up is _redis_up else POSTGRES_URL}): run bash {SERVICES}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def redis_store():
    """A RedisBlockStore in a namespace of its own (cleared afterwards)."""
    from langchain_kvmemory.blockstore import RedisBlockStore

    require(_redis_up)
    store = RedisBlockStore(REDIS_URL, namespace=f"kvmtest-{uuid.uuid4().hex[:8]}")
    yield store
    store.clear()
    store.close()


@pytest.fixture
def postgres_store():
    """A PostgresBlockStore on a table of its own (dropped afterwards)."""
    from langchain_kvmemory.blockstore import PostgresBlockStore

    require(_postgres_up)
    store = PostgresBlockStore(POSTGRES_URL, table=f"kvmtest_{uuid.uuid4().hex[:8]}")
    yield store
    store._sql(f"DROP TABLE {store.table}, {store.table}_leases")
    store.close()


@pytest.fixture
def private_redis():
    """A Redis server of the test's own on a free local port (``redis-server`` from
    .ci/services.sh), as ``(url, stop)``: ``stop()`` shuts it down, as in an outage."""
    import shutil
    import socket
    import time

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        message = f"redis-server not installed: run bash {SERVICES}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    else:
        server.kill()
        pytest.fail(f"redis-server on port {port} did not start")

    def stop() -> None:
        server.terminate()
        server.wait(10)

    yield url, stop
    if server.poll() is None:
        stop()


@pytest.fixture
def postgres_url():
    require(_postgres_up)
    return POSTGRES_URL


@pytest.fixture
def redis_url():
    require(_redis_up)
    return REDIS_URL
