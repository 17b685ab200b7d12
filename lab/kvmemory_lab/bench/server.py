"""``kvmemory bench server``: the kvmemory agent served by several LangGraph Agent Server
processes over one PostgreSQL and one Redis, loaded through ``langgraph-sdk``.

The servers are stock ``langgraph-api`` on the PostgreSQL + Redis runtime
``langgraph-runtime-pg`` (``langhost serve``, from the separate venv ``--server-venv``, default
``.venv-server``: ``make server-venv``), each its own process with its own copy of the model,
serving ``examples/server``'s agent (``langgraph.pg.json``) with kvmemory's ``KVCheckpointSaver``
as the custom checkpointer: ``AsyncPostgresSaver`` on the runtime's database, the KV caches as
token blocks in Redis (``examples/server/checkpointer_pg.py``). Runs go to the runtime's queue
(PostgreSQL ``SKIP LOCKED``, Redis wake-ups, one job per process): any process runs any thread's
next run; a process that did not run the thread's previous turn loads the thread's newest cache
state from the shared blocks.

For each N of ``--threads`` (default 1, 4, 8): N threads run ``--turns`` turns each (default 6)
at the same time, each turn sent with ``runs.stream`` to the servers in turn (round robin). Before
turn ``--delete-at`` (default 4) the messages of the thread's second turn are removed with
``threads.update_state`` (a deletion in the middle of the history: the next model call repairs
the cache instead of re-prefilling it); ``ClearToolUsesEdit`` also clears older tool outputs from
the second turn on. Measured per N:

- hop latency p50 / p95: a hop is one model call, timed on the client from the run's request
  (or the previous model node's update) to the model node's update in the stream; the turn
  latency (request to end of stream) beside it;
- aggregate decoded tokens/s: completion tokens of all model calls / wall time of the N threads;
- reused-token ratio: reused / prompt tokens over all model calls
  (``response_metadata["repair"]``), and over the first call of the turns that ran on another
  process than the thread's previous turn (resumed from the shared blocks), with fallbacks;
- messages lost (each turn's user message exactly once, an answer after it, every message seen
  after a turn still there unless deleted), checkpoints lost (a checkpoint for every run), runs
  failed: all must be 0.

Then the kill case (``--kill-threads``, default 4; 0 skips it): the same load, and once a third of
its turns are done, one server process that is running a run is killed with SIGKILL. Its run's
heartbeat in Redis expires (``LG_BG_JOB_HEARTBEAT``), the survivor's sweep puts the run back in
the queue (or marks it failed after ``BG_JOB_MAX_RETRIES``; the client then sends the turn again
with the same message id) and runs it from the thread's last checkpoint; clients whose stream
went through the killed process wait for the run on another one (``runs.join``).

``--out DIR`` writes ``server.json``, ``server.md`` and ``server.png`` (latency against N); the
servers' logs go to a temporary folder (printed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from kvmemory_lab.bench.common import int_list

ROOT = Path(__file__).resolve().parents[3]
SERVER_DIR = ROOT / "examples" / "server"
QUESTIONS = ["What is the weather in Paris?", "And what time is it in Tokyo?", "Is it snowing in Oslo?",
             "How is the weather in Rome?", "What time is it in Paris?", "Is it cold in Oslo?",
             "What time is it in Rome?", "Is it sunny in Tokyo?"]
DATABASE = "kvmemory_bench_server"


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/server"),
                        help="output folder (default benchmarks/results/server)")
    parser.add_argument("--workers", type=int, default=2, help="server processes (default 2)")
    parser.add_argument("--threads", type=int_list, default=[1, 4, 8], help="concurrent threads, e.g. 1,4,8")
    parser.add_argument("--turns", type=int, default=6, help="turns per thread (default 6)")
    parser.add_argument("--delete-at", type=int, default=4,
                        help="before this turn, remove the thread's second turn (0: no deletion; default 4)")
    parser.add_argument("--kill-threads", type=int, default=4,
                        help="threads of the kill case (SIGKILL one server mid-run; 0 skips it; default 4)")
    parser.add_argument("--max-tokens", type=int, default=24, help="answer length cap (default 24)")
    parser.add_argument("--heartbeat", type=float, default=5.0,
                        help="LG_BG_JOB_HEARTBEAT seconds: a dead process's run is swept after ~2-4x this")
    parser.add_argument("--server-venv", type=Path, default=ROOT / ".venv-server",
                        help="venv with langhost / langgraph-runtime-pg (make server-venv)")
    parser.add_argument("--postgres", default=os.environ.get(
        "KVMEMORY_POSTGRES_URL", "postgresql://kvmemory:kvmemory@localhost:5432/kvmemory"),
        help=f"an existing database of a role with CREATEDB; the servers get a fresh database {DATABASE}")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/5",
                        help="Redis database of the runtime and the blocks (flushed first; default db 5)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for a server's /ok")
    parser.add_argument("--run-timeout", type=float, default=300.0, help="seconds to wait for one run")


# ------------------------------------------------------------------ servers
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _database_url(admin_url: str, name: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(admin_url)
    return urlunsplit(parts._replace(path=f"/{name}"))


def fresh_stores(postgres_url: str, redis_url: str, database: str = DATABASE) -> tuple[str, str]:
    """A new PostgreSQL database ``database`` for the servers (dropped first; ``postgres_url``
    names an existing database of a role with CREATEDB) and the Redis database ``redis_url``
    emptied. Returns the URLs the servers get."""
    import psycopg
    import redis

    with psycopg.connect(postgres_url, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {database}")
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=5)
    client.flushdb()
    client.close()
    return _database_url(postgres_url, database), redis_url


class Server:
    """One ``langhost serve`` process (stock langgraph-api + langgraph-runtime-pg) on a free port."""

    def __init__(self, name: str, work: Path, args, database_url: str, redis_url: str):
        self.name, self.work, self.args = name, work, args
        self.database_url, self.redis_url = database_url, redis_url
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.log_path = work / f"{name}.log"
        self.started_s = 0.0

    def start(self) -> None:
        import httpx

        config = json.loads((SERVER_DIR / "langgraph.pg.json").read_text())
        config["dependencies"] = [str(SERVER_DIR)]
        config["checkpointer"]["path"] = f"{SERVER_DIR / 'checkpointer_pg.py'}:checkpointer"
        (self.work / "langgraph.json").write_text(json.dumps(config))
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "DATABASE_URI": self.database_url, "REDIS_URI": self.redis_url,
               "KVMEMORY_WORKER_ID": self.name, "KVMEMORY_SERVER_MAX_TOKENS": str(self.args.max_tokens),
               "KVMEMORY_SERVER_BLOCKS_NAMESPACE": "kvmemory-bench", "OMP_NUM_THREADS": "1",
               "LG_BG_JOB_HEARTBEAT": str(self.args.heartbeat), "N_JOBS_PER_WORKER": "1",
               "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false", "LANGGRAPH_CLI_NO_ANALYTICS": "1"}
        t0 = time.perf_counter()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(self.args.server_venv / "bin" / "langhost"), "serve", "--host", "127.0.0.1", "--port", str(port),
             "-c", "langgraph.json", "--n-jobs-per-worker", "1"],
            cwd=self.work, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.args.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):  # not listening yet
                if httpx.get(f"{self.url}/ok", timeout=2).status_code == 200:
                    self.started_s = time.perf_counter() - t0
                    return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer /ok within {self.args.start_timeout:.0f} s:\n{self.tail()}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process group (the server and anything it started): no clean-up runs."""
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def in_run(self) -> bool:
        """Whether the log shows a background run started and not finished yet."""
        text = self.log_text()
        started = text.count("Starting background run")
        ended = sum(text.count(s) for s in ("Background run succeeded", "Background run failed",
                                                "Run exceeded max attempts"))
        return started > ended


