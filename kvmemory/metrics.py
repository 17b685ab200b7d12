"""Fidelity metrics against Re-prefill and answer scoring."""

from __future__ import annotations

import re
import string

import torch


def first_token_kl(reference_logits: torch.Tensor, method_logits: torch.Tensor) -> float:
    """KL(p_reference ‖ p_method) in nats between two next-token distributions.

    Args:
        reference_logits, method_logits: ``[vocab]`` logits (any float dtype; computed in fp32).

    Raises:
        ValueError: shapes differ.
    """
    if reference_logits.shape != method_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(reference_logits.shape)} vs {tuple(method_logits.shape)}")
    log_p = torch.log_softmax(reference_logits.float(), dim=-1)
    log_q = torch.log_softmax(method_logits.float(), dim=-1)
    return float(torch.sum(log_p.exp() * (log_p - log_q)).clamp(min=0.0))


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
