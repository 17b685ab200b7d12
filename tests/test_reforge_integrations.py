"""Test-time training through LangGraph (node) and LangChain (callback): one LoRA step, a new
adapter version, every live thread cache maintained (equal to a fresh prefill, fp32)."""

from __future__ import annotations

from typing import Annotated, TypedDict

import pytest
import torch
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from kvmemory.reforge import ReforgeConfig
from kvmemory.reforge.online import OnlineAdapter
from kvmemory.session import KVSession
from langchain_kvmemory.test_time_training import TestTimeTrainingCallback, make_ttt_node, to_chat_messages
from support import QUERY, history
from test_reforge import lora_tiny


class State(TypedDict):
    messages: Annotated[list, add_messages]
    confirmed_answer: str | None
    adapter_version: str | None


def _threads(model, tokenizer):
    a = KVSession(model, tokenizer, "replay", reforge=ReforgeConfig())
    b = KVSession(model, tokenizer, "replay", reforge=ReforgeConfig())
    a.prepare(history() + [QUERY])
    b.prepare(history()[:4] + [QUERY])
    return {"thread-a": a, "thread-b": b}


def _assert_fresh(sessions, model, tokenizer):
    for s in sessions.values():
        ref = KVSession(model, tokenizer, "reprefill")
        ref.prepare(s.messages)
        assert torch.allclose(s.next_logits, ref.next_logits, atol=1e-4)
        assert not s.adapter_versions.mixed and s.adapter_versions.current == s.reforge.current().digest


def test_langgraph_node_trains_and_maintains_every_thread(tokenizer):
    model = lora_tiny(targets=("v_proj",), layers=(2,))
    sessions = _threads(model, tokenizer)
    before = sessions["thread-a"].adapter_versions.current
    online = OnlineAdapter(model, tokenizer, sessions, lr=5e-2)
    graph = StateGraph(State)
    graph.add_node("ttt", make_ttt_node(online))
    graph.add_edge(START, "ttt")
    graph.add_edge("ttt", END)
    app = graph.compile()
    out = app.invoke({
        "messages": [SystemMessage("Answer briefly."), HumanMessage("Where was Ilse Marrow born?"), AIMessage("Dorne")],
        "confirmed_answer": "Helmsford",
    })
    assert out["confirmed_answer"] is None and out["adapter_version"] not in (None, before)
    _assert_fresh(sessions, model, tokenizer)
    assert "adapter_version" not in app.invoke({"messages": [HumanMessage("hi")], "confirmed_answer": None})


def test_langchain_callback_trains_on_confirmed_answer(tokenizer):
    model = lora_tiny(targets=("v_proj",), layers=(2,))
    sessions = _threads(model, tokenizer)
    online = OnlineAdapter(model, tokenizer, sessions, lr=5e-2)
    seen = []
    cb = TestTimeTrainingCallback(online, target_fn=lambda msgs, answer: seen.append(answer) or None)
    chat = FakeListChatModel(responses=["Helmsford"])
    chat.invoke([HumanMessage("Where was Ilse Marrow born?")], config={"callbacks": [cb]})
    assert seen == ["Helmsford"] and cb.last_messages == [{"role": "user", "content": "Where was Ilse Marrow born?"}]
    report = cb.confirm()
    assert report.version_before != report.version_after and set(report.sessions) == set(sessions)
    _assert_fresh(sessions, model, tokenizer)
    with pytest.raises(ValueError, match="empty"):
        cb.confirm("")


def test_message_conversion_rejects_unknown_types():
    from langchain_core.messages import ChatMessage

    assert to_chat_messages([HumanMessage("q", id="1")]) == [{"role": "user", "content": "q", "id": "1"}]
    with pytest.raises(ValueError, match="human/ai/system/tool"):
        to_chat_messages([ChatMessage(role="critic", content="x")])