# ------------------------------------------------------------------ load
def _questions(index: int, turns: int) -> list[str]:
    start = index % len(QUESTIONS)
    return [(QUESTIONS[start:] + QUESTIONS[:start])[t % len(QUESTIONS)] for t in range(turns)]


def _repair(message: dict) -> dict:
    return (message.get("response_metadata") or {}).get("repair") or {}


def _writer(state: dict) -> str | None:
    entry = (state.get("metadata") or {}).get("kvmemory_cache") or {}
    return entry.get("writer")


class Pool:
    """The servers the clients send to: round robin over the live ones; a server whose connection
    failed is left out from then on."""

    def __init__(self, servers: list[Server], timeout: float):
        from langgraph_sdk import get_client

        self.servers = servers
        self.clients = {s.name: get_client(url=s.url, timeout=timeout) for s in servers}
        self.dead: set[str] = set()
        self._next = 0

    def pick(self, exclude: str | None = None) -> tuple[str, object]:
        live = [s.name for s in self.servers if s.name not in self.dead and s.name != exclude and s.alive]
        if not live:
            live = [s.name for s in self.servers if s.alive]
        if not live:
            raise RuntimeError("no server left")
        name = live[self._next % len(live)]
        self._next += 1
        return name, self.clients[name]

    async def call(self, request):
        """``await request(client)`` on a live server; a connection error (the server was killed
        meanwhile) leaves it out and the request goes to another one."""
        import httpx

        for _ in range(4):
            name, client = self.pick()
            try:
                return await request(client)
            except (httpx.TransportError, OSError):
                self.dead.add(name)
        return await request(self.pick()[1])


