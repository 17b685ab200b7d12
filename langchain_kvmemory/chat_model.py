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
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Callable, Iterator, Literal, Sequence

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import Field, PrivateAttr, model_validator

import torch

from kvmemory.guard import FidelityGuard, GuardConfig
from kvmemory.errors import InputError, InputTypeError, MessageError
from kvmemory.models import LoadedModel, load_model
from kvmemory.policy import RepairPolicy
from kvmemory.prompt import normalize_messages, render_text
from kvmemory.threads import ThreadCaches

from .constrained import Grammars, processor
from .messages import session_message, to_session_messages
from .tool_calls import CALL_OPEN, split_calls, template_renders_tools

log = logging.getLogger(__name__)

REPORT_KEYS = ("operator", "budget", "allocator", "prompt_tokens", "reused_tokens", "recomputed_tokens",
               "refreshed_tokens", "stale_tokens", "shifted_tokens", "intervals", "edits", "fallback",
               "capability_notes", "executor", "executor_fallback", "latency_ms", "adapter", "engine")


EMBEDDED_NAME = "SmolLM2-135M-Instruct"
RESERVE_SLACK = 16  # rows a call may hold beyond prompt + answer (end-of-turn markers of a committed answer)


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


def _runtime(model: str, dtype: str, engine: str) -> _Runtime:
    with _RUNTIMES_LOCK:
        key = (model, dtype, engine)
        if key not in _RUNTIMES:
            loaded = load_model(None if model in ("smollm2", "") else model, dtype, engine=engine)
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
    thread_id: str


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
    setting below; per-call overrides go to ``invoke(..., repair_policy=..., erase=...)``.
    """

    model: str = "smollm2"
    """``"smollm2"`` (the embedded SmolLM2-135M-Instruct), a local transformers model folder, or a
    :class:`kvmemory.LoadedModel` that this instance alone runs."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Weights and cache dtype (CPU: fp32 is exact to Re-prefill, bf16 is faster)."""
    engine: Literal["auto", "q4_1", "transformers"] = "auto"
    """What computes cache rows (``kvmemory.load_model(engine=...)``): ``"auto"`` runs the embedded
    model on its GGUF blocks (same weights, faster decoding on CPU) and other models on transformers;
    ``response_metadata["repair"]["engine"]`` says which ran and why."""
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
    repair_policy: str = "sur@5"
    """How an edited history is repaired: ``"sur@5"`` (Shift + SUR at b = 5 %), ``"shift"``,
    ``"replay"``, ``"reprefill"``, ``"bm25@2"``, ... (see ``kvmemory.RepairPolicy``)."""
    memory_budget_bytes: int | None = Field(default=1 << 30, ge=0)
    """K/V bytes all live threads may hold together; least-recently-used idle threads are evicted
    first and a call that still does not fit waits (None: no limit)."""
    default_thread_id: str = "default"
    """Thread used when the run config names none."""
    auto_tool_calls: Literal["model", "after_user"] = "model"
    """Under ``tool_choice="auto"``: ``"model"`` lets the model decide; ``"after_user"`` requires
    a tool call after a user turn and leaves text free after a tool result (a ReAct policy for
    models too small to decide, such as the embedded one)."""
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

    _pinned: _Runtime | None = PrivateAttr(default=None)

    def __init__(self, **kwargs: Any):
        """``model=`` may be an already loaded :class:`kvmemory.LoadedModel`: this instance then
        runs exactly that object (never a model loaded by name elsewhere in the process, and
        never lent to another instance that names the same model).

        Raises:
            ValueError (pydantic ValidationError): ``dtype`` given and different from the
                LoadedModel's.
        """
        loaded = kwargs.get("model")
        if isinstance(loaded, LoadedModel):
            dtype = "bf16" if loaded.dtype == torch.bfloat16 else "fp32"
            if kwargs.get("dtype", dtype) != dtype:
                raise ValueError(f"dtype={kwargs['dtype']!r} but the LoadedModel runs in {dtype}: "
                                 "omit dtype, or load the model with load_model(..., dtype=...)")
            kwargs = {**kwargs, "model": "smollm2" if loaded.name == EMBEDDED_NAME else str(loaded.path),
                      "dtype": dtype}
        super().__init__(**kwargs)
        if isinstance(loaded, LoadedModel):
            self._pinned = _Runtime(loaded, template_renders_tools(loaded.tokenizer))

    @model_validator(mode="after")
    def _check_settings(self) -> "ChatKVMemory":
        # bad settings fail at construction, naming the fix (pydantic wraps them in a ValidationError)
        _check_call_settings(self.repair_policy, self.max_tokens, self.temperature, self.timeout)
        return self

    # ------------------------------------------------------------ identity
    @property
    def _llm_type(self) -> str:
        return "kvmemory"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "engine": self.engine, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "repair_policy": self.repair_policy}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params.update(ls_provider="kvmemory", ls_model_name=kwargs.get("model", self.model),
                      ls_temperature=kwargs.get("temperature", self.temperature),
                      ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _resolve_model_profile(self):
        return {"max_input_tokens": 8192 if self.model == "smollm2" else None, "text_inputs": True,
                "image_inputs": False, "audio_inputs": False, "pdf_inputs": False, "video_inputs": False,
                "text_outputs": True, "tool_calling": True, "tool_choice": True, "structured_output": True,
                "tool_call_streaming": True, "open_weights": True}

    # ------------------------------------------------------------- threads
    def _runtime_of(self, name: str) -> _Runtime:
        """The model object calls naming ``name`` run: the LoadedModel this instance was given,
        else the process-wide one kvmemory loaded from that name or folder."""
        if self._pinned is not None and name == self.model:
            return self._pinned
        return _runtime(name, self.dtype, self.engine)

    def threads_for(self, model: str | None = None) -> ThreadCaches:
        """The live-cache registry of ``model`` (default: this instance's model), loading it."""
        name = model or self.model
        runtime = self._runtime_of(name)
        with self._registry_lock:
            key = (name, self.dtype)
            if key not in self._registries:
                self._registries[key] = ThreadCaches(
                    runtime.loaded.model, runtime.loaded.tokenizer, self.repair_policy,
                    memory_budget_bytes=self.memory_budget_bytes, model_name=runtime.loaded.name)
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
        configured = ensure_config().get("configurable", {}).get("thread_id")  # set inside LangGraph nodes
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
        for kind, value in self._decode(messages, stop, message_id, run_manager, **kwargs):
            if kind == "text":
                text += value
                if run_manager:
                    run_manager.on_llm_new_token(value)
            else:
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
            calls = [{"name": c["name"], "args": _json(c["args"]), "id": c["id"], "index": i, "type": "tool_call_chunk"}
                     for i, c in enumerate(value["tool_calls"])]
            n = len(calls)
            calls += [{"name": c["name"], "args": c["args"], "id": c["id"], "index": n + i, "type": "tool_call_chunk"}
                      for i, c in enumerate(value["invalid_tool_calls"])]
            last = AIMessageChunk(id=message_id, content="", tool_call_chunks=calls, usage_metadata=value["usage"],
                                  response_metadata=value["metadata"], chunk_position="last")
            yield ChatGenerationChunk(message=last, generation_info={"finish_reason": value["metadata"]["finish_reason"]})

    def _decode(self, messages: Sequence[BaseMessage], stop: list[str] | None, message_id: str,
                run_manager: CallbackManagerForLLMRun | None, **kwargs: Any) -> Iterator[tuple]:
        """Prepare the thread's cache for ``messages`` and decode, yielding ``("text", delta)``
        events for streamable text and one final ``("end", result)``. An answer that ended with
        an end-of-turn token is then held in the cache as a message with id ``message_id``."""
        call = self._plan_call(messages, stop, run_manager, kwargs)
        registry = self.threads_for(call.model_name)
        with registry.lease(call.thread_id, reserve_tokens=self._reserve_tokens(call, registry)) as session:
            policy, report, erased = self._prepare_thread(session, registry, call, kwargs)
            watcher = _TextWatcher(call.runtime.loaded.tokenizer, call.stops,
                                   watch_calls=bool(call.tools) and call.choice != "none")
            t0 = time.perf_counter()
            reason = yield from self._stream_tokens(session, watcher, call, kwargs)
            result = self._result(watcher, report, reason, call.runtime, call.thread_id,
                                  (time.perf_counter() - t0) * 1000.0)
            self._annotate(result, call, policy, erased)
            if reason == "stop" and not watcher.stopped:  # ended with an end-of-turn token
                answer = AIMessage(id=message_id, content=result["content"], tool_calls=result["tool_calls"])
                session.commit_answer(session_message(answer, call.runtime.template_tools))
        tail = watcher.finish()
        if tail:
            yield "text", tail
        yield "end", result

    def _plan_call(self, messages: Sequence[BaseMessage], stop: list[str] | None,
                   run_manager: CallbackManagerForLLMRun | None, kwargs: dict[str, Any]) -> "_Call":
        """Everything a call decides before it touches the thread: settings (checked first, so a
        refused call leaves the thread as it was), tools and tool choice, grammar, messages,
        stops, answer length, timeout and thread id.

        Raises:
            MessageError: no messages. InputError / InputTypeError: bad per-call settings.
        """
        if not messages:
            raise MessageError("no messages: pass at least one message (e.g. a HumanMessage)")
        _check_call_settings(kwargs.get("repair_policy"), kwargs.get("max_tokens"), kwargs.get("temperature"),
                             kwargs.get("timeout"))
        model_name = kwargs.get("model") or self.model
        runtime = self._runtime_of(model_name)
        tools = kwargs.get("tools") or None
        choice = _tool_choice(kwargs.get("tool_choice"), tools)
        if choice == "auto" and self.auto_tool_calls == "after_user" and isinstance(messages[-1], HumanMessage):
            choice = "required"
        response_format = kwargs.get("response_format") or {}
        thread_id = self._thread_id(kwargs)
        if run_manager is not None and (run_manager.metadata or {}).get("lc_source") == "summarization":
            thread_id += "/summary"  # a summariser call inside the agent's node must not displace its cache
        return _Call(
            model_name=model_name, runtime=runtime, tools=tools, choice=choice,
            grammar=self._grammar(runtime, tools, choice, kwargs.get("response_format")),
            messages=to_session_messages(messages, runtime.template_tools, response_format.get("schema")),
            stops=[s for s in (stop if stop is not None else self.stop) or [] if s],
            max_tokens=int(kwargs.get("max_tokens") or self.max_tokens),
            timeout=kwargs.get("timeout", self.timeout), thread_id=thread_id,
        )

    @staticmethod
    def _reserve_tokens(call: "_Call", registry: ThreadCaches) -> int:
        """Rows the call may hold (prompt + answer + end-of-turn slack), reserved against the
        registry's memory budget before the call runs (0 without a budget)."""
        if registry.memory_budget_bytes is None:
            return 0
        return _prompt_tokens(call.runtime, call.messages, call.tools) + call.max_tokens + RESERVE_SLACK

    def _prepare_thread(self, session, registry: ThreadCaches, call: "_Call", kwargs: dict[str, Any]):
        """Bring the leased thread's cache to the call's messages under its repair policy (raised
        by the fidelity guard where it escalated), purge a strict erase from the stores, and let
        the guard sample the repair. Returns ``(policy, report, erase metadata or None)``."""
        guard = self.guard_for(call.model_name)
        policy = RepairPolicy.coerce(kwargs.get("repair_policy") or session.policy)
        if guard is not None:
            policy = guard.policy_for(call.thread_id, policy)
        # the session renders the tools: through the template or folded (kvmemory.prompt)
        report = session.prepare(call.messages, policy=policy, erase=kwargs.get("erase") or self.erase,
                                 tools=call.tools)
        erased = _erase_everywhere(registry, call.thread_id, session, report)
        if guard is not None:
            guard.observe(call.thread_id, session, report)
        return policy, report, erased

    def _stream_tokens(self, session, watcher: "_TextWatcher", call: "_Call", kwargs: dict[str, Any]):
        """Decode from the live cache, yielding ``("text", delta)``; returns the finish reason:
        ``stop`` (a stop string, or the model's end of turn), ``length`` or ``timeout``."""
        tokens = session.stream_tokens(call.max_tokens, temperature=float(kwargs.get("temperature", self.temperature)),
                                       seed=kwargs.get("seed", self.seed),
                                       logits_processor=processor(call.grammar) if call.grammar is not None else None)
        t0, reason = time.perf_counter(), "length"
        try:
            for token in tokens:
                delta = watcher.add(token)
                if delta:
                    yield "text", delta
                if watcher.stopped:
                    reason = "stop"
                    break
                if call.timeout is not None and time.perf_counter() - t0 > call.timeout:
                    reason = "timeout"
                    log.warning("kvmemory: decoding stopped after the %.1f s timeout (thread %r)", call.timeout,
                                call.thread_id)
                    break
            else:
                reason = "stop" if session.next_logits is None else "length"
        finally:
            tokens.close()
        return reason

    def _annotate(self, result: dict[str, Any], call: "_Call", policy: RepairPolicy, erased: dict | None) -> None:
        """Add the strict-erase and fidelity-guard entries to the response metadata."""
        if erased is not None:
            result["metadata"]["erase"] = erased
        guard = self.guard_for(call.model_name)
        if guard is not None:
            result["metadata"]["guard"] = {**guard.thread_info(call.thread_id), "policy": policy.label}

    def _grammar(self, runtime: _Runtime, tools, choice: str | None, response_format: dict | None):
        if response_format is not None:
            schema = response_format.get("schema")
            return runtime.grammars.json_schema(schema) if schema else runtime.grammars.json_object()
        if tools and choice is not None:
            return runtime.grammars.tool_calls(tools, choice)
        return None

    def _result(self, watcher: "_TextWatcher", report, reason: str, runtime: _Runtime, thread_id: str,
                decode_ms: float) -> dict[str, Any]:
        if watcher.watch_calls and CALL_OPEN in watcher.text:
            content, calls, invalid = split_calls(watcher.text)
        else:
            content, calls, invalid = watcher.text, [], []
        usage = {"input_tokens": report.prompt_tokens, "output_tokens": watcher.count,
                 "total_tokens": report.prompt_tokens + watcher.count,
                 "input_token_details": {"cache_read": report.reused_tokens}}
        metadata = {
            "model_name": runtime.loaded.name,
            "model_provider": "kvmemory",
            "finish_reason": "tool_calls" if calls else reason,
            "thread_id": thread_id,
            "repair": {k: getattr(report, k) for k in REPORT_KEYS},
            "decode_ms": decode_ms,
        }
        return {"content": content, "tool_calls": calls, "invalid_tool_calls": invalid, "usage": usage,
                "metadata": metadata}

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
        kwargs["tool_choice"] = _tool_choice(tool_choice, formatted)
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
            llm = self.bind_tools([tool], tool_choice=name, ls_structured_output_format={
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


class _TextWatcher:
    """Decodes tokens incrementally and decides what text may be streamed yet: text that could
    still grow into a stop sequence or a ``<tool_call>`` opener is held back; a stop sequence
    ends the answer before it; once a tool call opens, nothing more is streamed as text."""

    def __init__(self, tokenizer, stops: list[str], watch_calls: bool):
        self.tokenizer, self.stops, self.watch_calls = tokenizer, stops, watch_calls
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    @property
    def count(self) -> int:
        return len(self.ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stops:
            at = text.find(s)
            if at >= 0:
                self.stopped = True
                text = text[:at]
        self.text = text
        if self.stopped:
            return ""
        return self._release(self._safe_end(text))

    def _safe_end(self, text: str) -> int:
        end = len(text) - (1 if text.endswith("\ufffd") else 0)  # an incomplete UTF-8 character
        if self.watch_calls:
            opened = text.find(CALL_OPEN)
            if opened >= 0:
                return min(end, opened)
        for marker in self.stops + ([CALL_OPEN] if self.watch_calls else []):
            for k in range(min(len(marker) - 1, end), 0, -1):
                if text[:end].endswith(marker[:k]):
                    end -= k
                    break
        return end

    def _release(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted:end], end
        return delta

    def finish(self) -> str:
        """Text still held back when decoding ended (not a tool call)."""
        end = len(self.text)
        if self.watch_calls and CALL_OPEN in self.text:
            end = self.text.find(CALL_OPEN)
        return self._release(end)


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str | None:
    """Normalise LangChain's tool_choice forms to ``auto`` / ``required`` / ``none`` / a tool name
    (None: no tools bound, nothing to constrain).

    Raises:
        ValueError: a forced choice without tools, or a name that is not a bound tool.
    """
    if choice is None or choice == "auto" or choice == "none":
        return (choice or "auto") if tools else None
    if not tools:
        raise ValueError(f"tool_choice={choice!r} but no tools are bound: pass tools to bind_tools")
    if choice is True or choice in ("any", "required"):
        return "required"
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else choice
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not a bound tool: use one of "
                         f"{', '.join(names)}, 'auto', 'any' or 'none'")
    return name


def _erase_everywhere(registry: ThreadCaches, thread_id: str, session, report) -> dict | None:
    """After a strict-erase repair: drop the thread's side caches and purge the erased messages
    from every checkpoint store persisting ``registry``. Returns the response metadata entry."""
    if report.erased is None:
        return None
    dropped = [tid for tid in registry.thread_ids if tid.startswith(thread_id + "/") and registry.drop(tid)]
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
    """Tokens of the rendered prompt: the rows the thread's cache holds once prepared (so the call
    can reserve its share of the memory budget before it runs). Raises what rendering raises."""
    tokenizer = runtime.loaded.tokenizer
    text = render_text(tokenizer, normalize_messages(session_messages), tools=tools)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


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
