"""``kvmemory bench persistence``: what block-level persistence stores and how workers share it.

(a) **storage**: one thread, a long chat with tool results (each turn: user question, a tool call,
its tool result, the model's answer), one old tool result cleared every 5 turns (a mid-history
edit repaired by SUR, whose stale rows get new blocks). One worker, ``SqliteSaver`` + the Redis
block store with retention ``keep_states``; garbage collected after every turn. Per turn: bytes
stored (sum of live manifests + blocks), block write ms, and every 5 turns the ms to restore the
thread from Redis into a fresh registry. Compared with the final cache's K/V bytes and with the
one-blob-per-state layout (sum of every distinct state's K/V + logits, as the blob layout keeps
while checkpoints name them). When the thread first passes ``--restore-at`` tokens, its restore
is timed against a Re-prefill of the same tokens.

(b) **workers**: ``--workers`` worker processes (:mod:`.workers`: own model, one compiled graph,
PostgresSaver + Redis block store), ``--threads`` threads x ``--turns`` turns routed to random
workers, vs the same turns all on one worker: tokens reused, Re-prefills after a thread's first
turn, messages lost (checkpointed messages vs the turns sent).

``--out DIR`` writes ``persistence.json`` (``bytes_stored``, ``final_cache_bytes``,
``legacy_bytes``, ``restore_ms``, ``reuse_ratio_vs_single``, ``reprefills``, ``messages_lost``
and the per-turn series), ``persistence.md`` and ``persistence.png``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import uuid
from pathlib import Path

TOOL_TEXT = ("Record {i}: the survey of site {i} found {n} stone walls, a well of {d} metres and pottery "
             "from the {c} century, stored in box {b}.")


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/persistence"),
                        help="output folder (default benchmarks/results/persistence)")
    parser.add_argument("--turns", type=int, default=50, help="(a) chat turns (default 50)")
    parser.add_argument("--clear-every", type=int, default=5, help="(a) clear one old tool result every N turns")
    parser.add_argument("--keep-states", type=int, default=2, help="(a) retention: newest K cache states (default 2)")
    parser.add_argument("--block-tokens", type=int, default=128, help="rows per block (default 128)")
    parser.add_argument("--restore-at", type=int, default=2048, help="(a) time restore vs Re-prefill at this size")
    parser.add_argument("--workers", type=int, default=2, help="(b) worker processes (default 2)")
    parser.add_argument("--threads", type=int, default=8, help="(b) threads (default 8)")
    parser.add_argument("--worker-turns", type=int, default=6, help="(b) turns per thread (default 6)")
    parser.add_argument("--parts", default="storage,workers", help="comma-separated: storage, workers")
    parser.add_argument("--redis", default=os.environ.get("KVMEMORY_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--postgres", default=os.environ.get(
        "KVMEMORY_POSTGRES_URL", "postgresql://kvmemory:kvmemory@localhost:5432/kvmemory"))
    parser.add_argument("--seed", type=int, default=0)


def run(args, console) -> int:
    import torch

    from kvmemory_lab.bench.common import load_average, machine_name

    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"storage", "workers"}:
        console.print(f"[red]--parts takes storage and/or workers (got {args.parts!r})[/red]")
        return 2
    result = {"meta": {"command": getattr(args, "command_line", ""), "machine": machine_name(),
                       "python": platform.python_version(), "torch": torch.__version__,
                       "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                       "load_before": load_average(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "model": "SmolLM2-135M-Instruct fp32 (embedded)", "block_tokens": args.block_tokens}}
    if "storage" in parts:
        result["storage"] = storage_run(args, console)
    if "workers" in parts:
        result["workers"] = workers_run(args, console)
    result["meta"]["load_after"] = load_average()
    _carry_over(args.out / "persistence.json", parts, result)
    result.update(headline(result))
    write_outputs(args.out, result, console)
    return 0


def _carry_over(path: Path, parts: set[str], result: dict) -> None:
    """Keep the part not run now from an earlier persistence.json in the same folder (each part
    may run on its own, e.g. to stay under 10 minutes), with that run's metadata."""
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    for part in {"storage", "workers"} - parts:
        if part in old:
            result[part] = old[part]
            result["meta"].setdefault("parts_from_earlier_runs", {})[part] = old["meta"].get(
                "parts_from_earlier_runs", {}).get(part, {k: old["meta"].get(k) for k in
                                                          ("command", "started", "load_before", "load_after")})


def headline(result: dict) -> dict:
    """The fields the issue names, at the top level of persistence.json."""
    out = {}
    s = result.get("storage")
    if s:
        out.update({k: s[k] for k in ("bytes_stored", "final_cache_bytes", "legacy_bytes")})
        out["restore_ms"] = s["restore_at"]["restore_ms"] if s.get("restore_at") else None
    w = result.get("workers")
    if w:
        out.update({k: w[k] for k in ("reuse_ratio_vs_single", "reprefills", "messages_lost")})
    return out


