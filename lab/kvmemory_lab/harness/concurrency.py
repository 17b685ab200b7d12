"""Concurrency: N >= 8 LangGraph threads driven at once against one model and one saver.

Every thread id runs its own seeded script of model turns and history edits (a same-id
replacement, a message removal, a clear-and-resend; each followed by a turn, so repairs run
concurrently) in its own Python thread, all through one :class:`~langchain_kvmemory.ChatKVMemory`
(one model, one :class:`~kvmemory.threads.ThreadCaches` registry under a byte budget small enough
that threads are evicted) and one :class:`~langchain_kvmemory.checkpointer.KVCheckpointSaver`
on SQLite. Two modes:

- ``blobs``: the saver persists caches, so an evicted thread resumes from the blob written when
  it was evicted;
- ``reprefill``: the saver stores checkpoints only, so an evicted thread re-prefills.

The reference for each thread is a run of that thread alone (fresh model wrapper, registry and
database, no budget, one Python thread). After every model call the harness fingerprints the
thread's cache inside its lease (sha256 of the token ids and of every layer's keys and values);
the concurrent and the solo fingerprints must be equal call for call, and the final caches are
compared with ``torch.equal`` on every layer's keys and values and on the token ids. Where the
concurrent run found a thread evicted at the moment of a model call (nothing reused), the solo
run drops its cache before the same call, so both re-prefill the same messages and must agree
bit for bit as well. The registry's K/V bytes are sampled after every forward pass of the model
and after every graph operation; their peak must stay within the budget.

Entry point: :func:`run_concurrency_profile`.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

SYSTEM = "You are a brief assistant."
WORDS = ("river", "lamp", "seven", "north", "apple", "stone", "music", "cloud", "green", "tower", "salt", "bridge")


def script(thread_index: int, turns: int, seed: int) -> list[dict]:
    """The seeded steps of one thread: ``turns`` model turns, with an edit before some of them
    (``replace`` / ``remove`` pick their target among the messages present at that point)."""
    rng = random.Random(f"{seed}:{thread_index}")
    steps = []
    for t in range(turns):
        if t >= 2:
            kind = ("replace", "remove", "clear", None, None)[(t + thread_index) % 5]
            if kind:
                steps.append({"kind": kind, "pick": rng.random(), "text": _sentence(rng), "id": f"e{t}"})
        steps.append({"kind": "turn", "text": _sentence(rng), "id": f"u{t}"})
    return steps


def _sentence(rng: random.Random) -> str:
    return "Tell me about " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7))) + "."


def _fingerprint(session) -> str:
    h = hashlib.sha256(repr(list(session.token_ids)).encode())
    for layer in session.cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass
class Record:
    """What one run saw for one thread."""

    prints: list = field(default_factory=list)  # cache fingerprint after each model call
    reused: list = field(default_factory=list)  # reused (cache_read) tokens of each model call
    answers: list = field(default_factory=list)
    final_ids: list | None = None
    final_layers: list | None = None
    calls: int = 0


class Run:
    """One ChatKVMemory + one saver + a graph, instrumented: per-call fingerprints taken inside
    the lease, and the registry's K/V bytes sampled after every forward pass."""

    def __init__(self, loaded, db: Path, mode: str, budget: int | None, max_tokens: int, policy: str,
                 drops: dict[str, set[int]] | None = None):
        from langgraph.graph import START, MessagesState, StateGraph

        from langchain_kvmemory import ChatKVMemory
        from langchain_kvmemory.checkpointer import KVCheckpointSaver

        self.chat = ChatKVMemory(model=loaded, max_tokens=max_tokens, memory_budget_bytes=budget,
                                 repair_policy=policy)
        self.registry = self.chat.threads
        self.records: dict[str, Record] = {}
        self.drops = drops or {}
        self.peak, self.samples, self.budget = 0, 0, budget
        self._sample_lock = threading.Lock()
        self._calling = threading.local()  # .tid: the thread id whose model call runs in this Python thread
        db.parent.mkdir(parents=True, exist_ok=True)
        self._saver_cm = KVCheckpointSaver.from_sqlite(db, self.chat if mode == "blobs" else None)
        self.saver = self._saver_cm.__enter__()
        self._instrument()

        def answer(state: MessagesState, config):
            tid = config["configurable"]["thread_id"]
            record = self.records[tid]
            if record.calls in self.drops.get(tid, ()):
                self.registry.drop(tid)  # the concurrent run found this thread evicted here
            self._calling.tid = tid
            try:
                reply = self.chat.invoke(state["messages"])
            finally:
                self._calling.tid = None
            record.calls += 1
            record.reused.append(reply.usage_metadata["input_token_details"]["cache_read"])
            record.answers.append(reply.content)
            return {"messages": [reply]}

        builder = StateGraph(MessagesState)
        builder.add_node("answer", answer)
        builder.add_edge(START, "answer")
        self.graph = builder.compile(checkpointer=self.saver)

    def _instrument(self) -> None:
        registry, real_lease = self.registry, self.registry.lease

        @contextmanager
        def lease(thread_id, **kwargs):
            with real_lease(thread_id, **kwargs) as session:
                yield session
                record = self.records.get(str(thread_id))
                model_call = getattr(self._calling, "tid", None) == str(thread_id)  # not a checkpoint restore
                if record is not None and model_call and session.token_ids:  # inside the lease: the state is final
                    record.prints.append(_fingerprint(session))
                    record.final_ids = list(session.token_ids)
                    record.final_layers = [(layer.keys.clone(), layer.values.clone()) for layer in session.cache.layers]

        registry.lease = lease
        self._hook = registry.model.register_forward_hook(lambda module, args, output: self.sample())

    def sample(self) -> None:
        held = self.registry.memory_bytes
        with self._sample_lock:
            self.samples += 1
            self.peak = max(self.peak, held)

    def drive(self, tid: str, steps: list[dict]) -> None:
        """Run one thread's steps in order (edits through ``update_state``, turns through ``invoke``)."""
        from langchain_core.messages import HumanMessage, RemoveMessage, SystemMessage
        from langgraph.graph.message import REMOVE_ALL_MESSAGES

        config = {"configurable": {"thread_id": tid}}
        self.records.setdefault(tid, Record())
        first = True
        for step in steps:
            if step["kind"] == "turn":
                new = ([SystemMessage(SYSTEM, id="sys")] if first else []) + [HumanMessage(step["text"], id=step["id"])]
                self.graph.invoke({"messages": new}, config)
                first = False
            else:
                messages = self.graph.get_state(config).values["messages"]
                if step["kind"] == "replace":
                    humans = [m for m in messages if m.type == "human"]
                    target = humans[int(step["pick"] * len(humans))]
                    update = [HumanMessage(step["text"], id=target.id)]
                elif step["kind"] == "remove":
                    middle = [m for m in messages[1:-1]]
                    update = [RemoveMessage(id=middle[int(step["pick"] * len(middle))].id)] if middle else []
                else:
                    update = [RemoveMessage(id=REMOVE_ALL_MESSAGES), SystemMessage(SYSTEM, id="sys"),
                              HumanMessage(step["text"], id=step["id"])]
                if update:
                    self.graph.update_state(config, {"messages": update}, as_node="answer")
            self.sample()

    def close(self) -> None:
        self._hook.remove()
        self._saver_cm.__exit__(None, None, None)


