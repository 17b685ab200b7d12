"""A long chat on the embedded model whose older turns are summarised by a LangGraph pruning
node; the summary takes the place (and id) of the first summarised message, so the live cache
is repaired (Shift + budgeted Semantic-Unit Refresh of the kept turns) instead of re-prefilled.
The thread is checkpointed in SQLite with its live cache stored beside it (KVCheckpointSaver).

Run:  .venv/bin/python examples/agents/long_chat.py [--turns 10] [--budget 5] [--max-tokens 32]
      [--db chat.sqlite] [--json out.json]

Per turn it prints the context length, the tokens reused from the live cache, the tokens
recomputed (new text vs repair) and the latency against a Re-prefill of the same prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hops import print_hops, record_hop, summary, time_reprefill  # noqa: E402

from kvmemory import load_model  # noqa: E402
from langchain_kvmemory import ChatKVMemory  # noqa: E402
from langchain_kvmemory.checkpointer import KVCheckpointSaver  # noqa: E402
from langchain_kvmemory.pruning import pruning_node, side_thread_summarizer  # noqa: E402

SYSTEM = "You are a friendly travel planner. Answer in one or two sentences."
USER_TURNS = [
    "Hi! I am planning a week in Scotland in May with my sister Anna.",
    "We land in Edinburgh on Saturday morning. What should we do on the first day?",
    "Anna loves castles and old trains. Any museum for her?",
    "We have a budget of 90 pounds a day each. Is that enough for Edinburgh?",
    "On Monday we want a day trip. Stirling or North Berwick?",
    "Then we take the train to Inverness on Wednesday. How long is the ride?",
    "In Inverness I would like to see Loch Ness. How do we get there?",
    "Anna is vegetarian. Is it easy to eat in the Highlands?",
    "We fly home from Inverness on Saturday evening. What can we do that morning?",
    "Can you remind me what we planned for Monday?",
    "And what was our daily budget again?",
    "Thanks! Write one sentence we can send to our parents about the trip.",
]


def build_graph(chat: ChatKVMemory, saver, *, budget: float, max_history: int, keep: int):
    """START -> prune (summarise the head above ``max_history`` approximate tokens) -> chat."""
    prune = pruning_node(max_tokens=max_history, keep_tokens=keep, strategy="summarize",
                         summarizer=side_thread_summarizer(chat, max_tokens=48))
    model = chat.bind(repair_policy=f"sur@{budget:g}")

    def answer(state: MessagesState) -> dict:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("prune", prune)
    builder.add_node("chat", answer)
    builder.add_edge(START, "prune")
    builder.add_edge("prune", "chat")
    builder.add_edge("chat", END)
    return builder.compile(checkpointer=saver)


def run(args: argparse.Namespace, lm=None, console: Console | None = None) -> dict:
    """Chat ``--turns`` turns; returns the JSON-able summary (also written to ``--json``)."""
    console = console or Console(width=132)
    if not 1 <= args.turns <= len(USER_TURNS):
        raise ValueError(f"--turns must lie in [1, {len(USER_TURNS)}] (got {args.turns})")
    lm = lm or load_model(args.model)
    chat = ChatKVMemory(model=lm, max_tokens=args.max_tokens, temperature=0.0)
    config = {"configurable": {"thread_id": "long-chat"}}
    hops, keys = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(args.db) if args.db else Path(tmp) / "chat.sqlite"
        with KVCheckpointSaver.from_sqlite(db, chat) as saver:
            graph = build_graph(chat, saver, budget=args.budget, max_history=args.max_history, keep=args.keep)
            graph.update_state(config, {"messages": [SystemMessage(SYSTEM, id="system")]})
            for turn, text in enumerate(USER_TURNS[: args.turns], start=1):
                state = graph.invoke({"messages": [HumanMessage(text, id=f"user-{turn}")]}, config)
                session = chat.threads.session("long-chat")
                hops.append(record_hop(session, keys, turn))
                time_reprefill(lm.model, lm.tokenizer, hops[-1:])  # right away: both under the same machine load
                keys = {m.key for m in session.messages}
                summarised = any(m.content.startswith("Summary of") for m in state["messages"])
                console.print(f"[bold]user {turn}:[/bold] {text}\n  [bold]model:[/bold] {state['messages'][-1].content}"
                              + ("  [dim](history summarised)[/dim]" if summarised and hops[-1].edited else ""))
    print_hops(hops, f"Long chat with summarisation, budget {args.budget:g} %", console)
    out = summary(hops) | {"budget": args.budget, "model": lm.name, "turns": args.turns}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=len(USER_TURNS), help=f"user turns (1-{len(USER_TURNS)})")
    p.add_argument("--budget", type=float, default=5.0, help="repair budget b in %% of the stale suffix")
    p.add_argument("--max-tokens", type=int, default=32, help="answer length cap (tokens)")
    p.add_argument("--max-history", type=int, default=300,
                   help="summarise once the history exceeds this many approximate tokens")
    p.add_argument("--keep", type=int, default=120, help="approximate tokens of recent turns kept verbatim")
    p.add_argument("--db", default=None, help="SQLite checkpoint file (default: a temporary one)")
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--json", default=None, help="write the per-turn numbers to this JSON file")
    return p


if __name__ == "__main__":
    run(parser().parse_args())
