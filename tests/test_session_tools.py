"""Tools given to a session reach the prompt: through the chat template when it renders ``tools``,
folded into the system message otherwise (SmolLM2's ChatML), by one function
(``kvmemory.prompt.render_text``) that KVSession, commit_answer, check_invariants, import_state and
ChatKVMemory all render through."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from kvmemory.edits import common_prefix_length
from kvmemory.errors import InputError, InputTypeError
from kvmemory.models import LoadedModel
from kvmemory.prompt import template_renders_tools, tools_block
from kvmemory.session import KVSession
from kvmemory.persistence import export_state, import_state
from langchain_kvmemory import ChatKVMemory
from support import reprefill_logits, tiny_model

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up passages about a topic.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
OTHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city.",
                                          "parameters": {"type": "object", "properties": {}}}}
MSGS = [{"role": "system", "content": "Answer from the tool results.", "id": "sys"},
        {"role": "user", "content": "Find passages about rivers.", "id": "u1"}]
ATOL = 1e-4  # fp32 logits


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_tools_are_folded_into_the_system_message_of_a_template_without_tool_support(llama, tokenizer):
    assert not template_renders_tools(tokenizer)  # SmolLM2's ChatML ignores `tools`
    s = KVSession(llama, tokenizer, tools=[LOOKUP])
    s.prepare(MSGS)
    text = s.rendered.text
    assert "Answer from the tool results.\n\n" + tools_block([LOOKUP]) + "<|im_end|>" in text
    assert '"name": "lookup"' in text and '"required": ["query"]' in text  # the schema itself
    assert list(s.token_ids) == tokenizer(text, add_special_tokens=False)["input_ids"]
    s.check_invariants()
    # no system message: one is put first for the tools (and belongs to message 0's segment)
    bare = KVSession(llama, tokenizer, tools=[LOOKUP])
    bare.prepare(MSGS[1:])
    assert bare.rendered.text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n" + tools_block([LOOKUP]))
    assert [seg.key for seg in bare.rendered.segments] == ["u1"] and bare.rendered.segments[0].token_start == 0


def test_a_template_that_renders_tools_gets_them(llama, tokenizer):
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    s = KVSession(llama, templated, tools=[LOOKUP, OTHER])
    s.prepare(MSGS)
    assert s.rendered.text.startswith("TOOLS: lookup weather<system>Answer from the tool results.</system>")
    assert "You can call these tools" not in s.rendered.text  # not folded as well


def test_tools_a_template_cannot_take_raise_a_clear_error(llama, tokenizer):
    no_system = copy.deepcopy(tokenizer)
    no_system.chat_template = (
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<{{ m.role }}>{{ m.content }}\n{% endfor %}")
    s = KVSession(llama, no_system, tools=[LOOKUP])
    with pytest.raises(InputError, match="renders no tools and rejects the system message"):
        s.prepare(MSGS[1:])
    with pytest.raises(InputTypeError, match="list of tools"):
        KVSession(llama, tokenizer, tools=LOOKUP)
    with pytest.raises(InputError, match="OpenAI-format"):
        KVSession(llama, tokenizer, tools=[{"name": "lookup"}])


def test_python_functions_are_described_like_the_template_would(llama, tokenizer):
    def lookup(query: str) -> str:
        """Look up passages about a topic.

        Args:
            query: the topic
        """
        return query

    s = KVSession(llama, tokenizer, tools=[lookup])
    assert s.tools[0]["function"]["name"] == "lookup"
    s.prepare(MSGS)
    assert '"query": {"type": "string", "description": "the topic"}' in s.rendered.text


def test_changing_the_tools_recomputes_what_they_changed(llama, tokenizer):
    """The folded tools live in the system message's rows: new tools are new text there (its rows
    are recomputed, never reused), and a full-budget repair equals a Re-prefill."""
    s = KVSession(llama, tokenizer, "replay", tools=[LOOKUP])
    s.prepare(MSGS)
    before = list(s.token_ids)
    s.tools = [OTHER]
    report = s.prepare(MSGS)
    assert "weather" in s.rendered.text and "lookup" not in s.rendered.text
    assert report.widened == ["sys"] and report.reused_tokens == common_prefix_length(before, s.token_ids)
    torch.testing.assert_close(s.next_logits, reprefill_logits(llama, s.token_ids), rtol=0, atol=ATOL)
    s.check_invariants()


def forcing(token_ids: list[int]):
    """A logits processor that makes greedy decoding write ``token_ids`` (then nothing more)."""
    queue = list(token_ids)

    def processor(input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        forced[:, queue.pop(0)] = 0.0
        return forced
    return processor


def test_commit_answer_invariants_and_import_state_render_the_same_tools(llama, tokenizer):
    s = KVSession(llama, tokenizer, tools=[LOOKUP])
    s.prepare(MSGS)
    answer = tokenizer("Rivers run.", add_special_tokens=False)["input_ids"]
    out = s.generate(10, logits_processor=forcing(answer + [tokenizer.convert_tokens_to_ids("<|im_end|>")]))
    assert out.finish_reason == "stop" and out.text == "Rivers run."
    assert s.commit_answer({"role": "assistant", "content": out.text, "id": "a1"})
    s.check_invariants()
    state = export_state(s)
    assert state.tools == [LOOKUP]
    other = KVSession(llama, tokenizer)  # no tools of its own: the state's are restored
    import_state(other, state)
    assert other.tools == [LOOKUP] and other.rendered.text == s.rendered.text
    other.check_invariants()
    follow = MSGS + [{"role": "assistant", "content": out.text, "id": "a1"},
                     {"role": "user", "content": "And lakes?", "id": "u2"}]
    report = other.prepare(follow)
    assert report.reused_tokens >= len(state.token_ids) - 1  # the tools' rows and the answer's are reused
    torch.testing.assert_close(other.next_logits, reprefill_logits(llama, other.token_ids), rtol=0, atol=ATOL)


# ------------------------------------------------------------- ChatKVMemory
# Prompts ChatKVMemory built before the session owned the tools (it folded them itself), captured
# from that version: they must stay byte-identical.
_TOOLS_TEXT = (
    "You can call these tools:\n<tools>\n{\"name\": \"lookup\", \"description\": \"Look up passages about a topic.\", "
    "\"parameters\": {\"properties\": {\"query\": {\"type\": \"string\"}}, \"required\": [\"query\"], \"type\": "
    "\"object\"}}\n</tools>\nTo call a tool, reply with only:\n<tool_call>\n{\"name\": <tool name>, \"arguments\": "
    "<arguments as a JSON object>}\n</tool_call>\nOtherwise answer normally.<|im_end|>\n")
BEFORE_WITH_SYSTEM = (
    "<|im_start|>system\nAnswer from the tool results.\n\n" + _TOOLS_TEXT
    + "<|im_start|>user\nWho founded Ostrava Nova?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": "
    "\"lookup\", \"arguments\": {\"query\": \"Ostrava Nova\"}}\n</tool_call><|im_end|>\n<|im_start|>tool\nFounded "
    "in 1873 by Ilse Marrow.<|im_end|>\n<|im_start|>user\nAnswer in one word.<|im_end|>\n<|im_start|>assistant\n")
BEFORE_NO_SYSTEM = (
    "<|im_start|>system\nYou are a helpful assistant.\n\n" + _TOOLS_TEXT
    + "<|im_start|>user\nFind passages about rivers.<|im_end|>\n<|im_start|>assistant\n")


@tool
def lookup(query: str) -> str:
    """Look up passages about a topic."""
    return query


def test_chat_model_prompts_with_tools_are_unchanged(llama, tokenizer):
    loaded = LoadedModel(llama, tokenizer, "tiny-llama", Path("tiny-llama"), torch.float32)
    llm = ChatKVMemory(model=loaded, max_tokens=3)
    bound = llm.bind_tools([lookup])
    history = [SystemMessage("Answer from the tool results.", id="sys"),
               HumanMessage("Who founded Ostrava Nova?", id="u1"),
               AIMessage("", id="a1", tool_calls=[{"name": "lookup", "args": {"query": "Ostrava Nova"}, "id": "c1"}]),
               ToolMessage("Founded in 1873 by Ilse Marrow.", tool_call_id="c1", id="t1"),
               HumanMessage("Answer in one word.", id="u2")]
    for thread, messages, before in (("sys", history, BEFORE_WITH_SYSTEM),
                                     ("bare", [HumanMessage("Find passages about rivers.", id="h")], BEFORE_NO_SYSTEM)):
        bound.invoke(messages, config={"configurable": {"thread_id": thread}})
        session = llm.threads.session(thread)
        want = tokenizer(before, add_special_tokens=False)["input_ids"]
        # the answer is held after the prompt: its first characters may tokenize with the opener's last "\n"
        assert session.tools and session.token_ids[: len(want) - 1] == want[:-1]
        assert session.rendered.text.startswith(before)