def _solo(loaded, tid: str, steps: list[dict], work: Path, mode: str, max_tokens: int, policy: str,
          drops: set[int]) -> Record:
    run = Run(loaded, work / f"solo-{tid}.sqlite", mode, None, max_tokens, policy, {tid: drops})
    try:
        with ThreadPoolExecutor(1) as pool:  # a worker thread, like the concurrent run's
            pool.submit(run.drive, tid, steps).result()
    finally:
        run.close()
    return run.records[tid]


def _concurrent(loaded, scripts: dict[str, list], work: Path, mode: str, budget: int, max_tokens: int,
                policy: str) -> tuple[Run, list[str]]:
    run = Run(loaded, work / f"concurrent-{mode}.sqlite", mode, budget, max_tokens, policy)
    errors: list[str] = []
    start = threading.Barrier(len(scripts))

    def worker(tid: str) -> None:
        start.wait()  # all threads start together
        run.drive(tid, scripts[tid])

    try:
        with ThreadPoolExecutor(len(scripts)) as pool:
            futures = {tid: pool.submit(worker, tid) for tid in scripts}
            for tid, future in futures.items():
                try:
                    future.result()
                except Exception as exc:  # a crash is a finding, reported with the others
                    errors.append(f"thread {tid}: {type(exc).__name__}: {exc}")
    finally:
        run.close()
    return run, errors


def _same_final(a: Record, b: Record) -> bool:
    if a.final_ids != b.final_ids or a.final_layers is None or b.final_layers is None:
        return False
    return len(a.final_layers) == len(b.final_layers) and all(
        torch.equal(k1, k2) and torch.equal(v1, v2) for (k1, v1), (k2, v2) in zip(a.final_layers, b.final_layers))


SIZES = {
    # (model, threads, turns, modes, max_tokens)
    "reduced": [("tiny", 8, 4, ("blobs", "reprefill"), 6), ("smollm2", 8, 2, ("blobs",), 4)],
    "full": [("tiny", 8, 8, ("blobs", "reprefill"), 8), ("tiny", 12, 6, ("blobs", "reprefill"), 8),
             ("smollm2", 8, 4, ("blobs", "reprefill"), 6)],
}


def _tiny():
    from kvmemory.testing import tiny_loaded

    return tiny_loaded("concurrency-tiny-llama")


