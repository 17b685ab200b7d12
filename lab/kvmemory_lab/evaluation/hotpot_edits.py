"""HotpotQA distractor-setting agent histories at a target length, with three kinds of edit.

Each source question's ten passages (its two supporting passages and eight distractors, the
distractor setting) become tool results of an agent history; passages of other questions of the
file pad the history to about ``length`` prompt tokens (older search results). Passages are in a
seeded order in which the first third of the tool results holds no supporting passage, so that
every edit below touches old turns and leaves a long stale suffix. Three cases per source and
length, paired by ``source_id`` (``meta["edit"]``):

- ``delete``: one non-supporting tool result of the first third is removed;
- ``replace``: one non-supporting tool result of the first third keeps its id and gets the
  content of a cleared tool output (a replacement);
- ``summary``: the first third of the tool results (none supporting) is replaced by one message
  summarising them (a deletion of those turns plus an inserted summary in their place).

None of the edits removes a supporting passage, so the gold is the dataset answer. Sources are
drawn from a seeded order (``Random(f"hotpot-edits-{seed}-{length}")``) before any model output
is seen; ``seed`` also draws the padding, the order and the edited passages.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .cases import EvalCase
from .multihop import FILES, SYSTEM

EDITS = ("delete", "replace", "summary")
CLEARED = "[tool output cleared: not relevant to the question]"


def _prompt_tokens(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages], tokenize=False, add_generation_prompt=True
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _passages(item: dict) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    gold = {t for t, _ in item["supporting_facts"]}
    paras = [(t, "".join(s).strip()) for t, s in item["context"]]
    return [p for p in paras if p[0] in gold], [p for p in paras if p[0] not in gold]


def _history(item: dict, pool: list[tuple[str, str]], tokenizer, length: int, rng: random.Random):
    """System, task and tool messages of about ``length`` tokens with the query (``None`` if the
    question's own passages and query already exceed it); the first third holds no support."""
    support, distractors = _passages(item)
    query = f"Answer the question: {item['question']} Reply with just the answer."
    head = [{"role": "system", "content": SYSTEM, "id": "system"},
            {"role": "user", "content": f"Question: {item['question']}", "id": "task"}]
    tail = [{"role": "user", "content": query, "id": "query"}]
    own = [("d", t, x) for t, x in distractors] + [("s", t, x) for t, x in support]
    padding = []
    extra = list(pool)
    rng.shuffle(extra)

    def build(pad):
        passages = [("d", t, x) for t, x in pad] + own
        rng_order = random.Random(f"{item['_id']}-{len(pad)}")
        others = [p for p in passages if p[0] == "d"]
        rng_order.shuffle(others)
        first = max(2, len(passages) // 3)
        rest = others[first:] + [p for p in passages if p[0] == "s"]
        rng_order.shuffle(rest)
        ordered = others[:first] + rest
        msgs, k = [], 0
        for kind, title, text in ordered:
            mid = f"support-{k}" if kind == "s" else f"r{len(msgs):02d}"
            k += kind == "s"
            msgs.append({"role": "tool", "content": f"{title}: {text}", "id": mid})
        return msgs, first

    msgs, first = build(padding)
    if _prompt_tokens(tokenizer, head + msgs + tail) > length:
        return None
    for passage in extra:
        trial, trial_first = build(padding + [passage])
        if _prompt_tokens(tokenizer, head + trial + tail) > length:
            break
        padding.append(passage)
        msgs, first = trial, trial_first
    return head + msgs, first, query


def _summary(old: list[dict]) -> str:
    titles = [m["content"].split(":", 1)[0] for m in old]
    return (f"Summary of the {len(old)} earlier search results (on " + "; ".join(titles)
            + "): none of them bears on the question.")


def hotpot_edit_cases(data_dir: Path, tokenizer, lengths=(2048, 4096), sources_per_length: int = 8,
                      seed: int = 0, edits=EDITS) -> list[EvalCase]:
    """``sources_per_length`` HotpotQA sources per length, one case per edit kind each
    (ordered source index first, then length, then edit, so a partial run covers all).

    Raises:
        FileNotFoundError: the HotpotQA file is missing under ``data_dir``.
        ValueError: an unknown edit kind.
    """
    unknown = [e for e in edits if e not in EDITS]
    if unknown:
        raise ValueError(f"unknown edit(s) {unknown}: use {', '.join(EDITS)}")
    path = Path(data_dir) / FILES["hotpotqa"]
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass --data pointing at the shared data folder")
    items = json.loads(path.read_text())
    per_length = {}
    for length in lengths:
        rng = random.Random(f"hotpot-edits-{seed}-{length}")
        order = list(items)
        rng.shuffle(order)
        built = []
        for item in order:
            if len(built) == sources_per_length:
                break
            support, distractors = _passages(item)
            if len(support) < 2 or len(distractors) < 2:
                continue
            pool = [p for other in items if other["_id"] != item["_id"] for p in sum(_passages(other), [])]
            made = _history(item, pool, tokenizer, length, rng)
            if made is None:
                continue
            history, first, query = made
            built.append(_cases(item, history, first, query, length, rng, edits, tokenizer))
        per_length[length] = built
    out = []
    for k in range(max((len(v) for v in per_length.values()), default=0)):
        for length in lengths:
            if k < len(per_length[length]):
                out.extend(per_length[length][k])
    return out


def _cases(item, history, first, query, length, rng, edits, tokenizer) -> list[EvalCase]:
    tools = [m for m in history if m["role"] == "tool"]
    old = tools[:first]
    target = rng.choice(old[: max(1, len(old) - 1)])  # an old non-supporting result, not the newest of them
    source_id = f"hotpotqa-{item['_id']}-{length}"
    cases = []
    for edit in edits:
        if edit == "delete":
            edited, deleted = [m for m in history if m["id"] != target["id"]], (target["id"],)
        elif edit == "replace":
            edited = [dict(m, content=CLEARED) if m["id"] == target["id"] else m for m in history]
            deleted = ()
        else:
            ids = {m["id"] for m in old}
            at = history.index(old[0])
            kept = [m for m in history if m["id"] not in ids]
            edited = kept[:at] + [{"role": "tool", "content": _summary(old), "id": "summary"}] + kept[at:]
            deleted = tuple(sorted(ids))
        meta = {"edit": edit, "placement": edit, "length": length, "tool_results": len(tools), "old_turns": len(old),
                "edited_id": target["id"] if edit != "summary" else None,
                "prompt_tokens": _prompt_tokens(tokenizer, history + [{"role": "user", "content": query}])}
        cases.append(EvalCase(f"hotpotqa{length}-{item['_id']}-{edit}", "qa", "hotpotqa", source_id,
                              tuple(history), deleted, query, (item["answer"],), None, meta,
                              edited_history=tuple(edited)))
    return cases
