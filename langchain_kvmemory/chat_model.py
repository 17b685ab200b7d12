"""``ChatKVMemory``: a LangChain chat model over kvmemory's live, repaired KV caches.

Each LangGraph thread (``config["configurable"]["thread_id"]``) keeps its own live cache in a
:class:`kvmemory.threads.ThreadCaches` registry (byte budget, least-recently-used eviction). A new
turn prefills only new tokens; a history edited in the middle (a cleared tool output, a summary,
a removed message) is repaired under the repair policy (Shift + budgeted SUR by default) instead
of re-prefilled. ``usage_metadata.input_token_details["cache_read"]`` counts the prompt tokens
served from the live cache; ``response_metadata["repair"]`` is the repair report.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, ToolMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool, StructuredTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import Field, PrivateAttr, model_validator

import torch

from kvmemory.engine import attach as attach_engine
from kvmemory.guard import FidelityGuard, GuardConfig
from kvmemory.errors import InputError, InputTypeError, MessageError
from kvmemory.models import LoadedModel, embedded_model_dir, load_model
from kvmemory.policy import RepairPolicy
from kvmemory.prompt import RenderedPrompt, normalize_messages, render_prompt
from kvmemory.lookup import checked_prompt_lookup
from kvmemory.session import PROMPT_LOOKUP_TOKENS
from kvmemory.threads import ThreadCaches

from .constrained import AnswerBudget, BudgetSpent, Grammars, processor, response_schema
from .leased_streams import OpenStreams
from .messages import check_tool_history, session_message, to_session_messages
from .options import fold_aliases, normalize_device, normalize_dtype, reject_unknown
from .sampling import LogprobRecorder, Sampling
from .streaming import TextWatcher
from .tool_calls import CALL_OPEN, bare_calls, split_calls, template_renders_tools
from .slots import pick_slot, prompt_head_text, prompt_head_tokens
from .tool_policy import DEFAULT_MARGIN, normalize_tool_choice, scored_choice

log = logging.getLogger(__name__)

REPORT_KEYS = ("operator", "budget", "allocator", "prompt_tokens", "reused_tokens", "recomputed_tokens",
               "refreshed_tokens", "stale_tokens", "shifted_tokens", "intervals", "edits", "fallback",
               "capability_notes", "executor", "executor_fallback", "latency_ms", "adapter", "engine", "decode_replay")


EMBEDDED_NAME = "SmolLM2-135M-Instruct"
MODEL_ENV = "KVMEMORY_MODEL"  # the default model (a folder, or "smollm2") when none is passed
CHECKPOINTER_KEY = "__pregel_checkpointer"  # where LangGraph puts the graph's checkpointer in a node's config
# keyword arguments a call accepts besides the sampling settings (LangChain passes the ls_* and
# strict ones; decoding under a grammar is always schema-exact, so strict needs nothing more)
CALL_KEYS = frozenset({"max_tokens", "seed", "timeout", "repair_policy", "erase", "thread_id", "model", "tools",
                       "tool_choice", "parallel_tool_calls", "response_format", "ls_structured_output_format",
                       "strict", "structured_output_tools"})
RESERVE_SLACK = 16  # rows a call may hold beyond prompt + answer (end-of-turn markers of a committed answer)
# grammar-fixed tokens a constrained answer may add beyond max_tokens (call wrappers, forced names)
FIXED_TOKEN_ALLOWANCE = 128


@dataclass
class _Runtime:
    """A loaded model and what its chat template renders: one per model kvmemory loaded by name
    (shared by the instances naming it), or pinned to the instance given a LoadedModel."""

    loaded: LoadedModel
    template_tools: bool

    @property
    def grammars(self) -> Grammars:
        # built on the first constrained call (~1 s for the tokenizer info), once per tokenizer object
        tokenizer, vocab = self.loaded.tokenizer, self.loaded.model.config.vocab_size
        with _RUNTIMES_LOCK:
            per_vocab = _GRAMMARS.setdefault(tokenizer, {})
            if vocab not in per_vocab:
                per_vocab[vocab] = Grammars(tokenizer, vocab)
            return per_vocab[vocab]


_GRAMMARS: "weakref.WeakKeyDictionary[Any, dict[int, Grammars]]" = weakref.WeakKeyDictionary()
_RUNTIMES: dict[tuple[str, str, str], _Runtime] = {}
_RUNTIMES_LOCK = threading.Lock()


def _checked_stops(stop) -> list[str]:
    """A call's stop sequences as a list (one string is one sequence, as in other LangChain chat
    models; empty strings dropped).

    Raises:
        InputTypeError: not a string or a list / tuple of strings.
    """
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise InputTypeError(f"stop must be a string or a list of strings (got {stop!r}), e.g. stop=['\\n\\n']")
    return [s for s in stops if s]


def _runtime(model: str, dtype: str, engine: str, device: str = "cpu") -> _Runtime:
    with _RUNTIMES_LOCK:
        key = (model, dtype, engine, device)
        if key not in _RUNTIMES:
            on_gpu = engine == "cuda_graphs"  # attached once the model is on its device
            loaded = load_model(None if model in ("smollm2", "") else model, dtype,
                                engine="transformers" if on_gpu else engine)
            if device != "cpu":
                loaded.model.to(device)
            if on_gpu:
                loaded.engine = attach_engine(loaded.model, None, engine)
            _RUNTIMES[key] = _Runtime(loaded, template_renders_tools(loaded.tokenizer))
        return _RUNTIMES[key]


@dataclass
class _Call:
    """What one model call decided before it touched its thread (see ``ChatKVMemory._plan_call``)."""

    model_name: str
    runtime: _Runtime
    tools: list[dict[str, Any]] | None
    choice: str | None
    grammar: Any
    messages: list[dict[str, Any]]
    stops: list[str]
    max_tokens: int
    timeout: float | None
    thread_id: str  # the registry entry the call leases: the thread's cache slot
    logical_thread: str  # the LangGraph thread (response_metadata["thread_id"], checkpoint stores)
    prompt: RenderedPrompt  # the messages rendered and tokenized (no segment table: the session adds it)
    requested: tuple | None  # the response_format asked for (see constrained.response_schema)
    parallel: bool  # several tool calls allowed in one answer
    scored: bool  # auto_tool_calls="scored" decides the choice once the thread is prepared
    has_tool_results: bool  # the messages hold a tool result (the scored policy's later turns)
    sampling: Sampling
    fixed_allowance: int  # grammar-fixed tokens the answer may add beyond max_tokens
    seed: int | None
    call_gap: float | None = None  # the scored policy's gap in nats, once decided
    answer_tools: list[str] | None = None  # structured-output tools the answer is held to (structured_output_rounds)


def _model_folder(model: str) -> Path:
    """The folder a model name loads from (the embedded model: its converted cache folder)."""
    return embedded_model_dir() if model in ("smollm2", "") else Path(model).expanduser()


def _profile(config, name: str) -> dict[str, Any]:
    """The LangChain model profile of a model with this transformers ``config``."""
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    return {"name": name, "max_input_tokens": context, "max_output_tokens": context,
            "text_inputs": True, "image_inputs": False, "audio_inputs": False, "pdf_inputs": False,
            "video_inputs": False, "text_outputs": True, "tool_calling": True, "tool_choice": True,
            "structured_output": True, "tool_call_streaming": True, "temperature": True, "open_weights": True}


def _display_name(model: str) -> str:
    """The model's name in response_metadata["model_name"]: the embedded model's name, else the
    folder as given (so a per-call ``model=`` override shows in the answer's metadata)."""
    return EMBEDDED_NAME if model in ("smollm2", "") else str(model)


class ChatKVMemory(BaseChatModel):
    """Chat model on a local transformers model with per-thread live KV caches.

    Example:
        ```python
        from langchain_kvmemory import ChatKVMemory

        llm = ChatKVMemory(max_tokens=64, repair_policy="sur@5")
        llm.invoke("Hello", config={"configurable": {"thread_id": "t1"}})
        ```

    Each LangGraph ``thread_id`` (from the run config; ``default_thread_id`` otherwise) keeps
    its own live cache; an edited history is repaired under ``repair_policy``, and
    ``response_metadata["repair"]`` says what was reused, recomputed and why. One field per
    setting below; per-call overrides go to ``invoke(..., repair_policy=..., erase=...)``, and so
    do the sampling settings. Aliases: ``model_name`` (``model``), ``max_new_tokens``
    (``max_tokens``), ``torch_dtype`` (``dtype``), ``device_map`` (``device``); ``model_kwargs``
    folds into the fields. Unknown settings raise an InputError naming the closest accepted one.
    ``model_name`` (read-only after construction) is the name in ``response_metadata["model_name"]``
    and LangSmith's ``ls_model_name``.
    """

    model: str = Field(default_factory=lambda: os.environ.get(MODEL_ENV) or "smollm2")
    """``"smollm2"`` (the embedded SmolLM2-135M-Instruct), a local transformers model folder, or a
    :class:`kvmemory.LoadedModel` that this instance alone runs (alias ``model_name``; default:
    ``$KVMEMORY_MODEL``, else ``"smollm2"``)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Weights and cache dtype (CPU: fp32 is exact to Re-prefill, bf16 is faster). Alias
    ``torch_dtype``; accepts ``"float32"``/``torch.float32``, ``"bfloat16"``/``torch.bfloat16`` and
    ``"auto"`` (bf16 on CUDA, fp32 on CPU)."""
    engine: Literal["auto", "q4_1", "q4_1_int8", "q4_1_bf16", "q4_1_int8_bf16", "cuda_graphs", "transformers"] = "auto"
    """What computes cache rows (``kvmemory.load_model(engine=...)``): ``"auto"`` runs the embedded
    model on its GGUF blocks (same weights, faster decoding on CPU) and other models on transformers;
    ``"q4_1_int8"`` adds int8 activations on decoded tokens (faster, lossy like llama.cpp),
    ``"q4_1_bf16"`` bf16 linears for prefills (faster first call, lossy like bf16), ``"q4_1_int8_bf16"`` both;
    ``"cuda_graphs"`` (with ``device="cuda..."``) decodes each token as one captured CUDA graph, same weights;
    ``response_metadata["repair"]["engine"]`` says which ran and why."""
    device: str = "cpu"
    """Where the model runs (alias ``device_map``): ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"auto"``
    (CUDA when present)."""
    temperature: float = 0.0
    """Sampling temperature; 0 decodes greedily."""
    max_tokens: int = 256
    """Longest answer in tokens."""
    stop: list[str] | None = None
    """Strings that end the answer (not included in it)."""
    timeout: float | None = None
    """Seconds of decoding; the answer so far is returned with finish_reason ``"timeout"``."""
    max_retries: int = 0
    """Accepted for compatibility: local decoding has no transient failures to retry."""
    streaming: bool = False
    """Whether ``invoke`` streams through the callbacks (LangChain's standard parameter)."""
    seed: int | None = None
    """Sampling seed (temperature > 0)."""
    top_p: float | None = None
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``
    (transformers logits processors, see :mod:`langchain_kvmemory.sampling`)."""
    top_k: int | None = None
    """Sample among the ``top_k`` most likely tokens only."""
    min_p: float | None = None
    """Drop tokens less likely than ``min_p`` times the most likely one."""
    repetition_penalty: float | None = None
    """transformers' repetition penalty (> 1 discourages repeats), over the whole context."""
    presence_penalty: float | None = None
    """OpenAI's presence penalty, over the answer so far."""
    frequency_penalty: float | None = None
    """OpenAI's frequency penalty, over the answer so far."""
    logprobs: bool | None = None
    """Return the chosen tokens' log-probabilities (``response_metadata["logprobs"]["content"]``)."""
    top_logprobs: int | None = None
    """With ``logprobs``: also the ``top_logprobs`` most likely alternatives per token."""
    repair_policy: str = "sur@5"
    """How an edited history is repaired: ``"sur@5"`` (Shift + SUR at b = 5 %), ``"shift"``,
    ``"replay"``, ``"reprefill"``, ``"bm25@2"``, ... (see ``kvmemory.RepairPolicy``)."""
    memory_budget_bytes: int | None = Field(default=1 << 30, ge=0)
    """K/V bytes all live threads may hold together; least-recently-used idle threads are evicted
    first and a call that still does not fit waits (None: no limit)."""
    default_thread_id: str = "default"
    """Thread used when the run config names none."""
    auto_tool_calls: Literal["model", "after_user", "scored"] = "model"
    """Under ``tool_choice="auto"``: ``"model"`` lets the model decide; ``"after_user"`` requires
    a tool call after a user turn and leaves text free after a tool result (a ReAct policy for
    models too small to decide, such as the embedded one); ``"scored"``: as ``"after_user"`` on
    the first user turn, but a later user turn calls only when the model's own log-probability of
    opening a call is within ``call_margin`` nats of its favourite first token
    (:mod:`langchain_kvmemory.tool_policy`), so "thanks, summarise" gets text."""
    call_margin: float = Field(default=DEFAULT_MARGIN, ge=0)
    """``auto_tool_calls="scored"``: how many nats below the favourite first token a call may
    open and still be made."""
    parallel_tool_calls: bool = False
    """True allows several tool calls in one answer; False (default, because the 135 M model
    repeats a call when allowed several) at most one. Also per call / bind. ``max_tokens`` counts
    the tokens the model chooses: tokens the grammar fixes (call wrappers, a forced name) are not
    charged (``response_metadata["grammar_fixed_tokens"]``)."""
    structured_output_rounds: int = Field(default=1, ge=0)
    """With a structured-output tool bound next to other tools (a schema-only tool, as LangChain's
    ``create_agent(..., response_format=ToolStrategy(Schema))`` binds): once this many tool rounds
    (AIMessages calling other tools) follow the last user message, a call under
    ``tool_choice="any"``/``"auto"`` must call the structured-output tool, so the agent ends with
    its structured response; before that the model chooses among all bound tools. Raise it for
    models that chain several calls; 0 answers with the schema at once."""
    prompt_lookup: int = Field(default=PROMPT_LOOKUP_TOKENS, ge=0)
    """Greedy decoding checks this many draft tokens per forward, copied from what followed the
    answer's last tokens earlier in the conversation (prompt lookup, as llama.cpp's lookup
    decoding): the same answer in fewer forwards when it repeats its context (tool calls naming
    entities from tool results, quotes). 0: one token per forward."""
    batch_decoding: bool = False
    """True: threads answering at the same time (LangGraph threads and branches, calls from
    several Python threads or asyncio tasks) decode in one kernel call per token on the block
    engine (:mod:`kvmemory.engine.batching`), each answer bit for bit the answer alone at the same
    thread count (a forward checking prompt-lookup drafts runs alone). It pays where weight reads
    bound a step (short contexts, larger models); on long contexts of a small model the rows' own
    cache reads dominate and concurrent calls on separate cores decode faster (docs/engine.md).
    False (default): every thread decodes alone, with its share of the cores."""
    cache_slots: int = Field(default=4, ge=1)
    """Live caches one thread may keep, one per distinct prompt head (e.g. a router and an
    answerer node with different system prompts on one thread); each call uses the slot with the
    longest exact prefix reuse (:mod:`langchain_kvmemory.slots`, ``response_metadata["cache_slot"]``);
    an edited system message (a memory line rewritten each turn) is repaired in the slot holding
    it, not prefilled in a new one; 1 = one cache per thread. The slots count in
    ``memory_budget_bytes``; a checkpointer persists the thread's first slot only."""
    erase: Literal["none", "strict"] = "none"
    """``"strict"``: a call that deletes or replaces a held message recomputes every row from the
    edit point (Replay), drops the thread's side caches (``<thread>/summary``) and purges the
    removed messages from every ``KVCheckpointSaver`` persisting this model's threads;
    ``response_metadata["erase"]`` says what was erased."""
    guard: GuardConfig | None = None
    """Fidelity guard (a :class:`kvmemory.guard.GuardConfig` or dict; None = off): checks a sampled
    fraction of repairs against Re-prefill in the background and raises the thread's budget when
    the first-token KL exceeds its threshold; ``response_metadata["guard"]`` shows the thread's
    state, :meth:`guard_summary` all threads."""

    _guards: dict[tuple[str, str], FidelityGuard] = PrivateAttr(default_factory=dict)
    _registries: dict[tuple[str, str], ThreadCaches] = PrivateAttr(default_factory=dict)
    _registry_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _open_streams: OpenStreams = PrivateAttr(default_factory=OpenStreams)

    _pinned: _Runtime | None = PrivateAttr(default=None)

    def __init__(self, **kwargs: Any):
        """``model=`` may be an already loaded :class:`kvmemory.LoadedModel`: this instance then
        runs exactly that object (never a model loaded by name elsewhere in the process, and
        never lent to another instance that names the same model).

        Raises:
            ValueError (pydantic ValidationError): ``dtype`` given and different from the
                LoadedModel's.
        """
        kwargs = fold_aliases(kwargs, "ChatKVMemory(...)")
        loaded = kwargs.get("model")
        if isinstance(loaded, LoadedModel):
            dtype = "bf16" if loaded.dtype == torch.bfloat16 else "fp32"
            if normalize_dtype(kwargs.get("dtype", dtype)) not in (dtype, "auto"):
                raise ValueError(f"dtype={kwargs['dtype']!r} but the LoadedModel runs in {dtype}: "
                                 "omit dtype, or load the model with load_model(..., dtype=...)")
            device = str(next(loaded.model.parameters()).device)
            device = "cuda:0" if device == "cuda" else device
            if "device" in kwargs and normalize_device(kwargs["device"]) != device:
                raise ValueError(f"device={kwargs['device']!r} but the LoadedModel lies on {device}: "
                                 "omit device, or move the model first (loaded.model.to(...))")
            kwargs = {**kwargs, "model": "smollm2" if loaded.name == EMBEDDED_NAME else str(loaded.path),
                      "dtype": dtype, "device": device}
            kwargs.setdefault("profile", _profile(loaded.model.config, loaded.name))  # not from a folder
        super().__init__(**kwargs)
        if isinstance(loaded, LoadedModel):
            self._pinned = _Runtime(loaded, template_renders_tools(loaded.tokenizer))

    @model_validator(mode="before")
    @classmethod
    def _known_settings(cls, values: Any) -> Any:
        # unknown keys raise (pydantic would drop them); aliases and model_kwargs fold into fields
        if not isinstance(values, dict):
            return values
        values = fold_aliases(values, "ChatKVMemory(...)")
        reject_unknown(values, cls.model_fields, "ChatKVMemory(...)")
        if "prompt_lookup" in values:  # the session's own check: no bools or strings coerced to ints
            checked_prompt_lookup(values["prompt_lookup"])
        if "dtype" in values or "device" in values:
            device = normalize_device(values.get("device"))
            dtype = normalize_dtype(values.get("dtype", "fp32"))
            values = {**values, "device": device,
                      "dtype": ("bf16" if device.startswith("cuda") else "fp32") if dtype == "auto" else dtype}
        return values

    @model_validator(mode="after")
    def _check_settings(self) -> "ChatKVMemory":
        # bad settings fail at construction, naming the fix (pydantic wraps them in a ValidationError)
        _check_call_settings(self.repair_policy, self.max_tokens, self.temperature, self.timeout)
        self._sampling({})
        if self.engine == "cuda_graphs" and not self.device.startswith("cuda"):
            raise InputError(f"engine='cuda_graphs' decodes on a GPU: pass device='cuda' (or 'cuda:N') with it "
                             f"(device is {self.device!r}), or use engine='auto' on CPU")
        return self

    def _sampling(self, kwargs: dict[str, Any]) -> Sampling:
        """The call's sampling settings: per-call values over the instance's (checked)."""
        return Sampling(**{name: kwargs.get(name, getattr(self, name)) for name in Sampling.names()})

    # ------------------------------------------------------------ identity
    @property
    def _llm_type(self) -> str:
        return "kvmemory"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """``dumpd(chat)`` keeps the settings (a model given as a name or folder, not a loaded
        object); loading one back: :mod:`langchain_kvmemory.serialization`."""
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["langchain_kvmemory", "chat_model"]

    @property
    def model_name(self) -> str:
        """The model's name as ``response_metadata["model_name"]`` and ``ls_model_name`` give it:
        ``"SmolLM2-135M-Instruct"`` for the embedded model, the folder as given, a LoadedModel's name."""
        return self._name_of(self.model)

    def _name_of(self, model: str) -> str:
        if self._pinned is not None and model == self.model:
            return self._pinned.loaded.name
        return _display_name(model)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "engine": self.engine, "device": self.device,
                "temperature": self.temperature, "max_tokens": self.max_tokens, "repair_policy": self.repair_policy,
                **{name: getattr(self, name) for name in Sampling.names() if getattr(self, name) is not None}}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params.update(ls_provider="kvmemory", ls_model_name=self._name_of(kwargs.get("model") or self.model),
                      ls_temperature=kwargs.get("temperature", self.temperature),
                      ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _resolve_model_profile(self):
        """Capabilities, with the context length from the model's config (``max_position_embeddings``
        of its text config): the loaded model's when pinned, else the folder's ``config.json``
        (the embedded model: its converted cache folder, converting it on first use)."""
        if self._pinned is not None:
            return _profile(self._pinned.loaded.model.config, self.model_name)
        folder = _model_folder(self.model)
        if not (folder / "config.json").is_file():
            return None  # loading names the missing folder and the fix
        from transformers import AutoConfig

        return _profile(AutoConfig.from_pretrained(folder, local_files_only=True), self.model_name)

    # ------------------------------------------------------------- tokens
    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` under the model's tokenizer (no special tokens added)."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return self._runtime_of(self.model).loaded.tokenizer(text, add_special_tokens=False)["input_ids"]

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Tokens of the prompt the model reads for ``messages``: rendered by its chat template
        (with the default system prompt the template adds, the tools block when ``tools`` are
        given and the assistant-turn opener), as a call with these messages would prefill.

        Raises:
            UnsupportedContentError: non-text content; InputError: a tool LangChain cannot convert.
        """
        runtime = self._runtime_of(self.model)
        formatted = [convert_to_openai_tool(t) for t in tools] if tools else None
        return _prompt_tokens(runtime, to_session_messages(messages, runtime.template_tools), formatted)

    # ------------------------------------------------------------- threads
    def _runtime_of(self, name: str) -> _Runtime:
        """The model object calls naming ``name`` run: the LoadedModel this instance was given,
        else the process-wide one kvmemory loaded from that name or folder."""
        if self._pinned is not None and name == self.model:
            return self._pinned
        return _runtime(name, self.dtype, self.engine, self.device)

    def threads_for(self, model: str | None = None) -> ThreadCaches:
        """The live-cache registry of ``model`` (default: this instance's model), loading it."""
        name = model or self.model
        runtime = self._runtime_of(name)
        with self._registry_lock:
            key = (name, self.dtype)
            if key not in self._registries:
                self._registries[key] = ThreadCaches(
                    runtime.loaded.model, runtime.loaded.tokenizer, self.repair_policy,
                    memory_budget_bytes=self.memory_budget_bytes, model_name=runtime.loaded.name,
                    batch_decoding=self.batch_decoding)
            return self._registries[key]

    def guard_for(self, model: str | None = None) -> FidelityGuard | None:
        """The fidelity guard of ``model``'s threads (None when ``guard`` is not configured)."""
        if self.guard is None:
            return None
        name = model or self.model
        runtime = self._runtime_of(name)
        with self._registry_lock:
            key = (name, self.dtype)
            if key not in self._guards:
                self._guards[key] = FidelityGuard(runtime.loaded.model, self.guard)
            return self._guards[key]

    def guard_summary(self, *, wait: bool = False) -> dict:
        """The fidelity guard's summary for this model (samples, mean / max first-token KL in
        nats, escalations and budget per thread; see :meth:`FidelityGuard.summary`). ``wait``:
        first let running checks finish. Raises ValueError when ``guard`` is not configured."""
        guard = self.guard_for()
        if guard is None:
            raise ValueError("the fidelity guard is off: construct ChatKVMemory(guard={'fraction': 0.1, ...})")
        if wait:
            guard.wait()
        return guard.summary()

    @property
    def threads(self) -> ThreadCaches:
        """Live caches of this model's threads (e.g. for a checkpointer to export / import)."""
        return self.threads_for()

    def _thread_id(self, kwargs: dict[str, Any]) -> str:
        explicit = kwargs.get("thread_id")
        if explicit is not None:
            return str(explicit)
        configurable = ensure_config().get("configurable", {})  # set inside LangGraph nodes
        _note_unpersisted(configurable.get(CHECKPOINTER_KEY))
        configured = configurable.get("thread_id")
        return str(configured) if configured is not None else self.default_thread_id

    # The plain Runnable entry points drop config["configurable"] before _generate; carry the
    # thread id across as a keyword (LangGraph nodes also expose it through the context config).
    def invoke(self, input: LanguageModelInput, config=None, *, stop=None, **kwargs: Any) -> AIMessage:
        return super().invoke(input, config, stop=stop, **_with_thread(config, kwargs))

    async def ainvoke(self, input: LanguageModelInput, config=None, *, stop=None, **kwargs: Any) -> AIMessage:
        return await super().ainvoke(input, config, stop=stop, **_with_thread(config, kwargs))

    def stream(self, input: LanguageModelInput, config=None, *, stop=None, **kwargs: Any):
        return super().stream(input, config, stop=stop, **_with_thread(config, kwargs))

    def astream(self, input: LanguageModelInput, config=None, *, stop=None, **kwargs: Any):
        return super().astream(input, config, stop=stop, **_with_thread(config, kwargs))

    # -------------------------------------------------------------- decode
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        text, end = "", None
        message_id = _message_id(run_manager)
        for kind, value in self._decode(messages, stop, message_id, run_manager, closable=False, **kwargs):
            if kind == "text":
                text += value
                if run_manager:
                    run_manager.on_llm_new_token(value)
            elif kind == "end":
                end = value
        message = AIMessage(id=message_id, content=end["content"], tool_calls=end["tool_calls"],
                            invalid_tool_calls=end["invalid_tool_calls"], usage_metadata=end["usage"],
                            response_metadata=end["metadata"])
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        message_id = _message_id(run_manager)
        for kind, value in self._decode(messages, stop, message_id, run_manager, **kwargs):
            if kind == "text":
                chunk = ChatGenerationChunk(message=AIMessageChunk(id=message_id, content=value))
                if run_manager:
                    run_manager.on_llm_new_token(value, chunk=chunk)
                yield chunk
                continue
            if kind == "call":
                chunk = ChatGenerationChunk(message=AIMessageChunk(id=message_id, content="", tool_call_chunks=[value]))
                if run_manager:
                    run_manager.on_llm_new_token("", chunk=chunk)
                yield chunk
                continue
            # calls whose chunks were not streamed (a head cut short) come whole with the last chunk
            streamed, calls = value["streamed_calls"], []
            for c in value["tool_calls"] + value["invalid_tool_calls"]:
                if c["id"] not in streamed:
                    args = _json(c["args"]) if c["type"] == "tool_call" else c["args"]
                    calls.append({"name": c["name"], "args": args, "id": c["id"], "index": len(streamed) + len(calls),
                                  "type": "tool_call_chunk"})
            last = AIMessageChunk(id=message_id, content="", tool_call_chunks=calls, usage_metadata=value["usage"],
                                  response_metadata=value["metadata"], chunk_position="last")
            yield ChatGenerationChunk(message=last, generation_info={"finish_reason": value["metadata"]["finish_reason"]})
            return
        # no end: a later call on this thread closed the stream while nobody read it (leased_streams)
        last = AIMessageChunk(id=message_id, content="", chunk_position="last",
                              response_metadata={"finish_reason": "interrupted"})
        yield ChatGenerationChunk(message=last, generation_info={"finish_reason": "interrupted"})

    def _decode(self, messages: Sequence[BaseMessage], stop: list[str] | None, message_id: str,
                run_manager: CallbackManagerForLLMRun | None, closable: bool = True, **kwargs: Any) -> Iterator[tuple]:
        """Prepare the thread's cache for ``messages`` and decode, yielding ``("text", delta)``
        events for streamable text, ``("call", chunk)`` for each tool-call chunk completed and one
        final ``("end", result)``. The answer is then held in the cache as the message the caller
        gets (id ``message_id``; a cut answer as its returned text, see ``KVSession.commit_answer``).
        ``closable``: a stream another call may close when nobody reads it (``leased_streams``);
        ``invoke`` reads its own events to the end, so it is never closed."""
        kwargs = fold_aliases(kwargs, "call keyword arguments")
        call = self._plan_call(messages, stop, run_manager, kwargs)
        key = (call.model_name, call.thread_id)
        if self._open_streams.close_abandoned(key):  # else this call would wait for it forever
            log.info("kvmemory: closed a stream the main thread left suspended on thread %r", call.logical_thread)
        events = self._decode_leased(call, key, message_id, kwargs)
        yield from self._open_streams.wrap(key, events) if closable else events

    def _decode_leased(self, call: "_Call", key: tuple, message_id: str, kwargs: dict[str, Any]) -> Iterator[tuple]:
        """:meth:`_decode` once the call is planned: the thread's lease held while it runs (a
        stream left unread on it is closed after a while, see ``leased_streams``)."""
        registry = self.threads_for(call.model_name)
        with self._open_streams.lease(registry, call.thread_id, key, self._reserve_tokens(call, registry)) as session:
            policy, report, erased = self._prepare_thread(session, registry, call, kwargs)
            self._settle_tool_choice(session, call)
            processors, budget, recorder = self._processors(session, call)
            watcher = TextWatcher(call.runtime.loaded.tokenizer, call.stops,
                                   watch_calls=bool(call.tools) and call.choice != "none")
            t0 = time.perf_counter()
            reason = yield from self._stream_tokens(session, watcher, call, processors)
            result = self._result(watcher, report, reason, call, (time.perf_counter() - t0) * 1000.0)
            self._annotate(result, call, policy, erased, watcher, budget, recorder)
            # held as the caller got it (cut at a stop sequence or max_tokens, too): the next turn reuses its rows
            answer = AIMessage(id=message_id, content=result["content"], tool_calls=result["tool_calls"])
            session.commit_answer(session_message(answer, call.runtime.template_tools))
        tail = watcher.finish()
        if tail:
            yield "text", tail
        yield "end", result

    def _plan_call(self, messages: Sequence[BaseMessage], stop: list[str] | None,
                   run_manager: CallbackManagerForLLMRun | None, kwargs: dict[str, Any]) -> "_Call":
        """Everything a call decides before it touches the thread: settings (checked first, so a
        refused call leaves the thread as it was), sampling, tools and tool choice, grammar,
        messages, stops, answer length, timeout, thread id and the thread's cache slot.

        Raises:
            MessageError: no messages, or a malformed tool history (a ToolMessage answering no earlier
                call, a tool call left unanswered). InputError / InputTypeError: bad or unknown
                per-call settings.
        """
        if not messages:
            raise MessageError("no messages: pass at least one message (e.g. a HumanMessage)")
        check_tool_history(messages)
        reject_unknown(kwargs, CALL_KEYS | set(Sampling.names()), "call keyword arguments")
        _check_call_settings(kwargs.get("repair_policy"), kwargs.get("max_tokens"), kwargs.get("temperature"),
                             kwargs.get("timeout"))
        sampling = self._sampling(kwargs)
        model_name = kwargs.get("model") or self.model
        runtime = self._runtime_of(model_name)
        tools = kwargs.get("tools") or None
        choice = normalize_tool_choice(kwargs.get("tool_choice"), tools)
        requested = response_schema(kwargs.get("response_format"))
        schema = requested[1] if requested else None
        scored = False
        grammar_tools = self._answer_tools(messages, tools, choice, kwargs.get("structured_output_tools"))
        if grammar_tools is not None:
            choice = "required"  # the rounds are spent: the answer is the structured-output call
        elif choice == "auto" and self.auto_tool_calls in ("after_user", "scored"):
            # the ReAct policy: a call after a user turn; after a tool result, the answer (JSON when asked)
            choice = "required" if isinstance(messages[-1], HumanMessage) else ("none" if requested else "auto")
            # scored: a user turn after a tool round calls only when the model rates a call likely
            scored = self.auto_tool_calls == "scored" and choice == "required"
        parallel = bool(kwargs.get("parallel_tool_calls", self.parallel_tool_calls))
        session_messages = to_session_messages(messages, runtime.template_tools, schema)
        thread_id = self._thread_id(kwargs)
        if run_manager is not None and (run_manager.metadata or {}).get("lc_source") == "summarization":
            thread_id += "/summary"  # a summariser call inside the agent's node must not displace its cache
        # rendered and tokenized once: the slot choice reads its ids, the slot's session segments it
        tokenizer = runtime.loaded.tokenizer
        prompt = render_prompt(tokenizer, normalize_messages(session_messages), tools=tools, segments=False)
        slot, _ = pick_slot(self.threads_for(model_name), thread_id, prompt.token_ids,
                            prompt_head_tokens(tokenizer, prompt.messages, tools), self.cache_slots,
                            head_text=prompt_head_text(prompt.messages))
        return _Call(
            model_name=model_name, runtime=runtime, tools=tools, choice=choice,
            grammar=None if scored else self._grammar(runtime, grammar_tools or tools, choice, requested, parallel),
            messages=session_messages,
            stops=_checked_stops(stop if stop is not None else self.stop),
            max_tokens=int(kwargs.get("max_tokens") or self.max_tokens),
            timeout=kwargs.get("timeout", self.timeout), thread_id=slot, logical_thread=thread_id,
            prompt=prompt, requested=requested, parallel=parallel, scored=scored,
            has_tool_results=any(isinstance(m, ToolMessage) for m in messages), sampling=sampling,
            fixed_allowance=FIXED_TOKEN_ALLOWANCE if (tools or requested) else 0,
            seed=kwargs.get("seed", self.seed), answer_tools=[t["function"]["name"] for t in grammar_tools or []],
        )

    def _answer_tools(self, messages: Sequence[BaseMessage], tools, choice: str | None,
                      structured: Sequence[str] | None) -> list[dict[str, Any]] | None:
        """The structured-output tools the answer must call (see ``structured_output_rounds``),
        or None when the model still chooses: no such tool bound, no other tool bound, a choice
        other than ``"required"``/``"auto"``, or fewer tool rounds since the last user message."""
        if not structured or choice not in ("required", "auto"):
            return None
        answer = [t for t in tools if t["function"]["name"] in structured]
        if not answer or len(answer) == len(tools):
            return None
        return answer if _tool_rounds(messages, structured) >= self.structured_output_rounds else None

    @staticmethod
    def _reserve_tokens(call: "_Call", registry: ThreadCaches) -> int:
        """Rows the call may hold (prompt + answer + grammar-fixed allowance + end-of-turn slack),
        reserved against the registry's memory budget before the call runs (0 without a budget)."""
        if registry.memory_budget_bytes is None:
            return 0
        return len(call.prompt) + call.max_tokens + call.fixed_allowance + RESERVE_SLACK

    def _prepare_thread(self, session, registry: ThreadCaches, call: "_Call", kwargs: dict[str, Any]):
        """Bring the leased slot's cache to the call's messages under its repair policy (raised
        by the fidelity guard where it escalated), purge a strict erase from the stores, and let
        the guard sample the repair. Returns ``(policy, report, erase metadata or None)``."""
        guard = self.guard_for(call.model_name)
        policy = RepairPolicy.coerce(kwargs.get("repair_policy") or session.policy)
        if guard is not None:
            policy = guard.policy_for(call.thread_id, policy)
        # the session renders the tools: through the template or folded (kvmemory.prompt)
        report = session.prepare(call.messages, policy=policy, erase=kwargs.get("erase") or self.erase,
                                 tools=call.tools, rendered=call.prompt)
        erased = _erase_everywhere(registry, call.logical_thread, call.thread_id, session, report)
        if guard is not None:
            guard.observe(call.thread_id, session, report)
        return policy, report, erased

    def _settle_tool_choice(self, session, call: "_Call") -> None:
        """Under ``auto_tool_calls="scored"``: decide call or text from the prepared cache
        (:func:`tool_policy.scored_choice`) and set the call's choice, grammar and gap."""
        if not call.scored:
            return
        call.choice, call.call_gap = scored_choice(session, call.has_tool_results, self.call_margin)
        call.grammar = self._grammar(call.runtime, call.tools, call.choice, call.requested, call.parallel)

    def _processors(self, session, call: "_Call"):
        """The call's logits processors: grammar, answer budget (grammar-fixed tokens are not
        charged), sampling settings and the log-probability recorder. Returns
        ``(processors, budget, recorder or None)``."""
        constrain = processor(call.grammar) if call.grammar is not None else None
        budget = AnswerBudget(call.max_tokens, constrain)
        processors = call.sampling.processors([constrain, budget], len(session.token_ids))
        recorder = None
        if call.sampling.logprobs:
            recorder = LogprobRecorder(call.runtime.loaded.tokenizer, call.sampling.top_logprobs or 0)
            processors.append(recorder)
        return processors, budget, recorder

    def _stream_tokens(self, session, watcher: TextWatcher, call: "_Call", processors: list):
        """Decode from the live cache, yielding ``("text", delta)`` and ``("call", chunk)``;
        returns the finish reason: ``stop`` (a stop string, or the model's end of turn),
        ``length`` or ``timeout``."""
        tokens = session.stream_tokens(call.max_tokens + call.fixed_allowance,
                                       temperature=call.sampling.pick_temperature, seed=call.seed,
                                       logits_processor=processors or None, prompt_lookup=self.prompt_lookup)
        t0, reason = time.perf_counter(), "length"
        try:
            for token in _until_spent(tokens):
                delta = watcher.add(token)
                if delta:
                    yield "text", delta
                for chunk in watcher.call_chunks():
                    yield "call", chunk
                if watcher.stopped:
                    reason = "stop"
                    break
                if call.timeout is not None and time.perf_counter() - t0 > call.timeout:
                    reason = "timeout"
                    log.warning("kvmemory: decoding stopped after the %g s timeout (thread %r)", call.timeout,
                                call.thread_id)
                    break
            else:
                reason = "stop" if session.next_logits is None else "length"
        finally:
            tokens.close()
        return reason

    def _annotate(self, result: dict[str, Any], call: "_Call", policy: RepairPolicy, erased: dict | None,
                  watcher: TextWatcher, budget: AnswerBudget, recorder: LogprobRecorder | None) -> None:
        """Add the cache slot, grammar-fixed tokens, scored tool policy, log-probabilities,
        strict-erase and fidelity-guard entries to the response metadata."""
        metadata = result["metadata"]
        metadata["cache_slot"] = call.thread_id
        metadata["grammar_fixed_tokens"] = budget.fixed(watcher.count)
        if call.answer_tools:
            metadata["tool_policy"] = {"policy": "structured_output", "choice": call.answer_tools,
                                       "rounds": self.structured_output_rounds}
        if call.scored:
            metadata["tool_policy"] = {"policy": "scored", "choice": call.choice, "call_gap_nats": call.call_gap,
                                       "margin_nats": self.call_margin}
        if recorder is not None:
            metadata["logprobs"] = {"content": recorder.entries(watcher.ids)}
        if erased is not None:
            metadata["erase"] = erased
        guard = self.guard_for(call.model_name)
        if guard is not None:
            metadata["guard"] = {**guard.thread_info(call.thread_id), "policy": policy.label}

    def _grammar(self, runtime: _Runtime, tools, choice: str | None, requested: tuple | None, parallel: bool):
        """The grammar of the answer: tool calls under ``choice`` (with the answer's JSON schema
        when one is requested too), else the requested JSON, else None (free text)."""
        schema = requested[1] if requested else None
        if tools and choice is not None:
            answer = schema if schema is not None else ({"type": "object"} if requested else None)
            return runtime.grammars.tool_calls(tools, choice, parallel=parallel, answer_schema=answer)
        if requested is not None:
            return runtime.grammars.json_schema(schema) if schema is not None else runtime.grammars.json_object()
        return None

    def _result(self, watcher: TextWatcher, report, reason: str, call: "_Call", decode_ms: float) -> dict[str, Any]:
        model_name, thread_id = call.model_name, call.logical_thread
        content, calls, invalid = watcher.text, [], []
        if watcher.watch_calls and CALL_OPEN in watcher.text:
            content, calls, invalid = split_calls(watcher.text, watcher.calls.ids)
        elif watcher.watch_calls:  # a call the model wrote without the tags (bare or fenced JSON)
            calls = bare_calls(watcher.text, {tool["function"]["name"] for tool in call.tools})
            content = "" if calls else content
        usage = {"input_tokens": report.prompt_tokens, "output_tokens": watcher.count,
                 "total_tokens": report.prompt_tokens + watcher.count,
                 "input_token_details": {"cache_read": report.reused_tokens}}
        metadata = {
            "model_name": self._name_of(model_name),  # = self.model_name and ls_model_name
            "model_provider": "kvmemory",
            "finish_reason": "tool_calls" if calls else reason,
            "thread_id": thread_id,
            "repair": {k: getattr(report, k) for k in REPORT_KEYS},
            "decode_ms": decode_ms,
        }
        return {"content": content, "tool_calls": calls, "invalid_tool_calls": invalid, "usage": usage,
                "metadata": metadata, "streamed_calls": set(watcher.calls.ids)}

    # ------------------------------------------------------- tools, schema
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: str | dict | bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (rendered into the prompt by the chat template, or folded into the system
        message when the template has no tool support).

        Args:
            tool_choice: ``"auto"``/None (the model decides, see ``auto_tool_calls``), ``"any"``,
                ``"required"`` or True (one call to any tool), a tool name or
                ``{"type": "function", "function": {"name": ...}}`` (that tool), ``"none"`` (no
                call). Forced calls are decoded under an xgrammar grammar, so they always parse.

        A schema-only tool (a ``StructuredTool`` without a function, as LangChain's ``ToolStrategy``
        binds its response schema) bound next to other tools is the structured-output tool: after
        ``structured_output_rounds`` tool rounds the answer must call it, so the agent ends.

        Raises:
            InputTypeError: ``tools`` is not a list. InputError: a tool LangChain cannot convert, or
                ``tool_choice`` names a tool that is not bound.
        """
        if isinstance(tools, (str, dict)) or not isinstance(tools, Sequence):
            raise InputTypeError(f"tools must be a list of tools (got {type(tools).__name__}): wrap it, e.g. [my_tool]")
        formatted = []
        for i, tool in enumerate(tools):
            try:
                formatted.append(convert_to_openai_tool(tool))
            except (ValueError, TypeError) as exc:
                raise InputError(f"tool {i} ({type(tool).__name__}) cannot be bound: {exc}".strip()) from exc
        kwargs["tool_choice"] = normalize_tool_choice(tool_choice, formatted)
        structured = [t.name for t in tools if _is_schema_tool(t)]
        if structured:
            kwargs.setdefault("structured_output_tools", structured)
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(self, schema: dict | type | None = None, *,
                               method: Literal["function_calling", "json_schema", "json_mode"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, dict | Any]:
        """Answers parsed into ``schema`` (pydantic class, TypedDict or JSON schema dict).

        Every method decodes under an xgrammar grammar: ``json_schema`` (default) constrains the
        answer to the schema; ``function_calling`` forces a call of a tool named after it;
        ``json_mode`` constrains to any JSON object, or to ``schema`` when one is given.
        ``strict`` is accepted for compatibility (decoding is always schema-exact).

        Raises:
            ValueError: no schema for json_schema / function_calling, or an unknown method.
        """
        if kwargs:
            raise ValueError(f"unexpected arguments {sorted(kwargs)}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            if schema is None:
                raise ValueError("method='function_calling' needs a schema (pydantic class, TypedDict or dict)")
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            llm = self.bind_tools([tool], tool_choice=name, parallel_tool_calls=False, ls_structured_output_format={
                "kwargs": {"method": method, "strict": strict}, "schema": tool})
            parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic
                                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            if schema is None and method == "json_schema":
                raise ValueError("method='json_schema' needs a schema; use method='json_mode' for any JSON object")
            json_schema = convert_to_json_schema(schema) if schema is not None else None
            llm = self.bind(response_format={"type": method, "schema": json_schema}, ls_structured_output_format={
                "kwargs": {"method": method, "strict": strict}, "schema": json_schema})
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        else:
            raise ValueError(f"unknown method {method!r}: use 'json_schema', 'function_calling' or 'json_mode'")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")


def _is_schema_tool(tool: Any) -> bool:
    """A tool that only describes arguments and runs nothing: the structured-output tool
    LangChain's ``ToolStrategy`` binds (a ``StructuredTool`` with neither ``func`` nor ``coroutine``)."""
    return isinstance(tool, StructuredTool) and tool.func is None and tool.coroutine is None


def _tool_rounds(messages: Sequence[BaseMessage], structured: Sequence[str]) -> int:
    """AIMessages calling a tool other than the ``structured`` ones since the last user message."""
    rounds = 0
    for message in reversed(messages):
        if isinstance(message, HumanMessage):
            break
        if isinstance(message, AIMessage) and any(c["name"] not in structured for c in message.tool_calls):
            rounds += 1
    return rounds


def _erase_everywhere(registry: ThreadCaches, thread_id: str, slot: str, session, report) -> dict | None:
    """After a strict-erase repair in cache ``slot`` of ``thread_id``: drop the thread's other
    caches (side caches, other slots) and purge the erased messages from every checkpoint store
    persisting ``registry``. Returns the response metadata entry."""
    if report.erased is None:
        return None
    dropped = [tid for tid in registry.thread_ids
               if tid != slot and (tid == thread_id or tid.startswith(thread_id + "/")) and registry.drop(tid)]
    stores, ids = [], session.take_erasures()
    for saver in list(registry.erase_stores):
        try:
            purge = saver.erase_messages(thread_id, ids, live_clean=True, during_run=True, recheck=True)
            stores.append(purge.to_dict())
        except Exception as exc:  # the answer still comes; the saver retries at its next put
            saver.defer_erasures(thread_id, ids)
            log.warning("kvmemory: strict erase not purged from a checkpoint store yet (%s); retried at its next "
                        "checkpoint", exc)
            stores.append({"error": str(exc), "deferred": sorted(ids)})
    if not stores:
        session.defer_erasures(ids)  # a saver attached later purges them at its first put
    return {**report.erased, "side_caches_dropped": dropped, "stores": stores}


def _check_call_settings(policy, max_tokens, temperature, timeout) -> None:
    """Refuse unusable decoding settings (None: not given) with the fix named.

    Raises:
        InputError / InputTypeError: a bad policy label, ``max_tokens`` < 1 or not an int,
            ``temperature`` negative / NaN / not a number, ``timeout`` <= 0.
    """
    if policy is not None:
        RepairPolicy.coerce(policy)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise InputError(f"max_tokens must be an int >= 1 (got {max_tokens!r})")
    for name, value in (("temperature", temperature), ("timeout", timeout)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputTypeError(f"{name} must be a number (got {type(value).__name__})")
        if not math.isfinite(value) or value < 0 or (name == "timeout" and value == 0):
            hint = "0 decodes greedily" if name == "temperature" else "seconds of decoding, > 0, or None for no limit"
            raise InputError(f"{name} must be a finite number {'>= 0' if name == 'temperature' else '> 0'} "
                             f"(got {value}): {hint}")


def _prompt_tokens(runtime: _Runtime, session_messages, tools) -> int:
    """Tokens of the rendered prompt: the rows the thread's cache holds once prepared
    (``get_num_tokens_from_messages``). Raises what rendering raises."""
    messages = normalize_messages(session_messages)
    return len(render_prompt(runtime.loaded.tokenizer, messages, tools=tools, segments=False))


_NOTED_SAVERS: set[type] = set()


def _note_unpersisted(saver: Any) -> None:
    """Log once per saver class that a plain LangGraph checkpointer does not persist live caches
    (a restarted process re-prefills each thread): wrap it in KVCheckpointSaver to keep them."""
    if saver is None or type(saver) in _NOTED_SAVERS:
        return
    from .checkpointer import KVCheckpointSaver  # the checkpointer imports this module's package

    if not isinstance(saver, KVCheckpointSaver):
        _NOTED_SAVERS.add(type(saver))
        log.warning("kvmemory: the graph's checkpointer %s does not persist live KV caches (after a restart each "
                    "thread re-prefills): wrap it, KVCheckpointSaver(saver, chat_model), to store them with the "
                    "checkpoints", type(saver).__name__)


def _until_spent(tokens: Iterator[int]) -> Iterator[int]:
    """``tokens`` until the answer budget is spent (AnswerBudget raises before the pick)."""
    try:
        yield from tokens
    except BudgetSpent:
        return


def _with_thread(config, kwargs: dict[str, Any]) -> dict[str, Any]:
    if "thread_id" not in kwargs and config:
        thread_id = (config.get("configurable") or {}).get("thread_id")
        if thread_id is not None:
            return {**kwargs, "thread_id": thread_id}
    return kwargs


def _message_id(run_manager: CallbackManagerForLLMRun | None) -> str:
    # the id LangChain would give the message anyway, so the next turn's copy matches the cache
    return f"lc_run--{run_manager.run_id}" if run_manager is not None else f"lc_run--{uuid.uuid4()}"


def _json(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)
