"""Malformed tool histories are refused before the thread is touched: a ToolMessage answering no
earlier tool call, and a tool call left without its ToolMessage."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from kvmemory.errors import MessageError
from langchain_kvmemory import ChatKVMemory
from support import tiny_loaded


def _call(call_id: str, name: str = "search") -> AIMessage:
    return AIMessage("", id=f"a-{call_id}", tool_calls=[{"name": name, "args": {"q": "Ostrava"}, "id": call_id}])


def _history() -> list:
    return [SystemMessage("Answer from the tool results.", id="sys"),
            HumanMessage("Who founded Ostrava Nova?", id="u1"),
            _call("c1"),
            ToolMessage("Founded in 1873 by Ilse Marrow.", tool_call_id="c1", id="t1"),
            HumanMessage("Answer in one word.", id="u2")]


@pytest.fixture(scope="module")
def chat():
    return ChatKVMemory(model=tiny_loaded("tiny-llama"), max_tokens=2)


BAD = {
    "unknown id": ([*_history()[:4], ToolMessage("extra", tool_call_id="call_9", id="t9"), HumanMessage("?")],
                   r"ToolMessage at index 4 answers tool_call_id 'call_9', which no earlier AIMessage called: "
                   r"pass the AIMessage"),
    "tool first": ([HumanMessage("hi"), ToolMessage("x", tool_call_id="c1")], r"ToolMessage at index 1"),
    "human follows": ([*_history()[:3], HumanMessage("go on")],
                      r"AIMessage at index 2 calls 'search' \(tool_call_id 'c1'\) but no ToolMessage answers it "
                      r"before the HumanMessage at index 3: add ToolMessage\(\.\.\., tool_call_id='c1'\)"),
    "ai follows": ([*_history()[:3], AIMessage("done")], r"before the AIMessage at index 3"),
    "last": (_history()[:3], r"AIMessage at index 2 .* before the end of the messages"),
    "one of two": ([HumanMessage("hi"), AIMessage("", tool_calls=[{"name": "f", "args": {}, "id": "x"},
                                                                   {"name": "g", "args": {}, "id": "y"}]),
                    ToolMessage("1", tool_call_id="x"), HumanMessage("?")], r"calls 'g' \(tool_call_id 'y'\)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_tool_histories_name_the_message_and_the_fix(chat, case):
    messages, pattern = BAD[case]
    for run in (chat.invoke, lambda m: list(chat.stream(m))):
        with pytest.raises(MessageError, match=pattern) as caught:
            run(messages)
        assert isinstance(caught.value, ValueError)


def test_bad_tool_history_is_refused_by_ainvoke(chat):
    import asyncio

    with pytest.raises(MessageError, match="ToolMessage at index 1"):
        asyncio.run(chat.ainvoke([HumanMessage("hi"), ToolMessage("x", tool_call_id="c1")]))


def test_answered_tool_histories_still_run(chat):
    parallel = AIMessage("", tool_calls=[{"name": "f", "args": {}, "id": "x"}, {"name": "g", "args": {}, "id": "y"}])
    for messages in (_history(), _history()[:4],
                     [HumanMessage("hi"), parallel, ToolMessage("2", tool_call_id="y"), ToolMessage("1", tool_call_id="x")]):
        assert chat.invoke(messages).response_metadata["finish_reason"]


def test_refused_history_leaves_the_thread_as_it_was(chat):
    """After the error, the next call on the thread reuses the cache as a thread that never saw it."""
    reused = {}
    for thread in ("refused", "clean"):
        config = {"configurable": {"thread_id": thread}}
        first = chat.invoke(_history(), config=config)
        if thread == "refused":
            with pytest.raises(MessageError):
                chat.invoke([*_history(), first, ToolMessage("stray", tool_call_id="nope")], config=config)
        second = chat.invoke([*_history(), first, HumanMessage("And where?", id="u3")], config=config)
        reused[thread] = second.response_metadata["repair"]["reused_tokens"]
    assert reused["refused"] == reused["clean"] > 0
