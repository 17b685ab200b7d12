"""Chat messages, their rendering through the model's chat template, and the segment table.

The segment table maps every message (by key = its id, plus a content hash) to its token span in
the rendered prompt. Spans come from rendering growing prefixes of the message list: the text a
message adds is its segment, and each token belongs to the segment holding the midpoint of its
character span.

Tools (:func:`render_text`, used for every rendering): a chat template that uses a ``tools``
variable renders them itself; for one that ignores tools (ChatML, as in the embedded SmolLM2)
they are folded into the system message in one format (:func:`fold_tools`), so a model sees its
tools whichever template it has.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from jinja2 import TemplateError as JinjaTemplateError
from transformers.utils import get_json_schema

from .errors import InputError, InputTypeError, MessageError, TemplateError

ROLES = ("system", "user", "assistant", "tool")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
DEFAULT_SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True)
class ChatMessage:
    """One chat message as kvmemory sees it.

    ``key`` identifies the message across turns: its ``id`` when given, otherwise
    ``role:hash#n`` (the n-th message with that role and content), so identical anonymous
    messages still match in order. ``extra`` carries template fields such as ``tool_calls``.
    """

    role: str
    content: str
    key: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def content_hash(self) -> str:
        payload = json.dumps([self.role, self.content, dict(self.extra)], sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def template_dict(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content, **self.extra}


def normalize_messages(messages: Sequence[Mapping[str, Any] | ChatMessage]) -> list[ChatMessage]:
    """Validate ``[{"role", "content", "id"?, ...}, ...]`` and give each message its key.

    Raises:
        MessageError: not a list, empty list, a non-mapping item, missing/unknown role, missing
            or non-text content (lists of text blocks are joined, see :func:`message_text`), an id
            that is not a str/int, or a duplicated id.
    """
    if isinstance(messages, (str, bytes, Mapping)):
        raise MessageError(
            f"messages must be a list of messages, got one {type(messages).__name__}: "
            'wrap it, e.g. [{"role": "user", "content": "..."}]'
        )
    if not messages:
        raise MessageError("the message list is empty: pass at least one message (e.g. a system or user message)")
    seen_ids: set[str] = set()
    anonymous: Counter[str] = Counter()
    out: list[ChatMessage] = []
    for i, msg in enumerate(messages):
        if isinstance(msg, ChatMessage):
            msg = {"role": msg.role, "content": msg.content, "id": msg.key, **msg.extra}
        if not isinstance(msg, Mapping):
            raise MessageError(f"message {i} is a {type(msg).__name__}: pass a dict with 'role' and 'content'")
        role = msg.get("role")
        if role not in ROLES:
            what = "no 'role'" if "role" not in msg else f"role {role!r}"
            raise MessageError(f"message {i} has {what}: use one of {', '.join(ROLES)}")
        content = message_text(msg, i)
        extra = {k: v for k, v in msg.items() if k not in ("role", "content", "id")}
        mid = msg.get("id")
        if mid is not None:
            if not isinstance(mid, (str, int)) or isinstance(mid, bool):
                raise MessageError(f"message {i} has a {type(mid).__name__} id: ids are strings (or ints)")
            mid = str(mid)
            if mid in seen_ids:
                raise MessageError(f"message id {mid!r} appears twice: ids must be unique within a history")
            seen_ids.add(mid)
            key = mid
        else:
            digest = hashlib.sha256(f"{role}\0{content}".encode()).hexdigest()[:12]
            anonymous[digest] += 1
            key = f"{role}:{digest}#{anonymous[digest]}"
        out.append(ChatMessage(role=role, content=content, key=key, extra=extra))
    return out


def message_text(msg: Mapping[str, Any], index: int = 0) -> str:
    """The text of a message dict: a string, or a list of content blocks as LangChain and OpenAI
    write them (strings and ``{"type": "text", "text": ...}``, joined). A missing/None content is
    accepted only on an assistant message carrying ``tool_calls``.

    Raises:
        MessageError: no content, a non-text block (image, audio, ...), or another type.
    """
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            return ""
        what = "no 'content'" if "content" not in msg else "content None"
        raise MessageError(f"message {index} has {what}: give it a text 'content' (an empty string is allowed)")
    if isinstance(content, (list, tuple)):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, Mapping) and block.get("type") == "text" and isinstance(block.get("text"), str):
                parts.append(block["text"])
            else:
                kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
                raise MessageError(
                    f"message {index} holds a {kind!r} content block: kvmemory reads text only; pass strings or "
                    '{"type": "text", "text": ...} blocks (describe or transcribe other media first)'
                )
        return "".join(parts)
    raise MessageError(
        f"message {index} has {type(content).__name__} content: pass the text as a string "
        '(or a list of {"type": "text", "text": ...} blocks)'
    )


@dataclass(frozen=True)
class Segment:
    """One message's place in the rendered prompt.

    Token span ``[token_start, token_end)``; character spans into the prompt text for the whole
    rendered message and for its content alone (``content_start == content_end`` if not found).
    """

    key: str
    content_hash: str
    index: int
    token_start: int
    token_end: int
    char_start: int
    char_end: int
    content_start: int
    content_end: int

    @property
    def length(self) -> int:
        return self.token_end - self.token_start


@dataclass(frozen=True)
class RenderedPrompt:
    """A message list rendered with the chat template and tokenized.

    ``token_ids`` (length N) are the tokenization of ``text``; ``offsets[i]`` is token i's
    character span. ``segments`` has one entry per message; tokens after the last segment
    (the generation prompt) belong to no message.
    """

    messages: tuple[ChatMessage, ...]
    text: str
    token_ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]
    segments: tuple[Segment, ...]

    def __len__(self) -> int:
        return len(self.token_ids)


# ------------------------------------------------------------------ tools
def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template uses a ``tools`` variable (else tools are folded
    into the system message, see :func:`fold_tools`)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "tools" in template


def normalize_tools(tools: Sequence[Mapping[str, Any] | Callable] | None) -> list[dict[str, Any]] | None:
    """Check ``tools`` and give each as an OpenAI-format dict ``{"type": "function", "function":
    {"name", "description", "parameters"}}``; a Python function (typed, with a Google-style
    docstring) is converted by ``transformers.utils.get_json_schema``. None or ``[]``: None.

    Raises:
        InputTypeError: ``tools`` is not a list (e.g. one tool or a string).
        InputError: an item is neither such a dict nor a convertible function.
    """
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InputTypeError(f"tools must be a list of tools (got {type(tools).__name__}): wrap it, e.g. [tool]")
    out = []
    for i, tool in enumerate(tools):
        if callable(tool) and not isinstance(tool, Mapping):
            try:
                tool = get_json_schema(tool)
            except Exception as exc:  # transformers raises its own TypeErrors / ValueErrors
                raise InputError(f"tool {i} ({getattr(tool, '__name__', tool)!r}) cannot be described: {exc}") from exc
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InputError(
                f"tool {i} is not an OpenAI-format tool: pass {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                '"description": ..., "parameters": {...}}}, a typed Python function with a docstring, or convert it '
                "with langchain_core.utils.function_calling.convert_to_openai_tool"
            )
        out.append(dict(tool))
    return out or None


def tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools section appended to the system message for templates without tool support.

    Args:
        tools: OpenAI-format tools (see :func:`normalize_tools`).
    """
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You can call these tools:\n<tools>\n" + listing + "\n</tools>\n"
        "To call a tool, reply with only:\n" + CALL_OPEN + '\n{"name": <tool name>, "arguments": '
        "<arguments as a JSON object>}\n" + CALL_CLOSE + "\nOtherwise answer normally."
    )


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """One tool call as the model writes it in the format :func:`tools_block` asks for (the text an
    assistant turn holds for it under a template without tool support)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def fold_tools(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The template message dicts with the tools folded in, for templates without tool support:
    ``"\n\n" + tools_block(tools)`` appended to the first message when it is a system message,
    else a system message ``DEFAULT_SYSTEM + "\n\n" + tools_block(tools)`` put first. The
    messages themselves are not changed (so their keys and content hashes stay the caller's)."""
    block = tools_block(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + block}] + messages[1:]
    return [{"role": "system", "content": DEFAULT_SYSTEM + "\n\n" + block}] + messages