async def run_thread(pool: Pool, index: int, args, record: list[dict], progress: dict) -> dict:
    """One thread: ``args.turns`` turns, the second turn removed before ``args.delete_at``."""
    import httpx

    thread_id = (await pool.call(lambda c: c.threads.create()))["thread_id"]
    seen: set[str] = set()  # ids of messages the thread had after some turn (and not deleted since)
    deleted: set[str] = set()
    turn_ids: dict[int, list[str]] = {}
    run_ids: list[str] = []
    previous_writer = None
    for turn, text in enumerate(_questions(index, args.turns), 1):
        if args.delete_at and turn == args.delete_at and 2 in turn_ids:
            doomed = turn_ids[2]
            removal = {"messages": [{"type": "remove", "id": i, "content": ""} for i in doomed]}
            try:
                await pool.pick()[1].threads.update_state(thread_id, removal, as_node="model")
            except (httpx.TransportError, OSError):  # killed meanwhile: remove them unless that went through
                present = {m["id"] for m in (await pool.call(lambda c: c.threads.get_state(thread_id)))["values"]["messages"]}
                if set(doomed) & present:
                    await pool.call(lambda c: c.threads.update_state(thread_id, removal, as_node="model"))
            deleted.update(doomed)
            seen.difference_update(doomed)
        message_id = str(uuid.uuid4())
        payload = {"messages": [{"role": "user", "content": text, "id": message_id}]}
        row = {"thread": index, "thread_id": thread_id, "turn": turn, "hops_ms": [], "retried_by_client": 0,
               "stream_broken": False}
        t0 = time.perf_counter()
        created: dict = {}
        for attempt in range(3):  # a run the server reports failed is sent again (same message id)
            front, client = pool.pick()
            row["front"] = front
            last = t0
            try:
                async with asyncio.timeout(args.run_timeout):
                    async for part in client.runs.stream(
                            thread_id, "agent", input=payload, stream_mode="updates", on_disconnect="continue",
                            on_run_created=lambda meta: created.update(meta)):
                        now = time.perf_counter()
                        if part.event == "metadata" and isinstance(part.data, dict):
                            created.setdefault("run_id", part.data.get("run_id"))
                            row.setdefault("attempts_seen", []).append(part.data.get("attempt"))
                        elif part.event == "updates" and isinstance(part.data, dict) and "model" in part.data:
                            row["hops_ms"].append(round(1000 * (now - last), 1))
                            last = now
                        elif part.event == "error":
                            row["stream_error"] = str(part.data)[:300]
            except (httpx.HTTPError, OSError, TimeoutError) as exc:  # front died / no end: wait for the run elsewhere
                row["stream_broken"] = True
                row["stream_exception"] = f"{type(exc).__name__}: {exc}"[:300]
                if not isinstance(exc, TimeoutError):
                    pool.dead.add(front)
                row["hops_ms"] = []  # not all hops were seen
            run_id = created.get("run_id")
            if run_id is None:  # broken before the run id came back: the thread's newest run
                runs = await pool.call(lambda c: c.runs.list(thread_id, limit=1))
                run_id = runs[0]["run_id"] if runs else None
            status = None
            if run_id is not None:
                deadline = time.monotonic() + args.run_timeout
                while time.monotonic() < deadline:  # the stream ends with the run; a join covers a broken one
                    status = (await pool.call(lambda c: c.runs.get(thread_id, run_id)))["status"]
                    if status not in ("pending", "running"):
                        break
                    await asyncio.sleep(0.5)
            row.setdefault("runs", []).append({"run_id": run_id, "status": status})
            if run_id is not None:
                run_ids.append(run_id)
            if status == "success":
                break
            row["retried_by_client"] += 1
            created = {}
        row["turn_ms"] = round(1000 * (time.perf_counter() - t0), 1)
        row["status"] = status
        state = await pool.call(lambda c: c.threads.get_state(thread_id))
        messages = state["values"]["messages"]
        humans = [i for i, m in enumerate(messages) if m["type"] == "human"]
        last_user = humans[-1] if humans else -1
        calls = [m for m in messages[last_user + 1:] if m["type"] == "ai"]
        row["worker"] = _writer(state)
        row["moved"] = previous_writer is not None and row["worker"] != previous_writer
        previous_writer = row["worker"] or previous_writer
        row["calls"] = [{"prompt": _repair(m).get("prompt_tokens", 0), "reused": _repair(m).get("reused_tokens", 0),
                         "refreshed": _repair(m).get("refreshed_tokens", 0), "fallback": _repair(m).get("fallback"),
                         "operator": _repair(m).get("operator"),
                         "decoded": (m.get("usage_metadata") or {}).get("output_tokens", 0)} for m in calls]
        turn_ids[turn] = [m["id"] for m in messages[last_user:]] if messages[last_user]["id"] == message_id else []
        seen.update(m["id"] for m in messages)
        record.append(row)
        progress["turns"] += 1
    final = (await pool.call(lambda c: c.threads.get_state(thread_id)))["values"]["messages"]
    history = await pool.call(lambda c: c.threads.get_history(thread_id, limit=1000))
    ids = [m["id"] for m in final]
    texts = _questions(index, args.turns)
    removed_turn = 2 if args.delete_at and 2 < args.delete_at <= args.turns else None
    kept = [t for turn, t in enumerate(texts, 1) if turn != removed_turn]
    human_texts = [m["content"] for m in final if m["type"] == "human"]
    lost = len(seen - set(ids))
    lost += sum(1 for t in set(kept) if human_texts.count(t) < kept.count(t))
    doubled = sum(max(0, human_texts.count(t) - kept.count(t)) for t in set(human_texts))
    unanswered = 0  # a user message not followed by an answer without tool calls before the next one
    for i, m in enumerate(final):
        if m["type"] == "human":
            nxt = next((j for j in range(i + 1, len(final)) if final[j]["type"] == "human"), len(final))
            if not any(final[j]["type"] == "ai" and not final[j].get("tool_calls") for j in range(i + 1, nxt)):
                unanswered += 1
    checkpointed_runs = {(h.get("metadata") or {}).get("run_id") for h in history}
    succeeded = [r["run_id"] for row in record if row["thread_id"] == thread_id for r in row["runs"]
                 if r["status"] == "success"]
    return {"thread": index, "thread_id": thread_id, "messages": len(final), "messages_lost": lost,
            "messages_doubled": doubled, "unanswered": unanswered, "deleted_still_there": len(deleted & set(ids)),
            "checkpoints_lost": sum(1 for r in succeeded if r not in checkpointed_runs),
            "checkpoints": len(history), "runs": len(run_ids)}


