"""The LangGraph Agent Server (``langgraph dev``, a real subprocess) serving examples/server with
kvmemory's KVCheckpointSaver as its custom checkpointer, driven over HTTP with langgraph-sdk.

Two threads, three turns each (``runs.wait``, then ``runs.stream``): from the second turn on,
the turn's first model call resumes from the thread's live cache; the last AI message of the
thread state reports reused tokens. Deleting a thread through the API removes its checkpoints,
its manifests and the blocks only it named; the other thread's blocks stay and it goes on. A
copy of it resumes from the blocks it shares, and a restarted server resumes the remaining
thread from its stored blocks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from langgraph_sdk import get_sync_client
from langgraph_sdk.errors import NotFoundError

from langchain_kvmemory.blockstore import FilesystemBlockStore

pytestmark = pytest.mark.real_model

SERVER_DIR = Path(__file__).resolve().parents[1] / "examples" / "server"
LANGGRAPH = Path(sys.executable).with_name("langgraph")  # the venv's langgraph CLI (langgraph-cli[inmem])
START_TIMEOUT_S = 240.0  # model import and load on a loaded 2-core machine take 10-30 s
QUESTIONS = [
    ["What is the weather in Paris?", "And what time is it in Tokyo?", "Is it snowing in Oslo?"],
    ["How is the weather in Rome?", "What time is it in Paris?", "Is it cold in Oslo?"],
]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """``langgraph dev`` on examples/server's graph and checkpointer, in a folder of the test's own
    (its langgraph.json is the example's, with the example folder's absolute paths)."""

    def __init__(self, work: Path):
        self.work, self.data = work, work / "data"
        config = json.loads((SERVER_DIR / "langgraph.json").read_text())
        config["dependencies"] = [str(SERVER_DIR)]
        config["checkpointer"]["path"] = f"{SERVER_DIR / 'checkpointer.py'}:checkpointer"
        (work / "langgraph.json").write_text(json.dumps(config))
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> None:
        assert LANGGRAPH.is_file(), f"{LANGGRAPH} missing: install the test extra (make setup)"
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "KVMEMORY_SERVER_DIR": str(self.data), "OMP_NUM_THREADS": "1",
               "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false"}
        self.log = open(self.work / "server.log", "ab")
        self.proc = subprocess.Popen(
            [str(LANGGRAPH), "dev", "--no-browser", "--no-reload", "--host", "127.0.0.1", "--port", str(port),
             "--config", "langgraph.json"],
            cwd=self.work, env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"langgraph dev exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/ok", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:  # not listening yet
                pass
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"langgraph dev did not answer /ok within {START_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and anything it started
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        if proc is not None:
            self.log.close()

    def tail(self, chars: int = 4000) -> str:
        return (self.work / "server.log").read_text(errors="replace")[-chars:]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("agent-server"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _turn(client, thread_id: str, text: str, *, stream: bool) -> list[dict]:
    """One user turn; returns the model calls' AI messages of the turn (from the thread state)."""
    payload = {"messages": [{"role": "user", "content": text}]}
    if stream:
        nodes = [node for part in client.runs.stream(thread_id, "agent", input=payload, stream_mode="updates")
                 if part.event == "updates" for node in part.data]
        assert nodes[:2] == ["model", "tools"] and nodes[-1] == "model", nodes  # the forced call, its result, the answer
    else:
        client.runs.wait(thread_id, "agent", input=payload, raise_error=True)
    messages = client.threads.get_state(thread_id)["values"]["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["type"] == "human")
    assert messages[last_user]["content"] == text
    calls = [m for m in messages[last_user + 1:] if m["type"] == "ai"]
    assert calls and calls[0]["tool_calls"] and calls[-1] is messages[-1] and not calls[-1]["tool_calls"]
    return calls


def _repair(message: dict) -> dict:
    return message["response_metadata"]["repair"]


def _named(client, thread_id: str) -> tuple[set[str], set[str]]:
    """Block keys and manifests the thread's checkpoints name (metadata ``kvmemory_cache``)."""
    blocks, manifests = set(), set()
    for state in client.threads.get_history(thread_id, limit=1000):
        entry = (state.get("metadata") or {}).get("kvmemory_cache")
        if entry:
            blocks.update(entry["blocks"])
            manifests.add(entry["sha256"])
    return blocks, manifests


def test_agent_server_reuses_each_threads_cache_and_deletes_its_blocks(server):
    client = get_sync_client(url=server.url, timeout=120)
    threads = [client.threads.create()["thread_id"] for _ in QUESTIONS]
    for thread_id, questions in zip(threads, QUESTIONS):
        for turn, text in enumerate(questions, 1):
            calls = _turn(client, thread_id, text, stream=turn > 1)
            first, last = _repair(calls[0]), _repair(calls[-1])
            assert last["reused_tokens"] > 0  # the answer after the tool result extends the cache
            if turn == 1:
                assert first["reused_tokens"] == 0  # a new thread: nothing cached yet
            else:  # the previous turns are served from the thread's live cache (a cleared tool output repaired)
                assert first["reused_tokens"] >= first["prompt_tokens"] // 2, (turn, first)
            assert first["prompt_tokens"] > first["reused_tokens"]

    store = FilesystemBlockStore(server.data / "blocks")
    (a_blocks, a_manifests), (b_blocks, b_manifests) = (_named(client, t) for t in threads)
    a_only = a_blocks - b_blocks
    assert a_manifests and b_manifests and a_only and a_blocks & b_blocks  # the system prompt's blocks are shared
    assert all(store.exists(f"block/{k}") for k in a_blocks | b_blocks)
    assert all(store.exists(f"manifest/{m}") for m in a_manifests | b_manifests)

    client.threads.delete(threads[0])
    with pytest.raises(NotFoundError):
        client.threads.get(threads[0])
    assert not [m for m in a_manifests if store.exists(f"manifest/{m}")]
    assert not [k for k in a_only if store.exists(f"block/{k}")]
    assert all(store.exists(f"block/{k}") for k in b_blocks)  # shared ones included
    assert all(store.exists(f"manifest/{m}") for m in b_manifests)
    keys = {k.split("/", 1)[1] for k, _ in store.list("block/")}
    assert keys == b_blocks

    # the remaining thread goes on from its live cache in this process ...
    calls = _turn(client, threads[1], "And in Tokyo?", stream=False)
    assert _repair(calls[0])["reused_tokens"] > 0 and _repair(calls[-1])["reused_tokens"] > 0

    # a copy (threads.copy: the checkpointer's acopy_thread) names the same blocks and resumes from them
    copied = client.threads.copy(threads[1])["thread_id"]
    history = client.threads.get_history(copied, limit=1000)
    assert {h["metadata"].get("thread_id") for h in history} <= {copied, None}
    calls = _turn(client, copied, "Is it sunny in Paris?", stream=False)
    assert _repair(calls[0])["reused_tokens"] >= _repair(calls[0])["prompt_tokens"] // 2

    # ... and from its stored blocks after a restart (a new process: nothing live)
    server.stop()
    server.start()
    client = get_sync_client(url=server.url, timeout=120)
    calls = _turn(client, threads[1], "What time is it in Rome?", stream=True)
    resumed = _repair(calls[0])
    assert resumed["reused_tokens"] > 0 and resumed["reused_tokens"] >= resumed["prompt_tokens"] // 2, resumed
    assert resumed["fallback"] is None, resumed
