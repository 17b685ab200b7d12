"""Natural multi-hop QA deletion cases (paper §4.3, Appendix 7.5) from HotpotQA, MuSiQue, 2WikiMultiHopQA, IIRC.

For each source question, the supporting passages (in dataset order) are tool results of an
agent history, followed by one fixed non-supporting "tail" passage so that every placement
leaves a stale suffix. One further non-supporting passage is inserted before, between or after
the supporting passages (three placement cases, paired by ``source_id``) and is then deleted
before the question is asked; deleting it restores the same clean document, so the gold is the
dataset answer (with aliases where the dataset supplies them).

Sources are drawn per dataset from a seeded order before any model output is seen. Sources with
fewer than two supporting passages (no "between" placement) or fewer than two non-supporting
passages are skipped.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from .cases import EvalCase

SYSTEM = (
    "You are a research assistant. A search tool returns passages. Answer the user's question "
    "from the passages. Reply with the answer only, in a few words."
)
PLACEMENTS = ("before", "between", "after")
FILES = {
    "hotpotqa": Path("hotpotqa") / "wikontic_hotpotqa_dev_distractor_200.json",
    "musique": Path("musique") / "wikontic_musique_200.json",
    "2wikimultihopqa": Path("2wikimultihopqa") / "ircot_prompt_demos_train20.jsonl",
    "iirc": Path("iirc") / "ircot_prompt_demos_train20.jsonl",
}
QA_DATASETS = tuple(FILES)


@dataclass(frozen=True)
class Source:
    """One question: supporting and non-supporting passages as (title, text)."""

    qid: str
    question: str
    answer: str
    aliases: tuple[str, ...]
    support: tuple[tuple[str, str], ...]
    others: tuple[tuple[str, str], ...]


def _hotpot(item: dict) -> Source:
    gold = {t for t, _ in item["supporting_facts"]}
    paras = [(t, "".join(s).strip()) for t, s in item["context"]]
    return Source(item["_id"], item["question"], item["answer"], (),
                  tuple(p for p in paras if p[0] in gold), tuple(p for p in paras if p[0] not in gold))


def _paragraphs(item: dict, qid: str) -> Source:
    paras = item["paragraphs"]
    pick = lambda flag: tuple((p["title"], p["paragraph_text"].strip()) for p in paras if bool(p["is_supporting"]) == flag)  # noqa: E731
    return Source(str(item.get(qid) or item.get("qid")), item["question"], str(item["answer"]),
                  tuple(str(a) for a in item.get("answer_aliases", ()) or ()), pick(True), pick(False))


def load_sources(data_dir: Path, dataset: str) -> list[Source]:
    """Every source question of ``dataset`` in file order.

    Raises:
        ValueError: unknown dataset (lists the valid ones).
        FileNotFoundError: its file is missing under ``data_dir``.
    """
    if dataset not in FILES:
        raise ValueError(f"unknown dataset {dataset!r}: use one of {', '.join(QA_DATASETS)}")
    path = Path(data_dir) / FILES[dataset]
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass --data pointing at the shared data folder")
    if dataset == "hotpotqa":
        return [_hotpot(x) for x in json.loads(path.read_text())]
    if dataset == "musique":
        return [_paragraphs(x, "id") for x in json.loads(path.read_text())["data"]]
    return [_paragraphs(json.loads(line), "qid") for line in path.read_text().splitlines() if line.strip()]


def _messages(source: Source, passages: list[tuple[str, str, str]]) -> list[dict]:
    msgs = [
        {"role": "system", "content": SYSTEM, "id": "system"},
        {"role": "user", "content": f"Question: {source.question}", "id": "task"},
    ]
    return msgs + [{"role": "tool", "content": f"{title}: {text}", "id": mid} for mid, title, text in passages]


def placement_cases(source: Source, dataset: str, rng: random.Random) -> list[EvalCase]:
    """The before / between / after cases of one source (same inserted passage and tail)."""
    inserted, tail = rng.sample(list(source.others), 2)
    support = [(f"support-{k}", t, x) for k, (t, x) in enumerate(source.support)]
    slots = {"before": 0, "between": 1, "after": len(support)}
    cases = []
    for placement in PLACEMENTS:
        passages = list(support)
        passages.insert(slots[placement], ("inserted", *inserted))
        passages.append(("tail", *tail))
        history = _messages(source, passages)
        query = f"Answer the question: {source.question} Reply with just the answer."
        meta = {"placement": placement, "inserted_title": inserted[0], "tail_title": tail[0],
                "support_titles": [t for t, _ in source.support], "inserted_index": slots[placement]}
        cases.append(EvalCase(f"{dataset}-{source.qid}-{placement}", "qa", dataset, f"{dataset}-{source.qid}",
                              tuple(history), ("inserted",), query, (source.answer, *source.aliases), None, meta))
    return cases


def qa_cases(data_dir: Path, datasets=QA_DATASETS, sources_per_dataset: int = 5, seed: int = 0) -> list[EvalCase]:
    """Three placement cases for each of ``sources_per_dataset`` sources of every dataset.

    Sources are taken in a seeded shuffled order (``Random(f"qa-{seed}-{dataset}")``), skipping
    those with fewer than two supporting or two non-supporting passages; datasets interleave
    source by source so that a partial run covers all of them.

    Raises:
        ValueError, FileNotFoundError: as :func:`load_sources`.
    """
    per_dataset = []
    for dataset in datasets:
        rng = random.Random(f"qa-{seed}-{dataset}")
        sources = load_sources(data_dir, dataset)
        rng.shuffle(sources)
        eligible = [s for s in sources if len(s.support) >= 2 and len(s.others) >= 2][:sources_per_dataset]
        per_dataset.append([placement_cases(s, dataset, rng) for s in eligible])
    out = []
    for k in range(max((len(x) for x in per_dataset), default=0)):
        for groups in per_dataset:
            if k < len(groups):
                out.extend(groups[k])
    return out
