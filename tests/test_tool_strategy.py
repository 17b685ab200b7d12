"""``create_agent(..., response_format=ToolStrategy(Schema))`` with other tools bound ends: after
``structured_output_rounds`` tool rounds the answer must call the structured-output tool."""

from __future__ import annotations

import pytest
from langchain.agents import create_agent
from langchain.agents.structured_output import ToolStrategy
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from langchain_kvmemory import ChatKVMemory
from support import tiny_loaded


class WeatherReport(BaseModel):
    """The weather in a city."""

    city: str = Field(description="the city")
    summary: str = Field(description="the weather there, in a few words")


@tool
def weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny, 24 C in {city}."


@pytest.fixture(scope="module")
def tiny():
    return ChatKVMemory(model=tiny_loaded("tiny-llama"), max_tokens=200)


def _round(city: str = "Paris") -> list:
    return [HumanMessage(f"What is the weather in {city}?", id="u1"),
            AIMessage("", id="a1", tool_calls=[{"name": "weather", "args": {"city": city}, "id": "c1"}]),
            ToolMessage("Sunny, 24 C.", tool_call_id="c1", id="t1")]


def _bound(chat):
    schema_tool = ToolStrategy(WeatherReport).schema_specs[0]
    from langchain.agents.structured_output import OutputToolBinding

    return chat.bind_tools([weather, OutputToolBinding.from_schema_spec(schema_tool).tool], tool_choice="any")


def test_the_schema_tool_is_called_once_the_rounds_are_spent(tiny):
    answer = _bound(tiny).invoke(_round())
    assert [c["name"] for c in answer.tool_calls] == ["WeatherReport"]
    assert answer.response_metadata["tool_policy"] == {"policy": "structured_output", "choice": ["WeatherReport"],
                                                       "rounds": 1}


def test_before_the_rounds_are_spent_the_model_chooses(tiny):
    first = _bound(tiny).invoke(_round()[:1])  # a user turn: no tool round yet
    assert "tool_policy" not in first.response_metadata and first.tool_calls
    later = _bound(tiny.model_copy(update={"structured_output_rounds": 2})).invoke(_round())
    assert "tool_policy" not in later.response_metadata


def test_only_the_schema_tool_or_a_named_choice_is_left_alone(tiny):
    """Plain tools (functions) are never taken for a schema tool; a named tool_choice is kept."""
    assert "structured_output_tools" not in tiny.bind_tools([weather]).kwargs
    named = _bound(tiny).kwargs | {"tool_choice": "weather"}
    answer = tiny.bind(**named).invoke(_round())
    assert [c["name"] for c in answer.tool_calls] == ["weather"] and "tool_policy" not in answer.response_metadata


def test_tool_strategy_agent_ends_on_a_tiny_model(tiny):
    agent = create_agent(tiny, tools=[weather], response_format=ToolStrategy(WeatherReport))
    out = agent.invoke({"messages": [HumanMessage("What is the weather in Paris?")]},
                       {"configurable": {"thread_id": "ts-tiny"}, "recursion_limit": 12})
    assert isinstance(out["structured_response"], WeatherReport)


@pytest.mark.real_model
def test_tool_strategy_agent_ends_on_the_embedded_model(real):
    chat = ChatKVMemory(model=real, max_tokens=48)
    agent = create_agent(chat, tools=[weather], response_format=ToolStrategy(WeatherReport))
    out = agent.invoke({"messages": [HumanMessage("What is the weather in Paris?")]},
                       {"configurable": {"thread_id": "ts-real"}, "recursion_limit": 12})
    report = out["structured_response"]
    assert isinstance(report, WeatherReport) and report.city
    assert any(isinstance(m, ToolMessage) and m.name == "weather" for m in out["messages"])
