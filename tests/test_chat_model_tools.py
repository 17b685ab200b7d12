"""Tool calling as LangChain users expect it: several calls in one message (and at most one when
``parallel_tool_calls=False``), arguments streamed as ``tool_call_chunks`` while decoded, tokens the
grammar fixes not charged against ``max_tokens``, and the ``"scored"`` auto policy that answers
"thanks, summarise" with text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from langchain.agents import create_agent
from langchain.agents.structured_output import ProviderStrategy
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from pydantic import BaseModel

from kvmemory.models import LoadedModel
from langchain_kvmemory import ChatKVMemory
from langchain_kvmemory.tool_calls import CallStream, format_call
from support import tiny_model

CITIES = {"Paris": "Sunny, 24 C.", "Rome": "Rain, 15 C.", "Tokyo": "Cloudy, 18 C."}


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return CITIES.get(city, "Unknown city.")


@tool
def get_time(city: str) -> str:
    """Get the local time in a city."""
    return "12:00"


@tool
def ping() -> str:
    """Check that the service is up."""
    return "pong"


@pytest.fixture(scope="module")
def tiny_chat(tokenizer):
    loaded = LoadedModel(tiny_model("llama"), tokenizer, "tiny-llama", Path("tiny-llama"), torch.float32)
    return lambda **kw: ChatKVMemory(model=loaded, **kw)


# ------------------------------------------------------------------ fast
def test_call_stream_chunks_merge_into_the_calls():
    text = format_call("get_weather", {"city": "Paris"}) + "\n" + format_call("get_time", {"city": "Rome"})
    stream, chunks = CallStream(), []
    for end in range(1, len(text) + 1):
        chunks += stream.update(text[:end])
    merged = AIMessageChunk_from(chunks)
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_time", {"city": "Rome"})]
    assert [c["id"] for c in merged.tool_calls] == stream.ids
    assert sum(1 for c in chunks if c["name"]) == 2  # one head chunk per call, then argument deltas


def AIMessageChunk_from(chunks):
    from langchain_core.messages import AIMessageChunk

    message = AIMessageChunk(content="")
    for c in chunks:
        message = message + AIMessageChunk(content="", tool_call_chunks=[tool_call_chunk(
            name=c["name"], args=c["args"], id=c["id"], index=c["index"])])
    return message


def test_grammar_fixed_tokens_are_not_charged(tiny_chat):
    """A call whose every token the grammar fixes completes under max_tokens=1 (the answer's
    budget counts only tokens the model chooses)."""
    answer = tiny_chat(max_tokens=1).bind_tools([ping], tool_choice="ping", parallel_tool_calls=False).invoke("Ping?")
    assert [c["name"] for c in answer.tool_calls] == ["ping"] and not answer.invalid_tool_calls
    assert answer.response_metadata["grammar_fixed_tokens"] == answer.usage_metadata["output_tokens"] > 1


def test_parallel_tool_calls_false_allows_one_call(tiny_chat):
    llm = tiny_chat(max_tokens=64)
    for seed in range(3):  # a random model: whatever it picks, the grammar allows one call
        answer = llm.bind_tools([ping], tool_choice="any", parallel_tool_calls=False).invoke(
            "Ping?", temperature=1.0, seed=seed)
        assert len(answer.tool_calls) + len(answer.invalid_tool_calls) == 1


# ------------------------------------------------------------------ the embedded model
TWO_CITIES = [HumanMessage("What is the weather in Paris and in Rome?")]


@pytest.mark.real_model
def test_two_calls_in_one_message_under_max_tokens_32(real):
    llm = ChatKVMemory(model=real, max_tokens=32)
    answer = llm.bind_tools([get_weather, get_time], tool_choice="any", parallel_tool_calls=True).invoke(TWO_CITIES)
    assert len(answer.tool_calls) >= 2 and not answer.invalid_tool_calls
    assert {c["args"]["city"] for c in answer.tool_calls} >= {"Paris", "Rome"}
    assert answer.response_metadata["finish_reason"] == "tool_calls"
    single = llm.bind_tools([get_weather, get_time], tool_choice="any").invoke(TWO_CITIES)  # default: one call
    assert len(single.tool_calls) == 1 and not single.invalid_tool_calls
    assert single.tool_calls[0]["args"] == {"city": "Paris"}  # complete although max_tokens=32


@pytest.mark.real_model
def test_tool_call_arguments_stream_while_decoded(real):
    llm = ChatKVMemory(model=real, max_tokens=32).bind_tools([get_weather, get_time], tool_choice="any",
                                                             parallel_tool_calls=True)
    chunks = list(llm.stream(TWO_CITIES))
    with_calls = [i for i, c in enumerate(chunks) if c.tool_call_chunks]
    assert len(with_calls) > 4 and with_calls[0] < len(chunks) - 1  # before the last chunk, many deltas
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    invoked = llm.invoke(TWO_CITIES)
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in invoked.tool_calls]
    heads = [tc["id"] for c in chunks for tc in c.tool_call_chunks if tc["id"]]
    assert heads == [c["id"] for c in merged.tool_calls]
    assert merged.response_metadata["finish_reason"] == "tool_calls"


@pytest.mark.real_model
def test_scored_policy_answers_thanks_with_text_in_an_ordinary_agent(real):
    llm = ChatKVMemory(model=real, max_tokens=40, auto_tool_calls="scored", parallel_tool_calls=False)
    agent = create_agent(llm, tools=[get_weather], system_prompt="You are a helpful assistant. Use tools to answer.",
                         checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "scored"}}
    first = agent.invoke({"messages": [HumanMessage("What is the weather in Paris?")]}, cfg)["messages"]
    assert first[1].tool_calls[0]["args"] == {"city": "Paris"} and isinstance(first[2], ToolMessage)
    assert "24" in first[-1].content
    thanks = agent.invoke({"messages": [HumanMessage("Thanks, summarise that in one sentence.")]}, cfg)["messages"]
    last = thanks[-1]
    assert isinstance(last, AIMessage) and not last.tool_calls and last.content
    policy = last.response_metadata["tool_policy"]
    assert policy["choice"] == "none" and policy["call_gap_nats"] > policy["margin_nats"]


class WeatherReport(BaseModel):
    city: str
    summary: str


@pytest.mark.real_model
def test_provider_strategy_with_a_tool_calls_then_answers_in_the_schema(real):
    llm = ChatKVMemory(model=real, max_tokens=40, auto_tool_calls="after_user", parallel_tool_calls=False)
    agent = create_agent(llm, tools=[get_weather], response_format=ProviderStrategy(WeatherReport))
    out = agent.invoke({"messages": [HumanMessage("What is the weather in Paris?")]},
                       {"configurable": {"thread_id": "provider-tool"}})
    assert out["messages"][1].tool_calls[0]["name"] == "get_weather"
    report = out["structured_response"]
    assert isinstance(report, WeatherReport) and report.city == "Paris"


# ------------------------------------------------------------- calls without the tags
@pytest.mark.parametrize("text", [
    '{"name": "weather", "arguments": {"city": "Lyon"}}',
    '```json\n{"name": "weather", "arguments": {"city": "Lyon"}}\n```',
    '  ```\n[{"name": "weather", "arguments": {"city": "Lyon"}}]\n```\n',
    # doubled outer braces, as Qwen2.5's template shows the format (closed with one or two extra)
    '{{"name": "weather", "arguments": {"city": "Lyon"}}}',
    '{{"name": "weather", "arguments": {"city": "Lyon"}}}}',
])
def test_a_call_written_without_tags_is_a_call(text):
    from langchain_kvmemory.tool_calls import bare_calls

    calls = bare_calls(text, {"weather"})
    assert [(c["name"], c["args"]) for c in calls] == [("weather", {"city": "Lyon"})]
    assert calls[0]["id"].startswith("call_")


@pytest.mark.parametrize("text", [
    'Sure: {"name": "weather", "arguments": {"city": "Lyon"}}',  # prose around it
    '{"name": "forecast", "arguments": {"city": "Lyon"}}',  # not a bound tool
    '{"name": "weather", "arguments": "Lyon"}',  # arguments not an object
    '{"name": "weather", "arguments": {}, "note": 1}',  # other keys: an answer in JSON, not a call
    '{"name": "weather", "arguments": {"city": "Lyon"}}\n{"name": "weather", "arguments": {}}',  # not one JSON value
    '{{"name": "weather", "arguments": {"city": "Lyon"}}} and then',  # doubled braces, text after
])
def test_text_that_is_not_only_a_call_stays_text(text):
    from langchain_kvmemory.tool_calls import bare_calls

    assert bare_calls(text, {"weather"}) == []


def test_a_tagged_call_with_doubled_braces_is_a_call():
    from langchain_kvmemory.tool_calls import split_calls

    content, calls, invalid = split_calls('<tool_call>\n{{"name": "weather", "arguments": {"city": "Lyon"}}}\n</tool_call>')
    assert content == "" and not invalid
    assert [(c["name"], c["args"]) for c in calls] == [("weather", {"city": "Lyon"})]
