"""Several live caches per thread: a LangGraph graph with a router and an answerer node (different
system prompts) on one thread_id keeps one cache per prompt head, each call reusing its own rows
exactly; with one cache per thread the nodes edit message 0 of each other's cache."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

from langchain_kvmemory import ChatKVMemory
from langchain_kvmemory.slots import pick_slot

ROUTER = SystemMessage("You are a router. Reply with one word: weather or chat.", id="router-system")
ANSWERER = SystemMessage("You are a friendly assistant. Answer in one short sentence.", id="answerer-system")


class State(MessagesState):
    calls: list[dict[str, Any]]


def _graph(llm: ChatKVMemory):
    def router(state: State):
        reply = llm.invoke([ROUTER] + state["messages"])
        return {"calls": state.get("calls", []) + [{"node": "router", **_usage(reply)}]}

    def answerer(state: State):
        reply = llm.invoke([ANSWERER] + state["messages"])
        return {"messages": [reply], "calls": state["calls"] + [{"node": "answerer", **_usage(reply)}]}

    graph = StateGraph(State)
    graph.add_node("router", router)
    graph.add_node("answerer", answerer)
    graph.add_edge(START, "router")
    graph.add_edge("router", "answerer")
    return graph.compile(checkpointer=InMemorySaver())


def _usage(reply) -> dict[str, Any]:
    meta = reply.response_metadata
    return {"slot": meta["cache_slot"], "input": reply.usage_metadata["input_tokens"],
            "output": reply.usage_metadata["output_tokens"],
            "read": reply.usage_metadata["input_token_details"]["cache_read"], "stale": meta["repair"]["stale_tokens"]}


def _two_turns(llm: ChatKVMemory, thread: str) -> list[dict[str, Any]]:
    graph, cfg = _graph(llm), {"configurable": {"thread_id": thread}}
    graph.invoke({"messages": [HumanMessage("Hi! Is it sunny in Paris?", id="u1")], "calls": []}, cfg)
    return graph.invoke({"messages": [HumanMessage("And tomorrow?", id="u2")]}, cfg)["calls"]


def test_pick_slot_prefers_the_longest_exact_reuse(tokenizer):
    class Registry:  # the two ThreadCaches methods pick_slot reads
        def __init__(self, caches):
            self.caches = caches

        @property
        def thread_ids(self):
            return list(self.caches)

        def get(self, tid):
            return self.caches.get(tid)

    class Cache:
        def __init__(self, ids):
            self.token_ids = ids

    registry = Registry({"t": Cache([1, 2, 3, 4]), "t/slot-1": Cache([1, 9, 9]), "other": Cache([1, 2, 3, 4, 5])})
    assert pick_slot(registry, "t", [1, 2, 3, 4, 7], head_tokens=3, max_slots=4) == ("t", 4)
    assert pick_slot(registry, "t", [1, 9, 9, 9], head_tokens=3, max_slots=4) == ("t/slot-1", 3)
    assert pick_slot(registry, "t", [1, 5, 5, 5], head_tokens=3, max_slots=4) == ("t/slot-2", 0)  # a new head
    assert pick_slot(registry, "t", [1, 5, 5, 5], head_tokens=3, max_slots=2) == ("t", 1)  # full: the LRU slot
    assert pick_slot(registry, "t", [1, 5, 5, 5], head_tokens=3, max_slots=1) == ("t", 0)
    assert pick_slot(registry, "new", [1, 2], head_tokens=1, max_slots=4) == ("new", 0)


@pytest.mark.real_model
def test_router_and_answerer_keep_their_own_caches_on_one_thread(real):
    llm = ChatKVMemory(model=real, max_tokens=8)
    calls = _two_turns(llm, "routed")
    router1, answer1, router2, answer2 = calls
    assert router1["slot"] == router2["slot"] == "routed" and answer1["slot"] == answer2["slot"] == "routed/slot-1"
    for before, after in ((router1, router2), (answer1, answer2)):
        assert after["stale"] == 0  # no row computed under the other node's prompt
        assert after["read"] >= before["input"]  # the node's previous prompt is served from its own cache
    assert answer2["read"] >= answer1["input"] + answer1["output"] - 1  # and the answer it wrote
    registry = llm.threads
    assert {"routed", "routed/slot-1"} <= set(registry.thread_ids)
    assert registry.memory_bytes == sum(registry.get(t).memory_bytes for t in registry.thread_ids)

    one = ChatKVMemory(model=real, max_tokens=8, cache_slots=1)
    single = _two_turns(one, "routed-single")
    assert {c["slot"] for c in single} == {"routed-single"}
    # one cache per thread: each node's call replaces the other's system prompt (message 0)
    assert single[2]["stale"] > 0 and single[3]["stale"] > 0
    assert router2["input"] - router2["read"] < single[2]["input"] - single[2]["read"]
