"""ChatKVMemory beyond the standard suites: live-cache reuse per thread, repair reports after a
mid-history edit, thread ids from LangGraph, tool-call and stop-sequence handling."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import asyncio
import signal
import threading

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

from kvmemory.models import LoadedModel
from langchain_kvmemory import ChatKVMemory, leased_streams
from langchain_kvmemory.streaming import TextWatcher
from langchain_kvmemory.tool_policy import normalize_tool_choice
from langchain_kvmemory.constrained import MAX_FREE_STRING_CHARS, capped_strings
from langchain_kvmemory.messages import UnsupportedContentError, to_session_messages
from langchain_kvmemory.tool_calls import format_call, split_calls
from support import tiny_model

PASSAGE = ("Ostrava Nova was founded in 1873 by the engineer Ilse Marrow. The town lies on the Mira River. "
           "Its mill was the first in the valley.")


@pytest.fixture(scope="module")
def real_chat(real):
    return lambda **kw: ChatKVMemory(model=real, **kw)


@pytest.fixture(scope="module")
def tiny_chat(tokenizer):
    loaded = LoadedModel(tiny_model("llama"), tokenizer, "tiny-llama", Path("tiny-llama"), torch.float32)
    return lambda **kw: ChatKVMemory(model=loaded, max_tokens=kw.pop("max_tokens", 4), **kw)


def _agent_history(tool_text: str) -> list:
    return [
        SystemMessage("Answer from the tool results.", id="sys"),
        HumanMessage("Who founded Ostrava Nova?", id="u1"),
        AIMessage("", id="a1", tool_calls=[{"name": "search", "args": {"q": "Ostrava Nova"}, "id": "c1"}]),
        ToolMessage(tool_text, tool_call_id="c1", id="t1"),
        HumanMessage("Answer in one word.", id="u2"),
    ]


# ------------------------------------------------------------------ tiny model: mechanics
def test_second_turn_reads_the_first_turns_rows_including_the_answer(tiny_chat):
    llm = tiny_chat(max_tokens=3)
    cfg = {"configurable": {"thread_id": "reuse"}}
    first = llm.invoke([HumanMessage("Hello", id="h1")], config=cfg)
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0
    second = llm.invoke([HumanMessage("Hello", id="h1"), first, HumanMessage("More?", id="h2")], config=cfg)
    read = second.usage_metadata["input_token_details"]["cache_read"]
    assert read >= first.usage_metadata["input_tokens"] - 1  # the whole first prompt (its last row is recomputed)
    assert second.response_metadata["repair"]["edits"] == {"keep": 2, "append": 1} or read > 0
    other = llm.invoke([HumanMessage("Hello", id="h1")], config={"configurable": {"thread_id": "other"}})
    assert other.usage_metadata["input_token_details"]["cache_read"] == 0  # threads do not share caches
    assert set(llm.threads.thread_ids) >= {"reuse", "other"}


def test_mid_history_edit_is_repaired_and_reported(tiny_chat):
    llm = tiny_chat(repair_policy="sur@50")
    cfg = {"configurable": {"thread_id": "edit"}}
    llm.invoke(_agent_history(PASSAGE), config=cfg)
    edited = llm.invoke(_agent_history("[cleared]"), config=cfg)  # ClearToolUsesEdit: same id, new content
    repair = edited.response_metadata["repair"]
    assert repair["operator"] == "refresh" and repair["budget"] == 50.0 and repair["edits"].get("replace") == 1
    assert repair["stale_tokens"] > 0 and repair["refreshed_tokens"] > 0 and repair["reused_tokens"] > 0
    assert repair["recomputed_tokens"] < edited.usage_metadata["input_tokens"] and repair["latency_ms"] > 0
    per_call = llm.invoke(_agent_history(PASSAGE), config=cfg, repair_policy="reprefill")
    assert per_call.response_metadata["repair"]["operator"] == "reprefill"


def test_decode_time_replay_is_reported_in_the_response(tiny_chat):
    llm = tiny_chat(repair_policy="shift:margin=1e9")  # any margin is thin: replays before the first pick
    cfg = {"configurable": {"thread_id": "margin"}}
    llm.invoke(_agent_history(PASSAGE), config=cfg)
    repair = llm.invoke(_agent_history("[cleared]"), config=cfg).response_metadata["repair"]
    assert repair["operator"] == "shift" and repair["decode_replay"]["at_token"] == 0
    assert repair["decode_replay"]["recomputed_tokens"] > 0 and "decode margin" in repair["fallback"]


def test_a_call_renders_and_tokenizes_its_prompt_once(tiny_chat, tokenizer, monkeypatch):
    """The cache-slot choice and the session's prepare share one rendering of the call's messages
    (prefix renderings for the segment table and the committed answer's rendering aside)."""
    prompts, tokenized = [], []
    cls = type(tokenizer)
    render, tokenize = cls.apply_chat_template, cls.__call__

    def counting_render(self, *args, **kwargs):
        text = render(self, *args, **kwargs)
        if kwargs.get("add_generation_prompt"):
            prompts.append(text)
        return text

    def counting_tokenize(self, text, *args, **kwargs):
        tokenized.append(text)
        return tokenize(self, text, *args, **kwargs)

    monkeypatch.setattr(cls, "apply_chat_template", counting_render)
    monkeypatch.setattr(cls, "__call__", counting_tokenize)
    llm = tiny_chat(max_tokens=2)
    cfg = {"configurable": {"thread_id": "render-once"}}
    turn = [SystemMessage("Be brief.", id="s"), HumanMessage("Hello", id="h1")]
    first = llm.invoke(turn, config=cfg)
    llm.invoke(turn + [first, HumanMessage("More?", id="h2")], config=cfg)
    assert len(prompts) == 2 and prompts[0] != prompts[1]  # one rendering per call
    assert [tokenized.count(p) for p in prompts] == [1, 1]


def test_thread_id_comes_from_the_langgraph_run_config(tiny_chat):
    llm = tiny_chat(max_tokens=2)

    def call_model(state: MessagesState):
        return {"messages": [llm.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_edge(START, "model")
    app = graph.compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "graph-thread"}}
    app.invoke({"messages": [HumanMessage("Hi")]}, cfg)
    out = app.invoke({"messages": [HumanMessage("Again")]}, cfg)
    last = out["messages"][-1]
    assert last.response_metadata["thread_id"] == "graph-thread"
    assert last.usage_metadata["input_token_details"]["cache_read"] > 0
    assert "graph-thread" in llm.threads


def test_stream_gives_usage_once_on_the_last_chunk(tiny_chat):
    chunks = list(tiny_chat(max_tokens=5).stream("Hello", config={"configurable": {"thread_id": "s"}}))
    assert chunks[-1].chunk_position == "last"
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1
    assert chunks[-1].response_metadata["model_name"] == "tiny-llama"


def test_a_stream_left_suspended_is_closed_by_the_next_call_on_the_main_thread(real_chat):
    """A script's ``s = chat.stream(...); next(s)`` then ``chat.invoke(...)`` on the same thread
    id: nothing could ever resume the stream, so the call closes it instead of waiting forever
    (an alarm turns a hang into a failure). Its answer equals a fresh model's; the abandoned
    stream just ends."""
    chat, cfg = real_chat(max_tokens=24), {"configurable": {"thread_id": "abandoned"}}

    def hung(signum, frame):
        raise TimeoutError("the second call waited for the suspended stream")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(300)
    try:
        stream = chat.stream("Tell me a long story about a lighthouse.", config=cfg)
        first = next(stream).content
        answer = chat.invoke("Say hi.", config=cfg).content
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    rest = list(stream)
    assert first and "".join(c.content for c in rest) == ""
    assert rest[-1].response_metadata["finish_reason"] == "interrupted"  # the reader can tell it was cut
    assert answer == real_chat(max_tokens=24).invoke("Say hi.").content
    with chat.threads_for().lease("abandoned") as session:
        session.check_invariants()


def test_a_call_from_another_os_thread_waits_for_a_stream_being_read(real_chat, monkeypatch):
    """The same situation on another OS thread may be two workers of a pool on one thread id: the
    second waits while the stream is read (calls on one thread never interleave)."""
    monkeypatch.setattr(leased_streams, "ABANDONED_AFTER_S", 600.0)
    chat, cfg, out = real_chat(max_tokens=12), {"configurable": {"thread_id": "shared"}}, {}
    stream = chat.stream("Tell me a long story about a lighthouse.", config=cfg)
    first = next(stream).content
    waiting = threading.Thread(target=lambda: out.update(answer=chat.invoke("Say hi.", config=cfg).content), daemon=True)
    waiting.start()
    waiting.join(3.0)
    assert waiting.is_alive() and "answer" not in out  # holds while the stream holds the thread
    rest = "".join(c.content for c in stream)
    waiting.join(300)
    assert not waiting.is_alive() and out["answer"]
    assert first + rest


def test_a_stream_nobody_reads_is_closed_for_a_waiting_call_after_a_while(real_chat, monkeypatch):
    """``async for ... break`` on ``astream`` and then ``ainvoke``, or a ``batch`` after a suspended
    stream: the waiting call runs on an executor thread, where nothing proves the stream
    abandoned but time. After ``ABANDONED_AFTER_S`` unread seconds it is closed; the answers equal
    a fresh model's."""
    monkeypatch.setattr(leased_streams, "ABANDONED_AFTER_S", 0.5)
    chat, cfg = real_chat(max_tokens=16), {"configurable": {"thread_id": "unread"}}
    fresh = real_chat(max_tokens=16)

    async def abandon_then_ask():
        stream = chat.astream("Tell me a long story about a dragon.", config=cfg)
        async for _ in stream:
            break
        return await asyncio.wait_for(chat.ainvoke("What is the capital of France?", config=cfg), 300)

    answer = asyncio.run(abandon_then_ask()).content
    assert answer == fresh.invoke("What is the capital of France?").content
    stream = chat.stream("Tell me a long story about a dragon.", config=cfg)
    next(stream)
    done = []
    worker = threading.Thread(target=lambda: done.append(chat.batch(["Say hi.", "Say bye."], config=cfg)), daemon=True)
    worker.start()
    worker.join(300)
    assert done and [m.content for m in done[0]] == [m.content for m in fresh.batch(["Say hi.", "Say bye."])]


def test_stop_accepts_one_string_and_refuses_other_types(tiny_chat):
    llm = tiny_chat(max_tokens=8)
    text = llm.invoke("Hello").content
    assert len(text) > 2
    cut = text[1:3]
    assert llm.invoke("Hello", stop=cut).content == llm.invoke("Hello", stop=[cut]).content == text[: text.index(cut)]
    with pytest.raises(TypeError, match="stop must be a string or a list of strings"):
        llm.invoke("Hello", stop=5)


def test_cuda_graphs_without_a_gpu_device_fails_at_construction():
    with pytest.raises(ValueError, match="pass device='cuda'"):
        ChatKVMemory(engine="cuda_graphs")


def test_forced_tool_calls_parse_with_ids_even_on_a_random_model(tiny_chat):
    # bounded argument types: a random-weight model would otherwise fill free strings / integers
    # until max_tokens (the embedded model's free-form calls run in the standard suite)
    def lookup(topic: Literal["rivers", "towns"], recent: bool) -> str:
        """Look up passages."""
        return ""

    def other(flag: bool) -> bool:
        """Other tool."""
        return flag

    llm = tiny_chat(max_tokens=60)
    for choice, expected in (("any", {"lookup", "other"}), ("lookup", {"lookup"}), ("other", {"other"})):
        # one call: a random model never ends a parallel list by itself (parallel calls: test_chat_model_tools)
        msg = llm.bind_tools([lookup, other], tool_choice=choice, parallel_tool_calls=False).invoke(
            "Find passages about rivers.")
        assert len(msg.tool_calls) == 1, msg
        call = msg.tool_calls[0]
        assert call["name"] in expected and call["id"]
        if call["name"] == "lookup":
            assert call["args"]["topic"] in ("rivers", "towns") and isinstance(call["args"]["recent"], bool)
    none = llm.bind_tools([lookup], tool_choice="none").invoke("Find passages.")
    assert none.tool_calls == [] and "<tool_call>" not in none.content
    with pytest.raises(ValueError, match="not a bound tool"):
        llm.bind_tools([lookup], tool_choice="missing")


def test_structured_output_follows_the_schema_on_a_random_model(tiny_chat):
    schema = {"title": "Answer", "type": "object", "required": ["city", "known"],
              "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "known": {"type": "boolean"}}}
    llm = tiny_chat(max_tokens=60)
    for method in ("json_schema", "function_calling", "json_mode"):
        out = llm.with_structured_output(schema, method=method).invoke("Where?")
        assert set(out) == {"city", "known"} and isinstance(out["known"], bool), (method, out)
    raw = llm.with_structured_output(schema, include_raw=True).invoke("Where?")
    assert raw["parsing_error"] is None and isinstance(raw["raw"], AIMessage)


def test_prompt_lookup_changes_no_answer_even_under_a_grammar(tiny_chat):
    schema = {"title": "Answer", "type": "object", "required": ["city", "known"],
              "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "known": {"type": "boolean"}}}
    answers = []
    for lookup in (0, 4):
        llm = tiny_chat(max_tokens=40, prompt_lookup=lookup)
        answers.append((llm.invoke(_agent_history(PASSAGE)).content, llm.with_structured_output(schema).invoke("Where?")))
    assert answers[0] == answers[1]
    with pytest.raises(ValueError, match="prompt_lookup"):
        tiny_chat(prompt_lookup=-1)
    with pytest.raises(TypeError, match="prompt_lookup"):
        tiny_chat(prompt_lookup=True)  # not coerced to 1


# ------------------------------------------------------------------ pure helpers
def test_stop_sequences_and_tool_openers_are_held_back(tokenizer):
    ids = tokenizer("Hello wor", add_special_tokens=False)["input_ids"] + \
        tokenizer(" world STOP here", add_special_tokens=False)["input_ids"]
    watcher = TextWatcher(tokenizer, ["STOP"], watch_calls=False)
    streamed = "".join(watcher.add(t) for t in ids if not watcher.stopped) + watcher.finish()
    assert watcher.stopped and streamed == watcher.text and not streamed.endswith("STOP")
    call = tokenizer("Sure. " + format_call("f", {"a": 1}), add_special_tokens=False)["input_ids"]
    watcher = TextWatcher(tokenizer, [], watch_calls=True)
    streamed = "".join(watcher.add(t) for t in call) + watcher.finish()
    assert streamed == "Sure. " and "<" not in streamed


def test_split_calls_keeps_bad_calls_as_invalid_never_drops_them():
    text = "Let me look. " + format_call("f", {"a": 1}) + "\n<tool_call>\n{not json}\n</tool_call>\n<tool_call>\n{\"na"
    content, calls, invalid = split_calls(text)
    assert content == "Let me look." and calls[0]["name"] == "f" and calls[0]["args"] == {"a": 1} and calls[0]["id"]
    assert len(invalid) == 2 and all(i["id"] and i["error"] for i in invalid)
    assert "not terminated" in invalid[1]["error"]


def test_tool_choice_forms():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert normalize_tool_choice(None, tools) == "auto" and normalize_tool_choice(None, None) is None
    forced = [normalize_tool_choice(form, tools) for form in ("any", True, "required")]
    assert forced == ["required"] * 3
    assert normalize_tool_choice({"type": "function", "function": {"name": "f"}}, tools) == "f"
    assert normalize_tool_choice("none", tools) == "none"
    with pytest.raises(ValueError, match="no tools are bound"):
        normalize_tool_choice("any", [])


def test_grammar_caps_only_unbounded_strings():
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string", "enum": ["x"]},
                                               "c": {"type": "string", "maxLength": 3}}}
    capped = capped_strings(schema)["properties"]
    assert capped["a"]["maxLength"] == MAX_FREE_STRING_CHARS and "maxLength" not in capped["b"]
    assert capped["c"]["maxLength"] == 3 and "maxLength" not in schema["properties"]["a"]  # input untouched


def test_messages_leave_tools_to_the_session_and_reject_images():
    out = to_session_messages([HumanMessage("hi", id="h")], template_tools=False)
    assert out == [{"role": "user", "content": "hi", "id": "h"}]  # the session folds tools (prompt.render_text)
    schema = to_session_messages([HumanMessage("hi", id="h")], False, {"type": "object"})
    assert schema[0]["role"] == "system" and "JSON schema" in schema[0]["content"]
    ai = AIMessage("", tool_calls=[{"name": "f", "args": {"x": 1}, "id": "c"}])
    assert to_session_messages([ai], False)[0]["content"] == format_call("f", {"x": 1})
    image = HumanMessage(content=[{"type": "image", "url": "https://example.com/a.png"}])
    with pytest.raises(UnsupportedContentError, match="text only"):
        to_session_messages([image], False)


# ------------------------------------------------------------------ the embedded model
@pytest.mark.real_model
def test_real_model_second_turn_reads_the_live_cache(real):
    llm = ChatKVMemory(model=real, max_tokens=12)
    cfg = {"configurable": {"thread_id": "real-turns"}}
    first = llm.invoke([HumanMessage("What is the capital of France?", id="q1")], config=cfg)
    second = llm.invoke([HumanMessage("What is the capital of France?", id="q1"), first,
                         HumanMessage("And of Italy?", id="q2")], config=cfg)
    read = second.usage_metadata["input_token_details"]["cache_read"]
    assert read >= first.usage_metadata["input_tokens"] + first.usage_metadata["output_tokens"] - 1
    assert second.response_metadata["repair"]["recomputed_tokens"] == second.usage_metadata["input_tokens"] - read


@pytest.mark.real_model
def test_real_model_mid_history_edit_reports_a_budgeted_repair(real):
    llm = ChatKVMemory(model=real, max_tokens=8, repair_policy="sur@5")
    cfg = {"configurable": {"thread_id": "real-edit"}}
    llm.invoke(_agent_history(PASSAGE * 3), config=cfg)
    edited = llm.invoke(_agent_history("[cleared]"), config=cfg)
    repair = edited.response_metadata["repair"]
    assert repair["operator"] == "refresh" and repair["budget"] == 5.0 and repair["fallback"] is None
    assert repair["edits"].get("replace") == 1 and repair["stale_tokens"] > 0
    assert repair["refreshed_tokens"] == -(-repair["stale_tokens"] * 5 // 100)  # B = ceil(S * b / 100)
    assert edited.usage_metadata["input_token_details"]["cache_read"] == repair["reused_tokens"] > 0


def test_a_loaded_model_is_used_by_its_instance_only(tokenizer, real):
    """ChatKVMemory(model=LoadedModel) runs exactly that object, whichever instance came first;
    a plain ChatKVMemory() keeps the model kvmemory loads itself."""
    changed = LoadedModel(tiny_model("llama"), tokenizer, real.name, real.path, torch.float32)
    plain_before = ChatKVMemory(max_tokens=2)
    assert plain_before.threads.model is not changed.model  # the embedded model, loaded by name
    pinned = ChatKVMemory(model=changed, max_tokens=2)
    assert pinned.model == "smollm2" and pinned.threads.model is changed.model
    later_plain = ChatKVMemory(max_tokens=2).threads.model
    assert later_plain is plain_before.threads.model and later_plain is not changed.model
    answer = pinned.invoke([HumanMessage("Hi")], {"configurable": {"thread_id": "pinned"}})
    plain = plain_before.invoke([HumanMessage("Hi")], {"configurable": {"thread_id": "pinned"}})
    assert answer.response_metadata["model_name"] == plain.response_metadata["model_name"]
    assert pinned.threads.session("pinned").token_ids != plain_before.threads.session("pinned").token_ids
    with pytest.raises(ValueError, match="dtype"):
        ChatKVMemory(model=changed, dtype="bf16")
