"""A ReAct tool agent on the embedded model answering a HotpotQA question with a passage-lookup
tool, while ClearToolUsesEdit clears old tool outputs (same ids, new content) — each clear is
repaired in the live cache with a budgeted Semantic-Unit Refresh instead of a Re-prefill.

Run:  .venv/bin/python examples/agents/hotpot_react.py [--data ../shared/data] [--index 0]
      [--hops 3] [--budget 5] [--max-tokens 48] [--answer-tokens 24] [--json out.json]
      [--model path.gguf] [--model-decides] [--questions 10] [--no-baseline]

Per hop it prints the context length, the tokens reused from the live cache, the tokens
recomputed (new text vs repair) and the latency against a Re-prefill of the same prompt.
By default the first ``--hops`` calls are forced to look up (the embedded 135M model does not
call tools on its own); with ``--model-decides`` the model chooses when to look up and when to
answer (at most ``--hops`` lookups), as an instruct model such as Qwen2.5 does. ``--questions N``
runs items ``index .. index + N - 1`` and counts the answers that contain the gold answer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import bm25s
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ClearToolUsesEdit, ContextEditingMiddleware
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hops import print_hops, record_hop, summary, time_reprefill  # noqa: E402

from kvmemory import load_model  # noqa: E402
from langchain_kvmemory import ChatKVMemory  # noqa: E402
from langchain_kvmemory.pruning import RepairBudgetMiddleware  # noqa: E402

HOTPOT_FILE = Path("hotpotqa") / "wikontic_hotpotqa_dev_distractor_200.json"
DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared/data beside the checkout
SYSTEM = (
    "You are a research agent. Use the lookup tool to read Wikipedia passages, one per call, "
    "then answer the question in a few words."
)


def load_question(data_dir: Path, index: int) -> dict:
    """HotpotQA item ``index`` of the distractor file: question, answer, 10 titled paragraphs.

    Raises:
        FileNotFoundError: no HotpotQA file under ``data_dir`` (pass --data or KVMEMORY_DATA).
        IndexError: ``index`` outside the file.
    """
    path = Path(data_dir) / HOTPOT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass --data (or set KVMEMORY_DATA) to the shared data folder")
    items = json.loads(path.read_text())
    if not 0 <= index < len(items):
        raise IndexError(f"--index must lie in [0, {len(items) - 1}] (got {index})")
    return items[index]


def passage_lookup(paragraphs: list[tuple[str, str]]):
    """A ``lookup`` tool: BM25 (bm25s) over the question's paragraphs; returns the best passage
    not yet returned in this run, as ``"Title: text"``."""
    texts = [f"{title}: {text}" for title, text in paragraphs]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    shown: set[int] = set()

    @tool
    def lookup(query: str) -> str:
        """Look up the Wikipedia passage that best matches the query (a title or keywords)."""
        order = list(range(len(texts)))
        tokens = bm25s.tokenize([query or ""], stopwords="en", show_progress=False)
        if len(tokens.vocab):
            docs, _ = retriever.retrieve(tokens, k=len(texts), show_progress=False)
            order = [int(d) for d in docs[0]]
        best = next((i for i in order if i not in shown), order[0])
        shown.add(best)
        return texts[best]

    return lookup


class HopPlan(AgentMiddleware):
    """Forces a lookup on each of the first ``hops`` model calls (``force``; otherwise the model
    decides), then asks for the answer (``tool_choice="none"``, at most ``answer_tokens``; the
    tools stay in the prompt so the cached prefix is unchanged)."""

    def __init__(self, hops: int, answer_tokens: int, force: bool = True):
        super().__init__()
        self.hops, self.answer_tokens, self.force = hops, answer_tokens, force

    def wrap_model_call(self, request, handler):
        calls = sum(1 for m in request.messages if isinstance(m, AIMessage) and m.tool_calls)
        if calls < self.hops:
            return handler(request.override(tool_choice="any") if self.force else request)
        settings = {**request.model_settings, "max_tokens": self.answer_tokens}
        return handler(request.override(tool_choice="none", model_settings=settings))


class HopRecorder(AgentMiddleware):
    """After every model call, records what it did to the thread's live cache."""

    def __init__(self, chat: ChatKVMemory, thread_id: str, lm, baseline: bool = True):
        super().__init__()
        self.chat, self.thread_id, self.lm, self.hops, self._keys = chat, thread_id, lm, [], set()
        self.baseline = baseline

    def wrap_model_call(self, request, handler):
        response = handler(request)
        session = self.chat.threads.session(self.thread_id)
        hop = record_hop(session, self._keys, len(self.hops) + 1)
        if self.baseline:
            time_reprefill(self.lm.model, self.lm.tokenizer, [hop])  # right away: both under the same machine load
        self.hops.append(hop)
        self._keys = {m.key for m in session.messages}
        return response


