"""How much weight the embedded model gives to opening a tool call, per situation: the call gap
``log p(top first token) - log p(<tool_call>\\n)`` in nats (langchain_kvmemory.tool_policy), on a
first user turn and on user turns after one tool round. The ``"scored"`` auto policy calls when
the gap is at most its margin (2 nats by default).

Run:  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tool_call_gap.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.utils.function_calling import convert_to_openai_tool

from kvmemory.models import load_model
from kvmemory.session import KVSession
from langchain_kvmemory.messages import to_session_messages
from langchain_kvmemory.tool_policy import call_gap


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return city


def search(query: str) -> str:
    """Search the web."""
    return query


CALL = AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "c1"}])
PRIOR = [HumanMessage("What is the weather in Paris?"), CALL, ToolMessage("Sunny, 24 C in Paris.", tool_call_id="c1"),
         AIMessage("It is sunny and 24 C in Paris.")]
# (situation, user turn, does it need a tool?)
FIRST_TURNS = [("weather", "What is the weather in Paris?", True), ("news", "Find recent news about the Mira River.", True),
               ("rain", "Is it raining in London right now?", True), ("greeting", "Hi, how are you?", False),
               ("arithmetic", "What is 2 + 2?", False)]
FOLLOW_UPS = [("thanks summarise", "Thanks, summarise that in one sentence.", False), ("thanks", "Thanks!", False),
              ("one sentence", "Great, can you put that in one sentence?", False), ("goodbye", "OK, goodbye.", False),
              ("what did you find", "What did you find?", False), ("is it warm", "So is it warm there?", False),
              ("rome", "What about Rome?", True), ("berlin", "And the weather in Berlin?", True),
              ("news", "Search for news about Paris.", True), ("tokyo", "Now check Tokyo, please.", True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    lm = load_model()
    tools = [convert_to_openai_tool(t) for t in (get_weather, search)]
    rows = []
    for turn, cases, prior in (("first", FIRST_TURNS, []), ("after a tool round", FOLLOW_UPS, PRIOR)):
        for name, text, needs_tool in cases:
            session = KVSession(lm.model, lm.tokenizer, tools=tools)
            session.prepare(to_session_messages(prior + [HumanMessage(text)], False))
            rows.append({"turn": turn, "case": name, "needs_tool": needs_tool, "gap_nats": round(call_gap(session), 2)})
            print(f"{turn:20s} {name:20s} needs_tool={needs_tool!s:5s} gap={rows[-1]['gap_nats']:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": lm.name, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
