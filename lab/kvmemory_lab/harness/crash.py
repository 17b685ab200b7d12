"""Crash safety of :class:`~langchain_kvmemory.checkpointer.KVCheckpointSaver`: SIGKILL a process
that writes checkpoints and KV blobs, many times, and check every restart.

A child process (forked from a forkserver that imported torch, transformers and LangGraph once;
by hand: ``python -m kvmemory_lab.harness.crash child ...``) runs a LangGraph graph
whose node calls :class:`~langchain_kvmemory.ChatKVMemory`, checkpointed by KVCheckpointSaver on
SQLite, through a scripted, seeded workload on two thread ids: turns, same-id replacements,
message removals and clears. It writes a journal line before and after every operation. The
parent kills it with SIGKILL at random moments (seeded delays) or at chosen points (between a
blob's temporary write and its rename, between a blob and the checkpoint naming it, half-way
through garbage collection), sometimes damages a stored blob (truncation, bit flip) or restarts
with another model, then checks:

- the database is readable (``PRAGMA integrity_check``) and every message of every operation the
  journal says completed is still there, unchanged; an operation in flight is either absent or
  applied (a turn may also stand after its user message, and is then finished by the restart);
- the restarted process's first model call per thread either resumes from a verified blob
  (``cache_read`` > 0 and ``restored_from`` names it) or re-prefills with a recorded reason
  (``restore_failures``); a silent re-prefill is a violation;
- no damaged blob is ever loaded (the parent's list of damaged files, and the child re-hashes
  the file it resumed from);
- garbage collection at each restart removes blobs no checkpoint names and stale temporary
  files; after the last restart only referenced blobs remain.

Models: a tiny random-weight Llama with the embedded tokenizer (fast, for many kills) and the
embedded SmolLM2-135M-Instruct (fewer kills). Entry point: :func:`run_crash_profile`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

THREADS = ("crash-a", "crash-b")
SYSTEM = "You are brief."
MAX_TOKENS = 6
MAX_MESSAGES = 14  # a clear is forced beyond this, so prompts stay short
KILL_POINTS = ("before_rename", "before_checkpoint", "during_gc")
TINY_MODELS = ("tiny-a", "tiny-b")  # same cache layout, different weights: only the name tells them apart
WORDS = ("river", "lamp", "seven", "north", "apple", "stone", "music", "cloud", "green", "tower", "salt", "bridge")


# ------------------------------------------------------------------- the scripted workload
def op_for(index: int, seed: int, messages: list) -> dict:
    """Operation ``index`` of the workload, chosen from the thread's current ``messages``.

    Deterministic in ``(index, seed, messages)``, so a restarted child repeats an operation the
    kill interrupted, and the parent can compute the states it may leave behind.
    """
    rng = random.Random(f"{seed}:{index}")
    thread = THREADS[index % len(THREADS)]
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) + "?"
    humans = [m["id"] for m in messages[:-1] if m["type"] == "human"]
    others = [m["id"] for m in messages[:-1] if m["type"] != "system"]
    roll = rng.random()
    if messages and (len(messages) > MAX_MESSAGES or roll < 0.1):
        return {"index": index, "thread": thread, "kind": "clear", "id": f"h{index}", "text": text}
    if humans and roll < 0.22:
        return {"index": index, "thread": thread, "kind": "replace", "id": rng.choice(humans), "text": text}
    if others and roll < 0.32:
        return {"index": index, "thread": thread, "kind": "remove", "id": rng.choice(others)}
    return {"index": index, "thread": thread, "kind": "turn", "id": f"h{index}", "text": text,
            "system": not messages}


def _digest(text) -> str:
    return hashlib.sha256(str(text).encode()).hexdigest()[:16]


def summary(messages) -> list[dict]:
    """LangChain messages as ``{"id", "type", "sha"}`` (what the journal and the checks compare)."""
    return [{"id": m.id, "type": m.type, "sha": _digest(m.content)} for m in messages]


def allowed_states(op: dict, pre: list[dict]) -> list[list[dict]]:
    """States (message summaries) the thread may be in after a kill during ``op`` from ``pre``.

    A turn's answer (``type == "ai"``, any id or content) is a wildcard: its text is the model's.
    """
    if op["kind"] == "turn":
        head = ([{"id": "sys", "type": "system", "sha": _digest(SYSTEM)}] if op["system"] else [])
        asked = pre + head + [{"id": op["id"], "type": "human", "sha": _digest(op["text"])}]
        return [pre, asked, asked + [{"id": "*", "type": "ai", "sha": "*"}]]
    if op["kind"] == "replace":
        return [pre, [dict(m, sha=_digest(op["text"])) if m["id"] == op["id"] else m for m in pre]]
    if op["kind"] == "remove":
        return [pre, [m for m in pre if m["id"] != op["id"]]]
    return [pre, [{"id": "sys", "type": "system", "sha": _digest(SYSTEM)},
                  {"id": op["id"], "type": "human", "sha": _digest(op["text"])}]]


def _matches(state: list[dict], pattern: list[dict]) -> bool:
    if len(state) != len(pattern):
        return False
    return all(p["id"] == "*" and s["type"] == "ai" or s == p for s, p in zip(state, pattern))


class Journal:
    """Append-only JSON lines, flushed and fsynced: ``{"begin": op}`` before an operation and
    ``{"done": index, "thread": ..., "messages": [...]}`` after it committed."""

    def __init__(self, path: Path, *, repair: bool = False):
        self.path = path
        text = path.read_text() if path.is_file() else ""
        if text and not text.endswith("\n"):  # a kill cut the last line short: it never happened
            text = text[: text.rfind("\n") + 1]
            if repair:
                path.write_text(text)
        self.entries = [json.loads(line) for line in text.splitlines() if line.strip()]

    def append(self, entry: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.entries.append(entry)

    def committed(self) -> dict[str, list[dict]]:
        """Each thread's messages after its last completed operation."""
        out = {t: [] for t in THREADS}
        for e in self.entries:
            if "done" in e:
                out[e["thread"]] = e["messages"]
        return out

    def in_flight(self) -> dict | None:
        """The operation begun and not done (a kill interrupted it), or None."""
        if self.entries and "begin" in self.entries[-1]:
            return self.entries[-1]["begin"]
        return None

    def next_index(self) -> int:
        done = [e["done"] for e in self.entries if "done" in e]
        return (max(done) + 1) if done else 0