# ------------------------------------------------------------------ storage
def _turn_messages(i: int):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    call = {"name": "survey", "args": {"site": i}, "id": f"call{i}", "type": "tool_call"}
    text = TOOL_TEXT.format(i=i, n=3 + i % 7, d=2 + i % 5, c=["twelfth", "ninth", "fourth"][i % 3], b=100 + i)
    return [HumanMessage(f"What did the survey of site {i} find?", id=f"u{i}"),
            AIMessage("", tool_calls=[call], id=f"c{i}"), ToolMessage(text, tool_call_id=f"call{i}", id=f"t{i}")]


def storage_run(args, console) -> dict:
    import tempfile

    from langchain_core.messages import SystemMessage, ToolMessage
    from langgraph.checkpoint.sqlite import SqliteSaver

    from kvmemory.persistence import export_state

    from langchain_kvmemory.blockstore import RedisBlockStore
    from langchain_kvmemory.chat_model import ChatKVMemory
    from langchain_kvmemory.checkpointer import KVCheckpointSaver
    from kvmemory_lab.harness.workers import build_graph

    llm = ChatKVMemory(max_tokens=8, repair_policy="sur@5")
    store = RedisBlockStore(args.redis, namespace=f"kvmbench-{uuid.uuid4().hex[:6]}")
    config = {"configurable": {"thread_id": "chat"}}
    turns, legacy, seen = [], 0, set()
    restore_at = None
    with tempfile.TemporaryDirectory() as folder, SqliteSaver.from_conn_string(f"{folder}/c.sqlite") as inner:
        saver = KVCheckpointSaver(inner, llm, block_store=store, block_tokens=args.block_tokens,
                                  keep_states=args.keep_states, worker_id="writer")
        graph = build_graph(llm, saver)
        cleared = 0
        for i in range(args.turns):
            if i and i % args.clear_every == 0:  # clear the oldest tool result still in full
                old = graph.get_state(config).values["messages"]
                target = next(m for m in old if isinstance(m, ToolMessage) and m.id == f"t{cleared}")
                graph.update_state(config, {"messages": [ToolMessage("[cleared]", tool_call_id=target.tool_call_id,
                                                                     id=target.id)]})
                cleared += 1
            messages = _turn_messages(i)
            if i == 0:
                messages.insert(0, SystemMessage("You answer from the survey records the tool returns.", id="sys"))
            writes = len(saver.blocks.write_ms)
            t0 = time.perf_counter()
            out = graph.invoke({"messages": messages}, config)
            turn_ms = (time.perf_counter() - t0) * 1000
            write_ms = sum(saver.blocks.write_ms[writes:])
            saver.collect_garbage(grace_s=0)
            session = llm.threads.session("chat")
            state = export_state(session, llm.threads.model_name)
            key = (tuple(state.token_ids), session.exact_rows, id(session.cache))
            if key not in seen:  # the blob layout stores each distinct state once, while checkpoints name it
                seen.add(key)
                legacy += state.nbytes + (state.next_logits.numel() * 4 if state.next_logits is not None else 0)
            row = {"turn": i, "tokens": len(state.token_ids), "stored_bytes": saver.blocks.stored_bytes(),
                   "cache_bytes": state.nbytes, "legacy_bytes": legacy, "write_ms": round(write_ms, 1),
                   "turn_ms": round(turn_ms, 1),
                   "reused_tokens": out["messages"][-1].response_metadata["repair"]["reused_tokens"],
                   "operator": out["messages"][-1].response_metadata["repair"]["operator"]}
            crossing = restore_at is None and len(state.token_ids) >= args.restore_at
            if i % args.clear_every == args.clear_every - 1 or i == args.turns - 1 or crossing:
                row["restore_ms"], rows = _time_restore(inner, store, llm, args, config)
                assert rows == len(state.token_ids), "the restored thread is the stored one"
            if crossing:
                restore_at = {"tokens": len(state.token_ids), "restore_ms": row["restore_ms"],
                              "reprefill_ms": _time_reprefill(llm, state.token_ids)}
                restore_at["ratio"] = round(restore_at["restore_ms"] / restore_at["reprefill_ms"], 3)
            turns.append(row)
            console.print(f"turn {i}: {row}")
        final = turns[-1]
        written = saver.blocks.bytes_written
    store.clear()
    store.close()
    restores = [t["restore_ms"] for t in turns if "restore_ms" in t]
    return {"turns": turns, "bytes_stored": final["stored_bytes"], "final_cache_bytes": final["cache_bytes"],
            "legacy_bytes": legacy, "bytes_written_keep_all": written,
            "stored_over_final": round(final["stored_bytes"] / final["cache_bytes"], 3),
            "legacy_over_final": round(legacy / final["cache_bytes"], 3),
            "keep_states": args.keep_states, "clear_every": args.clear_every,
            "write_ms_median": statistics.median(t["write_ms"] for t in turns),
            "restore_ms_median": statistics.median(restores) if restores else None, "restore_at": restore_at}


