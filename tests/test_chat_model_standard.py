"""LangChain's standard chat-model suites (langchain-tests) on the embedded SmolLM2-135M-Instruct.

Tool-calling and structured-output tests return early (silently pass) when bind_tools /
with_structured_output are not overridden; ``test_suites_see_tool_calling`` pins that they run.
Image / audio / PDF / video inputs are off (``supports_*_inputs`` False): the model reads text only.
``test_serdes`` compares ``dumpd(model)`` with the stored snapshot (``__snapshots__``;
``--snapshot-update`` after a deliberate change of the settings) and loads it back under
``allowed_objects="all"`` (see ``langchain_kvmemory.serialization``).
"""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from kvmemory.models import embedded_model_dir
from langchain_kvmemory import ChatKVMemory

PARAMS = {"auto_tool_calls": "after_user"}
# Short answers keep the suite quick on CPU; 48 tokens hold a tool call or a small JSON object.
MAX_TOKENS = 48


class _KVMemoryModel:
    """The model both suites build (a plain mixin: the suites' no-override check only looks at
    the langchain_tests base class)."""

    @property
    def chat_model_class(self):
        return ChatKVMemory

    @property
    def chat_model_params(self):
        # auto_tool_calls="after_user": the 135M model never opens a tool call by itself under
        # tool_choice="auto" (p(<tool_call>) 0.015 vs 0.16 for its top token, measured), so the
        # agent-loop test runs with the ReAct policy: call after a user turn, answer after a tool.
        return PARAMS

    @property
    def standard_chat_model_params(self):
        # the unit suite adds api_key="test": a local model has none, and ChatKVMemory rejects
        # settings it does not use instead of dropping them
        params = {k: v for k, v in super().standard_chat_model_params.items() if k != "api_key"}
        return {**params, "max_tokens": MAX_TOKENS}


class TestChatKVMemoryUnit(_KVMemoryModel, ChatModelUnitTests):
    """LangChain's unit suite (no model load: ChatKVMemory loads lazily)."""

    @property
    def init_from_env_params(self):
        # the default model comes from $KVMEMORY_MODEL (a folder), as ChatOllama's host from $OLLAMA_HOST
        folder = str(embedded_model_dir())
        return {"KVMEMORY_MODEL": folder}, {}, {"model": folder}


@pytest.mark.real_model
class TestChatKVMemoryIntegration(_KVMemoryModel, ChatModelIntegrationTests):

    @property
    def model_override_value(self) -> str:
        # another name for a model: the embedded model's converted folder, loaded as a folder model
        return str(embedded_model_dir())

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def enable_vcr_tests(self) -> bool:
        # a local model makes no HTTP calls: the cassette records nothing and replays nothing
        return True

    @property
    def supported_usage_metadata_details(self):
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = ChatKVMemory(max_tokens=MAX_TOKENS, **PARAMS)
        config = {"configurable": {"thread_id": f"cache-read-{stream}"}}
        first = llm.invoke([HumanMessage("Name a colour.", id="q1")], config=config)
        history = [HumanMessage("Name a colour.", id="q1"), first, HumanMessage("And another one?", id="q2")]
        if not stream:
            return llm.invoke(history, config=config)
        full = None
        for chunk in llm.stream(history, config=config):
            full = chunk if full is None else full + chunk
        return full


def test_suites_see_tool_calling_and_structured_output():
    suite = TestChatKVMemoryIntegration()
    assert suite.has_tool_calling and suite.has_tool_choice and suite.has_structured_output
    assert suite.supports_json_mode
