"""``kvmemory bench agent``: the hops of a tool-using agent, kvmemory beside its peers.

The chat: a system prompt, a question, then HotpotQA passages as tool results (one assistant
``search`` call + one tool message per passage, rendered through the chat template with the
tool offered, as an agent's history is), grown to about ``--contexts`` tokens. The question's own
passages come first (a distractor, then the 2 supporting ones among 7 more distractors), then
passages of other questions. Per context
and system, one trial runs the steps in order on one system state, started cold:

- ``first``: the first call (the whole prompt is prefilled) and its answer;
- ``repeat``: the identical request again;
- ``append``: a user turn appended (the answer request);
- ``delete``: one tool result in the middle of the history deleted (a distractor);
- ``decode``: the ``delete`` request again, answered with ``--decode-tokens`` (``decode_tok_s``).

Every answer is exactly ``--answer-tokens`` greedy tokens (stop tokens masked, so every system
does the same decoding work). Systems run side by side in one process, trials interleaved
(system A trial 1, system B trial 1, ..., then trial 2); medians over ``--trials``. Output:
``agent.json`` (meta + one row per system, context and step), ``agent.md`` and ``agent.png``.
The systems are in :mod:`kvmemory_lab.bench.agent_systems`.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvmemory.engine import ENGINES
from kvmemory.errors import KVMemoryError, ModelNotFoundError
from kvmemory.models import embedded_gguf_path
from kvmemory.policy import RepairPolicy
from kvmemory.prompt import format_call, normalize_messages, render_text, template_renders_tools

from ..demo_cases import HOTPOT_FILE, SYSTEM_PROMPT, DemoCase, Passage, default_data_dir, hotpot_cases
from ..gguf_models import resolve_model
from .agent_systems import (
    KVMemorySystem, LlamaCppSystem, ModelPool, ReprefillSystem, llama_cpp_missing,
)
from .common import agg_pyplot, count_list, int_list, load_average, machine_name, simd_flags, time_ratio

STEPS = ("first", "repeat", "append", "delete", "decode")
REFERENCE = "transformers bf16"
QUESTION_PASSAGES = 10  # a HotpotQA item's paragraphs: 2 supporting + 8 distractors
POOL_CASES = 60  # questions whose passages may fill a context (~1,300 tokens each)
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search Wikipedia; returns one passage.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
FULL = {"contexts": [2048, 4096, 8192], "trials": 3, "answer_tokens": 20, "decode_tokens": 128}
QUICK = {"contexts": [768], "trials": 1, "answer_tokens": 4, "decode_tokens": 8}  # 2 HotpotQA tool turns need ~530


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", type=int_list, default=None, help="chat sizes in tokens (default 2048,4096,8192)")
    parser.add_argument("--trials", type=int, default=None, help="interleaved trials, medians reported (default 3)")
    parser.add_argument("--answer-tokens", type=int, default=None, help="greedy answer length per step (default 20)")
    parser.add_argument("--decode-tokens", type=int, default=None, help="tokens of the decode step (default 128)")
    parser.add_argument("--policies", default="sur@5", help="kvmemory repair policies, comma list (default sur@5)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="kvmemory's model dtype (default fp32)")
    parser.add_argument("--engines", default="auto",
                        help=f"kvmemory row engines, comma list of {', '.join(ENGINES)} (default auto)")
    parser.add_argument("--reprefill", default="fp32,bf16",
                        help="dtypes of the transformers Re-prefill peer, comma list of fp32, bf16 (default both; "
                             "bf16 is the reference of the time ratios)")
    parser.add_argument("--lookups", type=count_list, default=None,
                        help="kvmemory prompt-lookup draft tokens, comma list, one system each (default: the session's)")
    parser.add_argument("--llama-lookup", type=int, default=10,
                        help="also run llama.cpp with prompt lookup decoding of this many draft tokens "
                             "(llama-cpp-python's default 10; 0: only plain llama.cpp)")
    parser.add_argument("--threads", type=int, default=2, help="torch and llama.cpp CPU threads (default 2)")
    parser.add_argument("--quick", action="store_true", help="context 768, 1 trial, 4-token answers, 8-token decode (a fast check)")
    parser.add_argument("--model", default=None, help="a .gguf file (llama.cpp runs it too), a local transformers model folder, "
                        "or qwen2.5-coder-0.5b / qwen2.5-coder-1.5b (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="GGUF for llama.cpp (default: the embedded model's packaged Q4_1 GGUF, without --model)")
    parser.add_argument("--data", type=Path, default=None, help="shared data folder holding hotpotqa/ (default ../shared/data)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/agent"), help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="passage order seed")


def _settings(args) -> dict:
    """Resolved options: ``--quick`` shrinks the defaults, explicit flags still win."""
    base = QUICK if args.quick else FULL
    out = {k: getattr(args, k) if getattr(args, k) is not None else default for k, default in base.items()}
    out["policies"] = [p.strip() for p in args.policies.split(",") if p.strip()]
    out["engines"] = [e.strip() for e in args.engines.split(",") if e.strip()]
    out["reprefill"] = [d.strip() for d in args.reprefill.split(",") if d.strip()]
    return out


def _check(settings: dict, data_dir, threads: int) -> str | None:
    """A message naming the fix for unusable options, checked before any model loads."""
    if settings["trials"] < 1 or settings["answer_tokens"] < 1 or settings["decode_tokens"] < 2 or threads < 1:
        return "--trials, --answer-tokens and --threads must be at least 1, --decode-tokens at least 2"
    if not settings["policies"]:
        return "--policies needs at least one kvmemory policy label, e.g. sur@5,replay"
    if not settings["engines"] or set(settings["engines"]) - set(ENGINES):
        return f"--engines takes a comma list of {', '.join(ENGINES)} (got {','.join(settings['engines']) or 'nothing'})"
    if set(settings["reprefill"]) - {"fp32", "bf16"}:
        return f"--reprefill takes a comma list of fp32, bf16 (got {','.join(settings['reprefill'])})"
    for label in settings["policies"]:
        try:
            RepairPolicy.coerce(label)
        except KVMemoryError as exc:
            return f"--policies: {exc}"
    if data_dir is None or not (Path(data_dir) / HOTPOT_FILE).is_file():
        return f"no HotpotQA data: pass --data pointing at the shared data folder (with {HOTPOT_FILE})"
    return None


# ------------------------------------------------------------------ the chat
@dataclass(frozen=True)
class AgentChat:
    """The message lists of every step for one context, and their sizes in tokens."""

    context: int
    question: str
    gold: str
    steps: dict[str, list[dict]]
    prompt_tokens: dict[str, int]
    tool_results: int
    deleted_tokens: int


def _tool_turn(i: int, passage: Passage, template_tools: bool) -> list[dict]:
    """The agent's ``search`` call and its result: tool_calls fields for a template that renders
    tools, else the call written in the content (the format the folded tools block asks for)."""
    args = {"query": passage.title}
    if template_tools:
        call = {"role": "assistant", "content": "", "id": f"call-{i}", "tool_calls": [
            {"id": f"call-{i}", "type": "function", "function": {"name": "search", "arguments": args}}]}
        result = {"role": "tool", "content": f"{passage.title}: {passage.text}", "id": f"result-{i}",
                  "tool_call_id": f"call-{i}"}
    else:
        call = {"role": "assistant", "content": format_call("search", args), "id": f"call-{i}"}
        result = {"role": "tool", "content": f"{passage.title}: {passage.text}", "id": f"result-{i}"}
    return [call, result]


def _step_messages(case: DemoCase, passages: list[Passage], deleted: int, template_tools: bool) -> dict[str, list[dict]]:
    """Each step's messages: the history (system, question, tool turns), + the answer request
    (``append``), - tool result ``deleted`` (``delete``, ``decode``; its call stays, as when an
    agent removes a ToolMessage)."""
    history = [{"role": "system", "content": SYSTEM_PROMPT, "id": "system"},
               {"role": "user", "content": f"Question: {case.question}", "id": "task"}]
    for i, p in enumerate(passages):
        history += _tool_turn(i, p, template_tools)
    query = {"role": "user", "content": f"Answer the question: {case.question} Reply with just the answer.", "id": "query"}
    edited = [m for m in history + [query] if m["id"] != f"result-{deleted}"]
    return {"first": history, "repeat": history, "append": history + [query], "delete": edited, "decode": edited}


def _deleted_index(n: int, deletable: set[int]) -> int:
    """The deletable tool result nearest the middle of ``n`` (never the last: a suffix must follow)."""
    inner = [i for i in sorted(deletable) if i < n - 1]
    if not inner:
        raise ValueError(f"{n} tool result(s) leave none to delete in the middle: use a larger --contexts value")
    return min(inner, key=lambda i: (abs(i - n // 2), i))


def _tokens(tokenizer, messages: list[dict]) -> int:
    text = render_text(tokenizer, normalize_messages(messages), tools=[SEARCH_TOOL])
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def agent_chat(data_dir: Path, tokenizer, context: int, room: int, seed: int = 0) -> AgentChat:
    """The largest agent chat whose first prompt has at most ``context`` tokens and whose longest
    request leaves ``room`` answer tokens inside the model's context.

    Args:
        data_dir: shared data folder with ``hotpotqa/``. ``room``: the model's context (tokens)
            minus the longest answer.

    Raises:
        ValueError: fewer than 2 tool results fit (nothing to delete in the middle), or the data
            holds too few passages for ``context``.
    """
    cases = hotpot_cases(data_dir, POOL_CASES, passages=QUESTION_PASSAGES, seed=seed)
    case = cases[0]
    # a distractor first, so that even 2 tool results leave one to delete before a supporting one
    first = [case.passages[case.deleted]] + [p for i, p in enumerate(case.passages) if i != case.deleted]
    pool = first + [p for c in cases[1:] for p in c.passages]
    deletable = {0} | set(range(len(first), len(pool)))  # never a supporting passage
    template_tools = template_renders_tools(tokenizer)

    def build(k: int) -> dict[str, list[dict]]:
        return _step_messages(case, pool[:k], _deleted_index(k, deletable), template_tools)

    def fits(k: int) -> bool:
        steps = build(k)
        return _tokens(tokenizer, steps["first"]) <= context and _tokens(tokenizer, steps["append"]) <= room

    if not fits(2):
        raise ValueError(f"--contexts {context}: 2 tool results do not fit; use a larger context")
    k = bisect.bisect_left(range(2, len(pool) + 1), True, key=lambda k: not fits(k)) + 1
    if k == len(pool):
        raise ValueError(f"--contexts {context}: the data holds only {len(pool)} passages; use a smaller context")
    steps = build(k)
    sizes = {s: _tokens(tokenizer, m) for s, m in steps.items()}
    return AgentChat(context, case.question, case.answer, steps, sizes, k, sizes["append"] - sizes["delete"])


# ------------------------------------------------------------------ the run
@dataclass
class Row:
    """One (system, context, step) cell: medians over trials; times in ms, sizes in tokens."""

    system: str
    context: int
    step: str
    median_ms: float
    ttft_ms: float
    prefilled_tokens: int  # prompt tokens the system computed (kvmemory: RepairReport.recomputed_tokens)
    trials_ms: list[float] = field(default_factory=list)
    decode_tok_s: float | None = None  # decode step only
    prompt_tokens: int = 0
    answer: str = ""  # first trial's answer text (decode step: empty)
    fallback: str | None = None  # kvmemory: exact recomputation instead of the policy, and why


def run(args, console) -> int:
    settings = _settings(args)
    data_dir = args.data or default_data_dir()
    problem = _check(settings, data_dir, args.threads)
    if problem:
        console.print(problem, style="red", markup=False)
        return 2
    torch.set_num_threads(args.threads)
    loadavg_start = load_average()
    args.model = resolve_model(args.model)
    if args.gguf is None and str(args.model or "").endswith(".gguf"):
        args.gguf = Path(args.model)  # llama.cpp runs the very file kvmemory converted
    pool = ModelPool(args.model)
    tokenizer = pool.get(args.dtype).tokenizer
    room = pool.get(args.dtype).model.config.get_text_config().max_position_embeddings
    room -= max(settings["answer_tokens"], settings["decode_tokens"])
    try:
        chats = [agent_chat(Path(data_dir), tokenizer, n, room, args.seed) for n in settings["contexts"]]
    except ValueError as exc:
        console.print(str(exc), style="red", markup=False)
        return 2
    resident = _kvmemory_resident(args.model, args.dtype, chats[0].steps["first"], settings["answer_tokens"], args.threads)
    systems, skipped = _systems(args, settings, pool, chats)
    for note in skipped:
        console.print(note, markup=False, soft_wrap=True)
    _warm_up(systems, chats[0])
    rows = [row for chat in chats for row in _bench_context(systems, chat, settings, console)]
    meta = _meta(args, settings, pool, systems, skipped, chats, data_dir)
    meta["loadavg_start"] = loadavg_start
    meta["memory"]["kvmemory_process"] = resident
    write_outputs(args.out, meta, rows, console)
    return 0


def _systems(args, settings: dict, pool: ModelPool, chats: list[AgentChat]) -> tuple[list, list[str]]:
    """kvmemory per policy, transformers Re-prefill fp32 and bf16, llama.cpp when it can run."""
    tools = [SEARCH_TOOL]
    systems: list = []
    for engine in settings["engines"]:
        lm = pool.get(args.dtype, engine)
        systems += [KVMemorySystem({"engine": "kvmemory", "policy": p, "dtype": args.dtype, "rows": lm.engine.name,
                                    "lookup": lookup}, lm, tools)
                    for p in settings["policies"] for lookup in args.lookups or [None]]
    systems += [ReprefillSystem({"engine": "transformers", "dtype": d}, pool.get(d), tools) for d in settings["reprefill"]]
    skip = llama_cpp_missing()
    if skip is None and args.gguf is None and args.model is not None:
        skip = "llama.cpp skipped: --model is not the embedded model; pass --gguf with the same model as GGUF"
    notes = []
    if skip is None:
        try:
            systems.append(_llama_system(args, settings, pool, chats, tools))
        except ModelNotFoundError as exc:  # the embedded GGUF's wheel is gone (a converted copy still runs)
            skip = f"llama.cpp skipped: {exc}"
    if skip is None and args.llama_lookup > 0:
        try:
            systems.append(_llama_system(args, settings, pool, chats, tools, lookup=args.llama_lookup))
        except ImportError as exc:
            notes.append(f"llama.cpp with prompt lookup skipped: {exc}")
    return systems, ([skip] if skip else []) + notes


def _llama_system(args, settings: dict, pool: ModelPool, chats: list[AgentChat], tools,
                  lookup: int | None = None) -> LlamaCppSystem:
    """llama.cpp on ``--gguf`` (default: the embedded model's packaged GGUF), its context sized for
    the longest request (``lookup``: with prompt lookup decoding). Raises ModelNotFoundError when
    the embedded GGUF is not installed, ImportError when llama-cpp-python has no prompt lookup."""
    longest = max(max(c.prompt_tokens.values()) for c in chats)
    n_ctx = longest + settings["decode_tokens"] + 256  # margin: llama.cpp may tokenize a little longer
    config = {"engine": "llama.cpp", "gguf": str(args.gguf or embedded_gguf_path()), "lookup": lookup}
    return LlamaCppSystem(config, pool.get(args.dtype).tokenizer, tools, n_ctx, args.threads)


def _warm_up(systems: list, chat: AgentChat) -> None:
    """One untimed short call per system (first-call allocations and kernel selection)."""
    for system in systems:
        system.start()
        system.call(chat.steps["first"][:4], 2)


def _bench_context(systems: list, chat: AgentChat, settings: dict, console) -> list[Row]:
    calls = {(s.name, step): [] for s in systems for step in STEPS}
    for trial in range(settings["trials"]):
        for system in systems:  # interleaved: every system's trial t before any trial t + 1
            system.start()
            for step in STEPS:
                n = settings["decode_tokens"] if step == "decode" else settings["answer_tokens"]
                calls[(system.name, step)].append(system.call(chat.steps[step], n))
        console.print(f"context {chat.context}: trial {trial + 1}/{settings['trials']} done")
    return [_row(name, chat, step, done) for (name, step), done in calls.items()]


def _row(name: str, chat: AgentChat, step: str, calls: list) -> Row:
    decode = [c.decode_tok_s for c in calls if c.decode_tok_s is not None] if step == "decode" else []
    return Row(
        system=name, context=chat.context, step=step,
        median_ms=round(statistics.median(c.total_ms for c in calls), 2),
        ttft_ms=round(statistics.median(c.ttft_ms for c in calls), 2),
        prefilled_tokens=int(statistics.median(c.prefilled_tokens for c in calls)),
        trials_ms=[round(c.total_ms, 2) for c in calls],
        decode_tok_s=round(statistics.median(decode), 2) if decode else None,
        prompt_tokens=chat.prompt_tokens[step],
        answer="" if step == "decode" else calls[0].text,
        fallback=next((c.fallback for c in calls if c.fallback), None),
    )


def _meta(args, settings: dict, pool: ModelPool, systems: list, skipped: list[str], chats: list[AgentChat],
          data_dir) -> dict:
    import transformers

    llama = next((s for s in systems if isinstance(s, LlamaCppSystem)), None)
    return {
        "command": getattr(args, "command_line", None), "threads": args.threads, "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "machine": machine_name(), "cpu_flags": simd_flags(), "kernel_isa": _kernel_isa(),
        "kvmemory_isa_env": os.environ.get("KVMEMORY_ISA"),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "llama_cpp": llama.version if llama else None, "gguf": llama.gguf if llama else None,
        "model": pool.get(args.dtype).name, "memory": _memory(pool.get(args.dtype)),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), **settings, "dtype": args.dtype,
        "systems": [s.name for s in systems], "skipped": skipped, "data": str(data_dir),
        "question": chats[0].question, "gold": chats[0].gold,
        "chats": {c.context: {"prompt_tokens": c.prompt_tokens, "tool_results": c.tool_results,
                              "deleted_tokens": c.deleted_tokens} for c in chats},
        "protocol": "one cold system state per trial, steps in order; trials interleaved across systems; medians; "
                    "answers of exactly answer_tokens greedy tokens (stop tokens masked)",
    }


def _memory(lm) -> dict:
    """kvmemory's model in bytes: its dense weights (transformers' parameters: the prefill path
    and the reference) and its engine's blocks; and this process's peak resident set (every
    system of the run together, llama.cpp's mapped file included)."""
    import resource

    from kvmemory import kvcache
    from kvmemory.engine import engine_for

    dense = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    blocks = getattr(engine_for(lm.model, kvcache.new_cache(lm.model.config)), "nbytes", 0)
    return {"dense_weights_bytes": dense, "engine_blocks_bytes": blocks,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _kvmemory_resident(model, dtype: str, messages: list[dict], answer_tokens: int, threads: int) -> dict:
    """kvmemory alone in a fresh process, as a user's program runs it: ``load_model`` (default
    settings), one ``prepare`` of ``messages`` and an ``answer_tokens`` answer; its resident set then
    and its peak (the load's transient fp32 weights included), in bytes (Linux /proc)."""
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_resident_child, None if model is None else str(model), dtype, messages,
                           answer_tokens, threads).result()


def _resident_child(model, dtype: str, messages: list[dict], answer_tokens: int, threads: int) -> dict:
    from kvmemory.models import load_model
    from kvmemory.session import KVSession

    torch.set_num_threads(threads)
    lm = load_model(model, dtype)
    session = KVSession(lm.model, lm.tokenizer)
    session.prepare(messages)
    session.generate(answer_tokens)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kib = {key: int(status[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM") if key in status}
    return {"rss_bytes": kib.get("VmRSS"), "peak_rss_bytes": kib.get("VmHWM"), "released_dense_bytes": lm.released_bytes}


def _kernel_isa() -> str | None:
    """The instruction set kvmemory's block engine is built for here (None: no kernel)."""
    from kvmemory.engine import KernelUnavailableError, kernel_isa

    try:
        return kernel_isa()
    except KernelUnavailableError:
        return None


# ------------------------------------------------------------------ outputs
def write_outputs(out: Path, meta: dict, rows: list[Row], console) -> None:
    """``agent.json`` (meta + rows), ``agent.md`` and ``agent.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    meta["loadavg_end"] = load_average()
    (out / "agent.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    text = markdown(meta, rows)
    (out / "agent.md").write_text(text)
    plot(rows, out / "agent.png", meta)
    console.print(text, markup=False, soft_wrap=True)
    console.print(f"wrote {out / 'agent.json'}, agent.md, agent.png")


def markdown(meta: dict, rows: list[Row]) -> str:
    """A header (command, machine, load) and, per context, systems × steps tables: median ms with
    prefilled tokens, time to first token, and time ratios to transformers bf16 and llama.cpp."""
    lines = [
        f"# Agent hops side by side ({meta['model']}, {meta['threads']} thread(s))", "",
        f"Command: `{_env_prefix(meta)}{meta['command']}`", "",
        f"{meta['date']} on {meta['machine']} ({meta['cpu_count']} CPUs); torch {meta['torch']}, transformers "
        f"{meta['transformers']}" + (f", llama-cpp-python {meta['llama_cpp']}" if meta["llama_cpp"] else "") + ". "
        f"CPU flags: {' '.join(meta.get('cpu_flags') or ['unknown'])}; kvmemory's kernel built for "
        f"{meta.get('kernel_isa') or 'no ISA (transformers only)'}. "
        f"Load average {meta['loadavg_start'][0]:.1f} at the start, {meta['loadavg_end'][0]:.1f} at the end: other jobs "
        "share this machine, so compare systems within the run (ratios), not across runs.", "",
        f"Median of {meta['trials']} interleaved trials. Every answer is exactly {meta['answer_tokens']} greedy tokens "
        f"(stop tokens masked); `decode` answers the `delete` request with {meta['decode_tokens']} tokens. Steps: "
        "`first` call, identical `repeat`, `append` a user turn, `delete` a tool result in the middle, `decode`.",
    ]
    memory = meta.get("memory")
    if memory:
        lines += ["", f"Memory: kvmemory's model holds {memory['dense_weights_bytes'] / 2**30:.2f} GiB of dense weights "
                  f"and {memory['engine_blocks_bytes'] / 2**30:.2f} GiB of engine blocks; the process's peak resident set "
                  f"(every system of the run) {memory['peak_rss_bytes'] / 2**30:.2f} GiB."]
        alone = memory.get("kvmemory_process") or {}
        if alone.get("rss_bytes"):
            lines += ["", f"kvmemory alone in a fresh process (`load_model` defaults, the first request, a "
                      f"{meta['answer_tokens']}-token answer): resident {alone['rss_bytes'] / 2**30:.2f} GiB after the answer "
                      f"({alone['released_dense_bytes'] / 2**30:.2f} GiB of dense weights released), peak "
                      f"{alone['peak_rss_bytes'] / 2**30:.2f} GiB (the load's transient fp32 weights)."]
    if meta["skipped"]:
        lines += [""] + [f"- {note}" for note in meta["skipped"]]
    for context in sorted({r.context for r in rows}):
        lines += _context_tables(meta, [r for r in rows if r.context == context], context)
    return "\n".join(lines) + "\n"


def _env_prefix(meta: dict) -> str:
    """The OpenMP settings the run had (``OMP_WAIT_POLICY=PASSIVE`` makes OpenMP threads sleep
    between operations: it halves llama.cpp's decode speed here, so a comparison must name it)."""
    names = (("OMP_NUM_THREADS", "omp_num_threads"), ("OMP_WAIT_POLICY", "omp_wait_policy"))
    return "".join(f"{env}={meta[key]} " for env, key in names if meta.get(key))


def _context_tables(meta: dict, rows: list[Row], context: int) -> list[str]:
    chat = {int(k): v for k, v in meta["chats"].items()}[context]  # int keys, or str keys read back from JSON
    cell = {(r.system, r.step): r for r in rows}
    systems = list(dict.fromkeys(r.system for r in rows))
    head = "| system | " + " | ".join(STEPS) + " |"
    rule = "|---|" + "---|" * len(STEPS)
    lines = ["", f"## Context {context}: {chat['prompt_tokens']['first']} prompt tokens, {chat['tool_results']} tool "
             f"results; `delete` removes {chat['deleted_tokens']} tokens", "",
             "Median ms (prompt tokens the system computed):", "", head + " decode tok/s |", rule + "---|"]
    for s in systems:
        cells = [f"{cell[(s, st)].median_ms:,.0f} ({cell[(s, st)].prefilled_tokens})" for st in STEPS]
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {cell[(s, 'decode')].decode_tok_s or 0:.1f} |")
    lines += ["", "Time to first token, ms:", "", head, rule]
    lines += [f"| {s} | " + " | ".join(f"{cell[(s, st)].ttft_ms:,.0f}" for st in STEPS) + " |" for s in systems]
    references = [REFERENCE] + [s for s in systems if s.startswith("llama.cpp")]
    for ref in (r for r in references if r in systems):
        lines += _ratio_table(cell, systems, ref)
    lines += ["", "Answers after `append` (trial 1):", ""]
    lines += [f"- {s}: {' '.join(cell[(s, 'append')].answer.split())!r}" for s in systems]
    fallbacks = [f"- {s} {st}: {cell[(s, st)].fallback}" for s in systems for st in STEPS if cell[(s, st)].fallback]
    return lines + (["", "Exact recomputation instead of the policy:", ""] + fallbacks if fallbacks else [])


def _ratio_table(cell: dict, systems: list[str], ref: str) -> list[str]:
    """Time ratios to ``ref`` (< 1: faster); the decode column compares time per decoded token."""
    lines = ["", f"Time ratio to {ref} (this system's ms ÷ {ref}'s; < 1 is faster; decode tok: time per token):", "",
             "| system | " + " | ".join(STEPS) + " | decode tok |", "|---|" + "---|" * (len(STEPS) + 1)]
    for s in systems:
        ms = {st: cell[(s, st)].median_ms for st in STEPS}
        ref_ms = {st: cell[(ref, st)].median_ms for st in STEPS}
        per_token = {"s": 1 / (cell[(s, "decode")].decode_tok_s or float("inf")),
                     "ref": 1 / (cell[(ref, "decode")].decode_tok_s or float("inf"))}
        cells = [time_ratio({"s": ms[st], "ref": ref_ms[st]}, "s", "ref") for st in STEPS]
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {time_ratio(per_token, 's', 'ref')} |")
    return lines


def plot(rows: list[Row], path: Path, meta: dict) -> None:
    """Median ms per step, one bar per system, one panel per context (log y)."""
    plt = agg_pyplot()
    contexts = sorted({r.context for r in rows})
    systems = list(dict.fromkeys(r.system for r in rows))
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    width = 0.8 / len(systems)
    for ax, n in zip(axes[0], contexts):
        ms = {(r.system, r.step): r.median_ms for r in rows if r.context == n}
        for j, s in enumerate(systems):
            ax.bar([i + j * width for i in range(len(STEPS))], [ms[(s, st)] for st in STEPS], width, label=s)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(STEPS))], labels=list(STEPS))
        ax.set(yscale="log", ylabel="median ms per step", title=f"context {n} tokens")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"agent hops, {meta['model']}, {meta['threads']} thread(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
