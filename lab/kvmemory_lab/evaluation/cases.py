"""One evaluation case: an agent history, the messages deleted from it, the next query and the gold."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class EvalCase:
    """A deletion case evaluated with every repair method from the same pre-edit cache.

    Attributes:
        case_id: unique, stable id (resumable runs skip finished ids).
        task: "niah" or "qa".
        dataset: "niah-1024", "hotpotqa", "musique", "2wikimultihopqa", "iirc", ...
        source_id: the pairing unit of the bootstrap (NIAH: the case; QA: the source question,
            shared by its three placements).
        history: the pre-edit agent messages (dicts with role, content, id), no query.
        deleted: ids of the messages removed before the query is asked.
        query: the question asked after the edit (a user message).
        gold: NIAH: the ordered list of values the edited context holds; QA: [answer, *aliases].
        leak_value: NIAH needle cases: the deleted needle's value (None otherwise).
        meta: everything recorded about the construction (spans, depths, lengths, placement).
        edited_history: the history after the edit when it is more than a deletion (a replaced
            message content, a summary inserted in place of old turns); None: ``history`` less
            ``deleted``.
    """

    case_id: str
    task: str
    dataset: str
    source_id: str
    history: tuple[dict, ...]
    deleted: tuple[str, ...]
    query: str
    gold: tuple[str, ...]
    leak_value: str | None = None
    meta: dict = field(default_factory=dict)
    edited_history: tuple[dict, ...] | None = None

    def dirty_messages(self) -> list[dict]:
        """The history the cache is built on (deleted messages still present, no query)."""
        return [dict(m) for m in self.history]

    def edited_messages(self) -> list[dict]:
        """The history after the edit (the deletion, or ``edited_history``), followed by the query."""
        if self.edited_history is not None:
            kept = [dict(m) for m in self.edited_history]
        else:
            kept = [dict(m) for m in self.history if m["id"] not in self.deleted]
        return kept + [{"role": "user", "content": self.query, "id": "query"}]

    def to_dict(self) -> dict:
        return asdict(self)
