"""Answer scoring and fidelity metrics against Re-prefill (the runtime's first-token KL re-exported)."""

from __future__ import annotations

import re
import string
from typing import Sequence

import torch

from kvmemory.divergence import first_token_kl  # noqa: F401  (scored beside the answers)


def normalize_answer(text: str) -> str:
    """HotpotQA/SQuAD answer normalization: lowercase, drop punctuation, articles, extra spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> bool:
    """Normalized exact match (HotpotQA EM)."""
    return normalize_answer(prediction) == normalize_answer(gold)


def contains_gold(prediction: str, gold: str) -> bool:
    """Whether the normalized gold answer occurs as a whole-word span of the normalized
    prediction (lenient EM for models that answer in sentences)."""
    norm_gold = normalize_answer(gold)
    return bool(norm_gold) and f" {norm_gold} " in f" {normalize_answer(prediction)} "


def answers_agree(a: str, b: str) -> bool:
    """Whether two greedy answers are the same text (whitespace-trimmed)."""
    return a.strip() == b.strip()


def token_f1(prediction: str, gold: str) -> float:
    """HotpotQA/SQuAD token F1 in [0, 1] between normalized prediction and gold."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum(min(pred.count(w), ref.count(w)) for w in set(pred) & set(ref))
    if not pred or not ref or common == 0:
        return float(pred == ref)
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


# ------------------------------------------------------------ distributions (paper Appendix 11)


def first_token_tv(reference_logits: torch.Tensor, method_logits: torch.Tensor) -> float:
    """Total variation TV(p, q) = ½ Σ_v |p(v) − q(v)| between two next-token distributions, in [0, 1].

    Args:
        reference_logits, method_logits: ``[vocab]`` logits (computed in fp32).

    Raises:
        ValueError: shapes differ.

    Source: paper Appendix 11 (first-token total variation).
    """
    if reference_logits.shape != method_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(reference_logits.shape)} vs {tuple(method_logits.shape)}")
    p = torch.softmax(reference_logits.float(), dim=-1)
    q = torch.softmax(method_logits.float(), dim=-1)
    return float(0.5 * (p - q).abs().sum())


def normalized_recovery(tv_method: float, tv_dirty: float) -> float | None:
    """NR_TV(a) = 1 − TV(p_a, p_clean) / TV(p_dirty, p_clean) (paper eq. 14), per case.

    Returns None when the denominator is 0 (undefined); the ratio is not clipped, so it is
    negative when the method is further from the clean distribution than Dirty is.
    """
    if tv_dirty == 0:
        return None
    return 1.0 - tv_method / tv_dirty


# ------------------------------------------------------------------- answers (paper Appendix 7.5)

SEVEN_DIGITS = re.compile(r"(?<!\d)\d{7}(?!\d)")


def niah_values(text: str) -> list[str]:
    """The 7-digit values in an answer, in order, repeats kept (no deduplication)."""
    return SEVEN_DIGITS.findall(text)


def niah_exact_match(prediction: str, gold: Sequence[str]) -> bool:
    """Erasing-NIAH success: the emitted values equal the gold list in order and multiplicity."""
    return niah_values(prediction) == list(gold)


def leaked(prediction: str, deleted_value: str | None) -> bool | None:
    """Whether the deleted needle's value still appears in the answer (None without a needle)."""
    return None if deleted_value is None else deleted_value in niah_values(prediction)


def extract_answer(text: str) -> str:
    """The answer part of a reply: its first non-empty line without an ``Answer:`` prefix."""
    line = next((x for x in text.strip().splitlines() if x.strip()), "")
    return re.sub(r"^\s*(final\s+)?answer\s*(is)?\s*[:\-]?\s*", "", line, flags=re.IGNORECASE).strip()


def _number(token: str) -> float | None:
    try:
        return float(token.replace(",", ""))
    except ValueError:
        return None


def drop_normalize(text: str) -> str:
    """DROP-style numeric-aware normalization: lowercase, split on spaces and hyphens, drop
    punctuation (except inside numbers) and articles, write numbers canonically (1,000 → 1000.0)."""
    out = []
    for token in re.split(r"[\s\-]+", text.lower()):
        number = _number(token.strip(string.punctuation.replace(".", "").replace(",", "")).rstrip(".,"))
        if number is not None:
            out.append(str(number))
            continue
        token = "".join(ch for ch in token if ch not in set(string.punctuation))
        if token and token not in ("a", "an", "the"):
            out.append(token)
    return " ".join(out)


def qa_exact_match(prediction: str, gold: Sequence[str], dataset: str) -> bool:
    """Answer-only EM with the dataset's rule (paper Appendix 7.5) on the extracted answer.

    - hotpotqa: normalized string EM against the answer (``gold[0]``);
    - musique, 2wikimultihopqa: normalized EM, maximized over the answer and its aliases;
    - iirc: DROP-style numeric-aware normalization, over the answer and aliases.

    Args:
        prediction: the model's reply (the answer is extracted with :func:`extract_answer`).
        gold: ``[answer, *aliases]``.
        dataset: one of the names above; any other name uses normalized EM with aliases.
    """
    answer = extract_answer(prediction)
    if dataset == "hotpotqa":
        return exact_match(answer, gold[0])
    if dataset == "iirc":
        return any(drop_normalize(answer) == drop_normalize(g) for g in gold)
    return any(exact_match(answer, g) for g in gold)
