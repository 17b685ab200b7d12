"""Sampling settings of a ChatKVMemory call, applied as transformers logits processors.

``KVSession.stream_tokens`` takes one ``processor(input_ids, scores)``; this module builds it as a
``transformers.LogitsProcessorList`` in the order ``generate()`` uses: the grammar mask first
(constrained decoding), then the penalties, then the warpers (temperature, top-k, top-p, min-p).
With warpers in the list the session picks at temperature 1 (the temperature is already applied).
Greedy decoding (``temperature=0``) skips the warpers, as ``generate(do_sample=False)`` does.

``logprobs`` are those of the distribution the token was picked from (after the grammar mask and
the penalties; after the temperature when sampling), in nats, like the OpenAI field.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvmemory.errors import InputError, InputTypeError

log = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Sampling:
    """Decoding settings; None = off. Ranges follow transformers' ``GenerationConfig`` and, for the
    presence / frequency penalties, the OpenAI API."""

    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def __post_init__(self) -> None:
        check_sampling(self)

    @property
    def sampling(self) -> bool:
        return self.temperature > 0

    @property
    def pick_temperature(self) -> float:
        """The temperature the session picks at: 1 once the temperature warper ran, 0 = argmax."""
        return 1.0 if self.sampling else 0.0

    def processors(self, head: list[LogitsProcessor | None], prompt_tokens: int) -> "LogitsProcessorList":
        """The processors for one decode call.

        Args:
            head: processors that run first, None entries skipped (the constrained-decoding
                processor, the answer budget).
            prompt_tokens: cached rows before the answer (presence / frequency penalties count
                only answer tokens, as the OpenAI API does; the repetition penalty counts the
                whole context, as transformers does).
        """
        out = LogitsProcessorList([p for p in head if p is not None])
        if self.repetition_penalty not in (None, 1.0):
            out.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.presence_penalty or self.frequency_penalty:
            out.append(AnswerPenalties(prompt_tokens, self.presence_penalty or 0.0, self.frequency_penalty or 0.0))
        if self.sampling:
            out.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                out.append(TopKLogitsWarper(self.top_k))
            if self.top_p is not None and self.top_p < 1.0:
                out.append(TopPLogitsWarper(self.top_p))
            if self.min_p:
                out.append(MinPLogitsWarper(self.min_p))
        elif self.top_k or (self.top_p is not None and self.top_p < 1.0) or self.min_p:
            log.info("kvmemory: top_p / top_k / min_p have no effect at temperature=0 (greedy decoding)")
        return out


class AnswerPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the tokens decoded so far in this answer:
    ``logit -= frequency * count + presence * (count > 0)``."""

    def __init__(self, prompt_tokens: int, presence: float, frequency: float):
        self.prompt_tokens, self.presence, self.frequency = prompt_tokens, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        answer = input_ids[0, self.prompt_tokens:]
        if answer.numel() == 0:
            return scores
        counts = torch.bincount(answer, minlength=scores.shape[-1])[: scores.shape[-1]].to(scores.dtype)
        return scores - (self.frequency * counts + self.presence * (counts > 0).to(scores.dtype))[None]


class LogprobRecorder(LogitsProcessor):
    """Records, for every picked token, its log-probability and the ``top`` most likely
    alternatives under the final scores (placed last in the processor list). The token picked
    after a call is known at the next call (the last input id) or at :meth:`entries`."""

    def __init__(self, tokenizer, top: int):
        self.tokenizer, self.top = tokenizer, top
        self._pending: torch.Tensor | None = None
        self._done: list[tuple[int, torch.Tensor]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._pending is not None:
            self._done.append((int(input_ids[0, -1]), self._pending))
        self._pending = torch.log_softmax(scores[0].float(), dim=-1)
        return scores

    def entries(self, tokens: list[int]) -> list[dict[str, Any]]:
        """OpenAI-style ``[{"token", "logprob", "top_logprobs": [{"token", "logprob"}]}]`` for the
        answer ``tokens`` (the ids the call yielded, in order)."""
        steps = list(self._done)
        if self._pending is not None and len(steps) < len(tokens):
            steps.append((tokens[len(steps)], self._pending))
        out = []
        for token, logp in steps[: len(tokens)]:
            top = torch.topk(logp, self.top) if self.top else None
            out.append({
                "token": self.tokenizer.decode([token]), "logprob": _finite(logp[token]),
                "top_logprobs": [{"token": self.tokenizer.decode([int(i)]), "logprob": _finite(v)}
                                 for v, i in zip(top.values, top.indices)] if top is not None else [],
            })
        return out


def _finite(value: torch.Tensor) -> float:
    v = float(value)
    return v if math.isfinite(v) else -9999.0  # OpenAI's value for a token that could not be picked


def check_sampling(s: Sampling) -> None:
    """Refuse settings outside their range, naming the accepted one.

    Raises:
        InputTypeError: a setting of the wrong type. InputError: a value out of range.
    """
    _number("temperature", s.temperature, low=0.0)
    _number("top_p", s.top_p, low=0.0, high=1.0, open_low=True)
    _number("min_p", s.min_p, low=0.0, high=1.0)
    _number("repetition_penalty", s.repetition_penalty, low=0.0, open_low=True)
    _number("presence_penalty", s.presence_penalty, low=-2.0, high=2.0)
    _number("frequency_penalty", s.frequency_penalty, low=-2.0, high=2.0)
    _integer("top_k", s.top_k, low=0)
    _integer("top_logprobs", s.top_logprobs, low=0, high=MAX_TOP_LOGPROBS)
    if s.logprobs is not None and not isinstance(s.logprobs, bool):
        raise InputTypeError(f"logprobs must be True or False (got {type(s.logprobs).__name__})")


def _number(name: str, value: Any, *, low: float, high: float | None = None, open_low: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputTypeError(f"{name} must be a number (got {type(value).__name__})")
    below = value <= low if open_low else value < low
    if not math.isfinite(value) or below or (high is not None and value > high):
        interval = f"{'(' if open_low else '['}{low}, {high if high is not None else 'inf'}{']' if high else ')'}"
        raise InputError(f"{name} must lie in {interval} (got {value})")


def _integer(name: str, value: Any, *, low: int, high: int | None = None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{name} must be an int (got {type(value).__name__})")
    if value < low or (high is not None and value > high):
        raise InputError(f"{name} must lie in [{low}, {high if high is not None else 'inf'}] (got {value})")
