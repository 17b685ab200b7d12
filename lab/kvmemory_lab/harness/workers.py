"""A launcher of stateless worker processes over PostgreSQL and Redis: the deployment pattern of
LangGraph servers (several workers; any worker may run the next step of any thread).

Each worker process loads its own model (:class:`~.chat_model.ChatKVMemory`), compiles one
LangGraph graph (a chat node: ``MessagesState`` → the model's answer) with
``KVCheckpointSaver(PostgresSaver, llm, block_store=RedisBlockStore)``, and pops jobs from its
Redis queue ``<namespace>:jobs:<worker>``. A job is one turn of one thread: the worker takes the
thread's lease in the block store (so no other worker runs it at once), invokes the graph with the
turn's user message and pushes a result (repair report, restore statistics, ms) to
``<namespace>:results``. The thread's newest checkpoint names its newest cache state; a worker
whose live cache is older loads the blocks it lacks (see :mod:`.blockpersist`).

A worker that dies mid-call loses no message: LangGraph stored the turn's input checkpoint
before the model node ran, the lease expires after its ttl, and the coordinator sends the job to
another worker; the user message carries a fixed id, so running the turn again replaces it in the
graph state instead of adding it twice.

Run ``python -m kvmemory_lab.harness.workers --help`` (the demo: N workers, random routing).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import random
import time
import uuid
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

REDIS_URL = "redis://127.0.0.1:6379/0"
POSTGRES_URL = "postgresql://kvmemory:kvmemory@localhost:5432/kvmemory"
SYSTEM = "You are a brief assistant. Answer in one short sentence."


@dataclass
class WorkerOptions:
    """What every worker of a cluster runs with."""

    postgres_url: str = POSTGRES_URL
    redis_url: str = REDIS_URL
    namespace: str = "kvmemory-workers"
    model: str = "smollm2"
    max_tokens: int = 12
    repair_policy: str = "sur@5"
    block_tokens: int = 128
    lease_ttl_s: float = 10.0
    torch_threads: int = 1


def build_graph(llm, saver, after_model=None):
    """The compiled graph every worker runs: one node answering the thread's messages.
    ``after_model`` (fault injection for tests and benchmarks) runs after the model call, before
    the node returns its answer."""
    from langgraph.graph import START, MessagesState, StateGraph

    def answer(state: MessagesState):
        message = llm.invoke(state["messages"])
        if after_model is not None:
            after_model()
        return {"messages": [message]}

    builder = StateGraph(MessagesState)
    builder.add_node("answer", answer)
    builder.add_edge(START, "answer")
    return builder.compile(checkpointer=saver)


def turn_input(job: dict) -> dict:
    """The graph input of a job: the user message (fixed id: a retried turn replaces it) and, on
    a thread's first turn, the system message."""
    from langchain_core.messages import HumanMessage, SystemMessage

    messages = [HumanMessage(job["text"], id=f"{job['thread']}-u{job['turn']}")]
    if job["turn"] == 0:
        messages.insert(0, SystemMessage(SYSTEM, id=f"{job['thread']}-sys"))
    return {"messages": messages}


def worker_main(name: str, options: WorkerOptions) -> None:
    """Body of one worker process: load the model, serve jobs until a ``stop`` job."""
    os.environ.setdefault("OMP_NUM_THREADS", str(options.torch_threads))
    import redis
    import torch
    from langgraph.checkpoint.postgres import PostgresSaver

    from langchain_kvmemory.blockstore import RedisBlockStore
    from langchain_kvmemory.chat_model import ChatKVMemory
    from langchain_kvmemory.checkpointer import KVCheckpointSaver

    torch.set_num_threads(options.torch_threads)
    queue = redis.Redis.from_url(options.redis_url)
    llm = ChatKVMemory(model=options.model, max_tokens=options.max_tokens, repair_policy=options.repair_policy)
    store = RedisBlockStore(options.redis_url, namespace=f"{options.namespace}-blocks")
    with PostgresSaver.from_conn_string(options.postgres_url) as inner:
        inner.setup()
        saver = KVCheckpointSaver(inner, llm, block_store=store, block_tokens=options.block_tokens, worker_id=name)
        crash = {"now": False}
        graph = build_graph(llm, saver, after_model=lambda: crash["now"] and os._exit(137))
        llm.invoke("Hi", config={"configurable": {"thread_id": f"warmup-{name}"}})  # loads the model now
        llm.threads.drop(f"warmup-{name}")
        queue.rpush(f"{options.namespace}:results", json.dumps({"ready": name}))
        while True:
            popped = queue.blpop([f"{options.namespace}:jobs:{name}"], timeout=1)
            if popped is None:
                continue
            job = json.loads(popped[1])
            if job.get("stop"):
                return
            crash["now"] = job.get("crash") == name  # fault injection: die mid-call (after the model ran)
            queue.rpush(f"{options.namespace}:results", json.dumps(run_job(name, job, graph, saver, options)))


