"""Constrained decoding with xgrammar: grammars for tool calls and JSON output, applied through
``KVSession.stream_tokens(logits_processor=...)`` so even a 135 M-parameter model emits text that
parses against the schema.

One :class:`Grammars` per loaded model (the compiler caches compiled grammars); one logits
processor per decode call (``xgrammar.contrib.hf.LogitsProcessor`` holds per-call matcher state).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch
import transformers
import xgrammar as xgr
from xgrammar.contrib.hf import LogitsProcessor
from xgrammar.structural_tag import (
    AnyTextFormat,
    JSONSchemaFormat,
    OrFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
    TriggeredTagsFormat,
)

from kvmemory.errors import InputError, InputTypeError, KVMemoryError

from .tool_calls import CALL_CLOSE, CALL_OPEN

# Strings the schema leaves unbounded are capped in the grammar (not in the schema used to parse):
# a small model can otherwise repeat itself inside a string until max_tokens cuts the JSON.
MAX_FREE_STRING_CHARS = 80
# JSON inside a tool call may hold at most this many consecutive whitespace characters (an
# unbounded grammar lets a small model emit spaces until max_tokens).
MAX_JSON_WHITESPACE = 1


class Grammars:
    """Compiles grammars for one tokenizer.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's logits width (``config.vocab_size``; may exceed the tokenizer's).
    """

    def __init__(self, tokenizer, vocab_size: int):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info)
        self._lock = threading.Lock()  # compile calls from several worker threads

    def tool_calls(self, tools: list[dict[str, Any]], choice: str, *, parallel: bool = True,
                   answer_schema: dict[str, Any] | None = None) -> xgr.CompiledGrammar:
        """Grammar for an answer under ``tool_choice``.

        Args:
            tools: OpenAI-format function tools.
            choice: ``"auto"`` (free text; once the model writes ``<tool_call>`` the call must be
                valid JSON for one of the tools), ``"required"`` (one or more calls to any tool,
                nothing else), ``"none"`` (text that never opens a tool call) or a tool name
                (calls of that tool only).
            parallel: several calls in one answer (separated by a newline); False = at most one.
            answer_schema: the JSON schema a text answer must follow (structured output). Under
                ``"auto"`` the answer is then either tool calls or one JSON value for the schema;
                under ``"none"`` only the JSON value.

        Raises:
            ValueError: an unknown tool name, or no tools for a required/named choice.
        """
        tags = {t["function"]["name"]: _call_tag(t["function"]) for t in tools}
        answer = (JSONSchemaFormat(json_schema=capped_strings(answer_schema), max_whitespace_cnt=MAX_JSON_WHITESPACE)
                  if answer_schema is not None else None)
        if choice == "none":
            fmt: Any = answer if answer is not None else AnyTextFormat(excludes=[CALL_OPEN])
        elif choice == "auto" and answer is None:
            fmt = TriggeredTagsFormat(triggers=[CALL_OPEN], tags=list(tags.values()), stop_after_first=not parallel)
        elif choice == "auto":
            fmt = OrFormat(elements=[_calls(list(tags.values()), parallel), answer])
        elif choice == "required":
            if not tags:
                raise ValueError("tool_choice requires a tool call but no tools are bound: pass tools to bind_tools")
            fmt = _calls(list(tags.values()), parallel)
        elif choice in tags:
            fmt = _calls([tags[choice]], parallel)
        else:
            raise ValueError(f"tool_choice names {choice!r}, which is not a bound tool: use one of "
                             f"{', '.join(tags) or '(no tools bound)'}, 'auto', 'any' or 'none'")
        return self._compile(lambda: self._compiler.compile_structural_tag(StructuralTag(format=fmt)))

    def json_schema(self, schema: dict[str, Any]) -> xgr.CompiledGrammar:
        """Grammar for one JSON value valid under ``schema`` (no extra properties, compact)."""
        text = json.dumps(capped_strings(schema))
        return self._compile(lambda: self._compiler.compile_json_schema(text, any_whitespace=False))

    def json_object(self) -> xgr.CompiledGrammar:
        """Grammar for any JSON object (JSON mode), compact."""
        return self._compile(lambda: self._compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=False, strict_mode=False))

    def _compile(self, build):
        with self._lock:
            return build()


def _calls(tags: list[TagFormat], parallel: bool) -> Any:
    """One call (or, when ``parallel``, one or more newline-separated calls) of the ``tags``."""
    if parallel:
        return TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True)
    return OrFormat(elements=tags) if len(tags) > 1 else tags[0]


def _call_tag(function: dict[str, Any]) -> TagFormat:
    params = capped_strings(function.get("parameters") or {"type": "object", "properties": {}})
    return TagFormat(
        begin=f'{CALL_OPEN}\n{{"name": {json.dumps(function["name"])}, "arguments": ',
        content=JSONSchemaFormat(json_schema=params, max_whitespace_cnt=MAX_JSON_WHITESPACE),
        end=f"}}\n{CALL_CLOSE}",
    )


def capped_strings(schema: Any) -> Any:
    """A copy of ``schema`` where every string without its own bound (maxLength, enum, const,
    pattern, format) gets ``maxLength`` = MAX_FREE_STRING_CHARS, so constrained output ends."""
    if isinstance(schema, list):
        return [capped_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: capped_strings(v) for k, v in schema.items()}
    types = schema.get("type")
    if (types == "string" or (isinstance(types, list) and "string" in types)) and not (
        {"maxLength", "enum", "const", "pattern", "format"} & schema.keys()
    ):
        out["maxLength"] = MAX_FREE_STRING_CHARS
    return out


def response_schema(response_format: Any) -> tuple[str, dict[str, Any] | None] | None:
    """What a ``response_format`` asks for: ``("json_schema", schema)``, ``("json_object", None)``
    (any JSON object) or None (plain text).

    Accepts the forms LangChain and OpenAI-style callers pass: a pydantic class or TypedDict, a
    JSON schema dict, ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
    (OpenAI; what ``create_agent``'s ProviderStrategy binds), ``{"type": "json_schema",
    "schema": ...}``, ``{"type": "json_object"}`` and ``{"type": "text"}``.

    Raises:
        InputError: a json_schema request without a schema. InputTypeError: another type.
    """
    from langchain_core.utils.function_calling import convert_to_json_schema

    if response_format is None:
        return None
    if isinstance(response_format, type):
        return "json_schema", convert_to_json_schema(response_format)
    if not isinstance(response_format, dict):
        raise InputTypeError(f"response_format must be a pydantic class, a TypedDict, a JSON schema dict or "
                             f"{{'type': 'json_schema', 'json_schema': {{'schema': ...}}}} (got {type(response_format).__name__})")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else response_format.get("schema")
        if not isinstance(schema, dict):
            raise InputError("response_format type 'json_schema' without a schema: pass "
                             "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
        return "json_schema", schema
    if kind in ("json_object", "json_mode"):
        schema = response_format.get("schema")
        return ("json_schema", schema) if isinstance(schema, dict) else ("json_object", None)
    if isinstance(response_format.get("parameters"), dict) and "name" in response_format:
        return "json_schema", response_format["parameters"]  # a function schema
    return "json_schema", response_format  # a JSON schema


def processor(grammar: xgr.CompiledGrammar) -> LogitsProcessor:
    """A fresh logits processor for one decode call (transformers ``LogitsProcessor`` convention)."""
    return LogitsProcessor(grammar)


class BudgetSpent(KVMemoryError):
    """Raised by :class:`AnswerBudget` before a token the answer has no budget left for (the
    session is consistent: nothing was picked)."""


class AnswerBudget(transformers.LogitsProcessor):
    """Counts the answer's tokens against ``max_tokens``, except tokens the grammar fixes (the
    ``<tool_call>`` wrapper, a forced tool name, JSON punctuation that has one continuation): a
    step is fixed when the grammar leaves one allowed token or a forced string
    (``find_jump_forward_string``). Place it right after the grammar processor.

    Raises:
        BudgetSpent: at a free step once ``max_tokens`` free tokens were decoded.
    """

    def __init__(self, max_tokens: int, grammar: LogitsProcessor | None):
        self.max_tokens, self.grammar = max_tokens, grammar
        self.charged = 0
        self.steps: list[bool] = []  # per decoding step: fixed by the grammar

    def fixed(self, tokens: int) -> int:
        """Grammar-fixed tokens among the first ``tokens`` answer tokens (not the end-of-turn pick)."""
        return sum(self.steps[:tokens])

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        fixed = self._is_fixed(scores)
        if not fixed and self.charged >= self.max_tokens:
            raise BudgetSpent
        self.charged += not fixed
        self.steps.append(fixed)
        return scores

    def _is_fixed(self, scores: torch.FloatTensor) -> bool:
        if self.grammar is None or not self.grammar.matchers:
            return False
        matcher = self.grammar.matchers[0]
        if matcher.is_terminated():
            return False
        return bool(matcher.find_jump_forward_string()) or int(torch.isfinite(scores).sum()) == 1