def render_text(
    tokenizer, messages: Sequence[ChatMessage], *, tools=None, generation_prompt: bool = True
) -> str:
    """The prompt text of ``messages`` through the chat template, tools included: passed to the
    template when it renders ``tools`` (:func:`template_renders_tools`), folded into the system
    message otherwise (:func:`fold_tools`). Every rendering of a session goes through here.

    Args:
        tools: OpenAI-format tools or functions (see :func:`normalize_tools`), or None.

    Raises:
        InputTypeError / InputError: malformed ``tools``.
        InputError: the template renders no tools and rejects the system message they are
            folded into.
    """
    tools = normalize_tools(tools)
    dicts = [m.template_dict() for m in messages]
    folded = bool(tools) and not template_renders_tools(tokenizer)
    if folded:
        dicts, tools = fold_tools(dicts, tools), None
    try:
        return tokenizer.apply_chat_template(dicts, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
    except JinjaTemplateError as exc:
        if not folded:
            raise
        raise InputError(
            f"the chat template renders no tools and rejects the system message kvmemory folds them into ({exc}): "
            "use a chat template with tool support, or describe the tools in a message yourself and pass tools=None"
        ) from exc


def _render(tokenizer, messages: Sequence[ChatMessage], generation_prompt: bool, tools) -> str:
    return render_text(tokenizer, messages, tools=tools, generation_prompt=generation_prompt)


def render_prompt(
    tokenizer,
    messages: Sequence[ChatMessage],
    *,
    tools=None,
    generation_prompt: bool = True,
    previous: RenderedPrompt | None = None,
    segments: bool = True,
) -> RenderedPrompt:
    """Render ``messages`` with the tokenizer's chat template (:func:`render_text`), tokenize the
    text once and build the segment table (:func:`segment_prompt`, where ``tools`` and
    ``previous`` are explained).

    ``segments=False`` leaves the table empty: what a caller needs before it knows which cache
    the prompt goes to; :func:`segment_prompt` adds it later without rendering the whole list again.

    Returns:
        ``previous`` itself when it renders the same text from the same messages (no second
        tokenization), else a RenderedPrompt whose segments partition the message tokens in order.

    Raises:
        TemplateError: message spans are not stable (see :func:`segment_prompt`).
        InputTypeError / InputError: malformed ``tools``, or tools a template cannot take.
    """
    text = _render(tokenizer, messages, generation_prompt, tools)
    if _renders_as(previous, messages, text):
        return previous
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = tuple(tuple(o) for o in enc["offset_mapping"])
    tokenized = RenderedPrompt(tuple(messages), text, tuple(enc["input_ids"]), offsets, ())
    return segment_prompt(tokenizer, tokenized, tools=tools, previous=previous) if segments else tokenized


def segment_prompt(
    tokenizer, prompt: RenderedPrompt, *, tools=None, previous: RenderedPrompt | None = None
) -> RenderedPrompt:
    """``prompt`` (from ``render_prompt(..., segments=False)`` with the same ``tools``) with its
    segment table.

    ``tools`` reach the prompt as :func:`render_text` says (through the template, or folded into
    the system message, whose segment then holds them; a system message put first for them
    belongs to message 0's segment).

    Message boundaries come from rendering growing prefixes of the list. With ``previous`` (the
    last rendering of this conversation), the boundaries of an unchanged leading and trailing
    run of messages are taken from it when the text there is unchanged, so an append-only turn
    or a single mid-history edit renders only the changed messages' prefixes, not all n.

    Returns:
        ``prompt`` itself when it has its table already, ``previous`` itself for an identical
        rendering, else a RenderedPrompt whose segments partition the message tokens in order.

    Raises:
        TemplateError: rendering a prefix of the list changes a message's own text in the full
            rendering (the template rewrites earlier messages), so message spans are not stable.
            A prefix that differs only after its last message's content (a group closer the
            full text renders later, see :func:`_prefix_end`) is stable.
    """
    if prompt.segments:
        return prompt
    if _renders_as(previous, prompt.messages, prompt.text):
        return previous  # an identical request: same tokens and segments
    bounds = _message_bounds(tokenizer, prompt.messages, prompt.text, tools, previous)
    segments = _segments(prompt.messages, prompt.text, bounds, prompt.offsets)
    return replace(prompt, segments=tuple(segments))


def _renders_as(previous: RenderedPrompt | None, messages: Sequence[ChatMessage], text: str) -> bool:
    return previous is not None and previous.text == text and previous.messages == tuple(messages)


def _message_bounds(tokenizer, messages, text: str, tools, previous: RenderedPrompt | None) -> list[int]:
    """Character offsets ``[0, end_0, end_1, ..., end_{n-1}]`` of the messages in ``text``."""
    n = len(messages)
    bounds: list[int | None] = [0] + [None] * n
    bounds[n] = _prefix_end(tokenizer, messages, n, text, tools)
    if previous is not None and previous.segments:
        _reuse_previous_bounds(messages, text, previous, bounds)
    for k in range(1, n):
        if bounds[k] is None:
            bounds[k] = _prefix_end(tokenizer, messages, k, text, tools)
    if any(a > b for a, b in zip(bounds, bounds[1:])):
        raise TemplateError("the chat template renders messages out of order; kvmemory reuses only the common token prefix")
    return bounds


def _prefix_end(tokenizer, messages, k: int, text: str, tools) -> int:
    """Where message ``k - 1`` ends in ``text``: the end of the first ``k`` messages' rendering.

    Templates that render a message by its neighbours (Qwen2.5 groups consecutive tool results
    into one user turn and closes it after the last one; Llama 3 and Mistral have such rules
    too) end a prefix with a closer the full text has only later. The message then ends where
    the two texts part: its own tokens before, the group's closer with whichever message
    renders last. Its content must lie before that point, else the template rewrites the
    message itself and its span is not stable.
    """
    part = _render(tokenizer, messages[:k], False, tools)
    if text.startswith(part):
        return len(part)
    end = _common_text_prefix(part, text)
    content = messages[k - 1].content
    found = part.rfind(content) if content else end
    if found < 0 or found + len(content) > end:
        raise TemplateError(
            f"the chat template renders message {k - 1} differently once later messages follow; "
            "kvmemory reuses only the common token prefix for this model"
        )
    return end


def _common_text_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (binary search on slices: C speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _unchanged(message: ChatMessage, segment: Segment) -> bool:
    return message.key == segment.key and message.content_hash == segment.content_hash


def _reuse_previous_bounds(messages, text: str, previous: RenderedPrompt, bounds: list) -> None:
    """Fill ``bounds`` for the unchanged head and tail runs of messages from ``previous``."""
    old, old_text = previous.segments, previous.text
    n, m = len(messages), len(old)
    head = 0
    while head < min(n, m) and _unchanged(messages[head], old[head]):
        head += 1
    if head and text[: old[head - 1].char_end] == old_text[: old[head - 1].char_end]:
        for k in range(1, head + 1):
            bounds[k] = old[k - 1].char_end
    else:
        head = 0
    tail = 0
    while tail < min(n, m) - head and _unchanged(messages[n - 1 - tail], old[m - 1 - tail]):
        tail += 1
    if tail:
        end, old_start, old_end = bounds[n], old[m - tail].char_start, old[m - 1].char_end
        start = end - (old_end - old_start)
        if start >= (bounds[head] or 0) and text[start:end] == old_text[old_start:old_end]:
            for i in range(1, min(tail, n - 1) + 1):  # bounds[0] stays 0: the template's preamble is message 0's
                bounds[n - i] = end - (old_end - old[m - i].char_start)


def _segments(messages, text, bounds, offsets) -> list[Segment]:
    # A token belongs to the message whose character range holds the token's midpoint.
    mids = [(a + b) / 2 for a, b in offsets]
    segments, t = [], 0
    for i, msg in enumerate(messages):
        c0, c1 = bounds[i], bounds[i + 1]
        start = t
        while t < len(mids) and mids[t] < c1:
            t += 1
        found = text.find(msg.content, c0, c1) if msg.content else -1
        cs, ce = (found, found + len(msg.content)) if found >= 0 else (c0, c0)
        segments.append(Segment(msg.key, msg.content_hash, i, start, t, c0, c1, cs, ce))
    return segments
