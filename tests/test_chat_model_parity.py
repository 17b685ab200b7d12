"""ChatKVMemory on the paths users of ChatOpenAI / ChatOllama / ChatHuggingFace rely on:
``create_agent(response_format=...)`` and ``bind(response_format=...)``, token counting with the
model's tokenizer and chat template, a profile built from the model's config, sampling settings,
dtype / device spellings, unknown settings rejected, and one model name everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from langchain.agents import create_agent
from langchain.agents.middleware import SummarizationMiddleware
from langchain.agents.structured_output import ProviderStrategy, ToolStrategy
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from pydantic import BaseModel, Field

from kvmemory.errors import InputError
from kvmemory.models import LoadedModel
from langchain_kvmemory import ChatKVMemory
from langchain_kvmemory.constrained import response_schema
from langchain_kvmemory.sampling import Sampling
from support import tiny_model


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="the person's name")
    age: int = Field(description="age in years")


PERSON_TEXT = "Ilse Marrow is 42 years old. Extract the person."


@pytest.fixture(scope="module")
def tiny_loaded(tokenizer):
    return LoadedModel(tiny_model("llama"), tokenizer, "tiny-llama", Path("tiny-llama"), torch.float32)


# ------------------------------------------------------------------ fast: no model decoding
def test_response_format_forms_all_name_the_schema():
    schema = Person.model_json_schema()
    openai_form = {"type": "json_schema", "json_schema": {"name": "Person", "schema": schema, "strict": True}}
    assert response_schema(openai_form) == ("json_schema", schema)
    assert response_schema({"type": "json_schema", "schema": schema}) == ("json_schema", schema)
    kind, from_class = response_schema(Person)
    assert kind == "json_schema" and set(from_class["properties"]) == {"name", "age"}
    assert response_schema(schema) == ("json_schema", schema)
    assert response_schema({"type": "json_object"}) == ("json_object", None)
    assert response_schema({"type": "text"}) is None and response_schema(None) is None
    with pytest.raises(InputError, match="without a schema"):
        response_schema({"type": "json_schema", "json_schema": {"name": "x"}})


def test_unknown_settings_are_rejected_with_the_closest_name():
    with pytest.raises(ValueError, match="did you mean 'top_p'"):
        ChatKVMemory(top_q=0.9)
    with pytest.raises(ValueError, match="'frobnicate'"):
        ChatKVMemory(model_kwargs={"frobnicate": 1})
    with pytest.raises(ValueError, match="top_p must lie in"):
        ChatKVMemory(top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens=8 and max_tokens=9"):
        ChatKVMemory(max_new_tokens=8, max_tokens=9)


def test_aliases_dtype_spellings_and_device():
    llm = ChatKVMemory(max_new_tokens=7, torch_dtype="bfloat16", device_map="cpu", model_kwargs={"top_k": 5})
    assert (llm.max_tokens, llm.dtype, llm.device, llm.top_k) == (7, "bf16", "cpu", 5)
    assert ChatKVMemory(dtype=torch.float32).dtype == "fp32"
    assert ChatKVMemory(dtype="torch.bfloat16").dtype == "bf16"
    assert ChatKVMemory(dtype="auto").dtype == ("bf16" if torch.cuda.is_available() else "fp32")
    assert ChatKVMemory(device="auto").device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="use bf16"):
        ChatKVMemory(dtype="float16")
    with pytest.raises(ValueError, match="device_map dict"):
        ChatKVMemory(device_map={"": 0})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_a_gpu_names_the_fix():
    with pytest.raises(ValueError, match="torch sees no GPU"):
        ChatKVMemory(device="cuda")


def test_model_name_agrees_everywhere_on_a_tiny_model(tiny_loaded):
    llm = ChatKVMemory(model=tiny_loaded, max_tokens=2)
    answer = llm.invoke([HumanMessage("Hi")], {"configurable": {"thread_id": "names"}})
    assert llm.model_name == answer.response_metadata["model_name"] == llm._get_ls_params()["ls_model_name"]
    assert llm.model_name == "tiny-llama" and llm.profile["max_input_tokens"] == 8192  # the tiny config's


def test_unknown_call_arguments_are_rejected_before_the_thread_is_touched(tiny_loaded):
    llm = ChatKVMemory(model=tiny_loaded, max_tokens=2)
    with pytest.raises(InputError, match="did you mean 'top_k'"):
        llm.invoke([HumanMessage("Hi")], {"configurable": {"thread_id": "bad-call"}}, top_kk=3)
    assert "bad-call" not in llm.threads


def test_greedy_logprobs_name_the_argmax_token(tiny_loaded):
    llm = ChatKVMemory(model=tiny_loaded, max_tokens=4, logprobs=True, top_logprobs=3)
    answer = llm.invoke([HumanMessage("Hi")], {"configurable": {"thread_id": "logprobs"}})
    content = answer.response_metadata["logprobs"]["content"]
    assert len(content) == answer.usage_metadata["output_tokens"] and len(content) > 0
    for entry in content:
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] <= 0.0
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])


def test_presence_and_frequency_penalties_count_answer_tokens_only():
    scores = torch.zeros(1, 6)
    ids = torch.tensor([[1, 1, 4, 2, 2, 2, 5]])  # prompt = the first 3 ids
    out = Sampling(presence_penalty=0.5, frequency_penalty=0.25).processors([], prompt_tokens=3)(ids, scores)
    expected = torch.zeros(1, 6)
    expected[0, 2] = -(0.5 + 3 * 0.25)
    expected[0, 5] = -(0.5 + 0.25)
    assert torch.equal(out, expected)


# ------------------------------------------------------------------ the embedded model
@pytest.mark.real_model
@pytest.mark.parametrize("strategy", [ProviderStrategy, ToolStrategy], ids=["provider", "tool"])
def test_create_agent_response_format_decodes_under_the_schema(real, strategy):
    llm = ChatKVMemory(model=real, max_tokens=48)
    agent = create_agent(llm, tools=[], response_format=strategy(Person))
    out = agent.invoke({"messages": [HumanMessage(PERSON_TEXT)]}, {"configurable": {"thread_id": f"rf-{strategy.__name__}"}})
    person = out["structured_response"]
    assert isinstance(person, Person) and person.name == "Ilse Marrow" and person.age == 42


@pytest.mark.real_model
def test_bind_response_format_takes_a_pydantic_class_or_the_openai_form(real):
    llm = ChatKVMemory(model=real, max_tokens=48)
    openai_form = {"type": "json_schema", "json_schema": {"name": "Person", "schema": Person.model_json_schema()}}
    for form in (Person, openai_form):
        answer = llm.bind(response_format=form).invoke([HumanMessage(PERSON_TEXT)])
        assert Person.model_validate_json(answer.content).age == 42


@pytest.mark.real_model
def test_token_counts_use_the_models_tokenizer_and_chat_template(real):
    llm = ChatKVMemory(model=real, max_tokens=4)
    text = "Ostrava Nova was founded in 1873."
    assert llm.get_num_tokens(text) == len(real.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert llm.get_num_tokens("1873") == 4  # SmolLM2 splits digits (GPT-2 would count 1 or 2)
    messages = [SystemMessage("Be brief."), HumanMessage("Who founded Ostrava Nova?"),
                AIMessage("Ilse Marrow."), HumanMessage("When?")]

    def lookup(city: str) -> str:
        """Look a city up."""
        return city

    for tools in (None, [lookup]):
        runnable = llm.bind_tools(tools, tool_choice="none") if tools else llm
        answer = runnable.invoke(messages, {"configurable": {"thread_id": f"count-{bool(tools)}"}})
        assert llm.get_num_tokens_from_messages(messages, tools=tools) == answer.usage_metadata["input_tokens"]


@pytest.mark.real_model
def test_profile_of_a_folder_model_comes_from_its_config(real):
    llm = ChatKVMemory(model=str(real.path))
    assert llm.profile["max_input_tokens"] == real.model.config.max_position_embeddings == 8192
    assert llm.model_name == str(real.path) and ChatKVMemory().model_name == real.name == "SmolLM2-135M-Instruct"
    middleware = SummarizationMiddleware(model=llm, trigger=("fraction", 0.8), keep=("messages", 4))
    assert middleware._get_profile_limits() == 8192


@pytest.mark.real_model
def test_sampling_settings_reach_the_decoder(real):
    llm = ChatKVMemory(model=real, max_tokens=12)
    prompt = [HumanMessage("Write a short sentence about rivers.")]
    greedy = llm.invoke(prompt).content
    # hot sampling cut to the single most likely token (top_k=1) or nucleus (top_p tiny) is greedy
    assert llm.invoke(prompt, temperature=5.0, top_k=1, seed=3).content == greedy
    assert llm.invoke(prompt, temperature=5.0, top_p=1e-6, seed=3).content == greedy
    assert llm.invoke(prompt, temperature=5.0, seed=3).content != greedy  # sampling does run
    # greedy "The cat is a cat." repeats " cat": penalties on repeated tokens change the answer
    repeating = [HumanMessage("Say 'cat cat cat cat cat'.")]
    plain = llm.invoke(repeating).content
    assert plain.count(" cat") >= 2
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}):
        assert llm.invoke(repeating, **penalty).content != plain
    assert llm.invoke(prompt, max_new_tokens=3).usage_metadata["output_tokens"] <= 3


@pytest.mark.real_model
def test_model_name_agrees_on_the_embedded_model(real):
    llm = ChatKVMemory(max_tokens=2)
    answer = llm.invoke("Hi")
    assert llm.model_name == answer.response_metadata["model_name"] == llm._get_ls_params()["ls_model_name"]
    assert llm.model_name == "SmolLM2-135M-Instruct"


def test_a_plain_checkpointer_is_noted_once(tiny_loaded, tmp_path, monkeypatch, caplog):
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, MessagesState, StateGraph

    from langchain_kvmemory import chat_model
    from langchain_kvmemory.checkpointer import KVCheckpointSaver

    monkeypatch.setattr(chat_model, "_NOTED_SAVERS", set())
    llm = ChatKVMemory(model=tiny_loaded, max_tokens=2)

    def graph(saver):
        g = StateGraph(MessagesState)
        g.add_node("chat", lambda state: {"messages": [llm.invoke(state["messages"])]})
        g.add_edge(START, "chat")
        return g.compile(checkpointer=saver)

    def notes():
        return [r for r in caplog.records if "does not persist live KV caches" in r.getMessage()]

    wrapped = graph(KVCheckpointSaver(InMemorySaver(), llm, blob_dir=tmp_path))
    wrapped.invoke({"messages": [HumanMessage("Hi")]}, {"configurable": {"thread_id": "kept"}})
    assert notes() == []
    plain = graph(InMemorySaver())
    for turn in ("Hi", "Again"):
        plain.invoke({"messages": [HumanMessage(turn)]}, {"configurable": {"thread_id": "plain"}})
    assert len(notes()) == 1 and "InMemorySaver" in notes()[0].getMessage()
