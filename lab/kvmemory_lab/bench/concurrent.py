"""``kvmemory bench concurrent``: N threads of one model decoding at the same time.

Each of N agent chats (HotpotQA tool results, ``--context`` tokens each, a different chat per
thread) is prefilled once; then the N threads decode ``--tokens`` greedy tokens at once (stop
tokens masked, so every thread does the same work), each from its own copy of its prefilled
cache. Systems:

- ``kvmemory batched``: sessions sharing a :class:`~kvmemory.engine.batching.DecodeBatcher`
  (one kernel call per token for every thread decoding), one Python thread per session;
- ``kvmemory per-thread``: the same sessions without a batcher (each thread's own steps);
- ``llama.cpp batched``: llama-cpp-python's low-level API on the same GGUF, one context with
  ``n_seq_max = N`` and every step one ``llama_batch`` holding the N sequences' tokens (what the
  llama.cpp server does for parallel slots), when llama-cpp-python is installed.

Prompt lookup is off for kvmemory by default (one token per forward, as llama.cpp here;
``--prompt-lookup 2``: the sessions' default drafts, verified inside the batches). Reported per N:
aggregate decoded tokens/s, per-thread tokens/s, p95 time per token (ms), medians of interleaved
trials. Writes ``concurrent.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from kvmemory.engine import decode_batcher
from kvmemory.models import load_model
from kvmemory.prompt import normalize_messages, render_text
from kvmemory.session import KVSession, stop_token_ids

from ..demo_cases import default_data_dir
from ..gguf_models import resolve_model
from .agent import SEARCH_TOOL, agent_chat
from .agent_systems import llama_cpp_missing, peer_gguf
from .common import agg_pyplot, int_list, load_average, machine_name, simd_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--counts", type=int_list, default=[1, 2, 4, 8], help="threads decoding at once (default 1,2,4,8)")
    parser.add_argument("--context", type=int, default=2048, help="tokens of each thread's chat (default 2048)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each thread decodes (default 128)")
    parser.add_argument("--trials", type=int, default=2, help="interleaved trials, medians reported (default 2)")
    parser.add_argument("--threads", type=int, default=2, help="torch and llama.cpp CPU threads (default 2)")
    parser.add_argument("--prompt-lookup", type=int, default=0,
                        help="kvmemory's draft tokens per forward (default 0: one token per forward, as llama.cpp here)")
    parser.add_argument("--model", default=None, help="qwen2.5-coder-0.5b / -1.5b or a .gguf (default: the embedded model)")
    parser.add_argument("--data", type=Path, default=None, help="shared data folder holding hotpotqa/ (default ../shared/data)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/concurrent"), help="output folder")


def run(args, console) -> int:
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    lm = load_model(model)
    data = args.data or default_data_dir()
    room = lm.model.config.get_text_config().max_position_embeddings - args.tokens - 64
    chats = [agent_chat(data, lm.tokenizer, args.context, room, seed=i).steps["append"] for i in range(max(args.counts))]
    stops = sorted(stop_token_ids(lm.model, lm.tokenizer))
    prefilled = [_prefilled(lm, chat) for chat in chats]
    gguf = peer_gguf(model)
    skip = llama_cpp_missing() or (None if gguf else "llama.cpp skipped: --model is not a GGUF")
    prompts = [_prompt_ids(lm, chat) for chat in chats]
    meta = {"command": " ".join(["kvmemory bench concurrent", *sys.argv[3:]]), "machine": machine_name(),
            "cpu_flags": simd_flags(), "threads": args.threads, "model": args.model or "SmolLM2-135M-Instruct (embedded)",
            "context": args.context, "tokens": args.tokens, "trials": args.trials, "prompt_lookup": args.prompt_lookup,
            "loadavg_start": load_average(),
            "prompt_tokens": [len(p) for p in prompts], "skipped": [skip] if skip else [],
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    rows = []
    for trial in range(args.trials):
        for n in args.counts:
            for name in ("kvmemory batched", "kvmemory per-thread") + (() if skip else ("llama.cpp batched",)):
                if name.startswith("llama.cpp"):
                    times = _llama_batched(gguf, prompts[:n], args.tokens, args.threads, stops)
                else:
                    times = _kvmemory(lm, prefilled[:n], args.tokens, stops, batched=name.endswith("batched"),
                                      lookup=args.prompt_lookup)
                rows.append(_row(name, n, trial, times, args.tokens))
                r = rows[-1]
                print(f"trial {trial} N={n} {name:22} {r['aggregate_tok_s']:7.1f} tok/s aggregate, "
                      f"p95 {r['p95_ms']:6.1f} ms/token", flush=True)
    meta["loadavg_end"] = load_average()
    write_outputs(args.out, meta, rows, console)
    return 0


def _prompt_ids(lm, messages: list[dict]) -> list[int]:
    text = render_text(lm.tokenizer, normalize_messages(messages), tools=[SEARCH_TOOL])
    return lm.tokenizer(text, add_special_tokens=False)["input_ids"]


def _prefilled(lm, messages: list[dict]) -> KVSession:
    session = KVSession(lm.model, lm.tokenizer, tools=[SEARCH_TOOL], prompt_lookup=0)
    session.prepare(messages)
    return session


def _masked(stops: list[int]):
    def mask(_, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[..., stops] = float("-inf")
        return scores
    return mask


def _kvmemory(lm, prefilled: list[KVSession], tokens: int, stops: list[int], batched: bool,
              lookup: int = 0) -> list[list[float]]:
    """Each thread decodes ``tokens`` from a fork of its prefilled session (``lookup`` draft tokens
    per forward); returns each thread's token times (seconds since the common start)."""
    batcher = decode_batcher(lm.model) if batched else None
    sessions = []
    for s in prefilled:
        fork = s.fork()
        fork.batcher, fork.prompt_lookup = batcher, lookup
        sessions.append(fork)
    stamps: list[list[float]] = [[] for _ in sessions]
    start = threading.Barrier(len(sessions) + 1)

    def decode(i: int) -> None:
        start.wait()
        for _ in sessions[i].stream_tokens(tokens, logits_processor=_masked(stops)):
            stamps[i].append(time.perf_counter())
        sessions[i].settle_stream()

    workers = [threading.Thread(target=decode, args=(i,)) for i in range(len(sessions))]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    return [[t - t0 for t in s] for s in stamps]