# ------------------------------------------------------------------------------ the child
def _load(kind: str):
    from kvmemory.models import load_model

    if kind == "smollm2":
        return load_model()
    from kvmemory.testing import tiny_loaded

    return tiny_loaded(f"crash-{kind}", seed=TINY_MODELS.index(kind))


def _graph(chat, saver, calls: list):
    from langgraph.graph import START, MessagesState, StateGraph

    def answer(state: MessagesState, config):
        reply = chat.invoke(state["messages"])
        calls.append((config["configurable"]["thread_id"], reply))
        return {"messages": [reply]}

    builder = StateGraph(MessagesState)
    builder.add_node("answer", answer)
    builder.add_edge(START, "answer")
    return builder.compile(checkpointer=saver)


def _config(thread: str) -> dict:
    return {"configurable": {"thread_id": thread}}


def _install_kill_point(point: str | None, hit: int, saver, events: Path):
    """SIGKILL this process at the ``hit``-th pass through ``point`` (real kills, chosen moments).
    Returns a function that removes the patch again."""
    if not point:
        return lambda: None
    count = [0]

    def maybe_die():
        count[0] += 1
        if count[0] >= hit:
            _emit(events, event="kill_point", point=point)
            os.kill(os.getpid(), signal.SIGKILL)

    if point == "before_rename":  # the temporary file is written and fsynced, not yet renamed
        real_replace = os.replace

        def replace(src, dst, *a, **kw):
            if os.path.basename(str(src)).startswith(".tmp-"):
                maybe_die()
            return real_replace(src, dst, *a, **kw)

        os.replace = replace
        return lambda: setattr(os, "replace", real_replace)
    elif point == "before_checkpoint":  # the blob is in place, the checkpoint naming it is not
        from langchain_kvmemory.checkpointer import CACHE_KEY

        inner, real_put = saver.saver, saver.saver.put

        def put(config, checkpoint, metadata, new_versions):
            if CACHE_KEY in (metadata or {}):
                maybe_die()
            return real_put(config, checkpoint, metadata, new_versions)

        inner.put = put
        return lambda: setattr(inner, "put", real_put)
    elif point == "during_gc":  # half-way through deleting unreferenced files
        from pathlib import Path as _Path

        real_unlink = _Path.unlink

        def unlink(self, *a, **kw):
            real_unlink(self, *a, **kw)
            maybe_die()

        _Path.unlink = unlink
        return lambda: setattr(_Path, "unlink", real_unlink)
    else:
        raise ValueError(f"unknown kill point {point!r}: use one of {KILL_POINTS}")