async def load(servers: list[Server], n: int, args, *, kill: bool = False, console=None) -> dict:
    pool = Pool(servers, timeout=args.run_timeout)
    record: list[dict] = []
    progress = {"turns": 0}
    killed: dict = {}

    async def killer() -> None:
        target = servers[-1]
        while progress["turns"] < max(1, (n * args.turns) // 3):
            await asyncio.sleep(0.2)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not target.in_run():
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)  # inside the run (loading the thread or in a model call)
        killed.update({"worker": target.name, "in_run": target.in_run(), "after_turns": progress["turns"],
                       "at_s": round(time.perf_counter() - t0, 2),
                       "at_utc": time.strftime("%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}"})
        target.kill()
        if console is not None:
            console.print(f"  SIGKILL {target.name} after {progress['turns']} turns (in a run: {killed['in_run']})")

    t0 = time.perf_counter()
    tasks = [run_thread(pool, i, args, record, progress) for i in range(n)]
    if kill:
        done = await asyncio.gather(killer(), *tasks)
        threads = done[1:]
    else:
        threads = await asyncio.gather(*tasks)
    wall_s = time.perf_counter() - t0
    return summarise(n, record, threads, wall_s, killed)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return round(values[lo] + (values[hi] - values[lo]) * (k - lo), 1)


def summarise(n: int, record: list[dict], threads: list[dict], wall_s: float, killed: dict) -> dict:
    hops = [h for r in record for h in r["hops_ms"]]
    turns = [r["turn_ms"] for r in record]
    calls = [c for r in record for c in r["calls"]]
    firsts_moved = [r["calls"][0] for r in record if r["moved"] and r["calls"]]
    firsts_later = [r["calls"][0] for r in record if r["turn"] > 1 and r["calls"]]
    decoded = sum(c["decoded"] for c in calls)

    def ratio(cs):
        prompt = sum(c["prompt"] for c in cs)
        return round(sum(c["reused"] for c in cs) / prompt, 4) if prompt else None

    per_worker: dict[str, int] = {}
    for r in record:
        per_worker[str(r["worker"])] = per_worker.get(str(r["worker"]), 0) + 1
    return {
        "threads": n, "turns": len(record), "wall_s": round(wall_s, 2),
        "hop_ms_p50": _pct(hops, 0.5), "hop_ms_p95": _pct(hops, 0.95), "hops_timed": len(hops),
        "turn_ms_p50": _pct(turns, 0.5), "turn_ms_p95": _pct(turns, 0.95),
        "decoded_tokens": decoded, "decoded_tokens_per_s": round(decoded / wall_s, 2) if wall_s else None,
        "model_calls": len(calls), "prompt_tokens": sum(c["prompt"] for c in calls),
        "reused_tokens": sum(c["reused"] for c in calls), "reuse_ratio": ratio(calls),
        "reuse_ratio_first_call_later_turns": ratio(firsts_later),
        "moved_turns": len(firsts_moved), "reuse_ratio_first_call_moved": ratio(firsts_moved),
        "fallbacks": sum(1 for c in calls if c["fallback"]),
        "fallback_reasons": sorted({str(c["fallback"]) for c in calls if c["fallback"]}),
        "refreshed_tokens": sum(c["refreshed"] for c in calls),
        "turns_per_worker": per_worker,
        "messages_lost": sum(t["messages_lost"] for t in threads),
        "messages_doubled": sum(t["messages_doubled"] for t in threads),
        "unanswered_turns": sum(t["unanswered"] for t in threads),
        "deleted_still_there": sum(t["deleted_still_there"] for t in threads),
        "checkpoints_lost": sum(t["checkpoints_lost"] for t in threads),
        "runs_failed": sum(1 for r in record if r["status"] != "success"),
        "runs_resent_by_client": sum(r["retried_by_client"] for r in record),
        "streams_broken": sum(1 for r in record if r["stream_broken"]),
        "killed": killed or None, "per_thread": threads, "per_turn": record,
    }


def _swept_runs(servers: list[Server]) -> list[str]:
    """The runtime's sweep (a dead process's run put back in the queue or failed) and what became
    of each swept run, from the servers' logs: ``<time> <server>: <event> <run id>``."""
    import re

    plain = {s.name: re.sub(r"\x1b\[[0-9;]*m", "", s.log_text()).splitlines() for s in servers}
    swept = {m.group(1) for lines in plain.values() for line in lines if "Swept stale run " in line
             for m in [re.search(r"run_id=([0-9a-f-]+)", line)] if m}
    events = ("Created run", "Starting background run", "Background run succeeded", "Background run failed",
              "Swept stale run ", "exceeded max attempts")
    out = []
    for name, lines in plain.items():
        for line in lines:
            run = re.search(r"run_id=([0-9a-f-]+)", line)
            event = next((e.strip() for e in events if e in line), None)
            if event and run and run.group(1) in swept:
                out.append(f"{line[11:23]} {name}: {event} {run.group(1)}")
    return sorted(out)


# ------------------------------------------------------------------ run
def run(args, console) -> int:
    from kvmemory_lab.bench.common import load_average, machine_name, simd_flags

    langhost = args.server_venv / "bin" / "langhost"
    if not langhost.is_file():
        console.print(f"[red]{langhost} missing: run `make server-venv` (langgraph-runtime-pg pins langgraph-api "
                      "0.11.1 and langgraph-checkpoint-postgres 3.1.0, so it gets a venv of its own)[/red]")
        return 2
    try:
        database_url, redis_url = fresh_stores(args.postgres, args.redis)
    except Exception as exc:  # noqa: BLE001 - a server that does not answer: say which and how to start it
        console.print(f"[red]PostgreSQL / Redis not reachable ({exc}): run bash .ci/services.sh[/red]")
        return 2
    version = subprocess.run([str(args.server_venv / "bin" / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('langgraph-api'), "
                              "m.version('langgraph-runtime-pg'), m.version('langgraph-checkpoint-postgres'))"],
                             capture_output=True, text=True).stdout.split()
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="kvmemory-bench-server-"))  # the servers' logs (INFO: several MB)
    console.print(f"server logs in {logs}")
    meta = {"command": getattr(args, "command_line", ""), "machine": machine_name(), "cpu_flags": simd_flags(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "langgraph_api": version[0] if version else None, "langgraph_runtime_pg": version[1] if len(version) > 1 else None,
            "langgraph_checkpoint_postgres": version[2] if len(version) > 2 else None,
            "workers": args.workers, "turns": args.turns, "delete_at": args.delete_at, "max_tokens": args.max_tokens,
            "heartbeat_s": args.heartbeat, "jobs_per_worker": 1, "torch_threads_per_worker": 1,
            "model": "SmolLM2-135M-Instruct fp32 (embedded)", "block_store": "Redis", "checkpoints": "AsyncPostgresSaver",
            "loadavg_start": load_average(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    result: dict = {"meta": meta, "runs": []}
    servers: list[Server] = []
    try:
        for i in range(args.workers):  # one after the other: the runtime's migrations run at start-up
            server = Server(f"w{i + 1}", logs, args, database_url, redis_url)
            server.start()
            servers.append(server)
            console.print(f"{server.name} up at {server.url} in {server.started_s:.1f} s")
        meta["startup_s"] = [round(s.started_s, 1) for s in servers]
        for n in args.threads:
            console.print(f"N = {n}: {n} threads x {args.turns} turns on {args.workers} servers")
            summary = asyncio.run(load(servers, n, args))
            result["runs"].append(summary)
            console.print("  " + _line(summary))
        if args.kill_threads:
            console.print(f"kill case: {args.kill_threads} threads x {args.turns} turns, SIGKILL {servers[-1].name} mid-run")
            summary = asyncio.run(load(servers, args.kill_threads, args, kill=True, console=console))
            summary["swept"] = _swept_runs(servers)
            result["kill"] = summary
            console.print("  " + _line(summary))
    finally:
        for server in servers:
            server.stop()
        meta["loadavg_end"] = load_average()
        result["headline"] = headline(result)
        (args.out / "server.json").write_text(json.dumps(result, indent=1, default=str))
        (args.out / "server.md").write_text(markdown(result))
        if result["runs"]:
            plot(result, args.out / "server.png")
        console.print(f"wrote {args.out / 'server.json'}, server.md, server.png")
    bad = [r for r in result["runs"] + ([result["kill"]] if "kill" in result else [])
           if r["messages_lost"] or r["runs_failed"] or r["checkpoints_lost"]]
    return 1 if bad else 0


def _line(s: dict) -> str:
    return (f"hop p50/p95 {s['hop_ms_p50']}/{s['hop_ms_p95']} ms, turn p50/p95 {s['turn_ms_p50']}/{s['turn_ms_p95']} ms, "
            f"{s['decoded_tokens_per_s']} tok/s, reuse {s['reuse_ratio']} (moved turns {s['moved_turns']}: "
            f"{s['reuse_ratio_first_call_moved']}), lost {s['messages_lost']}, failed {s['runs_failed']}, "
            f"checkpoints lost {s['checkpoints_lost']}, per worker {s['turns_per_worker']}")


def headline(result: dict) -> dict:
    keys = ("hop_ms_p50", "hop_ms_p95", "turn_ms_p50", "decoded_tokens_per_s", "reuse_ratio",
            "reuse_ratio_first_call_moved", "messages_lost", "runs_failed", "checkpoints_lost")
    out = {f"N={r['threads']}": {k: r[k] for k in keys} for r in result["runs"]}
    if "kill" in result:
        out["kill"] = {k: result["kill"][k] for k in keys + ("streams_broken", "runs_resent_by_client")}
    return out


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = ["# Agent Server, several processes over PostgreSQL + Redis", "",
             f"`{meta['command']}` started {meta['started']} on {meta['machine']} ({meta['cpus']} CPUs; flags "
             f"{' '.join(meta['cpu_flags'])}); load average {meta['loadavg_start'][0]} at the start, "
             f"{meta.get('loadavg_end', ['?'])[0]} at the end. {meta['workers']} `langhost serve` processes "
             f"(langgraph-api {meta['langgraph_api']}, langgraph-runtime-pg {meta['langgraph_runtime_pg']}), one job "
             f"and one torch thread each, {meta['model']}, answers of at most {meta['max_tokens']} tokens; "
             f"checkpoints in PostgreSQL (AsyncPostgresSaver under kvmemory's KVCheckpointSaver), KV blocks in Redis. "
             f"{meta['turns']} turns per thread; before turn {meta['delete_at']} the thread's second turn is removed "
             f"(threads.update_state). Start-up: {meta.get('startup_s')} s.", "",
             "| N threads | turns | hop p50 / p95 ms | turn p50 / p95 ms | decoded tok/s | reuse ratio | first call "
             "after a move: turns, reuse | fallbacks | messages lost | checkpoints lost | runs failed | turns per process |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = list(result["runs"]) + ([result["kill"]] if "kill" in result else [])
    for r in rows:
        label = f"{r['threads']}" + (" (kill)" if r is result.get("kill") else "")
        lines.append(f"| {label} | {r['turns']} | {r['hop_ms_p50']} / {r['hop_ms_p95']} | {r['turn_ms_p50']} / "
                     f"{r['turn_ms_p95']} | {r['decoded_tokens_per_s']} | {r['reuse_ratio']} | {r['moved_turns']}, "
                     f"{r['reuse_ratio_first_call_moved']} | {r['fallbacks']} | {r['messages_lost']} | "
                     f"{r['checkpoints_lost']} | {r['runs_failed']} | {r['turns_per_worker']} |")
    if "kill" in result:
        k = result["kill"]
        lines += ["", f"Kill case: {k['killed']}; streams broken {k['streams_broken']}, turns sent again by the "
                  f"client {k['runs_resent_by_client']}, messages doubled {k['messages_doubled']}, unanswered turns "
                  f"{k['unanswered_turns']}. Runtime sweep:", ""]
        lines += [f"- `{line}`" for line in k.get("swept", [])] or ["- (none logged)"]
        lines += ["", "The kill's time and the sweep's are UTC; a client whose stream went through the killed "
                  "process waits for the langgraph-sdk stream's reconnection attempts to give up before it asks "
                  "another process about the run (its turn time includes them)."]
    lines += ["", "Hop: one model call, client-side from the run request (or the previous model node's update) to "
              "the model node's update in the stream (includes queueing, the checkpoint load and, after a move, "
              "the restore from the blocks). Reuse ratio: reused / prompt tokens over all model calls "
              "(`response_metadata[\"repair\"]`); \"after a move\": the first call of the turns that ran on another "
              "process than the thread's previous turn.", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    from kvmemory_lab.bench.common import agg_pyplot

    plt = agg_pyplot()
    runs = result["runs"]
    ns = [r["threads"] for r in runs]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax.plot(ns, [r["hop_ms_p50"] for r in runs], "o-", label="hop p50")
    ax.plot(ns, [r["hop_ms_p95"] for r in runs], "o--", label="hop p95")
    ax.plot(ns, [r["turn_ms_p50"] for r in runs], "s-", label="turn p50")
    ax.plot(ns, [r["turn_ms_p95"] for r in runs], "s--", label="turn p95")
    if "kill" in result:
        k = result["kill"]
        ax.plot([k["threads"]] * 2, [k["turn_ms_p50"], k["turn_ms_p95"]], "rx", label="turn p50 / p95, one killed")
    ax.set_yscale("log")
    ax.set_xlabel("concurrent threads N"), ax.set_ylabel("ms (log)"), ax.set_xticks(ns), ax.legend(fontsize=8)
    ax.set_title(f"{result['meta']['workers']} server processes")
    bx.plot(ns, [r["decoded_tokens_per_s"] for r in runs], "o-", label="decoded tok/s (all threads)")
    bx.set_xlabel("concurrent threads N"), bx.set_ylabel("tokens/s"), bx.set_xticks(ns)
    bx2 = bx.twinx()
    bx2.plot(ns, [r["reuse_ratio"] for r in runs], "g^-", label="reuse ratio")
    bx2.set_ylim(0, 1), bx2.set_ylabel("reused / prompt tokens")
    bx.legend(loc="lower left"), bx2.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