def build_agent(chat: ChatKVMemory, paragraphs, *, hops: int, answer_tokens: int, budget: float, clear_trigger: int,
                recorder, force: bool = True):
    edits = ClearToolUsesEdit(trigger=clear_trigger, keep=1)  # keep only the newest tool output
    return create_agent(
        model=chat,
        tools=[passage_lookup(paragraphs)],
        system_prompt=SYSTEM,
        middleware=[recorder, HopPlan(hops, answer_tokens, force), ContextEditingMiddleware(edits=[edits]),
                    RepairBudgetMiddleware(budget)],
    )


def has_gold(answer: str, gold: str) -> bool:
    """Whether ``answer`` contains the gold answer (case and surrounding punctuation ignored)."""
    return gold.strip(" .").lower() in answer.lower()


def run(args: argparse.Namespace, lm=None, console: Console | None = None) -> dict:
    """Run the agent on ``args.questions`` items (one by default); returns the JSON-able summary
    (also written to ``--json``): one question's hops, or with several the gold count and each
    question's summary."""
    console = console or Console(width=132)
    lm = lm or load_model(args.model)
    count = getattr(args, "questions", 1)
    results = [run_question(args, args.index + i, lm, console) for i in range(count)]
    out = results[0] if count == 1 else {
        "model": lm.name, "questions": count, "answered_gold": sum(r["gold_in_answer"] for r in results),
        "model_decides": args.model_decides, "items": results}
    if count > 1:
        console.print(f"[bold]{out['answered_gold']} of {count}[/bold] answers contain the gold answer ({lm.name})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return out


def run_question(args: argparse.Namespace, index: int, lm, console: Console) -> dict:
    """One HotpotQA item through a fresh agent thread; its summary."""
    item = load_question(args.data, index)
    paragraphs = [(title, "".join(sentences).strip()) for title, sentences in item["context"]]
    chat = ChatKVMemory(model=lm, max_tokens=args.max_tokens, temperature=0.0)
    thread_id = f"hotpot-{item['_id']}"
    recorder = HopRecorder(chat, thread_id, lm, baseline=not getattr(args, "no_baseline", False))
    agent = build_agent(chat, paragraphs, hops=args.hops, answer_tokens=args.answer_tokens, budget=args.budget,
                        clear_trigger=args.clear_trigger, recorder=recorder,
                        force=not getattr(args, "model_decides", False))
    console.print(f"[bold]Question:[/bold] {item['question']}  (gold: {item['answer']})")
    result = agent.invoke({"messages": [{"role": "user", "content": item["question"]}]},
                          {"configurable": {"thread_id": thread_id}, "recursion_limit": 4 * args.hops + 4})
    for m in result["messages"]:
        if isinstance(m, AIMessage) and m.tool_calls:
            console.print(f"  lookup({m.tool_calls[0]['args']})")
    answer = result["messages"][-1].content
    console.print(f"[bold]Answer:[/bold] {answer}")
    print_hops(recorder.hops, f"HotpotQA ReAct agent, ClearToolUsesEdit, budget {args.budget:g} %", console)
    lookups = sum(1 for m in result["messages"] if isinstance(m, AIMessage) and m.tool_calls)
    out = summary(recorder.hops) | {"question": item["question"], "gold": item["answer"], "answer": answer,
                                    "gold_in_answer": has_gold(answer, item["answer"]), "lookups": lookups,
                                    "budget": args.budget, "model": lm.name}
    if out["max_repair_share_after_edit"] is not None and recorder.baseline:
        console.print(f"worst repair share after a clear: {100 * out['max_repair_share_after_edit']:.1f} % of the "
                      f"context; total latency {out['total_latency_ms']:.0f} ms vs re-prefill "
                      f"{out['total_reprefill_ms']:.0f} ms")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path(os.environ.get("KVMEMORY_DATA", DEFAULT_DATA)),
                   help="shared data folder holding hotpotqa/ (default: $KVMEMORY_DATA or ../shared/data)")
    p.add_argument("--index", type=int, default=0, help="HotpotQA item (0-199)")
    p.add_argument("--hops", type=int, default=3, help="lookups before the answer")
    p.add_argument("--budget", type=float, default=5.0, help="repair budget b in %% of the stale suffix")
    p.add_argument("--max-tokens", type=int, default=48, help="tool-call length cap (tokens)")
    p.add_argument("--answer-tokens", type=int, default=24, help="final answer length cap (tokens)")
    p.add_argument("--clear-trigger", type=int, default=200,
                   help="ClearToolUsesEdit trigger (approximate tokens of the history)")
    p.add_argument("--model", default=None, help="a .gguf file or model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model-decides", action="store_true",
                   help="let the model choose when to look up and when to answer (default: forced lookups)")
    p.add_argument("--questions", type=int, default=1, help="items index .. index + N - 1; counts gold answers")
    p.add_argument("--no-baseline", action="store_true", help="skip timing a Re-prefill of every hop")
    p.add_argument("--json", default=None, help="write the per-hop numbers to this JSON file")
    return p


if __name__ == "__main__":
    run(parser().parse_args())