def _emit(events: Path, **event) -> None:
    with open(events, "a") as f:
        f.write(json.dumps(event) + "\n")
        f.flush()


def child_main(argv: list[str] | None = None) -> int:
    """One life of the writing process: restart checks, then operations until killed (or ``--ops``)."""
    p = argparse.ArgumentParser(prog="kvmemory_lab.harness.crash child")
    p.add_argument("--db", type=Path, required=True)
    p.add_argument("--journal", type=Path, required=True)
    p.add_argument("--events", type=Path, required=True)
    p.add_argument("--model", default="tiny-a")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-at", default=None)
    p.add_argument("--hit", type=int, default=1)
    p.add_argument("--ops", type=int, default=None, help="stop after this many operations (default: never)")
    p.add_argument("--log", type=Path, default=None, help="send stdout and stderr here")
    args = p.parse_args(argv)
    if args.log is not None:
        fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)

    import torch

    from langchain_kvmemory import ChatKVMemory
    from langchain_kvmemory.checkpointer import KVCheckpointSaver

    torch.set_num_threads(1)
    chat = ChatKVMemory(model=_load(args.model), max_tokens=MAX_TOKENS, memory_budget_bytes=None)
    calls: list = []
    with KVCheckpointSaver.from_sqlite(args.db, chat, layout="blobs") as saver:
        graph = _graph(chat, saver, calls)
        _install_kill_point(args.kill_at if args.kill_at != "during_gc" else None, args.hit, saver, args.events)
        _emit(args.events, event="ready", pid=os.getpid())
        undo = _install_kill_point("during_gc" if args.kill_at == "during_gc" else None, args.hit, saver, args.events)
        removed = saver.collect_garbage(grace_s=0.0)  # nothing else writes here: no grace needed
        undo()
        _emit(args.events, event="gc", blobs=len(removed), temp_files=saver.store.temp_files_removed)
        journal = Journal(args.journal, repair=True)
        first_call: dict[str, bool] = {t: True for t in THREADS}
        done = 0
        while args.ops is None or done < args.ops:
            _run_next(graph, saver, journal, args.seed, calls, first_call, args.events)
            done += 1
    _emit(args.events, event="exit")
    return 0