def _time_restore(inner, store, llm, args, config) -> tuple[float, int]:
    """ms for a fresh worker (its own registry) to load the thread's newest state from the store."""
    from kvmemory.threads import ThreadCaches

    from langchain_kvmemory.checkpointer import KVCheckpointSaver

    registry = ThreadCaches(llm.threads.model, llm.threads.tokenizer, model_name=llm.threads.model_name)
    reader = KVCheckpointSaver(inner, registry, block_store=store, block_tokens=args.block_tokens, worker_id="reader")
    t0 = time.perf_counter()
    reader.get_tuple(config)
    ms = (time.perf_counter() - t0) * 1000
    if reader.restore_failures:
        raise RuntimeError(f"restore failed: {reader.restore_failures}")
    return round(ms, 1), len(registry.session(config["configurable"]["thread_id"]).token_ids)


def _time_reprefill(llm, token_ids) -> float:
    import torch

    from kvmemory import kvcache
    from kvmemory.engine import forward_rows

    model = llm.threads.model
    t0 = time.perf_counter()
    with torch.no_grad():
        forward_rows(model, kvcache.new_cache(model.config), torch.tensor(token_ids), 0)
    return round((time.perf_counter() - t0) * 1000, 1)


# ------------------------------------------------------------------ workers
def workers_run(args, console) -> dict:
    from kvmemory_lab.harness.workers import QUESTIONS, Cluster, WorkerOptions, thread_messages

    texts = (QUESTIONS * 2)[: args.worker_turns]
    options = WorkerOptions(postgres_url=args.postgres, redis_url=args.redis, block_tokens=args.block_tokens,
                            namespace=f"kvmbench-{uuid.uuid4().hex[:6]}", max_tokens=12)
    tag = uuid.uuid4().hex[:6]
    single = [f"single-{tag}-{i}" for i in range(args.threads)]
    routed = [f"routed-{tag}-{i}" for i in range(args.threads)]
    t0 = time.perf_counter()
    with Cluster(args.workers, options) as cluster:
        startup_s = time.perf_counter() - t0
        alone = cluster.run_turns(single, texts, route="first")
        shared = cluster.run_turns(routed, texts, seed=args.seed)
    lost = 0  # per thread: each turn's user message once, and an answer after it
    for thread in routed:
        messages = thread_messages(options, thread)
        humans = [m.content for m in messages if m.type == "human"]
        lost += sum(1 for t in texts if humans.count(t) != 1)
        lost += max(0, len(texts) - sum(1 for m in messages if m.type == "ai"))
    reused_single = sum(r["reused_tokens"] for r in alone)
    reused_routed = sum(r["reused_tokens"] for r in shared)
    per_turn = {}
    for name, results in (("single", alone), ("routed", shared)):
        for t in range(len(texts)):
            per_turn.setdefault(name, []).append(statistics.mean(r["reused_tokens"] for r in results if r["turn"] == t))
    reprefills = sum(1 for r in shared if r["turn"] > 0 and (r["reused_tokens"] == 0 or r["restore_failure"]))
    console.print(f"workers: reused {reused_routed} vs single {reused_single}; reprefills {reprefills}; lost {lost}")
    return {"workers": args.workers, "threads": args.threads, "turns": len(texts), "startup_s": round(startup_s, 1),
            "reused_tokens_routed": reused_routed, "reused_tokens_single": reused_single,
            "reuse_ratio_vs_single": round(reused_routed / reused_single, 4) if reused_single else None,
            "reused_per_turn": per_turn, "reprefills": reprefills, "messages_lost": lost,
            "restores": sum(r["restored"] for r in shared), "blocks_fetched": sum(r["blocks_fetched"] for r in shared),
            "turns_per_worker": {w: sum(1 for r in shared if r["worker"] == w) for w in {r["worker"] for r in shared}},
            "turn_ms_median_routed": statistics.median(r["ms"] for r in shared),
            "turn_ms_median_single": statistics.median(r["ms"] for r in alone), "results": shared}


