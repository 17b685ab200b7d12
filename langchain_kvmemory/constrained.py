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

import xgrammar as xgr
from xgrammar.contrib.hf import LogitsProcessor
from xgrammar.structural_tag import (
    AnyTextFormat,
    JSONSchemaFormat,
    OrFormat,
    StructuralTag,
    TagFormat,
    TriggeredTagsFormat,
)

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

    def tool_calls(self, tools: list[dict[str, Any]], choice: str) -> xgr.CompiledGrammar:
        """Grammar for an answer under ``tool_choice``.

        Args:
            tools: OpenAI-format function tools.
            choice: ``"auto"`` (free text; once the model writes ``<tool_call>`` the call must be
                valid JSON for one of the tools), ``"required"`` (exactly one call to any tool,
                nothing else), ``"none"`` (text that never opens a tool call) or a tool name
                (exactly one call to that tool).

        Raises:
            ValueError: an unknown tool name, or no tools for a required/named choice.
        """
        tags = {t["function"]["name"]: _call_tag(t["function"]) for t in tools}
        if choice == "none":
            fmt: Any = AnyTextFormat(excludes=[CALL_OPEN])
        elif choice == "auto":
            fmt = TriggeredTagsFormat(triggers=[CALL_OPEN], tags=list(tags.values()), stop_after_first=True)
        elif choice == "required":
            if not tags:
                raise ValueError("tool_choice requires a tool call but no tools are bound: pass tools to bind_tools")
            fmt = OrFormat(elements=list(tags.values())) if len(tags) > 1 else next(iter(tags.values()))
        elif choice in tags:
            fmt = tags[choice]
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


def processor(grammar: xgr.CompiledGrammar) -> LogitsProcessor:
    """A fresh logits processor for one decode call (transformers ``LogitsProcessor`` convention)."""
    return LogitsProcessor(grammar)