def _run_next(graph, saver, journal: Journal, seed: int, calls: list, first_call: dict, events: Path) -> None:
    """Run (or finish) the next operation of the workload and journal it."""
    from langchain_core.messages import HumanMessage, RemoveMessage, SystemMessage
    from langgraph.graph.message import REMOVE_ALL_MESSAGES

    pending = journal.in_flight()
    index = pending["index"] if pending else journal.next_index()
    thread = THREADS[index % len(THREADS)]
    config = _config(thread)
    snapshot = graph.get_state(config)
    current = snapshot.values.get("messages", [])
    pre = journal.committed()[thread]
    op = pending or op_for(index, seed, pre)
    state = summary(current)
    fresh = not current  # a new thread: nothing stored to resume from
    if pending and state != pre:  # the interrupted operation committed (fully or up to its answer)
        # A run killed after its user message, or after its node's writes but before the checkpoint
        # that applies them: resume it. (LangGraph's get_state already shows a finished node's pending
        # writes, but a run started with new input instead would discard them: the answer is lost.)
        if snapshot.next or snapshot.tasks:
            _call(graph, None, config, calls, first_call, saver, events, fresh)
    else:
        journal.append({"begin": op})
        if op["kind"] == "turn":
            new = ([SystemMessage(SYSTEM, id="sys")] if op["system"] else []) + [HumanMessage(op["text"], id=op["id"])]
            _call(graph, {"messages": new}, config, calls, first_call, saver, events, fresh)
        elif op["kind"] == "replace":
            graph.update_state(config, {"messages": [HumanMessage(op["text"], id=op["id"])]}, as_node="answer")
        elif op["kind"] == "remove":
            graph.update_state(config, {"messages": [RemoveMessage(id=op["id"])]}, as_node="answer")
        else:
            graph.update_state(config, {"messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES), SystemMessage(SYSTEM, id="sys"),
                                                     HumanMessage(op["text"], id=op["id"])]}, as_node="answer")
    journal.append({"done": index, "thread": thread, "messages": summary(graph.get_state(config).values["messages"])})


def _call(graph, payload, config, calls: list, first_call: dict, saver, events: Path, fresh: bool) -> None:
    """One graph run with a model call; the first call of each thread after a restart is reported."""
    thread = config["configurable"]["thread_id"]
    before = len(calls)
    graph.invoke(payload, config)
    if len(calls) == before or not first_call[thread]:
        return  # no model call (answer taken from pending writes) or not the first since the restart
    first_call[thread] = False
    reply = calls[-1][1]
    cache_read = reply.usage_metadata["input_token_details"]["cache_read"]
    repair = reply.response_metadata["repair"]
    sha = saver.restored_from.get(thread)
    rehash_ok = None
    if sha is not None:  # independent check: the file it resumed from hashes to its name
        path = saver.store.path(sha)
        rehash_ok = path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == sha
    _emit(events, event="first_call", thread=thread, fresh=fresh, cache_read=cache_read, restored_from=sha,
          rehash_ok=rehash_ok, failure=saver.restore_failures.get(thread), fallback=repair.get("fallback"),
          operator=repair.get("operator"))


# ----------------------------------------------------------------------------- the parent
@dataclass
class Tally:
    kills: int = 0
    kills_survived: int = 0
    messages_lost: int = 0
    state_violations: int = 0
    resumed_from_blob: int = 0
    reprefilled: int = 0
    silent_reprefills: int = 0
    orphans_collected: int = 0
    temp_files_collected: int = 0
    corrupt_blobs_loaded: int = 0
    corruptions_injected: int = 0
    corruptions_rejected: int = 0
    wrong_model_restarts: int = 0
    wrong_model_rejected: int = 0
    targeted_kills: int = 0
    child_errors: int = 0
    kills_embedded_model: int = 0
    final_orphans: int = 0
    reasons: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)


def read_messages(db: Path) -> dict[str, list[dict]]:
    """Each thread's messages in the newest checkpoint, read with a plain SqliteSaver (no kvmemory).

    Raises:
        sqlite3.DatabaseError: the database file is damaged (``PRAGMA integrity_check`` is not ok).
    """
    from langgraph.checkpoint.sqlite import SqliteSaver

    if not db.is_file():
        return {t: [] for t in THREADS}
    with sqlite3.connect(db) as conn:
        verdict = conn.execute("PRAGMA integrity_check").fetchone()[0]
    if verdict != "ok":
        raise sqlite3.DatabaseError(f"integrity_check: {verdict}")
    out = {}
    with SqliteSaver.from_conn_string(str(db)) as saver:
        graph = _graph(None, saver, [])  # read through LangGraph: channels may be stored as deltas
        for t in THREADS:
            out[t] = summary(graph.get_state(_config(t)).values.get("messages", []))
    return out