def run_job(name: str, job: dict, graph, saver, options: WorkerOptions) -> dict:
    """Run one turn under the thread's lease; the result names the worker and the repair."""
    config = {"configurable": {"thread_id": job["thread"]}}
    restores = saver.blocks.stats.restores
    fetched = saver.blocks.stats.blocks_fetched
    t0 = time.perf_counter()
    with saver.lease_thread(job["thread"], ttl_s=options.lease_ttl_s, wait_s=None):
        out = graph.invoke(turn_input(job), config)
    repair = out["messages"][-1].response_metadata.get("repair", {})
    return {"job": job["id"], "thread": job["thread"], "turn": job["turn"], "worker": name,
            "reused_tokens": repair.get("reused_tokens"), "recomputed_tokens": repair.get("recomputed_tokens"),
            "prompt_tokens": repair.get("prompt_tokens"), "operator": repair.get("operator"),
            "restored": saver.blocks.stats.restores - restores, "blocks_fetched": saver.blocks.stats.blocks_fetched - fetched,
            "restore_failure": saver.restore_failures.get(job["thread"]), "ms": (time.perf_counter() - t0) * 1000,
            "messages": len(out["messages"])}


@dataclass
class Cluster:
    """Worker processes and their queues. Use as a context manager (workers stop at exit)."""

    workers: int = 2
    options: WorkerOptions = field(default_factory=WorkerOptions)
    ready_timeout_s: float = 600.0
    clear_on_exit: bool = True

    def __post_init__(self):
        import redis

        self.names = [f"w{i}" for i in range(self.workers)]
        self.queue = redis.Redis.from_url(self.options.redis_url)
        self.processes: dict[str, mp.Process] = {}

    def __enter__(self) -> "Cluster":
        for key in self.queue.scan_iter(match=f"{self.options.namespace}:*"):
            self.queue.delete(key)
        ctx = mp.get_context("spawn")  # a fresh interpreter per worker, as on separate machines
        for name in self.names:
            proc = ctx.Process(target=worker_main, args=(name, self.options), name=f"kvmemory-{name}", daemon=True)
            proc.start()
            self.processes[name] = proc
        ready, deadline = set(), time.monotonic() + self.ready_timeout_s
        while ready != set(self.names):
            msg = self._next_result(deadline)
            ready.add(msg.get("ready"))
        return self

    def __exit__(self, *exc) -> None:
        for name, proc in self.processes.items():
            if proc.is_alive():
                self.queue.rpush(f"{self.options.namespace}:jobs:{name}", json.dumps({"stop": True}))
        for proc in self.processes.values():
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        if self.clear_on_exit:  # queues and blocks of this cluster's namespaces (checkpoints stay in Postgres)
            for pattern in (f"{self.options.namespace}:*", f"{self.options.namespace}-blocks:*"):
                for key in self.queue.scan_iter(match=pattern):
                    self.queue.delete(key)

    def _next_result(self, deadline: float) -> dict:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError("no worker result in time (a worker died, or the model is slow to load)")
            dead = [n for n, p in self.processes.items() if not p.is_alive() and p.exitcode not in (0, 137)]
            if dead:
                raise RuntimeError(f"worker {dead} exited with {[self.processes[n].exitcode for n in dead]}")
            popped = self.queue.blpop([f"{self.options.namespace}:results"], timeout=1)
            if popped is not None:
                return json.loads(popped[1])

    def submit(self, worker: str, job: dict) -> None:
        self.queue.rpush(f"{self.options.namespace}:jobs:{worker}", json.dumps(job))

    def alive(self) -> list[str]:
        return [n for n, p in self.processes.items() if p.is_alive()]

    def run_turns(self, threads: list[str], texts: list[str], *, seed: int = 0, route: str = "random",
                  crash: set | None = None, job_timeout_s: float = 300.0) -> list[dict]:
        """Run ``len(texts)`` turns on every thread; each turn goes to a random live worker
        (``route="random"``) or always the first one (``"first"``). Turns of one thread run in
        order; threads run concurrently. ``route="alternate"`` hands each next turn of a thread to
        the next worker (deterministic: every turn after the first changes worker). ``crash``: ``{(thread, turn), ...}`` jobs on which the
        worker that gets them first dies mid-call; the job then goes to another worker.

        Returns the results in completion order."""
        rng = random.Random(seed)
        crash = set(crash or ())
        results, next_turn, pending = [], {t: 0 for t in threads}, {}

        def send(thread: str, turn: int, exclude: set[str] = frozenset()) -> None:
            choices = [n for n in self.alive() if n not in exclude]
            if route == "random":
                worker = rng.choice(choices)
            elif route == "alternate":  # every turn of a thread on another worker than the last
                worker = choices[(threads.index(thread) + turn) % len(choices)]
            else:
                worker = choices[0]
            job = {"id": uuid.uuid4().hex, "thread": thread, "turn": turn, "text": texts[turn],
                   "crash": worker if (thread, turn) in crash and not exclude else ""}
            pending[job["id"]] = (job, worker, time.monotonic())
            self.submit(worker, job)

        for t in threads:
            send(t, 0)
        while pending:
            try:
                msg = self._next_result(time.monotonic() + 5)
            except TimeoutError:
                msg = None
            if msg is not None and msg.get("job") in pending:
                pending.pop(msg["job"])
                results.append(msg)
                thread = msg["thread"]
                next_turn[thread] += 1
                if next_turn[thread] < len(texts):
                    send(thread, next_turn[thread])
            for job_id, (job, worker, sent) in list(pending.items()):  # a dead worker's job goes elsewhere
                if worker not in self.alive() or time.monotonic() - sent > job_timeout_s:
                    pending.pop(job_id)
                    log.warning("kvmemory: worker %s did not finish turn %d of %s: resent", worker, job["turn"],
                                job["thread"])
                    send(job["thread"], job["turn"], exclude={worker})
        return results


