"""LangChain messages -> kvmemory message dicts (role, content, id). Tools are not folded in
here: the session renders them (``kvmemory.prompt.render_text``), through the chat template or
folded into the system message.

Message ids are kept, so an edited message (same id, new content: a cleared tool output, a
summary) reaches the session as a replacement in the middle and is repaired, not re-prefilled.
"""

from __future__ import annotations

from typing import Any, Sequence

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage

from kvmemory.errors import MessageError

from .tool_calls import DEFAULT_SYSTEM, format_call, schema_block

TOOLS_SYSTEM_ID = "kvmemory:tools-system"


class UnsupportedContentError(MessageError):
    """A message holds content the text-only model cannot read (image, audio, file ...)."""


def text_of(message: BaseMessage) -> str:
    """The message's text. List content keeps its text blocks (tool-use blocks are carried by
    ``tool_calls``); any image/audio/file block raises UnsupportedContentError."""
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif not isinstance(block, dict):
            raise UnsupportedContentError(
                f"a {type(message).__name__} holds a {type(block).__name__} content block: pass strings or "
                '{"type": "text", "text": ...} blocks'
            )
        elif block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif block.get("type") in ("tool_use", "tool_call", "function_call", "reasoning", "thinking"):
            continue  # carried elsewhere (tool_calls) or not part of the prompt
        else:
            raise UnsupportedContentError(
                f"a {type(message).__name__} holds a {block.get('type')!r} block: the model reads text only; "
                "pass text content (describe or transcribe other media first)"
            )
    return "".join(parts)


def to_session_messages(
    messages: Sequence[BaseMessage], template_tools: bool, schema: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Convert a LangChain history for ``KVSession.prepare`` (the tools go to ``session.tools``).

    Args:
        messages: system / human / AI / tool messages (any order the agent produced).
        template_tools: the chat template renders ``tools`` itself (then tool calls travel as
            ``tool_calls`` fields); otherwise tool calls are written into the assistant content
            in the format the folded tools block asks for.
        schema: JSON schema the answer must follow (structured output); described in the
            system message so the model knows what the grammar will hold it to (the session
            folds a tools block, if any, after it).

    Raises:
        UnsupportedContentError: non-text content. ValueError: an unknown message type.
    """
    out = [_convert(m, template_tools) for m in messages]
    if schema:
        block = schema_block(schema)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": DEFAULT_SYSTEM + "\n\n" + block, "id": TOOLS_SYSTEM_ID})
    return out


def check_tool_history(messages: Sequence[BaseMessage]) -> None:
    """Refuse a tool history a chat API would refuse (OpenAI does): every ToolMessage answers a
    call of an earlier AIMessage, and every call of an AIMessage is answered by a ToolMessage
    before the next other message (or the end of the list).

    Raises:
        MessageError: naming the offending message's index and the fix.
    """
    called: set[str] = set()
    pending: dict[str, tuple[int, str]] = {}  # open call id -> (index of its AIMessage, tool name)
    for index, message in enumerate(messages):
        if isinstance(message, ToolMessage):
            if message.tool_call_id not in called:
                raise MessageError(
                    f"ToolMessage at index {index} answers tool_call_id {message.tool_call_id!r}, which no earlier "
                    "AIMessage called: pass the AIMessage with that tool call before it, or drop the ToolMessage")
            pending.pop(message.tool_call_id, None)
            continue
        _refuse_unanswered(pending, f"the {type(message).__name__} at index {index}")
        if isinstance(message, AIMessage):
            calls = [c for c in message.tool_calls if c.get("id")]
            called.update(c["id"] for c in calls)
            pending = {c["id"]: (index, c["name"]) for c in calls}
    _refuse_unanswered(pending, "the end of the messages")


def _refuse_unanswered(pending: dict[str, tuple[int, str]], before: str) -> None:
    if pending:
        call_id, (index, name) = next(iter(pending.items()))
        raise MessageError(
            f"AIMessage at index {index} calls {name!r} (tool_call_id {call_id!r}) but no ToolMessage answers it "
            f"before {before}: add ToolMessage(..., tool_call_id={call_id!r}) right after the AIMessage, or drop "
            "the tool call")


def session_message(message: BaseMessage, template_tools: bool) -> dict[str, Any]:
    """One LangChain message as a kvmemory message dict (see :func:`to_session_messages`)."""
    return _convert(message, template_tools)


def _convert(message: BaseMessage, template_tools: bool) -> dict[str, Any]:
    text = text_of(message)
    if isinstance(message, SystemMessage):
        out: dict[str, Any] = {"role": "system", "content": text}
    elif isinstance(message, HumanMessage):
        out = {"role": "user", "content": text}
    elif isinstance(message, AIMessage):
        out = _assistant(message, text, template_tools)
    elif isinstance(message, ToolMessage):
        out = {"role": "tool", "content": text}
        if template_tools:
            out["tool_call_id"] = message.tool_call_id
    else:
        raise MessageError(f"unsupported message type {type(message).__name__}: use System/Human/AI/Tool messages")
    if message.id:
        out["id"] = message.id
    return out


def _assistant(message: AIMessage, text: str, template_tools: bool) -> dict[str, Any]:
    calls = message.tool_calls
    if not calls:
        return {"role": "assistant", "content": text}
    if template_tools:
        return {"role": "assistant", "content": text, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
            for c in calls]}
    written = [format_call(c["name"], c["args"]) for c in calls]
    return {"role": "assistant", "content": "\n".join(([text] if text else []) + written)}
