"""Online test-time training: an answer-supervised peft LoRA step on a recent interaction, then
CacheReforge on every live session cache (CacheReforge §Introduction: adapter evolution)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, MutableMapping, Sequence

import torch

from ..prompt import normalize_messages
from .state import ReforgeReport
from .versions import capture_adapter

log = logging.getLogger(__name__)


def answer_supervised_ids(tokenizer, messages: Sequence[Mapping[str, Any]], answer: str) -> tuple[list[int], list[int]]:
    """Token ids of ``messages`` rendered with the chat template + generation prompt (the
    prompt), and of ``answer`` followed by the end-of-turn token (the target).

    Raises:
        ValueError: an empty answer.
    """
    if not answer or not answer.strip():
        raise ValueError("the supervised answer is empty: pass the user-confirmed answer or a target text")
    msgs = [m.template_dict() for m in normalize_messages(messages)]
    prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    target_ids = tokenizer(answer.strip(), add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        target_ids = target_ids + [tokenizer.eos_token_id]
    return prompt_ids, target_ids


def lora_update_step(model, optimizer: torch.optim.Optimizer, prompt_ids: list[int], target_ids: list[int]) -> float:
    """One optimizer step on the cross-entropy of ``target_ids`` given ``prompt_ids`` (tokens),
    through the trainable (LoRA) parameters of a peft model. Dropout stays as configured.

    Returns:
        The loss before the step (nats per target token).

    Raises:
        ValueError: no trainable parameters or an empty target.
    """
    if not target_ids:
        raise ValueError("empty target: nothing to supervise")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters: wrap it with peft.get_peft_model(LoraConfig(...))")
    ids = torch.tensor([prompt_ids + target_ids])
    labels = torch.tensor([[-100] * len(prompt_ids) + target_ids])
    optimizer.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out = model(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(out.loss.detach())


@dataclass
class UpdateReport:
    """One online update: the loss, the adapter version before/after, the training time (s) and
    a CacheReforge report per session id."""

    loss: float
    version_before: str | None
    version_after: str | None
    train_s: float
    sessions: dict[str, ReforgeReport] = field(default_factory=dict)


class OnlineAdapter:
    """Test-time training of a peft LoRA adapter shared by live sessions.

    Args:
        model: the peft-wrapped model the sessions run on.
        tokenizer: its tokenizer.
        sessions: registry ``{thread_id: KVSession}`` (live caches to maintain; shared, not copied).
        optimizer: defaults to Adam(lr) over the trainable parameters.
        lr: step size (the paper's update magnitude; 1e-2 in RQ4).
    """

    def __init__(self, model, tokenizer, sessions: MutableMapping[str, Any] | None = None, *,
                 optimizer: torch.optim.Optimizer | None = None, lr: float = 1e-2):
        self.model = model
        self.tokenizer = tokenizer
        self.sessions = sessions if sessions is not None else {}
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("no trainable parameters: wrap the model with peft.get_peft_model(LoraConfig(...))")
        self.optimizer = optimizer or torch.optim.Adam(params, lr=lr)
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.updates = 0

    def update(self, messages: Sequence[Mapping[str, Any]], answer: str) -> UpdateReport:
        """Train on ``messages`` → ``answer`` (one step), bump the adapter version, and apply
        CacheReforge to every registered session (each under its own ReforgeConfig).

        Raises:
            ValueError: empty answer / malformed messages.
        """
        before = capture_adapter(self.model, self.num_layers)
        prompt_ids, target_ids = answer_supervised_ids(self.tokenizer, messages, answer)
        t0 = time.perf_counter()
        loss = lora_update_step(self.model, self.optimizer, prompt_ids, target_ids)
        train_s = time.perf_counter() - t0
        self.updates += 1
        after = capture_adapter(self.model, self.num_layers)
        report = UpdateReport(loss, before.digest if before else None, after.digest if after else None, train_s)
        report.sessions = self.apply(after)
        return report

    def apply(self, current=None) -> dict[str, ReforgeReport]:
        """CacheReforge on every registered session that holds a cache (after an update)."""
        current = current if current is not None else capture_adapter(self.model, self.num_layers)
        out = {}
        for key, session in list(self.sessions.items()):
            if session.token_ids:
                out[str(key)] = session.maintain(current=current)
        return out

    def register(self, key: str, session) -> None:
        """Add a live session (the model must be the same object)."""
        if session.model is not self.model:
            raise ValueError(f"session {key!r} runs on a different model object than the adapter being trained")
        self.sessions[key] = session

    def registered(self) -> Iterable[str]:
        return list(self.sessions)