def check_messages(db: Path, journal: Journal, tally: Tally) -> bool:
    """Compare the database with the journal after a kill; counts lost messages. True when intact."""
    try:
        stored = read_messages(db)
    except (sqlite3.DatabaseError, OSError) as exc:
        tally.errors.append(f"database unreadable after a kill: {exc}")
        tally.state_violations += 1
        return False
    committed, flight = journal.committed(), journal.in_flight()
    intact = True
    for thread in THREADS:
        pre = committed[thread]
        allowed = allowed_states(flight, pre) if flight and flight["thread"] == thread else [pre]
        if any(_matches(stored[thread], a) for a in allowed):
            continue
        intact = False
        tally.state_violations += 1
        touched = {flight["id"]} if flight and flight["thread"] == thread and flight["kind"] != "turn" else set()
        lost = [m for m in pre if m not in stored[thread] and m["id"] not in touched]
        tally.messages_lost += len(lost)
        tally.errors.append(f"thread {thread}: stored {stored[thread]} is not one of {allowed}")
    return intact


def _stored_refs(db: Path) -> dict[str, str]:
    """sha256 of the newest blob each thread's latest checkpoint names (where it names one)."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    from langchain_kvmemory.checkpointer import CACHE_KEY

    refs = {}
    if not db.is_file():
        return refs
    with SqliteSaver.from_conn_string(str(db)) as saver:
        for t in THREADS:
            for tup in saver.list(_config(t), limit=8):
                if CACHE_KEY in (tup.metadata or {}):
                    refs[t] = tup.metadata[CACHE_KEY]["sha256"]
                    break
    return refs


def _damage(db: Path, blob_dir: Path, rng: random.Random) -> tuple[str, str] | None:
    """Truncate or flip one bit of a blob a thread would resume from; returns (sha256, kind)."""
    refs = _stored_refs(db)
    candidates = sorted(sha for sha in refs.values() if (blob_dir / sha[:2] / f"{sha}.safetensors").is_file())
    if not candidates:
        return None
    sha = rng.choice(candidates)
    path = blob_dir / sha[:2] / f"{sha}.safetensors"
    data = path.read_bytes()
    kind = rng.choice(("truncate", "flip"))
    if kind == "truncate":
        path.write_bytes(data[: rng.randint(0, len(data) - 1)])
    else:
        at = rng.randrange(len(data))
        path.write_bytes(data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:])
    return sha, kind


@dataclass
class Life:
    """One spawn of the child: what it was told and what it reported."""

    model: str
    kill_at: str | None = None
    hit: int = 1
    delay_s: float = 0.0
    events: list = field(default_factory=list)
    returncode: int | None = None
    stderr: str = ""


def spawn_life(life: Life, work: Path, seed: int, ops: int | None = None, timeout_s: float = 600.0) -> Life:
    """Start the child, wait until it is ready, then kill it after ``life.delay_s`` (or let it die
    at its kill point, or run ``ops`` operations to completion)."""
    events, log = work / "events.jsonl", work / "child.log"
    events.unlink(missing_ok=True)
    argv = ["--db", str(work / "chk.sqlite"), "--journal", str(work / "journal.jsonl"), "--events", str(events),
            "--model", life.model, "--seed", str(seed), "--hit", str(life.hit), "--log", str(log)]
    if life.kill_at:
        argv += ["--kill-at", life.kill_at]
    if ops is not None:
        argv += ["--ops", str(ops)]
    proc = _processes().Process(target=child_main, args=(argv,), daemon=True)
    proc.start()
    deadline = time.monotonic() + timeout_s
    while proc.is_alive() and not _read_events(events) and time.monotonic() < deadline:
        time.sleep(0.02)
    if ops is None:
        # a targeted kill may never pass its point (e.g. nothing to collect): the timer kills then
        proc.join(timeout=life.delay_s + (3 * life.delay_s + 2.0 if life.kill_at else 0.0))
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=max(1.0, deadline - time.monotonic()))
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    life.returncode = proc.exitcode
    life.events = _read_events(events)
    life.stderr = log.read_text()[-3000:] if log.is_file() else ""
    return life


_CONTEXT = []
PRELOAD = ["torch", "transformers", "transformers.models.llama.modeling_llama", "langgraph.graph",
           "langgraph.checkpoint.sqlite", "langchain_kvmemory", "kvmemory_lab.harness.crash"]


def _processes():
    """A forkserver context that has imported torch, transformers, LangGraph and kvmemory once:
    each child is a fresh process forked from it (a real process to SIGKILL) that starts in well
    under a second instead of re-importing everything (about 8 s on a busy 2-core machine)."""
    if not _CONTEXT:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def _read_events(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the kill cut the last line short
    return out


def _score_life(life: Life, damaged: dict[str, str], tally: Tally) -> None:
    for e in life.events:
        if e["event"] == "gc":
            tally.orphans_collected += e["blobs"] + e["temp_files"]
            tally.temp_files_collected += e["temp_files"]
        if e["event"] != "first_call" or e["fresh"]:
            continue  # a thread's very first call has nothing stored to resume from
        sha, failure = e["restored_from"], e["failure"]
        if sha is not None and (sha in damaged or e["rehash_ok"] is False):
            tally.corrupt_blobs_loaded += 1
            tally.errors.append(f"resumed from damaged blob {sha[:12]} ({damaged.get(sha, 'rehash mismatch')})")
        if e["cache_read"] > 0 and sha is not None:
            tally.resumed_from_blob += 1
        elif failure or e["fallback"]:
            tally.reprefilled += 1
            reason = (failure or e["fallback"]).split(":")[0]
            tally.reasons[reason] = tally.reasons.get(reason, 0) + 1
            if failure and failure.startswith("incompatible"):  # blobs a restart with another model wrote
                tally.wrong_model_rejected += 1
            if failure and failure.split(":")[0] in ("truncated", "mismatch"):
                tally.corruptions_rejected += 1
        else:
            tally.silent_reprefills += 1
            tally.errors.append(f"silent re-prefill after a restart: {e}")


def _episode(model: str, kills: int, work: Path, rng: random.Random, seed: int, tally: Tally,
             window_s: float, forced: list[dict], progress) -> None:
    """One database, ``kills`` SIGKILLs of its writer, checks after each, then a clean final run."""
    work.mkdir(parents=True, exist_ok=True)
    db, blob_dir = work / "chk.sqlite", work / "chk.sqlite.kvcache"
    damaged: dict[str, str] = {}
    wrong_model = False
    for k in range(kills):
        plan = forced[k] if k < len(forced) else {}
        if k > 0 and (plan.get("damage") or (not plan and rng.random() < 0.2)):
            hit = _damage(db, blob_dir, rng)
            if hit is not None:
                damaged[hit[0]] = hit[1]
                tally.corruptions_injected += 1
        wrong_model = bool(plan.get("wrong_model")) or (not plan and k > 0 and rng.random() < 0.08)
        life = Life(model=_sibling(model) if wrong_model else model)
        tally.wrong_model_restarts += wrong_model
        if plan.get("kill_at") or (not plan and rng.random() < 0.3):
            life.kill_at = plan.get("kill_at") or rng.choice(KILL_POINTS)
            life.hit = plan.get("hit") or rng.randint(1, 3)
            tally.targeted_kills += 1
        life.delay_s = rng.uniform(0.0, window_s)
        spawn_life(life, work, seed)
        tally.kills += 1
        tally.kills_embedded_model += life.model == "smollm2"
        if life.returncode != -signal.SIGKILL:
            tally.child_errors += 1
            tally.errors.append(f"child exited {life.returncode} instead of being killed: {life.stderr[-1500:]}")
        _score_life(life, damaged, tally)
        survived = check_messages(db, Journal(work / "journal.jsonl"), tally)
        tally.kills_survived += survived
        _clear_repaired(damaged, blob_dir)
        if progress:
            progress(f"{model} kill {k + 1}/{kills}: {'ok' if survived else 'VIOLATION'} "
                     f"({life.kill_at or f'after {life.delay_s:.2f} s'})")
    final = spawn_life(Life(model=model), work, seed, ops=2 * len(THREADS))
    if final.returncode != 0:
        tally.child_errors += 1
        tally.errors.append(f"final run failed ({final.returncode}): {final.stderr[-1500:]}")
    _score_life(final, damaged, tally)
    tally.final_orphans += _orphans(db, blob_dir)


def _clear_repaired(damaged: dict[str, str], blob_dir: Path) -> None:
    """Forget damaged blobs that were since rewritten whole (a put of the same state repairs them)."""
    for sha in list(damaged):
        path = blob_dir / sha[:2] / f"{sha}.safetensors"
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() == sha:
            damaged.pop(sha)


def _orphans(db: Path, blob_dir: Path) -> int:
    """Files left in the store that no checkpoint names (temporary files included)."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    from langchain_kvmemory.checkpointer import CACHE_KEY

    with SqliteSaver.from_conn_string(str(db)) as saver:
        named = {t.metadata[CACHE_KEY]["sha256"] for t in saver.list(None) if CACHE_KEY in (t.metadata or {})}
    files = [p for p in blob_dir.rglob("*") if p.is_file()] if blob_dir.is_dir() else []
    return sum(1 for p in files if p.name.startswith(".") or p.name.split(".")[0] not in named)


