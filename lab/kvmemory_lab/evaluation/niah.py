"""Erasing-NIAH cases (paper §4.2, Appendix 7.5): two same-key needles in an essay haystack, one deleted.

Each case renders an agent history through the model's chat template: a system message, the
user's task, the haystack as tool results (sentence-aligned chunks of Paul Graham essays) and the
two needles as their own tool results, "The special magic number for <key> is <value>." with
distinct 7-digit values at sampled depths. The query asks for every value in order. A needle
case deletes one needle, alternating first/second and early/late depth, and the gold becomes the
remaining one-value list; a control case (every fifth) deletes a haystack span of about the
needle's token length instead, and the gold keeps both values.

The haystack is cut at pysbd sentence boundaries (pieces over MAX_SENTENCE tokens are skipped) so that the dirty prompt (history + query,
generation prompt included) has at most ``length`` tokens of the model's own tokenizer and one
more sentence would exceed it. Every case is seeded (``seed``, length, index) and records its
spans: the token span of every needle, the deleted message and the prompt lengths.
"""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

import pysbd

from kvmemory.prompt import normalize_messages, render_prompt
from .cases import EvalCase

HAYSTACK_DIR = Path("niah_haystack") / "PaulGrahamEssays"
CHUNK_TOKENS = 160  # haystack tokens per tool result (a "document" the agent retrieved)
MAX_SENTENCE = 96  # longer pysbd "sentences" (unsplit lists, run-on text) are skipped
SYSTEM = (
    "You are an agent with a document memory. Tool results are documents you retrieved earlier. "
    "Answer the user's question from them."
)
TASK = "Read the documents and keep track of every special magic number you see."
KEYS = (
    "the silver lighthouse", "the quiet orchard", "the copper bridge", "the northern archive",
    "the glass observatory", "the hidden harbour", "the amber valley", "the stone library",
)
# variant i % 5: (deleted needle: 0 first / 1 second / None control, deleted depth early?)
VARIANTS = ((0, True), (1, False), (1, True), (0, False), (None, True))
EARLY, LATE = (0.15, 0.45), (0.55, 0.85)


def needle_text(key: str, value: str) -> str:
    return f"The special magic number for {key} is {value}."


def query_text(key: str) -> str:
    return (
        f"What are all the special magic numbers for {key} in the documents? List every one in the "
        "order they appear, separated by commas. Reply with the numbers only."
    )


def _essay_files(data_dir: Path) -> list[Path]:
    folder = Path(data_dir) / HAYSTACK_DIR
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays under {folder}: pass --data pointing at the shared data folder")
    return files


@lru_cache(maxsize=64)
def _sentences(path: Path) -> tuple[str, ...]:
    """The essay's sentences (whitespace collapsed), split with pysbd; computed once per file."""
    text = " ".join(path.read_text(encoding="utf-8", errors="replace").split())
    return tuple(s.strip() for s in pysbd.Segmenter(language="en", clean=False).segment(text) if s.strip())


def _prompt_tokens(tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages], tokenize=False, add_generation_prompt=True
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chunks(sentences: list[str], counts: list[int]) -> list[list[int]]:
    """Greedy sentence groups of about CHUNK_TOKENS tokens (indices into ``sentences``)."""
    groups, current, size = [], [], 0
    for k, c in enumerate(counts):
        if current and size + c > CHUNK_TOKENS:
            groups.append(current)
            current, size = [], 0
        current.append(k)
        size += c
    if current:
        groups.append(current)
    return groups


def _layout(spec: dict, sentences: list[str], counts: list[int]) -> tuple[list[dict], str]:
    """The history for the first len(sentences) haystack sentences; returns (messages, deleted id)."""
    groups = _chunks(sentences, counts)
    n = len(groups)
    slots = [min(n, max(0, round(d * n))) for d in spec["depths"]]
    if slots[1] <= slots[0]:
        slots[1] = slots[0] + 1  # the second needle follows at least one more chunk
    history = [{"role": "system", "content": SYSTEM, "id": "system"}, {"role": "user", "content": TASK, "id": "task"}]
    deleted = f"needle-{spec['deleted']}" if spec["deleted"] is not None else "span"
    span_chunk = min(n - 1, slots[spec["control_needle"]]) if spec["deleted"] is None else None
    for g in range(n + 1):
        for j in (0, 1):
            if slots[j] == g:
                history.append({"role": "tool", "content": needle_text(spec["key"], spec["values"][j]), "id": f"needle-{j}"})
        if g == n:
            break
        members = groups[g]
        if g == span_chunk:  # control: the sentence closest to the needle's length becomes its own message
            pick = min(members, key=lambda k: (abs(counts[k] - spec["needle_tokens"]), k))
            parts = [("", [k for k in members if k < pick]), ("span", [pick]), ("", [k for k in members if k > pick])]
        else:
            parts = [("", members)]
        for tag, ks in parts:
            if ks:
                mid = "span" if tag else f"doc-{g}-{ks[0]}"
                history.append({"role": "tool", "content": " ".join(sentences[k] for k in ks), "id": mid})
    return history, deleted