# ------------------------------------------------------------------ outputs
def write_outputs(out: Path, result: dict, console) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "persistence.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "persistence.md").write_text(markdown(result))
    _plot(result, out / "persistence.png")
    console.print(f"wrote {out / 'persistence.json'}, persistence.md, persistence.png")


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = ["# Persistence benchmark", "", f"`{meta['command']}` on {meta['machine']}, {meta['model']}, "
             f"torch {meta['torch']} with {meta['torch_threads']} threads, load {meta['load_before']} → "
             f"{meta.get('load_after')}, started {meta['started']}, blocks of {meta['block_tokens']} tokens.", ""]
    for part, earlier in meta.get("parts_from_earlier_runs", {}).items():
        lines += [f"Part {part} is from `{earlier['command']}` (started {earlier['started']}, load "
                  f"{earlier['load_before']} → {earlier['load_after']}).", ""]
    s = result.get("storage")
    if s:
        mb = 1 / 2**20
        lines += ["## (a) storage: one thread, tool results, a clear every "
                  f"{s['clear_every']} turns, retention {s['keep_states']} states", "",
                  "| | MiB | × final cache |", "|---|---|---|",
                  f"| final cache (K/V) | {s['final_cache_bytes'] * mb:.1f} | 1.00 |",
                  f"| stored (live blocks + manifests) | {s['bytes_stored'] * mb:.1f} | {s['stored_over_final']:.2f} |",
                  f"| written over the run (= kept with no retention) | {s['bytes_written_keep_all'] * mb:.1f} | "
                  f"{s['bytes_written_keep_all'] / s['final_cache_bytes']:.2f} |",
                  f"| one blob per state (previous layout) | {s['legacy_bytes'] * mb:.1f} | {s['legacy_over_final']:.2f} |",
                  "", f"Block writes: median {s['write_ms_median']:.0f} ms per turn; restore into a fresh worker: "
                  f"median {s['restore_ms_median']:.0f} ms."]
        peak = max(s["turns"], key=lambda r: r["stored_bytes"] / r["cache_bytes"])
        why = (" (right after a clear the retained states share only the blocks before the cleared tool result; "
               "the next turns drop the older ones)") if s["keep_states"] > 1 else ""
        lines += [f"Peak stored / live cache: {peak['stored_bytes'] / peak['cache_bytes']:.2f}× at turn "
                  f"{peak['turn']}{why}."]
        if s.get("restore_at"):
            r = s["restore_at"]
            lines += [f"At {r['tokens']} tokens: restore from Redis {r['restore_ms']:.0f} ms vs Re-prefill "
                      f"{r['reprefill_ms']:.0f} ms ({100 * r['ratio']:.1f} %)."]
        lines.append("")
    w = result.get("workers")
    if w:
        lines += [f"## (b) {w['workers']} workers × {w['threads']} threads × {w['turns']} turns, random routing", "",
                  "| | value |", "|---|---|",
                  f"| tokens reused, random routing | {w['reused_tokens_routed']} |",
                  f"| tokens reused, one worker | {w['reused_tokens_single']} |",
                  f"| reuse ratio vs one worker | {w['reuse_ratio_vs_single']} |",
                  f"| Re-prefills after a thread's first turn | {w['reprefills']} |",
                  f"| messages lost | {w['messages_lost']} |",
                  f"| restores / blocks fetched | {w['restores']} / {w['blocks_fetched']} |",
                  f"| turns per worker | {w['turns_per_worker']} |",
                  f"| median turn ms routed / one worker | {w['turn_ms_median_routed']:.0f} / "
                  f"{w['turn_ms_median_single']:.0f} |", ""]
    return "\n".join(lines)


def _plot(result: dict, path: Path) -> None:
    from kvmemory_lab.bench.common import agg_pyplot

    plt = agg_pyplot()
    s = result.get("storage")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    if s:
        t = [r["turn"] for r in s["turns"]]
        mb = 1 / 2**20
        axes[0].plot(t, [r["stored_bytes"] * mb for r in s["turns"]], label="stored (blocks)")
        axes[0].plot(t, [r["cache_bytes"] * mb for r in s["turns"]], label="live cache")
        axes[0].plot(t, [r["legacy_bytes"] * mb for r in s["turns"]], label="one blob per state")
        axes[0].set_xlabel("turn"), axes[0].set_ylabel("MiB"), axes[0].set_yscale("log"), axes[0].legend()
        axes[1].plot(t, [r["write_ms"] for r in s["turns"]], label="block write ms")
        rt = [(r["turn"], r["restore_ms"]) for r in s["turns"] if "restore_ms" in r]
        axes[1].plot([x for x, _ in rt], [y for _, y in rt], "o-", label="restore ms (Redis)")
        axes[1].set_xlabel("turn"), axes[1].set_ylabel("ms"), axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
