"""Test-time training through LangGraph (node) and LangChain (callback): one LoRA step, a new
adapter version, every live thread cache maintained (equal to a fresh prefill, fp32); the step
trains on the text the chat model caches for the same messages."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, TypedDict

import pytest
import torch
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import AIMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from kvmemory import online_adapter
from kvmemory.errors import MessageError
from kvmemory.models import LoadedModel
from kvmemory.online_adapter import OnlineAdapter
from kvmemory.prompt import CALL_OPEN
from kvmemory.reforge import ReforgeConfig
from kvmemory.session import KVSession
from langchain_kvmemory import ChatKVMemory
from langchain_kvmemory.online_training import TestTimeTrainingCallback, make_ttt_node, trained_messages
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


def test_message_conversion_rejects_unknown_types(tokenizer):
    assert trained_messages(tokenizer, [HumanMessage("q", id="1")]) == [{"role": "user", "content": "q", "id": "1"}]
    with pytest.raises(MessageError, match="System/Human/AI/Tool"):
        trained_messages(tokenizer, [ChatMessage(role="critic", content="x")])


def test_the_callback_trains_on_the_prompt_the_chat_model_caches(tokenizer, monkeypatch):
    """A history holding a tool call and its result: the callback's training prompt is, token for
    token, the prompt the chat model cached for the same call (the tool call written into the
    assistant turn as the chat model writes it, not dropped)."""
    model = lora_tiny(targets=("v_proj",), layers=(2,))
    loaded = LoadedModel(model.get_base_model(), tokenizer, "tiny-lora", Path("tiny-lora"), torch.float32)
    chat = ChatKVMemory(model=loaded, max_tokens=2)
    online = OnlineAdapter(model, tokenizer, chat.threads, lr=5e-2)
    callback = TestTimeTrainingCallback(online)
    call = AIMessage("", id="a1", tool_calls=[{"name": "birthplace", "args": {"who": "Ilse Marrow"}, "id": "c1"}])
    turn = [SystemMessage("Answer briefly.", id="s"), HumanMessage("Where was Ilse Marrow born?", id="q"), call,
            ToolMessage("Helmsford", tool_call_id="c1", id="r"), HumanMessage("So where?", id="q2")]
    answer = chat.invoke(turn, config={"configurable": {"thread_id": "t"}, "callbacks": [callback]})
    cached = tokenizer.decode(chat.threads.session("t").token_ids)  # prompt + the committed answer

    trained, step = [], online_adapter.lora_update_step
    monkeypatch.setattr(online_adapter, "lora_update_step",
                        lambda m, opt, prompt, target: trained.append(prompt) or step(m, opt, prompt, target))
    callback.confirm("Helmsford")
    # the answer's first token may merge with the prompt's last on re-tokenization: compare text
    [prompt] = trained
    assert CALL_OPEN in tokenizer.decode(prompt) and cached.startswith(tokenizer.decode(prompt))
    assert len(prompt) == answer.usage_metadata["input_tokens"]
