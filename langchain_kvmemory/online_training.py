"""Online test-time training for LangGraph / LangChain agents on kvmemory sessions.

* :func:`make_ttt_node` builds a LangGraph node: when the state carries a confirmed answer it
  runs one answer-supervised peft LoRA step on the recent messages, bumps the adapter version,
  and applies CacheReforge to every live thread cache in the registry.
* :class:`TestTimeTrainingCallback` is a LangChain callback handler that remembers the last
  chat-model call (its messages and answer) and trains on it once the answer is confirmed
  (``confirm()``) or when ``target_fn`` supplies a target.

Both drive :class:`kvmemory.online_adapter.OnlineAdapter` (the core; it never imports LangChain)
and convert the LangChain messages exactly as ``ChatKVMemory`` does
(:func:`langchain_kvmemory.messages.to_session_messages`, tool calls written as the tokenizer's
chat template takes them), so the text a step trains on is the text the chat model caches.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import BaseMessage

from kvmemory.online_adapter import OnlineAdapter, UpdateReport

from .messages import to_session_messages
from .tool_calls import template_renders_tools


def trained_messages(tokenizer, messages: Sequence[BaseMessage]) -> list[dict]:
    """``messages`` as the kvmemory message dicts ``ChatKVMemory`` caches for them with
    ``tokenizer``'s chat template (the same conversion, see ``to_session_messages``).

    Raises:
        UnsupportedContentError: non-text content. MessageError (a ValueError): an unknown
            message type.
    """
    return to_session_messages(messages, template_renders_tools(tokenizer))


def make_ttt_node(online: OnlineAdapter, *, answer_key: str = "confirmed_answer", messages_key: str = "messages",
                  version_key: str | None = "adapter_version", window: int = 6) -> Callable[[dict], dict]:
    """A LangGraph node ``node(state) -> update`` for test-time training.

    Reads ``state[answer_key]`` (the user-confirmed answer or a supplied target; nothing happens
    when it is empty) and the last ``window`` messages of ``state[messages_key]`` before the
    answer. Returns ``{answer_key: None}`` (the answer is consumed) and, if ``version_key`` is
    set, the new adapter digest under that key (declare both keys in the graph state). The
    report of the last update is kept on ``node.last_report``.
    """

    def node(state: dict) -> dict:
        answer = state.get(answer_key)
        if not answer:
            return {}
        recent = list(state.get(messages_key) or [])[-window:]
        while recent and recent[-1].type == "ai":  # supervise the answer, not the model's own try
            recent.pop()
        if not recent:
            raise ValueError(f"no messages before the confirmed answer in state[{messages_key!r}]")
        report = online.update(trained_messages(online.tokenizer, recent), answer)
        node.last_report = report
        update: dict[str, Any] = {answer_key: None}
        if version_key:
            update[version_key] = report.version_after
        return update

    node.last_report = None
    return node


class TestTimeTrainingCallback(BaseCallbackHandler):
    """LangChain callback: remember each chat-model call, train on it when confirmed.

    Args:
        online: the adapter trainer holding the registry of live sessions.
        target_fn: optional ``f(messages, answer_text) -> target | None``; a returned target
            trains immediately after the call (e.g. a verifier or a supplied reference).
    """

    __test__ = False  # not a pytest class, despite the name

    def __init__(self, online: OnlineAdapter, target_fn: Callable[[list[dict], str], str | None] | None = None):
        self.online = online
        self.target_fn = target_fn
        self.last_messages: list[dict] | None = None
        self.last_answer: str | None = None
        self.reports: list[UpdateReport] = []

    def on_chat_model_start(self, serialized, messages, **kwargs) -> None:
        self.last_messages = None  # a call whose messages fail to convert must not pair with the last call's
        self.last_messages = trained_messages(self.online.tokenizer, messages[0])

    def on_llm_end(self, response, **kwargs) -> None:
        generations = response.generations[0] if response.generations else []
        self.last_answer = generations[0].text if generations else None
        if self.target_fn and self.last_messages is not None and self.last_answer is not None:
            target = self.target_fn(self.last_messages, self.last_answer)
            if target:
                self.reports.append(self.online.update(self.last_messages, target))

    def confirm(self, answer: str | None = None) -> UpdateReport:
        """Train on the last call: ``answer`` if given (a correction), else the model's own
        answer (the user confirmed it).

        Raises:
            RuntimeError: no chat-model call was seen yet, or the last one's messages did not convert.
        """
        if self.last_messages is None:
            raise RuntimeError("no chat-model call with convertible messages seen yet: pass this callback in "
                               "`callbacks=[...]` first (text-only System/Human/AI/Tool messages)")
        target = answer if answer is not None else self.last_answer
        report = self.online.update(self.last_messages, target or "")
        self.reports.append(report)
        return report
