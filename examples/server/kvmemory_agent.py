"""The agent the LangGraph Agent Server serves (``langgraph.json``: graph ``kvmemory_agent:agent``).

A ``create_agent`` weather agent on ``ChatKVMemory`` (the embedded SmolLM2-135M-Instruct by
default, ``$KVMEMORY_MODEL`` for another), compiled without a checkpointer: the server gives it
kvmemory's ``KVCheckpointSaver`` (``checkpointer.py``), which keeps each thread's live KV cache
in this process and stores it as token blocks beside the SQLite checkpoints.

- ``auto_tool_calls="after_user"``: the 135M model calls a tool after every user turn and
  answers in text after the tool result (it does not decide to call tools by itself).
- ``ContextEditingMiddleware(ClearToolUsesEdit(keep=1))``: once the history passes
  ``$KVMEMORY_SERVER_CLEAR_TRIGGER`` approximate tokens (default 100, the system prompt not
  counted: from the second turn on), older tool outputs are replaced by
  ``[cleared]`` (same message ids): the live cache is repaired (Shift + budgeted refresh,
  ``RepairBudgetMiddleware``), not re-prefilled.
- ``AnswerAfterToolResult``: the call after a tool result is made with ``tool_choice="none"``
  (the tools stay in the prompt, so the cache is unchanged), so a turn is two model calls: the
  forced call and the answer. Left free there, the 135M model often calls the same tool again
  instead of answering (greedy decoding repeats itself: "Is it snowing in Oslo?" loops until the
  recursion limit).

Both the graph and the checkpointer factory use the one chat model of this module, so the
server's checkpointer persists the caches the graph's model calls build. The server imports it
as a module (``kvmemory_agent:agent``, with this folder on ``sys.path``), once.
"""

from __future__ import annotations

import os

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ClearToolUsesEdit, ContextEditingMiddleware
from langchain_core.tools import tool

from langchain_kvmemory import ChatKVMemory
from langchain_kvmemory.pruning import RepairBudgetMiddleware

WEATHER = {"Paris": "Sunny, 24 C.", "Rome": "Rain, 15 C.", "Tokyo": "Cloudy, 18 C.", "Oslo": "Snow, -3 C."}
LOCAL_TIME = {"Paris": "14:05", "Rome": "14:05", "Tokyo": "21:05", "Oslo": "14:05"}
SYSTEM = "You are a weather assistant. Use the tools, then answer in one short sentence."


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return WEATHER.get(city, "No report for that city.")


@tool
def get_local_time(city: str) -> str:
    """Get the local time in a city."""
    return LOCAL_TIME.get(city, "Unknown city.")


class AnswerAfterToolResult(AgentMiddleware):
    """The model call right after a tool result answers in text (``tool_choice="none"``)."""

    @staticmethod
    def _choose(request):
        if request.messages and request.messages[-1].type == "tool":
            return request.override(tool_choice="none")
        return request

    def wrap_model_call(self, request, handler):
        return handler(self._choose(request))

    async def awrap_model_call(self, request, handler):
        return await handler(self._choose(request))


llm = ChatKVMemory(max_tokens=int(os.environ.get("KVMEMORY_SERVER_MAX_TOKENS", "24")),
                   auto_tool_calls="after_user", parallel_tool_calls=False)

agent = create_agent(
    llm,
    tools=[get_weather, get_local_time],
    system_prompt=SYSTEM,
    middleware=[
        ContextEditingMiddleware(edits=[ClearToolUsesEdit(
            trigger=int(os.environ.get("KVMEMORY_SERVER_CLEAR_TRIGGER", "100")), keep=1)]),
        RepairBudgetMiddleware(5.0),
        AnswerAfterToolResult(),
    ],
)
