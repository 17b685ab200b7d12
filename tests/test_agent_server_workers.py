"""Two Agent Server processes over one PostgreSQL + Redis (stock langgraph-api on the runtime
langgraph-runtime-pg, ``langhost serve``), kvmemory's KVCheckpointSaver as their custom
checkpointer (AsyncPostgresSaver + Redis block store, examples/server/checkpointer_pg.py).

A thread's first turn runs on whichever process claims it from the runtime's queue; that process
is then killed (SIGKILL), and the thread's next turn, sent to the other one, runs there from the
thread's last checkpoint with its KV cache resumed from the shared blocks (most of the prompt
reused, no fallback); the thread keeps every message.

The servers run from a venv of their own (``make server-venv``: langgraph-runtime-pg pins
langgraph-api 0.11.1 and langgraph-checkpoint-postgres 3.1.0, the main venv has 0.16 and 3.2);
without it the test is skipped. The load test with a process killed mid-run is
``kvmemory bench server`` (docs/scale-out.md).
"""

from __future__ import annotations

import types
import uuid
from pathlib import Path

import pytest
from servers import POSTGRES_URL, _postgres_up, _redis_up, require

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[1]
SERVER_VENV = ROOT / ".venv-server"
REDIS_DB_URL = "redis://127.0.0.1:6379/6"  # a database of this test's own (emptied first)


def _turn(client, thread_id: str, text: str) -> tuple[list[dict], dict]:
    """One user turn (``runs.wait``); the turn's AI messages and the thread state after it."""
    payload = {"messages": [{"role": "user", "content": text, "id": str(uuid.uuid4())}]}
    client.runs.wait(thread_id, "agent", input=payload, raise_error=True)
    state = client.threads.get_state(thread_id)
    messages = state["values"]["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["type"] == "human")
    assert messages[last_user]["content"] == text
    return [m for m in messages[last_user + 1:] if m["type"] == "ai"], state


def test_a_threads_next_turn_runs_on_another_process_from_the_shared_blocks(tmp_path):
    if not (SERVER_VENV / "bin" / "langhost").is_file():
        pytest.skip(f"{SERVER_VENV} missing: run `make server-venv` (langgraph-runtime-pg pins langgraph-api==0.11.1 "
                    "and langgraph-checkpoint-postgres==3.1.0, so its servers get a venv of their own)")
    require(_postgres_up)
    require(_redis_up)
    from langgraph_sdk import get_sync_client

    from kvmemory_lab.bench.server import Server, fresh_stores

    database_url, redis_url = fresh_stores(POSTGRES_URL, REDIS_DB_URL, database="kvmemory_test_server")
    args = types.SimpleNamespace(max_tokens=16, heartbeat=5.0, server_venv=SERVER_VENV, start_timeout=240.0)
    servers = [Server(name, tmp_path, args, database_url, redis_url) for name in ("w1", "w2")]
    try:
        for server in servers:  # one after the other: the runtime migrates its database at start-up
            server.start()
        client = get_sync_client(url=servers[0].url, timeout=180)
        thread_id = client.threads.create()["thread_id"]
        calls, state = _turn(client, thread_id, "What is the weather in Paris?")
        first_writer = state["metadata"]["kvmemory_cache"]["writer"]
        assert calls[-1]["response_metadata"]["repair"]["reused_tokens"] > 0
        before = [m["id"] for m in state["values"]["messages"]]

        ran, other = (servers if servers[0].name == first_writer else servers[::-1])
        ran.kill()  # the process that holds the thread's live cache is gone
        client = get_sync_client(url=other.url, timeout=180)
        calls, state = _turn(client, thread_id, "And what time is it in Tokyo?")
        assert state["metadata"]["kvmemory_cache"]["writer"] == other.name
        resumed = calls[0]["response_metadata"]["repair"]
        assert resumed["fallback"] is None, resumed
        assert resumed["reused_tokens"] >= resumed["prompt_tokens"] // 2, resumed  # the blocks, not a Re-prefill
        after = [m["id"] for m in state["values"]["messages"]]
        assert after[:len(before)] == before and len(after) > len(before)
        humans = [m["content"] for m in state["values"]["messages"] if m["type"] == "human"]
        assert humans == ["What is the weather in Paris?", "And what time is it in Tokyo?"]
    finally:
        for server in servers:
            server.stop()