def _sibling(model: str) -> str:
    return {"tiny-a": "tiny-b", "tiny-b": "tiny-a", "smollm2": "tiny-a"}[model]


SIZES = {
    # (model, kills, random delay window s): the reduced profile forces one of each fault
    "reduced": [("tiny-a", 5, 3.0), ("smollm2", 2, 6.0)],
    "full": [("tiny-a", 35, 3.0), ("tiny-a", 35, 3.0), ("tiny-a", 20, 1.0), ("smollm2", 12, 8.0)],
}
FORCED = [{"kill_at": "before_rename", "hit": 1}, {"kill_at": "before_checkpoint", "hit": 1, "damage": True},
          {"wrong_model": True}, {"kill_at": "during_gc", "hit": 1, "damage": True}]


def run_crash_profile(size: str, *, seed: int, workdir: Path, progress: bool = False) -> dict:
    """Kill a checkpoint-writing process many times; count what each restart found.

    Args:
        size: ``"reduced"`` (7 kills, about a minute: what ``make test`` runs) or ``"full"``
            (102 kills, the benchmark).
        seed: seeds the workload, the kill delays, the kill points and the damage.
        workdir: scratch folder (one subfolder per episode; replaced).
        progress: print one line per kill.

    Returns:
        counts: ``kills``, ``kills_survived``, ``messages_lost``, ``resumed_from_blob``,
        ``reprefilled``, ``orphans_collected``, ``corrupt_blobs_loaded``, ``ok`` and details
        (``silent_reprefills``, ``state_violations``, ``reasons``, ``errors``, ...).

    Raises:
        ValueError: unknown ``size``.
    """
    import shutil

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: use 'reduced' or 'full'")
    workdir = Path(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    rng, tally = random.Random(seed), Tally()
    say = print if progress else None
    for i, (model, kills, window) in enumerate(SIZES[size]):
        forced = FORCED if i == 0 else ([{"plain": True}, {"damage": True}] if size == "reduced" else [])
        _episode(model, kills, workdir / f"episode{i}-{model}", rng, seed + i, tally, window, forced, say)
    out = {k: v for k, v in tally.__dict__.items() if k != "errors"}
    out["errors"] = tally.errors[:20]
    out["ok"] = (tally.kills > 0 and tally.kills_survived == tally.kills and tally.messages_lost == 0
                 and tally.state_violations == 0 and tally.corrupt_blobs_loaded == 0 and tally.silent_reprefills == 0
                 and tally.child_errors == 0 and tally.final_orphans == 0)
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.exit(child_main(sys.argv[2:]))
    print("usage: python -m kvmemory_lab.harness.crash child --db ... (started by run_crash_profile)")
    sys.exit(2)
