"""Pruning helpers and node: what they emit through LangGraph's add_messages reducer."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.graph.message import add_messages

from langchain_kvmemory.pruning import (
    SUMMARY_PREFIX,
    pruning_node,
    remove_messages,
    replace_history,
    split_history,
)


def _history(turns: int = 4) -> list:
    msgs = [SystemMessage("Be brief.", id="sys")]
    for i in range(turns):
        msgs += [
            HumanMessage(f"Question {i}: what is item {i} of the list of long things?", id=f"h{i}"),
            AIMessage("", id=f"c{i}", tool_calls=[{"name": "lookup", "args": {"q": str(i)}, "id": f"call{i}"}]),
            ToolMessage(f"Item {i} is a very long passage about thing {i}. " * 3, tool_call_id=f"call{i}", id=f"t{i}"),
            AIMessage(f"Item {i} is thing {i}.", id=f"a{i}"),
        ]
    return msgs


def _ids(msgs) -> list[str]:
    return [m.id for m in msgs]


def test_split_keeps_system_and_starts_the_tail_at_a_human_turn():
    msgs = _history()
    system, head, tail = split_history(msgs, keep_tokens=120)
    assert _ids(system) == ["sys"]
    assert isinstance(tail[0], HumanMessage) and tail[-1].id == "a3"
    assert _ids(system + head + tail) == _ids(msgs)
    # a budget below the last turn still keeps that turn whole
    _, head, tail = split_history(msgs, keep_tokens=1)
    assert _ids(tail) == ["h3", "c3", "t3", "a3"]
    with pytest.raises(ValueError, match="keep_tokens"):
        split_history(msgs, keep_tokens=0)


def test_remove_and_replace_updates_through_the_reducer():
    msgs = _history(2)
    assert _ids(add_messages(msgs, remove_messages(["t0"]))) == [i for i in _ids(msgs) if i != "t0"]
    tail = msgs[-4:]
    assert _ids(add_messages(msgs, replace_history([msgs[0], *tail]))) == ["sys", *_ids(tail)]
    with pytest.raises(ValueError, match="without an id"):
        remove_messages([""])


def test_node_removes_the_head_above_the_threshold_only():
    msgs = _history()
    node = pruning_node(max_tokens=300, keep_tokens=120, strategy="remove")
    assert node({"messages": msgs[:5]}, {}) == {}  # short history: no update
    update = node({"messages": msgs}, {})
    kept = add_messages(msgs, update["messages"])
    assert _ids(kept) == ["sys", "h3", "c3", "t3", "a3"]


def test_node_summary_takes_the_place_and_id_of_the_first_summarised_message():
    msgs = _history()
    seen = []

    def summarizer(head):
        seen.append(_ids(head))
        return "the user asked about items 0-2"

    node = pruning_node(max_tokens=300, keep_tokens=120, summarizer=summarizer)
    new = add_messages(msgs, node({"messages": msgs}, {})["messages"])
    assert seen == [_ids(msgs[1:13])]
    assert _ids(new) == ["sys", "h0", "h3", "c3", "t3", "a3"]
    assert new[1].content == SUMMARY_PREFIX + "the user asked about items 0-2"


def test_node_arguments_are_checked():
    with pytest.raises(ValueError, match="strategy"):
        pruning_node(max_tokens=10, keep_tokens=5, strategy="drop")
    with pytest.raises(ValueError, match="keep_tokens < max_tokens"):
        pruning_node(max_tokens=10, keep_tokens=10, strategy="remove")
    with pytest.raises(ValueError, match="summarizer"):
        pruning_node(max_tokens=10, keep_tokens=5)
