"""What an answer being decoded may stream yet: stop sequences and tool-call openers held back."""

from __future__ import annotations

from typing import Any

from .tool_calls import CALL_OPEN, CallStream


class TextWatcher:
    """Decodes tokens incrementally and decides what text may be streamed yet: text that could
    still grow into a stop sequence or a ``<tool_call>`` opener is held back; a stop sequence
    ends the answer before it; once a tool call opens, nothing more is streamed as text."""

    def __init__(self, tokenizer, stops: list[str], watch_calls: bool):
        self.tokenizer, self.stops, self.watch_calls = tokenizer, stops, watch_calls
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.calls = CallStream()

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

    def call_chunks(self) -> list[dict[str, Any]]:
        """Tool-call chunks the last token completed (see :class:`CallStream`)."""
        if not self.watch_calls or CALL_OPEN not in self.text:
            return []
        return self.calls.update(self.text)

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
