"""Bad input everywhere public: each bad call raises a kvmemory error (a
ValueError / TypeError subclass) naming the fix, and the session or thread stays exactly as it
was: same messages, same cache rows, and the next answer equals a clean run's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage
from pydantic import ValidationError

from kvmemory import kvcache
from kvmemory.edits import plan_edits
from kvmemory.errors import (ContextOverflowError, InputError, InputTypeError, KVMemoryError, MessageError,
                             ModelNotFoundError, UnknownMessageError)
from kvmemory.models import LoadedModel, load_model, resolve_dtype
from kvmemory.policy import RepairPolicy
from kvmemory.shift import RotaryShifter
from kvmemory.session import KVSession
from support import QUERY, history, tiny_model

HUGE = "lorem ipsum " * 6000  # ~12 K tokens, beyond the 8 K context of the tiny models and SmolLM2


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture
def session(llama, tokenizer):
    s = KVSession(llama, tokenizer)
    s.prepare(history() + [QUERY])
    return s


class Snapshot:
    """Everything a bad call must leave alone."""

    def __init__(self, s: KVSession):
        self.ids, self.exact = list(s.token_ids), s.exact_rows
        self.messages = [(m.key, m.role, m.content) for m in s.messages]
        self.rows = [(k.clone(), v.clone()) for k, v in kvcache.layer_tensors(s.cache)]
        self.logits = None if s.next_logits is None else s.next_logits.clone()

    def check(self, s: KVSession) -> None:
        assert list(s.token_ids) == self.ids and s.exact_rows == self.exact
        assert [(m.key, m.role, m.content) for m in s.messages] == self.messages
        for (k, v), (k2, v2) in zip(self.rows, kvcache.layer_tensors(s.cache), strict=True):
            assert torch.equal(k, k2) and torch.equal(v, v2)
        if self.logits is None:  # the last answer is held as a message: nothing pending
            assert s.next_logits is None
        else:
            assert s.next_logits is not None and torch.equal(self.logits, s.next_logits)


def answers_like_a_clean_run(s: KVSession, model, tokenizer) -> None:
    clean = KVSession(model, tokenizer)
    clean.prepare([{"role": m.role, "content": m.content, "id": m.key, **m.extra} for m in s.messages])
    assert s.generate(6).token_ids == clean.generate(6).token_ids


class ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.calls += 1


BAD_SESSION_CALLS = {
    "empty list": (lambda s: s.prepare([]), MessageError, "empty"),
    "one dict, not a list": (lambda s: s.prepare({"role": "user", "content": "x"}), MessageError, "wrap it"),
    "a string, not a list": (lambda s: s.prepare("hello"), MessageError, "wrap it"),
    "not a mapping": (lambda s: s.prepare([42]), MessageError, "dict with 'role'"),
    "missing role": (lambda s: s.prepare([{"content": "x"}]), MessageError, "no 'role'"),
    "missing content": (lambda s: s.prepare([{"role": "user"}]), MessageError, "no 'content'"),
    "unknown role": (lambda s: s.prepare([{"role": "wizard", "content": "x"}]), MessageError, "use one of"),
    "int content": (lambda s: s.prepare([{"role": "user", "content": 5}]), MessageError, "as a string"),
    "image block": (lambda s: s.prepare([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
                    MessageError, "text only"),
    "list id": (lambda s: s.prepare([{"role": "user", "content": "x", "id": ["a"]}]), MessageError, "ids are"),
    "duplicate ids": (lambda s: s.prepare([{"role": "user", "content": "x", "id": "1"},
                                           {"role": "user", "content": "y", "id": "1"}]), MessageError, "twice"),
    "enormous message": (lambda s: s.prepare(history() + [{"role": "user", "content": HUGE}]),
                         ContextOverflowError, r"context is 8192: remove or summarise"),
    "budget > 100": (lambda s: s.prepare(history(), policy="sur@150"), InputError, r"\[0, 100\]"),
    "budget NaN": (lambda s: s.prepare(history(), policy="sur@nan"), InputError, r"\[0, 100\]"),
    "negative budget": (lambda s: s.prepare(history(), policy="sur@-1"), InputError, r"\[0, 100\]"),
    "policy of another type": (lambda s: s.prepare(history(), policy=5), InputTypeError, "label like"),
    "unknown id delete": (lambda s: s.delete_message("nope"), UnknownMessageError, "known ids: 'sys'"),
    "unknown id replace": (lambda s: s.replace_message("nope", "x"), UnknownMessageError, "known ids"),
    "unknown id insert": (lambda s: s.insert_message("nope", {"role": "user", "content": "x"}),
                          UnknownMessageError, "known ids"),
    "replace with non-text": (lambda s: s.replace_message("t1", 3.5), MessageError, "as a string"),
    "replace with enormous text": (lambda s: s.replace_message("t1", HUGE), ContextOverflowError, "8192"),
    "insert a malformed message": (lambda s: s.insert_message("t1", {"role": "robot", "content": "x"}),
                                   MessageError, "role"),
    "max_new_tokens 0": (lambda s: s.generate(0), InputError, "at least 1"),
    "max_new_tokens str": (lambda s: s.generate("5"), InputTypeError, "int"),
    "temperature NaN": (lambda s: s.generate(4, temperature=float("nan")), InputError, "finite"),
    "negative temperature": (lambda s: s.generate(4, temperature=-1.0), InputError, ">= 0"),
    "seed str": (lambda s: s.generate(4, seed="x"), InputTypeError, "seed"),
}


@pytest.mark.parametrize("name", sorted(BAD_SESSION_CALLS))
def test_bad_session_call_leaves_the_session_as_it_was(name, session, llama, tokenizer):
    call, error, match = BAD_SESSION_CALLS[name]
    before = Snapshot(session)
    counter = ForwardCounter(llama)
    try:
        with pytest.raises(error, match=match) as info:
            call(session)
    finally:
        counter.handle.remove()
    assert isinstance(info.value, KVMemoryError) and isinstance(info.value, (ValueError, TypeError))
    assert counter.calls == 0, "the bad call ran the model before refusing"
    before.check(session)
    answers_like_a_clean_run(session, llama, tokenizer)


def test_content_block_lists_work_like_strings(llama, tokenizer):
    blocks = KVSession(llama, tokenizer)
    blocks.prepare([{"role": "user", "content": [{"type": "text", "text": "Where is "}, "Helmsford?"], "id": "u"},
                    {"role": "assistant", "content": None, "id": "a",
                     "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {}}}]},
                    {"role": "user", "content": "Go on.", "id": "u2"}])
    text = KVSession(llama, tokenizer)
    text.prepare([{"role": "user", "content": "Where is Helmsford?", "id": "u"},
                  {"role": "assistant", "content": "", "id": "a",
                   "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {}}}]},
                  {"role": "user", "content": "Go on.", "id": "u2"}])
    assert blocks.token_ids == text.token_ids


@pytest.mark.parametrize("budget", [-1, 100.5, float("nan"), float("inf"), "5", True])
def test_repair_policy_budget_outside_0_100_or_of_another_type(budget):
    with pytest.raises(ValidationError, match="budget"):
        RepairPolicy(budget=budget)


def test_a_misspelled_policy_or_guard_setting_names_the_one_meant():
    from kvmemory.guard import GuardConfig

    with pytest.raises(ValidationError, match="'bugdet' \\(did you mean 'budget'\\?\\)"):
        RepairPolicy(bugdet=50)
    with pytest.raises(ValidationError, match="'fractoin' \\(did you mean 'fraction'\\?\\)"):
        GuardConfig(fractoin=0.2)


def test_repair_refuses_a_cache_that_does_not_match_its_ids(session):
    from kvmemory.repair import RepairJob, repair

    new = session._render(session.messages)[0]
    plan = plan_edits(session.token_ids, session.rendered, new, session.exact_rows)

    def job(cached_ids, policy):
        return RepairJob(model=session.model, capabilities=session.capabilities, shifter=None, cache=session.cache,
                         cached_ids=cached_ids, new=new, plan=plan, policy=policy, query_ids=[1], query_text="q")

    before = Snapshot(session)
    with pytest.raises(InputError, match="cache holds"):
        repair(job(session.token_ids[:-1], "sur@5"))
    with pytest.raises(InputError, match="bad policy label"):
        repair(job(session.token_ids, "sur@nan"))
    with pytest.raises(InputTypeError, match="RepairPolicy"):
        repair(job(session.token_ids, 7))
    before.check(session)


def test_shift_and_executors_refuse_float_positions_and_integer_keys(llama):
    from kvmemory.executors.sequential import check_positions

    shifter = RotaryShifter(llama)
    with pytest.raises(InputTypeError, match="integer tensor"):
        shifter.coefficients(torch.tensor([3.0, 4.0]), torch.tensor([1, 2]))
    coeffs = shifter.coefficients(torch.tensor([3, 4]), torch.tensor([1, 2]))
    with pytest.raises(InputTypeError, match="floating-point"):
        shifter.apply(torch.zeros(1, 2, 2, 16, dtype=torch.long), coeffs)
    with pytest.raises(InputTypeError, match="integer token positions"):
        check_positions(torch.tensor([0.5, 1.5]), 2, 2)


@pytest.mark.parametrize("dtype,match", [("fp16", "bf16 for half"), ("float64", "use 'fp32'"), (16, "use 'fp32'"),
                                         (torch.float16, "bf16 for half")])
def test_unsupported_dtypes_name_the_accepted_ones(dtype, match):
    with pytest.raises(InputError, match=match):
        resolve_dtype(dtype)
    assert resolve_dtype("BF16") == torch.bfloat16


def test_load_model_bad_arguments_fail_before_loading(tmp_path):
    with pytest.raises(InputTypeError, match="folder path"):
        load_model(123)
    with pytest.raises(InputError, match="fp16"):
        load_model(tmp_path, dtype="fp16")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(tmp_path / "nowhere")
    tiny_model("llama").save_pretrained(tmp_path / "no-tokenizer")
    with pytest.raises(ModelNotFoundError, match="no-tokenizer.*tokenizer.save_pretrained"):
        load_model(tmp_path / "no-tokenizer")


def test_session_needs_a_model_and_a_chat_template(llama, tokenizer):
    import copy

    with pytest.raises(InputTypeError, match="causal LM"):
        KVSession(None, tokenizer)
    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    with pytest.raises(InputError, match="chat_template"):
        KVSession(llama, base)
    with pytest.raises(InputError, match="bad policy label"):
        KVSession(llama, tokenizer, "magic@5")


@pytest.mark.real_model
def test_real_model_thread_survives_bad_calls(real):
    s = KVSession(real.model, real.tokenizer)
    s.prepare(history() + [QUERY])
    before = Snapshot(s)
    bad = [lambda: s.delete_message("missing"), lambda: s.prepare(history() + [{"role": "user", "content": HUGE}]),
           lambda: s.prepare([{"role": "user", "content": {"text": "x"}}]), lambda: s.prepare(history(), policy="sur@101")]
    for call in bad:
        with pytest.raises(KVMemoryError):
            call()
        before.check(s)
    answers_like_a_clean_run(s, real.model, real.tokenizer)


# ----------------------------------------------------------- LangChain surface
@pytest.fixture(scope="module")
def chat(llama, tokenizer):
    from langchain_kvmemory import ChatKVMemory

    loaded = LoadedModel(model=llama, tokenizer=tokenizer, name="tiny-llama-bad-input",
                         path=Path("tiny-llama-bad-input"), dtype=torch.float32)
    return ChatKVMemory(model=loaded, max_tokens=5)


def _thread(chat, thread_id):
    return chat.threads.session(thread_id)


HISTORY_LC = [HumanMessage("Where was Ilse Marrow born?", id="h1"), AIMessage("In Helmsford.", id="a1"),
              HumanMessage("And which river is it on?", id="h2")]
BAD_CHAT_CALLS = {
    "image block": (lambda llm, cfg: llm.invoke([HumanMessage(content=[{"type": "image_url", "image_url": {"url": "x"}}])],
                                                cfg), MessageError, "text only"),
    "enormous message": (lambda llm, cfg: llm.invoke(HISTORY_LC + [HumanMessage(HUGE)], cfg), ContextOverflowError,
                         "8192"),
    "budget > 100": (lambda llm, cfg: llm.invoke(HISTORY_LC, cfg, repair_policy="sur@150"), InputError, r"\[0, 100\]"),
    "max_tokens 0": (lambda llm, cfg: llm.invoke(HISTORY_LC, cfg, max_tokens=0), InputError, "max_tokens"),
    "temperature NaN": (lambda llm, cfg: llm.invoke(HISTORY_LC, cfg, temperature=math.nan), InputError, "finite"),
    "stream with bad budget": (lambda llm, cfg: list(llm.stream(HISTORY_LC, cfg, repair_policy="sur@-3")), InputError,
                               r"\[0, 100\]"),
    "empty history": (lambda llm, cfg: llm.invoke([], cfg), MessageError, "no messages"),
    "unknown setting": (lambda llm, cfg: llm.invoke(HISTORY_LC, cfg, top_q=0.5), InputError, "did you mean 'top_p'"),
    "top_p out of range": (lambda llm, cfg: llm.invoke(HISTORY_LC, cfg, top_p=2.0), InputError, "top_p"),
}


@pytest.mark.parametrize("name", sorted(BAD_CHAT_CALLS))
def test_bad_chat_call_leaves_the_thread_as_it_was(name, chat):
    call, error, match = BAD_CHAT_CALLS[name]
    cfg = {"configurable": {"thread_id": f"bad-{name}"}}
    first = chat.invoke(HISTORY_LC, cfg)
    before = Snapshot(_thread(chat, f"bad-{name}"))
    with pytest.raises(error, match=match):
        call(chat, cfg)
    before.check(_thread(chat, f"bad-{name}"))
    again = chat.invoke(HISTORY_LC + [first, HumanMessage("Thanks!", id="h3")], cfg)
    clean = chat.invoke(HISTORY_LC + [first, HumanMessage("Thanks!", id="h3")],
                        {"configurable": {"thread_id": f"clean-{name}"}})
    assert again.content == clean.content


def test_chat_content_blocks_answer_like_text(chat):
    blocks = chat.invoke([HumanMessage(content=[{"type": "text", "text": "Where is "}, "Helmsford?"])],
                         {"configurable": {"thread_id": "blocks"}})
    text = chat.invoke([HumanMessage("Where is Helmsford?")], {"configurable": {"thread_id": "text"}})
    assert blocks.content == text.content


def test_chat_model_settings_and_bind_tools(chat, llama, tokenizer):
    from langchain_kvmemory import ChatKVMemory

    for bad in ({"repair_policy": "sur@150"}, {"temperature": float("nan")}, {"max_tokens": 0}, {"timeout": 0}):
        with pytest.raises(ValidationError):
            ChatKVMemory(model=chat.model, **bad)
    with pytest.raises(InputTypeError, match="list of tools"):
        chat.bind_tools(lambda x: x)
    with pytest.raises(InputError, match="tool 0"):
        chat.bind_tools([42])

    def search(query: str) -> str:
        """Search the passages."""
        return query

    with pytest.raises(ValueError, match="not a bound tool"):
        chat.bind_tools([search], tool_choice="lookup")


def test_checkpoint_saver_constructor_arguments(tmp_path, chat):
    from langgraph.checkpoint.memory import InMemorySaver

    from langchain_kvmemory.checkpointer import KVCheckpointSaver

    with pytest.raises(InputTypeError, match="LangGraph checkpoint saver"):
        KVCheckpointSaver(object(), chat, blob_dir=tmp_path)
    with pytest.raises(InputError, match="search_depth"):
        KVCheckpointSaver(InMemorySaver(), chat, blob_dir=tmp_path, search_depth=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        KVCheckpointSaver(InMemorySaver(), chat, blob_dir=tmp_path / "file")
    with pytest.raises(TypeError, match="thread registry"):
        KVCheckpointSaver(InMemorySaver(), object(), blob_dir=tmp_path)
    with pytest.raises(ValueError, match="blob_dir"):
        KVCheckpointSaver(InMemorySaver(), chat)


def test_cli_bad_arguments_name_the_fix(tmp_path, capsys):
    from kvmemory_lab.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--budget", "150"])
    assert exit_info.value.code == 2 and "[0, 100]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--dtype", "fp16"])
    assert "invalid choice" in capsys.readouterr().err
    tiny_model("llama").save_pretrained(tmp_path / "no-tokenizer")
    assert main(["demo", "--model", str(tmp_path / "no-tokenizer")]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "no-tokenizer" in out and "tokenizer.save_pretrained" in out
