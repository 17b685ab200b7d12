"""``kvmemory bench agent-loop``: a LangChain ``create_agent`` tool loop as users run it, on a
quiet machine and beside one busy process.

Three questions in one thread, each answered by the agent (a tool call, the tool result, the
answer: six model calls, "hops"), with two tools bound and ``ContextEditingMiddleware(
ClearToolUsesEdit(keep=1))`` clearing old tool results in the middle of the history. Variants:
``model`` (default settings: the model decides its calls) and ``after_user``
(``auto_tool_calls="after_user"``: a call after each user turn).

Systems, each a LangChain chat model driving the same agent:

- ``kvmemory sur@5``: ``ChatKVMemory`` with default settings (threads per call from the free
  cores, :mod:`kvmemory.engine.cores`);
- ``kvmemory sur@5 fixed threads``: the same with ``KVMEMORY_SHARE_CORES=0`` behaviour (torch's
  thread count on every call, as before the core sharing);
- ``kvmemory reprefill:always``: the same engine, every call re-prefilled;
- ``transformers Re-prefill``: ``ChatKVMemory(engine="transformers",
  repair_policy="reprefill:always")`` with fixed threads: what ``ChatHuggingFace`` does (render,
  prefill the whole prompt on transformers' forward, generate), with the same tool policy;
- ``llama.cpp``: :class:`~kvmemory_lab.bench.llama_chat.LlamaCppChat` on the same GGUF (its own
  prefix reuse, the same template, tools and grammar), when llama-cpp-python is installed.

"Busy" runs one process spinning on a core (``python -c "while True: pass"``) for the whole
condition. Times are wall milliseconds per model call (LangChain callbacks) and per loop;
medians over interleaved trials. Writes ``agent_loop.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from langchain.agents import create_agent
from langchain.agents.middleware import ClearToolUsesEdit, ContextEditingMiddleware
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from kvmemory.engine import CORES
from langchain_kvmemory import ChatKVMemory

from ..gguf_models import resolve_model
from .agent_systems import gguf_label, llama_cpp_missing, peer_gguf
from .common import agg_pyplot, load_average, machine_name, simd_flags

SYSTEM = "You are a travel assistant. Use the tools to look facts up, then answer in one sentence."
QUESTIONS = ("What is the weather in Paris?", "When does the Louvre open?", "What is the weather in Rome?")
WEATHER = {"Paris": "Sunny, 24 C.", "Rome": "Rain, 15 C.", "London": "Cloudy, 17 C."}
HOURS = {"Louvre": "9:00-18:00, closed on Tuesdays.", "Colosseum": "8:30-19:00 every day."}
CONDITIONS = ("quiet", "busy")


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return WEATHER.get(city.strip().title(), "No report for that city.")


@tool
def get_opening_hours(place: str) -> str:
    """Get the opening hours of a museum or monument."""
    return next((h for name, h in HOURS.items() if name.lower() in place.lower()), "No hours known for that place.")


TOOLS = [get_weather, get_opening_hours]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trials", type=int, default=2, help="interleaved trials, medians reported (default 2)")
    parser.add_argument("--variants", default="model,after_user",
                        help="auto_tool_calls settings, comma list of model, after_user (default both)")
    parser.add_argument("--conditions", default="quiet,busy", help="quiet, busy or both (default both)")
    parser.add_argument("--systems", default=None, help="comma list of system names (default all that can run)")
    parser.add_argument("--max-tokens", type=int, default=48, help="answer limit per model call (default 48)")
    parser.add_argument("--clear-trigger", type=int, default=300,
                        help="ClearToolUsesEdit trigger in (approximate) tokens (default 300: clears from the 2nd question)")
    parser.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads (default 2)")
    parser.add_argument("--model", default=None, help="qwen2.5-coder-0.5b / -1.5b or a .gguf (default: the embedded model)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/agent_loop"), help="output folder")


@dataclass
class Loop:
    """One run of the three questions by one system."""

    variant: str
    condition: str
    system: str
    trial: int
    hop_ms: list[float] = field(default_factory=list)
    total_ms: float = 0.0
    tool_calls: int = 0
    reused_tokens: list[int] = field(default_factory=list)
    operators: list[str] = field(default_factory=list)  # kvmemory: each call's repair operator
    answers: list[str] = field(default_factory=list)


class HopClock(BaseCallbackHandler):
    """Wall time of every chat-model call of a run (start to end callback)."""

    def __init__(self):
        self.started: dict[Any, float] = {}
        self.hops: list[float] = []

    def on_chat_model_start(self, serialized, messages, *, run_id, **kwargs):
        self.started[run_id] = time.perf_counter()

    def on_llm_end(self, response, *, run_id, **kwargs):
        if run_id in self.started:
            self.hops.append((time.perf_counter() - self.started.pop(run_id)) * 1e3)


@dataclass
class System:
    name: str
    build: Callable[[str], Any]  # variant -> chat model
    share_cores: bool


def systems(args) -> tuple[list[System], list[str]]:
    """The systems that can run here, and notes on those that cannot."""
    model = resolve_model(args.model)
    name = str(model) if model is not None else "smollm2"

    def kv(policy: str, engine: str = "auto") -> Callable[[str], Any]:
        return lambda variant: ChatKVMemory(model=name, engine=engine, repair_policy=policy, max_tokens=args.max_tokens,
                                            auto_tool_calls=variant, parallel_tool_calls=False)

    out = [System("kvmemory sur@5", kv("sur@5"), True),
           System("kvmemory sur@5 fixed threads", kv("sur@5"), False),
           System("kvmemory reprefill:always", kv("reprefill:always"), True),
           System("transformers Re-prefill", kv("reprefill:always", "transformers"), False)]
    notes = []
    skip = llama_cpp_missing()
    gguf = peer_gguf(model)
    if skip is None and gguf is None:
        skip = "llama.cpp skipped: --model is a transformers folder, not a GGUF"
    if skip is None:
        from .llama_chat import LlamaCppChat

        chats: dict[str, Any] = {}

        def llama(variant: str):  # one Llama per variant (its prefix cache is its only state)
            if variant not in chats:
                chats[variant] = LlamaCppChat(gguf=gguf, model=None if model is None else name, threads=args.threads,
                                              max_tokens=args.max_tokens, auto_tool_calls=variant)
            return chats[variant]

        out.append(System(f"llama.cpp {gguf_label(Path(gguf))}", llama, False))
    else:
        notes.append(skip)
    if args.systems:
        wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
        out = [s for s in out if s.name in wanted or s.name.split(" ")[0] in wanted]
    return out, notes


def run_loop(llm, variant: str, condition: str, system: System, trial: int, clear_trigger: int) -> Loop:
    """The three questions in a fresh thread; every hop timed."""
    agent = create_agent(llm, tools=TOOLS, system_prompt=SYSTEM, checkpointer=InMemorySaver(),
                         middleware=[ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=clear_trigger, keep=1)])])
    clock, loop = HopClock(), Loop(variant, condition, system.name, trial)
    config = {"configurable": {"thread_id": f"{system.name}/{variant}/{condition}/{trial}"}, "callbacks": [clock],
              "recursion_limit": 12}
    CORES.enabled = system.share_cores
    t0 = time.perf_counter()
    state: dict = {}
    for question in QUESTIONS:
        state = agent.invoke({"messages": [HumanMessage(question)]}, config)
    loop.total_ms = (time.perf_counter() - t0) * 1e3
    loop.hop_ms = clock.hops
    for message in state["messages"]:
        if isinstance(message, AIMessage):
            loop.tool_calls += len(message.tool_calls)
            repair = (message.response_metadata or {}).get("repair") or {}
            if "reused_tokens" in repair:
                loop.reused_tokens.append(int(repair["reused_tokens"]))
                loop.operators.append(str(repair.get("operator")))
            if message.content:
                loop.answers.append(str(message.content)[:120])
    return loop


@contextmanager
def condition_of(name: str):
    """``busy``: one process spinning on a core for the block; ``quiet``: nothing."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if name == "busy" else None
    try:
        if spinner is not None:
            time.sleep(1.0)  # let the scheduler and the core sampler see it
        yield
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def run(args, console) -> int:
    torch.set_num_threads(args.threads)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    bad = [v for v in variants if v not in ("model", "after_user")] + [c for c in conditions if c not in CONDITIONS]
    if bad or args.trials < 1:
        console.print(f"[red]unknown variants / conditions {bad} or --trials < 1: use model,after_user and quiet,busy[/red]")
        return 2
    chosen, notes = systems(args)
    meta = {"command": " ".join(["kvmemory bench agent-loop", *sys.argv[3:]]),
            "machine": machine_name(), "cpu_flags": simd_flags(), "threads": args.threads, "loadavg_start": load_average(),
            "model": args.model or "SmolLM2-135M-Instruct (embedded)", "max_tokens": args.max_tokens,
            "clear_trigger": args.clear_trigger, "trials": args.trials, "notes": notes,
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    models = {(s.name, v): s.build(v) for s in chosen for v in variants}
    sharing = CORES.enabled
    try:
        loops = _trials(args, chosen, variants, conditions, models)
    finally:
        CORES.enabled = sharing
    meta["loadavg_end"] = load_average()
    write_outputs(args.out, meta, loops, console)
    return 0


def _trials(args, chosen: list[System], variants: list[str], conditions: list[str], models: dict) -> list[Loop]:
    """A warm-up loop per system, then the trials interleaved: per trial, per condition, every
    variant and system once."""
    for (name, variant), llm in models.items():  # untimed: loads, grammar compilation, first allocations
        run_loop(llm, variant, "warm-up", next(s for s in chosen if s.name == name), -1, args.clear_trigger)
    loops: list[Loop] = []
    for trial in range(args.trials):
        for condition in conditions:
            with condition_of(condition):
                for variant in variants:
                    for system in chosen:
                        loop = run_loop(models[(system.name, variant)], variant, condition, system, trial, args.clear_trigger)
                        loops.append(loop)
                        print(f"trial {trial} {condition:5} {variant:10} {system.name:32} {loop.total_ms:9.0f} ms  "
                              f"{len(loop.hop_ms)} hops  {loop.tool_calls} calls", flush=True)
    return loops


def summary(loops: list[Loop]) -> dict:
    """Median loop ms and per-hop ms per (variant, condition, system)."""
    cells: dict = {}
    for loop in loops:
        cells.setdefault((loop.variant, loop.condition, loop.system), []).append(loop)
    out = {}
    for (variant, condition, system), runs in cells.items():
        out[f"{variant}|{condition}|{system}"] = {
            "loop_ms": statistics.median(r.total_ms for r in runs),
            "hop_ms": statistics.median(h for r in runs for h in r.hop_ms) if any(r.hop_ms for r in runs) else None,
            "hops": statistics.median(len(r.hop_ms) for r in runs),
            "tool_calls": statistics.median(r.tool_calls for r in runs),
        }
    return out


def write_outputs(out: Path, meta: dict, loops: list[Loop], console) -> None:
    out.mkdir(parents=True, exist_ok=True)
    table = summary(loops)
    (out / "agent_loop.json").write_text(json.dumps({"meta": meta, "summary": table, "loops": [asdict(x) for x in loops]},
                                                    indent=1))
    (out / "agent_loop.md").write_text(markdown(meta, table))
    plot(table, out / "agent_loop.png", meta)
    console.print(markdown(meta, table))
    console.print(f"wrote {out}/agent_loop.json, agent_loop.md, agent_loop.png")


def _cell(table: dict, variant: str, condition: str, system: str) -> dict | None:
    return table.get(f"{variant}|{condition}|{system}")


def markdown(meta: dict, table: dict) -> str:
    keys = [k.split("|") for k in table]
    variants = list(dict.fromkeys(k[0] for k in keys))
    systems_ = list(dict.fromkeys(k[2] for k in keys))
    conditions = [c for c in CONDITIONS if any(k[1] == c for k in keys)]
    lines = [f"# Agent loop: three questions, six hops ({meta['model']}, {meta['threads']} threads)", "",
             f"Command: `{meta['command']}`", "",
             f"{meta['started']} on {meta['machine']}; CPU flags: {' '.join(meta['cpu_flags'])}. Load average "
             f"{meta['loadavg_start'][0]} at the start, {meta['loadavg_end'][0]} at the end. Answers of at most "
             f"{meta['max_tokens']} tokens; ClearToolUsesEdit(trigger={meta['clear_trigger']}, keep=1); medians of "
             f"{meta['trials']} interleaved trials. busy: one process spinning on a core beside the run.", ""]
    lines += [f"- {n}" for n in meta["notes"]] + ([""] if meta["notes"] else [])
    for variant in variants:
        lines += [f"## auto_tool_calls=\"{variant}\"", "",
                  "| system | " + " | ".join(f"{c} loop ms (hops, calls)" for c in conditions)
                  + " | busy ÷ quiet | " + " | ".join(f"{c} ms per hop" for c in conditions) + " |",
                  "|---" * (1 + 2 * len(conditions) + 1) + "|"]
        for system in systems_:
            cells = [_cell(table, variant, c, system) for c in conditions]
            if not any(cells):
                continue
            loop = [f"{x['loop_ms']:,.0f} ({x['hops']:g}, {x['tool_calls']:g})" if x else "-" for x in cells]
            hop = [f"{x['hop_ms']:,.0f}" if x and x["hop_ms"] else "-" for x in cells]
            q, b = _cell(table, variant, "quiet", system), _cell(table, variant, "busy", system)
            ratio = f"{b['loop_ms'] / q['loop_ms']:.2f}×" if q and b else "-"
            lines.append(f"| {system} | " + " | ".join(loop) + f" | {ratio} | " + " | ".join(hop) + " |")
        lines += [""] + _ratios(table, variant, systems_, conditions) + [""]
    return "\n".join(lines)


def _ratios(table: dict, variant: str, systems_: list[str], conditions: list[str]) -> list[str]:
    """Loop time of kvmemory sur@5 over each peer's, per condition (< 1: kvmemory faster)."""
    ours = "kvmemory sur@5"
    out = []
    for condition in conditions:
        mine = _cell(table, variant, condition, ours)
        if not mine:
            continue
        parts = [f"{peer}: {mine['loop_ms'] / cell['loop_ms']:.2f}×" for peer in systems_ if peer != ours
                 for cell in [_cell(table, variant, condition, peer)] if cell]
        out.append(f"{condition}: kvmemory sur@5 loop time ÷ " + ", ".join(parts))
    return out


def plot(table: dict, path: Path, meta: dict) -> None:
    plt = agg_pyplot()
    keys = [k.split("|") for k in table]
    variants = list(dict.fromkeys(k[0] for k in keys))
    systems_ = list(dict.fromkeys(k[2] for k in keys))
    fig, axes = plt.subplots(1, len(variants), figsize=(6 * len(variants), 4), squeeze=False)
    for ax, variant in zip(axes[0], variants):
        for i, condition in enumerate(CONDITIONS):
            values = [(_cell(table, variant, condition, s) or {}).get("loop_ms", 0) / 1e3 for s in systems_]
            ax.bar([j + 0.4 * i for j in range(len(systems_))], values, width=0.4, label=condition)
        ax.set_xticks([j + 0.2 for j in range(len(systems_))], [s.replace(" ", "\n", 1) for s in systems_], fontsize=7)
        ax.set_ylabel("three questions (six hops), s")
        ax.set_yscale("log")
        ax.set_title(f"auto_tool_calls={variant}", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(f"Agent loop, {meta['threads']} threads, {meta['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