def thread_messages(options: WorkerOptions, thread: str) -> list:
    """The messages of a thread's newest checkpoint (read straight from Postgres)."""
    from langgraph.checkpoint.postgres import PostgresSaver

    with PostgresSaver.from_conn_string(options.postgres_url) as saver:
        tup = saver.get_tuple({"configurable": {"thread_id": thread}})
    return [] if tup is None else list(tup.checkpoint["channel_values"].get("messages", []))


QUESTIONS = ["What colour is the sky on a clear day?", "Name a fruit that is yellow.", "How many legs has a spider?",
             "What do bees make?", "Which season comes after winter?", "Name a large animal with a trunk.",
             "What is frozen water called?", "Which planet do we live on?"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmemory_lab.harness.workers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--postgres", default=POSTGRES_URL)
    parser.add_argument("--redis", default=REDIS_URL)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.workers < 1 or args.threads < 1 or not 1 <= args.turns <= len(QUESTIONS):
        parser.error(f"--workers, --threads >= 1 and 1 <= --turns <= {len(QUESTIONS)}")
    logging.basicConfig(level=logging.WARNING)
    options = WorkerOptions(postgres_url=args.postgres, redis_url=args.redis)
    threads = [f"demo-{uuid.uuid4().hex[:6]}-{i}" for i in range(args.threads)]
    with Cluster(args.workers, options) as cluster:
        results = cluster.run_turns(threads, QUESTIONS[: args.turns], seed=args.seed)
    for r in sorted(results, key=lambda r: (r["thread"], r["turn"])):
        print(f"{r['thread']} turn {r['turn']} on {r['worker']}: {r['reused_tokens']} tokens from cache, "
              f"{r['recomputed_tokens']} computed, restored={r['restored']} ({r['blocks_fetched']} blocks fetched)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