def _spec(rng: random.Random, index: int, tokenizer) -> dict:
    which, early = VARIANTS[index % len(VARIANTS)]
    d_del = rng.uniform(*(EARLY if early else LATE))
    if which == 0 or which is None:
        depths = [d_del, rng.uniform(d_del + 0.05, 0.95)]
    else:
        depths = [rng.uniform(0.05, d_del - 0.05), d_del]
    values = [str(v) for v in rng.sample(range(10**6, 10**7), 2)]
    key = rng.choice(KEYS)
    control_needle = rng.randrange(2)
    needle_tokens = len(tokenizer(" " + needle_text(key, values[0]), add_special_tokens=False)["input_ids"])
    return dict(deleted=which, early=early, depths=depths, values=values, key=key,
                control_needle=control_needle, needle_tokens=needle_tokens)


def _haystack_stream(essays: list[Path], rng: random.Random, need_tokens: int, tokenizer) -> tuple[list[str], list[int]]:
    """Consecutive sentences from a seeded essay order, with their token counts, >= need_tokens."""
    order = list(essays)
    rng.shuffle(order)
    sentences, counts, total = [], [], 0
    for essay in order:
        for s in _sentences(essay):
            c = len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
            if c > MAX_SENTENCE:  # lists / run-on text pysbd could not split: not a sentence boundary cut
                continue
            sentences.append(s)
            counts.append(c)
            total += c
            if total >= need_tokens:
                return sentences, counts
    return sentences, counts


def _fit(spec, sentences, counts, tokenizer, length: int, key: str) -> tuple[list[dict], str, int]:
    """Largest sentence count whose dirty prompt (history + query) has <= length tokens."""
    query = {"role": "user", "content": query_text(key), "id": "query"}

    def size(n):
        history, deleted = _layout(spec, sentences[:n], counts[:n])
        return history, deleted, _prompt_tokens(tokenizer, history + [query])

    # estimate from token counts, then step one sentence at a time against the exact rendering
    base = size(1)[2] - counts[0]
    n, total = 0, base
    while n < len(counts) and total + counts[n] + 6 * (n // 8 + 1) <= length:
        total += counts[n]
        n += 1
    n = max(n, 2)
    best = size(n)
    while best[2] > length and n > 2:
        n -= 1
        best = size(n)
    while n < len(counts):
        trial = size(n + 1)
        if trial[2] > length:
            break
        n, best = n + 1, trial
    if best[2] > length:
        raise ValueError(f"length {length} is too short for the needles and the query (got {best[2]} tokens)")
    return best


def niah_cases(data_dir: Path, tokenizer, lengths=(1024, 2048, 4096), per_length: int = 5, seed: int = 0) -> list[EvalCase]:
    """Erasing-NIAH cases, ``per_length`` for each context length (paper §4.2, Appendix 7.5).

    Args:
        data_dir: folder holding ``niah_haystack/PaulGrahamEssays/*.txt``.
        tokenizer: the model's tokenizer (chat template and exact token counts).
        lengths: target prompt lengths in tokens (dirty history + query, generation prompt included).
        per_length: cases per length (ordered case index first, then length); variants cycle (first needle early, second late, second
            early, first late, control).
        seed: base seed; case i at length L uses ``Random(f"niah-{seed}-{L}-{i}")``.

    Returns:
        EvalCase list with task "niah", dataset "niah-<L>", gold = the ordered values left after
        the deletion, ``leak_value`` = the deleted needle's value (None for controls), and meta
        with depths, the needles' and deleted message's token spans and the exact prompt length.

    Raises:
        FileNotFoundError: no essays under ``data_dir``.
        ValueError: a length too short for the needles and query.
    """
    essays = _essay_files(data_dir)
    cases = []
    for i in range(per_length):  # lengths interleave, so a partial run covers all of them
        for length in lengths:
            rng = random.Random(f"niah-{seed}-{length}-{i}")
            spec = _spec(rng, i, tokenizer)
            sentences, counts = _haystack_stream(essays, rng, length + 64, tokenizer)
            history, deleted, tokens = _fit(spec, sentences, counts, tokenizer, length, spec["key"])
            case_id = f"niah-{length}-{i:03d}"
            cases.append(_case(case_id, length, spec, history, deleted, tokens, tokenizer))
    return cases


def _case(case_id, length, spec, history, deleted, tokens, tokenizer) -> EvalCase:
    values = spec["values"]
    if spec["deleted"] is None:
        gold, leak = tuple(values), None
    else:
        gold, leak = (values[1 - spec["deleted"]],), values[spec["deleted"]]
    query = query_text(spec["key"])
    rendered = render_prompt(tokenizer, normalize_messages(history + [{"role": "user", "content": query, "id": "query"}]))
    spans = {s.key: [s.token_start, s.token_end] for s in rendered.segments if s.key.startswith(("needle", "span"))}
    meta = {
        "length": length,
        "prompt_tokens": len(rendered),
        "variant": "control" if spec["deleted"] is None else f"needle-{spec['deleted']}",
        "deleted_depth": "early" if spec["early"] else "late",
        "depths": [round(d, 4) for d in spec["depths"]],
        "key": spec["key"],
        "values": values,
        "spans": spans,
        "deleted_span": spans[deleted],
        "haystack_messages": sum(m["id"].startswith("doc-") for m in history),
    }
    assert tokens == len(rendered), "token count of the fitted prompt changed on re-rendering"
    return EvalCase(case_id, "niah", f"niah-{length}", case_id, tuple(history), (deleted,), query, gold, leak, meta)
