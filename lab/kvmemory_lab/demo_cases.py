"""Agent conversations for the demo: HotpotQA passages delivered as tool results, one
non-supporting passage removed in the middle, then the question asked.

Data is read in place from ``../shared/data`` (or ``--data``); when that folder is absent a small
built-in conversation written for the project is used instead.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

HOTPOT_FILE = Path("hotpotqa") / "wikontic_hotpotqa_dev_distractor_200.json"
MIN_PASSAGES, MAX_PASSAGES = 3, 10  # 2 supporting + at least 1 distractor; HotpotQA has 10 paragraphs
SYSTEM_PROMPT = (
    "You are a research assistant. A search tool returns passages. Answer the user's question "
    "from the passages. Reply with the answer only, in a few words."
)


@dataclass(frozen=True)
class Passage:
    title: str
    text: str


@dataclass(frozen=True)
class DemoCase:
    """One question with its passages in tool-result order; ``deleted`` indexes the
    non-supporting passage the agent removes before answering."""

    case_id: str
    question: str
    answer: str
    passages: tuple[Passage, ...]
    deleted: int
    source: str

    def messages(self, *, with_deleted: bool, with_query: bool) -> list[dict]:
        """The agent history as chat messages with stable ids."""
        msgs = [
            {"role": "system", "content": SYSTEM_PROMPT, "id": "system"},
            {"role": "user", "content": f"Question: {self.question}", "id": "task"},
        ]
        for i, p in enumerate(self.passages):
            if i == self.deleted and not with_deleted:
                continue
            msgs.append({"role": "tool", "content": f"{p.title}: {p.text}", "id": f"result-{i}"})
        if with_query:
            msgs.append(
                {"role": "user", "content": f"Answer the question: {self.question} Reply with just the answer.", "id": "query"}
            )
        return msgs

    @property
    def deleted_ids(self) -> tuple[str]:
        return (f"result-{self.deleted}",)


def default_data_dir() -> Path | None:
    """``$KVMEMORY_DATA``, else ``../shared/data`` next to the working directory or the checkout."""
    candidates = [os.environ.get("KVMEMORY_DATA")]
    candidates += [Path.cwd().parent / "shared" / "data", Path(__file__).resolve().parents[2] / "shared" / "data"]
    for c in candidates:
        if c and (Path(c) / HOTPOT_FILE).is_file():
            return Path(c)
    return None


def hotpot_cases(data_dir: Path, n: int, *, passages: int = 6, seed: int = 0) -> list[DemoCase]:
    """Up to ``n`` cases from the HotpotQA distractor file: the two supporting paragraphs plus
    ``passages - 2`` distractors, shuffled with ``seed`` except that the deleted distractor sits
    right after the first supporting passage (an edit in the middle of the history).

    Raises:
        FileNotFoundError: the HotpotQA file is missing under ``data_dir``.
        ValueError: ``passages`` outside [3, 10].
    """
    if not MIN_PASSAGES <= passages <= MAX_PASSAGES:
        raise ValueError(f"passages must lie in [{MIN_PASSAGES}, {MAX_PASSAGES}] (got {passages})")
    path = Path(data_dir) / HOTPOT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass --data pointing at the shared data folder")
    items = json.loads(path.read_text())
    rng = random.Random(seed)
    cases = []
    for item in items:
        if len(cases) >= n:
            break
        case = _hotpot_case(item, passages, rng)
        if case is not None:
            cases.append(case)
    return cases


def _hotpot_case(item: dict, passages: int, rng: random.Random) -> DemoCase | None:
    gold = {title for title, _ in item["supporting_facts"]}
    paras = [Passage(t, "".join(s).strip()) for t, s in item["context"]]
    support = [p for p in paras if p.title in gold]
    others = [p for p in paras if p.title not in gold]
    if len(support) != 2 or len(others) < passages - 2:
        return None
    distractors = rng.sample(others, passages - 2)
    rest = [support[1]] + distractors[1:]
    rng.shuffle(rest)
    order = [support[0], distractors[0]] + rest
    return DemoCase(item["_id"], item["question"], item["answer"], tuple(order), 1, "hotpotqa")


def builtin_cases() -> list[DemoCase]:
    """A conversation written for the project, used when no data folder is available."""
    passages = (
        Passage("Lake Vostrel", "Lake Vostrel is a glacial lake in the Karsk Highlands. Its outflow, the Mira River, "
                "powers the town of Ostrava Nova, founded in 1873 by the engineer Ilse Marrow."),
        Passage("Harbour lights", "The harbour of Port Calder has three lighthouses. The oldest, built of granite in "
                "1790, was decommissioned after a storm in 1911 and is now a museum of navigation."),
        Passage("Nordic bread", "Rye sourdough is common across Scandinavia. Bakers often add caraway seeds, and the "
                "dough is left to rise slowly overnight in a cool room."),
        Passage("Ilse Marrow", "Ilse Marrow (1841-1919) was a hydraulic engineer. Before founding Ostrava Nova she "
                "designed the canal locks of Helmsford, her birthplace, a river port on the Dorne."),
        Passage("Chess openings", "The Sicilian Defence begins 1.e4 c5. It is the most popular response to the "
                "king's pawn opening at master level and leads to sharp, unbalanced positions."),
    )
    question = "In which town was the founder of the town powered by the Mira River born?"
    return [DemoCase("builtin-0", question, "Helmsford", passages, 1, "builtin")]