def run_case(loaded, threads: int, turns: int, mode: str, work: Path, *, seed: int, max_tokens: int,
             policy: str = "sur@5", budget_threads: float = 3.0) -> dict:
    """One concurrent run of ``threads`` thread ids against their solo runs; returns its counts.

    The budget is ``budget_threads`` times the largest reservation one call of the solo runs
    needed (prompt + answer + slack rows), so about that many threads stay live and the others are
    evicted.
    """
    from langchain_kvmemory.chat_model import RESERVE_SLACK

    work.mkdir(parents=True, exist_ok=True)
    tids = [f"conc-{i}" for i in range(threads)]
    scripts = {tid: script(i, turns, seed) for i, tid in enumerate(tids)}
    solo = {tid: _solo(loaded, tid, scripts[tid], work / "solo", mode, max_tokens, policy, set()) for tid in tids}
    bpt = _bytes_per_token(loaded)
    biggest = max(len(r.final_ids or []) for r in solo.values()) + max_tokens + RESERVE_SLACK + 64
    budget = int(budget_threads * biggest * bpt)
    run, errors = _concurrent(loaded, scripts, work, mode, budget, max_tokens, policy)
    counts = {"threads": threads, "turns": 0, "mismatches": 0, "evictions": run.registry.evictions,
              "peak_bytes": run.peak, "budget_bytes": budget, "budget_exceeded": int(run.peak > budget),
              "cold_calls": 0, "reprefill_checked": 0, "errors": errors, "samples": run.samples}
    for tid in tids:
        got = run.records.get(tid, Record())
        counts["turns"] += got.calls
        cold = {i for i, r in enumerate(got.reused) if i > 0 and r == 0}
        counts["cold_calls"] += len(cold)
        want = solo[tid] if not cold else _solo(loaded, tid, scripts[tid], work / "solo-replay", mode, max_tokens,
                                                policy, cold)
        counts["reprefill_checked"] += len(cold)
        if got.prints != want.prints or not _same_final(got, want) or got.answers != want.answers:
            counts["mismatches"] += 1
            first = next((i for i, (a, b) in enumerate(zip(got.prints, want.prints)) if a != b), None)
            errors.append(f"thread {tid}: cache differs from its solo run (first differing call {first}, "
                          f"cold calls {sorted(cold)}, reused {got.reused} vs {want.reused})")
    return counts


def _bytes_per_token(loaded) -> int:
    text = loaded.model.config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * next(loaded.model.parameters()).element_size()


def run_concurrency_profile(size: str, *, seed: int, workdir: Path, progress: bool = False) -> dict:
    """Drive N >= 8 threads concurrently against one model and one saver; compare with solo runs.

    Args:
        size: ``"reduced"`` (what ``make test`` runs: 8 threads x 4 turns on a tiny model in both
            modes, 8 x 2 on the embedded model) or ``"full"`` (the benchmark).
        seed: seeds the scripts.
        workdir: scratch folder for the SQLite databases and blobs (replaced).
        progress: print one line per case.

    Returns:
        ``threads`` (largest N), ``turns`` (model calls), ``mismatches``, ``evictions``,
        ``peak_bytes`` / ``budget_bytes`` (of the case with the highest peak-to-budget ratio),
        ``budget_exceeded``, ``ok`` and ``cases`` (per-case counts).

    Raises:
        ValueError: unknown ``size``.
    """
    import shutil

    from kvmemory.models import load_model

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: use 'reduced' or 'full'")
    workdir = Path(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    models = {}
    cases = []
    for model, threads, turns, modes, max_tokens in SIZES[size]:
        if model not in models:
            models[model] = _tiny() if model == "tiny" else load_model()
        for mode in modes:
            t0 = time.perf_counter()
            counts = run_case(models[model], threads, turns, mode, workdir / f"{model}-{threads}-{mode}", seed=seed,
                              max_tokens=max_tokens)
            counts.update(model=model, mode=mode, seconds=round(time.perf_counter() - t0, 1))
            cases.append(counts)
            if progress:
                print(f"concurrency {model} N={threads} {mode}: {counts}")
    worst = max(cases, key=lambda c: c["peak_bytes"] / c["budget_bytes"])
    out = {"threads": max(c["threads"] for c in cases), "turns": sum(c["turns"] for c in cases),
           "mismatches": sum(c["mismatches"] for c in cases), "evictions": sum(c["evictions"] for c in cases),
           "peak_bytes": worst["peak_bytes"], "budget_bytes": worst["budget_bytes"],
           "budget_exceeded": sum(c["budget_exceeded"] for c in cases),
           "cold_calls": sum(c["cold_calls"] for c in cases),
           "errors": sum(len(c["errors"]) for c in cases), "cases": cases}
    out["ok"] = (out["mismatches"] == 0 and out["budget_exceeded"] == 0 and out["errors"] == 0
                 and all(c["evictions"] > 0 for c in cases))
    return out
