"""How tool calls come back out of the model's text (tools reach the prompt through the session:
``kvmemory.prompt.render_text``).

Models whose chat template renders ``tools`` get them through the template. Templates that ignore
tools (ChatML, as in the embedded SmolLM2) get a tools block appended to the system message
(``kvmemory.prompt.fold_tools``), and an assistant turn's tool calls are written into its content
in the same ``<tool_call>`` format the model is asked (and, with constrained decoding, forced) to
produce::

    <tool_call>
    {"name": "get_weather", "arguments": {"location": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from kvmemory.prompt import CALL_CLOSE, CALL_OPEN, DEFAULT_SYSTEM, format_call, template_renders_tools, tools_block

__all__ = ["CALL_CLOSE", "CALL_OPEN", "DEFAULT_SYSTEM", "CallStream", "bare_calls", "format_call", "new_call_id", "schema_block",
           "split_calls", "template_renders_tools", "tools_block"]
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
# the head of a call as the grammar writes it, up to where its arguments begin
_HEAD_RE = re.compile(re.escape(CALL_OPEN) + r'\n\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')
CALL_TAIL = "}\n" + CALL_CLOSE  # what the grammar writes after a call's arguments
_FENCE_RE = re.compile(r"\A```[a-zA-Z]*\s*(.*?)\s*```\Z", re.DOTALL)


def schema_block(schema: dict[str, Any]) -> str:
    """The instruction appended to the system message when the answer must be JSON for ``schema``."""
    return "Answer with only a JSON object that follows this JSON schema:\n" + json.dumps(schema, ensure_ascii=False)


def split_calls(text: str, ids: list[str] | None = None) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """Split generated text into (content, tool_calls, invalid_tool_calls).

    ``content`` is the text outside ``<tool_call>`` blocks (stripped). Each valid call is
    ``{"name", "args", "id", "type": "tool_call"}`` with a fresh non-empty id; a block that does
    not parse as ``{"name": str, "arguments": object}`` becomes an invalid tool call (with the
    raw text and the error), never silently dropped. An unterminated block (decoding stopped at
    ``max_tokens``) is invalid too. ``ids``: the ids already given to the blocks, in order
    (streamed as tool-call chunks); blocks beyond them get fresh ids.
    """
    calls, invalid = [], []
    given = iter(ids or [])
    for match in _CALL_RE.finditer(text):
        _parse_block(match.group(1), calls, invalid, next(given, None) or new_call_id())
    content = _CALL_RE.sub("", text)
    open_at = content.find(CALL_OPEN)
    if open_at >= 0:  # an unterminated call
        invalid.append(_invalid(None, content[open_at + len(CALL_OPEN):].strip(), "tool call not terminated "
                                "(decoding stopped, e.g. at max_tokens): raise max_tokens", next(given, None)))
        content = content[:open_at]
    return content.strip(), calls, invalid


def bare_calls(text: str, tool_names: set[str]) -> list[dict[str, Any]]:
    """Tool calls written without the ``<tool_call>`` tags: the whole answer is one JSON object
    ``{"name": <a bound tool>, "arguments": <object>}``, or a list of them, bare or in one
    Markdown code fence. Qwen2.5-Coder models often answer a tool request this way (as Ollama
    users see); anything else (prose around it, another name, a malformed object) is text: [].
    Each call gets a fresh id."""
    body = text.strip()
    fenced = _FENCE_RE.match(body)
    if fenced:
        body = fenced.group(1)
    if not body.startswith(("{", "[")):
        return []
    try:
        found = loads_call_json(body)
    except json.JSONDecodeError:
        return []
    objects = found if isinstance(found, list) else [found]
    calls = []
    for obj in objects:
        if not (isinstance(obj, dict) and set(obj) == {"name", "arguments"} and obj["name"] in tool_names
                and isinstance(obj["arguments"], dict)):
            return []
        calls.append({"name": obj["name"], "args": obj["arguments"], "id": new_call_id(), "type": "tool_call"})
    return calls


class CallStream:
    """Tool-call chunks of an answer while it is decoded: once a call's head (its name) is
    complete, a chunk ``{"name", "args": "", "id", "index"}``; then its arguments as they grow
    (``{"name": None, "args": delta, "id": None, "index"}``), holding back text that may still be
    the call's closing ``}`` + ``</tool_call>``. Merged, the chunks give the calls' JSON."""

    def __init__(self):
        self.ids: list[str] = []
        self._sent: list[int] = []  # argument characters sent per call

    def update(self, text: str) -> list[dict[str, Any]]:
        """Chunks for what ``text`` (the whole answer so far) adds."""
        chunks = []
        for index, head in enumerate(_HEAD_RE.finditer(text)):
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self._sent.append(0)
                chunks.append(_chunk(json.loads(head.group(1)), "", self.ids[index], index))
            rest = text[head.end():]
            closed = rest.find(CALL_TAIL)
            args = rest[:closed] if closed >= 0 else rest[: len(rest) - _held_back(rest)]
            if len(args) > self._sent[index]:
                chunks.append(_chunk(None, args[self._sent[index]:], None, index))
                self._sent[index] = len(args)
        return chunks


def _held_back(text: str) -> int:
    """Length of the longest end of ``text`` that may begin CALL_TAIL."""
    for k in range(min(len(CALL_TAIL), len(text)), 0, -1):
        if text.endswith(CALL_TAIL[:k]):
            return k
    return 0


def _chunk(name: str | None, args: str, call_id: str | None, index: int) -> dict[str, Any]:
    return {"name": name, "args": args, "id": call_id, "index": index, "type": "tool_call_chunk"}


def loads_call_json(text: str) -> Any:
    """``json.loads`` that also reads a call written with doubled outer braces. Qwen2.5's own chat
    template shows the call format as ``{{"name": <function-name>, "arguments": ...}}`` (a Jinja
    string literal keeps both braces), and its models copy it, closing with one or two extra
    ``}``: the object from the first ``{"`` on, followed by closing braces only, is the call.

    Raises:
        json.JSONDecodeError: anything else that is not JSON.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        body = text.strip()
        if not body.startswith("{{"):
            raise
        body = "{" + body.lstrip("{ \n")
        obj, end = json.JSONDecoder().raw_decode(body)
        if body[end:].replace("}", "").strip():
            raise
        return obj


def _parse_block(raw: str, calls: list, invalid: list, call_id: str) -> None:
    try:
        obj = loads_call_json(raw)
    except json.JSONDecodeError as exc:
        invalid.append(_invalid(None, raw, f"not JSON: {exc}", call_id))
        return
    name = obj.get("name") if isinstance(obj, dict) else None
    args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
    if not isinstance(name, str) or not isinstance(args, dict):
        invalid.append(_invalid(name if isinstance(name, str) else None, raw,
                                'expected {"name": <string>, "arguments": <object>}', call_id))
        return
    calls.append({"name": name, "args": args, "id": call_id, "type": "tool_call"})


def _invalid(name: str | None, raw: str, error: str, call_id: str | None = None) -> dict[str, Any]:
    return {"name": name, "args": raw, "id": call_id or new_call_id(), "error": error, "type": "invalid_tool_call"}


def new_call_id() -> str:
    """A fresh tool-call id (``call_`` + 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]