def _llama_batched(gguf: str, prompts: list[list[int]], tokens: int, threads: int, stops: list[int]) -> list[list[float]]:
    """llama.cpp: the N prompts prefilled as N sequences of one context, then ``tokens`` steps of
    one batch holding every sequence's token (greedy, stop tokens masked)."""
    import llama_cpp

    _silence(llama_cpp)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(gguf.encode(), mparams)
    n = len(prompts)
    cparams = llama_cpp.llama_context_default_params()
    per_seq = -(-(max(len(p) for p in prompts) + tokens + 64) // 256) * 256
    cparams.n_ctx = n * per_seq
    cparams.kv_unified = True  # one cell pool for all sequences (each needs per_seq at most)
    cparams.n_batch = cparams.n_ubatch = 512
    cparams.n_seq_max = n
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    vocab = llama_cpp.llama_n_vocab(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(512, 0, n)
    try:
        for seq, ids in enumerate(prompts):  # prefill all but the last token, 512 tokens a call
            for at in range(0, len(ids) - 1, 512):
                chunk = ids[at:min(at + 512, len(ids) - 1)]
                _fill(batch, [(tok, at + j, seq, False) for j, tok in enumerate(chunk)])
                assert llama_cpp.llama_decode(ctx, batch) == 0
        _fill(batch, [(ids[-1], len(ids) - 1, seq, True) for seq, ids in enumerate(prompts)])  # the first answer tokens
        assert llama_cpp.llama_decode(ctx, batch) == 0
        last = [_pick(llama_cpp.llama_get_logits_ith(ctx, s), vocab, stops) for s in range(n)]
        stamps: list[list[float]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        for step in range(tokens):
            _fill(batch, [(last[s], len(prompts[s]) + step, s, True) for s in range(n)])
            assert llama_cpp.llama_decode(ctx, batch) == 0
            now = time.perf_counter() - t0
            for s in range(n):
                last[s] = _pick(llama_cpp.llama_get_logits_ith(ctx, s), vocab, stops)
                stamps[s].append(now)
        return stamps
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


_QUIET: list = []  # llama.cpp's log callback that drops its context set-up lines (kept alive)


def _silence(llama_cpp) -> None:
    if not _QUIET:
        _QUIET.append(llama_cpp.llama_log_callback(lambda level, text, user_data: None))
    llama_cpp.llama_log_set(_QUIET[0], None)


def _fill(batch, entries: list[tuple[int, int, int, bool]]) -> None:
    """Put (token, position, sequence, wants logits) entries into a llama_batch."""
    batch.n_tokens = len(entries)
    for i, (token, pos, seq, logits) in enumerate(entries):
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits


def _pick(pointer, vocab: int, stops: list[int]) -> int:
    logits = np.ctypeslib.as_array(pointer, shape=(vocab,)).copy()
    logits[stops] = -np.inf
    return int(logits.argmax())


def _row(name: str, n: int, trial: int, stamps: list[list[float]], tokens: int) -> dict:
    end = max(s[-1] for s in stamps)
    gaps = [1e3 * (b - a) for s in stamps for a, b in zip(s, s[1:])]
    return {"system": name, "n": n, "trial": trial, "wall_s": end, "aggregate_tok_s": n * tokens / end,
            "per_thread_tok_s": statistics.median(tokens / s[-1] for s in stamps),
            "p95_ms": float(np.percentile(gaps, 95)) if gaps else None}


def summary(rows: list[dict]) -> list[dict]:
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["system"], r["n"]), []).append(r)
    return [{"system": s, "n": n, **{k: statistics.median(x[k] for x in rs) for k in
                                     ("aggregate_tok_s", "per_thread_tok_s", "p95_ms")}, "trials": len(rs)}
            for (s, n), rs in cells.items()]


def write_outputs(out: Path, meta: dict, rows: list[dict], console) -> None:
    out.mkdir(parents=True, exist_ok=True)
    table = summary(rows)
    (out / "concurrent.json").write_text(json.dumps({"meta": meta, "summary": table, "trials": rows}, indent=1))
    (out / "concurrent.md").write_text(markdown(meta, table))
    plot(table, out / "concurrent.png", meta)
    console.print(markdown(meta, table))
    console.print(f"wrote {out}/concurrent.json, concurrent.md, concurrent.png")


def markdown(meta: dict, table: list[dict]) -> str:
    lines = [f"# N threads decoding at once ({meta['model']}, {meta['threads']} threads)", "",
             f"Command: `{meta['command']}`", "",
             f"{meta['started']} on {meta['machine']}; CPU flags: {' '.join(meta['cpu_flags'])}. Load average "
             f"{meta['loadavg_start'][0]} at the start, {meta['loadavg_end'][0]} at the end. Each thread: its own "
             f"agent chat ({min(meta['prompt_tokens'])}-{max(meta['prompt_tokens'])} prompt tokens), {meta['tokens']} "
             f"greedy tokens (stop tokens masked), kvmemory with {meta.get('prompt_lookup', 0)} draft tokens per "
             f"forward; medians of {meta['trials']} interleaved trials.", ""]
    lines += [f"- {s}" for s in meta["skipped"]] + ([""] if meta["skipped"] else [])
    lines += ["| system | N | aggregate tok/s | per-thread tok/s | p95 ms per token | aggregate ÷ own N=1 |",
              "|---|---|---|---|---|---|"]
    base = {r["system"]: r["aggregate_tok_s"] for r in table if r["n"] == 1}
    for r in sorted(table, key=lambda r: (r["system"], r["n"])):
        ratio = f"{r['aggregate_tok_s'] / base[r['system']]:.2f}×" if r["system"] in base else "-"
        lines.append(f"| {r['system']} | {r['n']} | {r['aggregate_tok_s']:.1f} | {r['per_thread_tok_s']:.1f} | "
                     f"{r['p95_ms']:.1f} | {ratio} |")
    llama = {r["n"]: r["aggregate_tok_s"] for r in table if r["system"] == "llama.cpp batched"}
    ours = {r["n"]: r["aggregate_tok_s"] for r in table if r["system"] == "kvmemory batched"}
    if llama:
        lines += ["", "kvmemory batched ÷ llama.cpp batched (aggregate): " + ", ".join(
            f"N={n}: {ours[n] / llama[n]:.2f}×" for n in sorted(llama) if n in ours)]
    return "\n".join(lines) + "\n"


def plot(table: list[dict], path: Path, meta: dict) -> None:
    plt = agg_pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in sorted({r["system"] for r in table}):
        pts = sorted((r["n"], r["aggregate_tok_s"]) for r in table if r["system"] == system)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
    ax.set_xlabel("threads decoding at once (N)")
    ax.set_ylabel("aggregate decoded tokens/s")
    ax.set_title(f"{meta['model']}, {meta['context']}-token chats, {meta['threads']} threads", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
