"""An ordinary LangChain v1 ``create_agent`` agent on the embedded model: one tool, a structured
final answer (``response_format``), a checkpointer, and nothing kvmemory-specific beyond the chat
model itself (no forcing middleware). ``auto_tool_calls="scored"`` is the tool policy a 135 M
model needs: a call on the first user turn, an answer after the tool result, a scored choice on
later user turns (docs/chat-model-parity.md).

Run:  .venv/bin/python examples/agents/weather_agent.py [--city Paris] [--max-tokens 40]

It prints each message of the run and the structured answer.
"""

from __future__ import annotations

import argparse

from langchain.agents import create_agent
from langchain.agents.structured_output import ProviderStrategy
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from pydantic import BaseModel, Field

from langchain_kvmemory import ChatKVMemory

WEATHER = {"Paris": "Sunny, 24 C.", "Rome": "Rain, 15 C.", "Tokyo": "Cloudy, 18 C.", "Oslo": "Snow, -3 C."}


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return WEATHER.get(city, "No report for that city.")


class WeatherReport(BaseModel):
    """The agent's final answer."""

    city: str = Field(description="the city asked about")
    summary: str = Field(description="the weather in a few words")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--city", default="Paris", choices=sorted(WEATHER))
    p.add_argument("--max-tokens", type=int, default=40)
    return p


def run(args, llm: ChatKVMemory | None = None) -> dict:
    """One run of the agent; returns its messages and the structured answer."""
    llm = llm or ChatKVMemory(max_tokens=args.max_tokens, auto_tool_calls="scored", parallel_tool_calls=False)
    agent = create_agent(llm, tools=[get_weather], system_prompt="You are a weather assistant. Use the tool.",
                         response_format=ProviderStrategy(WeatherReport), checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "weather"}}
    first = agent.invoke({"messages": [HumanMessage(f"What is the weather in {args.city}?")]}, config)
    for message in first["messages"]:
        print(f"{type(message).__name__:>12}: {message.content or message.tool_calls}")
    print("structured:", first["structured_response"])
    return {"messages": first["messages"], "report": first["structured_response"]}


if __name__ == "__main__":
    run(parser().parse_args())
