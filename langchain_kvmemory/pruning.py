"""Memory pruning for LangGraph agents whose history edits become budgeted cache repairs.

kvmemory's chat model diffs each call's message list against the thread's live cache by message
id, so every pruning move below ends in Shift + Semantic-Unit Refresh of the kept suffix (budget b
from the model or the call) instead of a Re-prefill:

- :func:`remove_messages` — ``RemoveMessage`` per id: deletions in the middle of the history.
- :func:`replace_history` — ``REMOVE_ALL_MESSAGES`` + the re-sent messages: kept messages keep
  their ids, so only what changed is repaired.
- :func:`pruning_node` — a graph node that, above a token threshold, drops the oldest turns or
  replaces them with a summary that takes the first summarised message's id (a replacement at
  the start of the history).
- :func:`side_thread_summarizer` — a summariser for the node and for LangChain v1's
  ``SummarizationMiddleware(summarizer=...)`` that runs on its own cache thread, so writing the
  summary never disturbs the conversation's live cache.
- :class:`RepairBudgetMiddleware` — a per-call repair budget for ``create_agent`` agents (next to
  ``ContextEditingMiddleware(ClearToolUsesEdit)``, whose cleared tool outputs keep their ids and
  therefore become mid-history replacements).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import (
    AnyMessage,
    BaseMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    get_buffer_string,
    trim_messages,
)
from langchain_core.messages.utils import count_tokens_approximately
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langgraph.graph.message import REMOVE_ALL_MESSAGES

from kvmemory.policy import RepairPolicy

TokenCounter = Callable[[Sequence[BaseMessage]], int]

SUMMARY_PREFIX = "Summary of the earlier conversation:\n"
SUMMARY_PROMPT = (
    "Summarise the conversation below in at most three short sentences. Keep names, numbers and "
    "decisions; leave out greetings.\n\n{transcript}"
)
SUMMARY_THREAD_SUFFIX = "/summary"


def remove_messages(ids: Sequence[str]) -> list[RemoveMessage]:
    """``RemoveMessage`` updates deleting the messages with ``ids`` (for a ``messages`` channel
    with the ``add_messages`` reducer).

    Raises:
        ValueError: an id is empty (messages without ids cannot be removed: give them ids).
    """
    if any(not i for i in ids):
        raise ValueError("cannot remove a message without an id: the add_messages reducer assigns ids; "
                         "pass the ids of messages read from the graph state")
    return [RemoveMessage(id=i) for i in ids]


def replace_history(messages: Sequence[BaseMessage]) -> list[BaseMessage]:
    """Updates that replace the whole history by ``messages`` (``REMOVE_ALL_MESSAGES`` + the re-sent
    tail). Messages that keep their ids are recognised by the chat model as unchanged."""
    return [RemoveMessage(id=REMOVE_ALL_MESSAGES), *messages]


def split_history(
    messages: Sequence[AnyMessage], keep_tokens: int, token_counter: TokenCounter = count_tokens_approximately
) -> tuple[list[AnyMessage], list[AnyMessage], list[AnyMessage]]:
    """Split a history into ``(leading system messages, head to prune, tail to keep)``.

    The tail is the longest run of recent messages within ``keep_tokens`` (``token_counter``
    units) that starts at a human message, so no tool result loses the AI call that asked for it;
    it always holds at least the last human turn.

    Raises:
        ValueError: ``keep_tokens`` < 1.
    """
    if keep_tokens < 1:
        raise ValueError(f"keep_tokens must be at least 1 (got {keep_tokens})")
    n_system = 0
    while n_system < len(messages) and isinstance(messages[n_system], SystemMessage):
        n_system += 1
    system, rest = list(messages[:n_system]), list(messages[n_system:])
    tail = trim_messages(rest, max_tokens=keep_tokens, token_counter=token_counter, strategy="last",
                         start_on="human", allow_partial=False)
    if not tail:  # the last turn alone is over the limit: keep it whole
        humans = [i for i, m in enumerate(rest) if isinstance(m, HumanMessage)]
        tail = rest[humans[-1]:] if humans else rest[-1:]
    return system, rest[: len(rest) - len(tail)], list(tail)


def pruning_node(
    *,
    max_tokens: int,
    keep_tokens: int,
    strategy: str = "summarize",
    summarizer: Callable[..., str] | Any = None,
    token_counter: TokenCounter = count_tokens_approximately,
    messages_key: str = "messages",
) -> Callable[[dict, RunnableConfig], dict]:
    """A LangGraph node that prunes the history once it exceeds ``max_tokens``.

    ``strategy="remove"`` deletes the head (``RemoveMessage`` per id); ``"summarize"`` replaces
    it by one human message holding ``summarizer(head)``, with the id of the first summarised
    message, and re-sends the tail (``REMOVE_ALL_MESSAGES`` + system + summary + tail). Leading
    system messages are always kept. Below the threshold the node returns no update.

    Args:
        max_tokens, keep_tokens: thresholds in ``token_counter`` units (default: LangChain's
            approximate count, about 4 characters per token).
        summarizer: a callable or Runnable from messages to summary text, e.g.
            :func:`side_thread_summarizer` (required for ``"summarize"``).

    Raises:
        ValueError: unknown strategy, ``keep_tokens`` >= ``max_tokens``, or no summarizer.
    """
    if strategy not in ("remove", "summarize"):
        raise ValueError(f"strategy must be 'remove' or 'summarize' (got {strategy!r})")
    if not 0 < keep_tokens < max_tokens:
        raise ValueError(f"need 0 < keep_tokens < max_tokens (got {keep_tokens}, {max_tokens})")
    if strategy == "summarize" and summarizer is None:
        raise ValueError("strategy='summarize' needs summarizer=... (e.g. side_thread_summarizer(model))")

    def prune(state: dict, config: RunnableConfig) -> dict:
        messages = state[messages_key]
        if token_counter(messages) <= max_tokens:
            return {}
        system, head, tail = split_history(messages, keep_tokens, token_counter)
        if not head:
            return {}
        if strategy == "remove":
            return {messages_key: remove_messages([m.id for m in head])}
        text = _summarize(summarizer, head, config)
        summary = HumanMessage(SUMMARY_PREFIX + text, id=head[0].id)  # takes the head's place: a replacement
        return {messages_key: replace_history([*system, summary, *tail])}

    return prune


def _summarize(summarizer, messages: list[AnyMessage], config: RunnableConfig) -> str:
    if hasattr(summarizer, "invoke"):
        return str(summarizer.invoke(messages, config=config)).strip()
    return str(summarizer(messages)).strip()


def side_thread_summarizer(
    model, *, prompt: str = SUMMARY_PROMPT, suffix: str = SUMMARY_THREAD_SUFFIX, max_tokens: int = 96
) -> RunnableLambda:
    """A summariser (messages -> text) that calls ``model`` on the thread ``<thread_id><suffix>``.

    Called inside a graph run, the chat model would otherwise serve the summary request from the
    conversation's own live cache and turn it into the summary prompt; on a side thread the
    conversation's cache is untouched and the summary prompts of successive summaries share
    their cached prefix. Usable as ``pruning_node(summarizer=...)`` and as LangChain v1
    ``SummarizationMiddleware(model=..., summarizer=...)``.

    Args:
        model: a chat model (ChatKVMemory); ``prompt`` has a ``{transcript}`` slot.
        max_tokens: answer length cap in tokens, passed to the model call.
    """

    def summarize(messages: list[AnyMessage], config: RunnableConfig) -> str:
        thread = (config or {}).get("configurable", {}).get("thread_id")
        side = {"configurable": {"thread_id": f"{thread}{suffix}"}} if thread is not None else {}
        request = [HumanMessage(prompt.format(transcript=get_buffer_string(messages)))]
        return model.invoke(request, config=side, max_tokens=max_tokens).text.strip()

    return RunnableLambda(summarize, name="side_thread_summarizer")


class RepairBudgetMiddleware(AgentMiddleware):
    """LangChain v1 agent middleware that sets the repair policy of every model call.

    ``create_agent`` passes ``request.model_settings`` to the chat model's ``bind`` /
    ``bind_tools``; kvmemory's chat model reads ``repair_policy`` from there, so the edits made
    by ``ContextEditingMiddleware`` or ``SummarizationMiddleware`` are repaired at this budget.

    Args:
        budget: b in % of the stale suffix (0 = Shift, 100 = Replay), or a policy label such as
            ``"sur@5"``, ``"bm25@2"`` or ``"reprefill"`` (for baselines).

    Raises:
        ValueError: an invalid budget or label (checked here, not at the first model call).
    """

    def __init__(self, budget: float | str = 5.0):
        super().__init__()
        label = budget if isinstance(budget, str) else f"sur@{float(budget):g}"
        self.policy = RepairPolicy.coerce(label)

    def wrap_model_call(self, request, handler):
        return handler(self._with_policy(request))

    async def awrap_model_call(self, request, handler):
        return await handler(self._with_policy(request))

    def _with_policy(self, request):
        return request.override(model_settings={**request.model_settings, "repair_policy": self.policy.label})
