"""Pruning on the embedded model: every history edit made by the pruning node or by LangChain v1
middleware reaches ChatKVMemory as a budgeted SUR repair of the live cache, not a Re-prefill."""

from __future__ import annotations

import math

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import (
    AgentMiddleware,
    ClearToolUsesEdit,
    ContextEditingMiddleware,
    SummarizationMiddleware,
)
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph

from langchain_kvmemory import ChatKVMemory
from langchain_kvmemory.pruning import RepairBudgetMiddleware, pruning_node, side_thread_summarizer

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def chat(real):
    return ChatKVMemory(model=real, max_tokens=3)


def _report(message: AIMessage) -> dict:
    return message.response_metadata["repair"]


def _assert_budgeted_refresh(report: dict, budget: float) -> None:
    """Shift + SUR at ``budget``: B = ceil(S·b/100) stale rows recomputed, the rest reused."""
    assert report["operator"] == "refresh" and report["budget"] == budget and report["fallback"] is None
    assert report["stale_tokens"] > 0
    assert report["refreshed_tokens"] == math.ceil(report["stale_tokens"] * budget / 100)
    assert report["reused_tokens"] > report["refreshed_tokens"] and report["recomputed_tokens"] < report["prompt_tokens"]


# ------------------------------------------------------------ LangGraph node
TURNS = [
    ("How tall is the Eiffel Tower?", "About 330 metres."),
    ("When was it built?", "Between 1887 and 1889."),
    ("Who designed it?", "Gustave Eiffel's company."),
]


def _history() -> list:
    msgs = [SystemMessage("You answer in a few words.", id="sys")]
    for i, (q, a) in enumerate(TURNS):
        msgs += [HumanMessage(q, id=f"q{i}"), AIMessage(a, id=f"a{i}")]
    return msgs


def _graph(chat, prune, budget: float):
    model = chat.bind(repair_policy=f"sur@{budget:g}")  # per-call budget

    def answer(state: MessagesState) -> dict:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("prune", prune)
    builder.add_node("answer", answer)
    builder.add_edge(START, "prune")
    builder.add_edge("prune", "answer")
    from langgraph.checkpoint.memory import InMemorySaver

    return builder.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize("strategy", ["remove", "summarize"])
def test_pruning_node_edit_becomes_a_budgeted_refresh(chat, strategy):
    thread = f"node-{strategy}"
    config = {"configurable": {"thread_id": thread}}
    summarizer = side_thread_summarizer(chat, max_tokens=8) if strategy == "summarize" else None
    # the thresholds let the first turn through and prune the second
    prune = pruning_node(max_tokens=75, keep_tokens=32, strategy=strategy, summarizer=summarizer)
    graph = _graph(chat, prune, budget=10)
    first = graph.invoke({"messages": _history()[:5] + [HumanMessage(TURNS[2][0], id="q2")]}, config)
    assert _report(first["messages"][-1])["edits"] == {"append": 6}  # nothing pruned yet
    out = graph.invoke({"messages": [HumanMessage("And how much does a ticket cost?", id="q3")]}, config)
    report = _report(out["messages"][-1])
    _assert_budgeted_refresh(report, budget=10)
    ids = [m.id for m in out["messages"]]
    if strategy == "remove":
        assert ids[:2] == ["sys", "q2"] and report["edits"]["delete"] == 4
    else:  # the summary took q0's place and id: a replacement at the start
        assert ids[:3] == ["sys", "q0", "q2"] and out["messages"][1].content.startswith("Summary of")
        assert report["edits"]["replace"] == 1 and report["edits"]["delete"] == 3
        assert f"{thread}/summary" in chat.threads  # the summary ran on its own cache thread
    assert out["messages"][-1].usage_metadata["input_token_details"]["cache_read"] == report["reused_tokens"]


# ----------------------------------------------------- LangChain v1 create_agent
@tool
def lookup(query: str) -> str:
    """Look up a passage."""
    return "unused"


class AnswerOnly(AgentMiddleware):
    """Every model call answers in text (no tool loop: one model call per invoke)."""

    def wrap_model_call(self, request, handler):
        return handler(request.override(tool_choice="none"))


def _tool_history() -> list:
    calls = [{"name": "lookup", "args": {"query": q}, "id": f"call{i}", "type": "tool_call"}
             for i, q in enumerate(["Eiffel Tower height", "Eiffel Tower architect"])]
    return [
        HumanMessage("Tell me about the Eiffel Tower.", id="h0"),
        AIMessage("", tool_calls=[calls[0]], id="c0"),
        ToolMessage("The Eiffel Tower in Paris is 330 metres tall. It was the tallest structure in the world "
                    "until 1930 and is repainted every seven years.", tool_call_id="call0", id="t0"),
        AIMessage("", tool_calls=[calls[1]], id="c1"),
        ToolMessage("The tower was designed and built by the company of Gustave Eiffel for the 1889 World's Fair.",
                    tool_call_id="call1", id="t1"),
        HumanMessage("Who built it?", id="h1"),
    ]


def _agent(chat, *middleware):
    return create_agent(model=chat, tools=[lookup], system_prompt="Answer in a few words.",
                        middleware=[AnswerOnly(), *middleware])


def test_cleared_tool_output_is_a_mid_history_replacement_at_the_call_budget(chat):
    config = {"configurable": {"thread_id": "agent-clear"}}
    warm = _agent(chat).invoke({"messages": _tool_history()}, config)  # the cache holds every tool output
    assert _report(warm["messages"][-1])["edits"] == {"append": 7}  # system prompt + 6
    clearing = _agent(chat, ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=10, keep=1)]),
                      RepairBudgetMiddleware(2))
    out = clearing.invoke({"messages": _tool_history() + [HumanMessage("When?", id="h2")]}, config)
    report = _report(out["messages"][-1])
    assert report["edits"]["replace"] == 1  # t0 -> "[cleared]", same id
    assert report["edits"].get("delete") == 1  # only the warm call's answer, held in the cache, is not in this history
    _assert_budgeted_refresh(report, budget=2)
    assert out["messages"][2].content.startswith("The Eiffel Tower")  # the state keeps the full output


def test_summarization_middleware_head_summary_is_repaired_not_reprefilled(chat):
    config = {"configurable": {"thread_id": "agent-summary"}}
    history = _history()[1:]  # create_agent holds the system prompt itself
    _agent(chat).invoke({"messages": history}, config)
    summarizing = _agent(chat, SummarizationMiddleware(model=chat, trigger=("messages", 6), keep=("messages", 3),
                                                       summary_prompt="Summarise briefly:\n{messages}"))
    out = summarizing.invoke({"messages": history + [HumanMessage("Is it open at night?", id="q3")]}, config)
    assert out["messages"][0].content.startswith("Here is a summary")
    report = _report(out["messages"][-1])
    # 4 summarised messages + the first call's answer (held in the cache, not in this history)
    assert report["edits"]["delete"] == 5 and report["edits"].get("insert", 0) + report["edits"].get("replace", 0) == 1
    _assert_budgeted_refresh(report, budget=5)  # the model's default policy
    assert "agent-summary/summary" in chat.threads  # ChatKVMemory ran the summary on a side thread
