"""Online test-time training: an answer-supervised peft LoRA step on a recent interaction, then
CacheReforge on every live session cache (CacheReforge §Introduction: adapter evolution).

It drives the thread registry (:class:`kvmemory.threads.ThreadCaches`), so it sits above the
session and the registry, not inside ``reforge`` (which the session itself uses).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, MutableMapping, Sequence

import torch

from .errors import AdapterUpdateError, InputTypeError
from .prompt import normalize_messages
from .reforge.state import ReforgeReport
from .reforge.versions import capture_adapter
from .threads import ThreadCaches

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
    """One online update: the loss, the adapter version before/after, the training time (s), a
    CacheReforge report per maintained session id, the sessions whose maintenance failed (id →
    why; their caches were dropped and re-prefill exactly at their next turn) and the registry
    threads busy in a call during the update (their session maintains itself before its next
    forward)."""

    loss: float
    version_before: str | None
    version_after: str | None
    train_s: float
    sessions: dict[str, ReforgeReport] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    busy: list[str] = field(default_factory=list)


class OnlineAdapter:
    """Test-time training of a peft LoRA adapter shared by live sessions.

    Args:
        model: the peft-wrapped model the sessions run on (or the model peft injected its
            layers into).
        tokenizer: its tokenizer.
        sessions: the live caches to maintain (shared, not copied): a
            :class:`kvmemory.threads.ThreadCaches` registry (e.g. ``ChatKVMemory.threads``:
            every live thread, each maintained with its lock held; a thread busy in a call is
            left to maintain itself before its next forward) or a mapping ``{id: KVSession}``.
        optimizer: defaults to Adam(lr) over the trainable parameters.
        lr: step size (the paper's update magnitude; 1e-2 in RQ4).

    Raises:
        InputTypeError: ``sessions`` is neither a registry nor a mapping.
        ValueError: no trainable parameters; a session runs on another model object.
    """

    def __init__(self, model, tokenizer, sessions: MutableMapping[str, Any] | ThreadCaches | None = None, *,
                 optimizer: torch.optim.Optimizer | None = None, lr: float = 1e-2):
        self.model = model
        self.tokenizer = tokenizer
        self.sessions = _check_registry(sessions if sessions is not None else {})
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("no trainable parameters: wrap the model with peft.get_peft_model(LoraConfig(...))")
        self.optimizer = optimizer or torch.optim.Adam(params, lr=lr)
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.updates = 0
        self._check_sessions()

    def update(self, messages: Sequence[Mapping[str, Any]], answer: str) -> UpdateReport:
        """Train on ``messages`` → ``answer`` (one step), bump the adapter version, and apply
        CacheReforge to every registered session (each under its own ReforgeConfig).

        Everything is checked before the step (arguments, every session's model and
        maintenance policy). If the step fails it is rolled back. A session whose maintenance
        fails afterwards has its cache dropped (exact re-prefill at its next turn, reported
        there and in ``UpdateReport.dropped``); every other cache is maintained.

        Raises:
            ValueError: empty answer / malformed messages; a session on another model object
                or with an unusable CacheReforge policy (nothing changed).
            AdapterUpdateError: the step failed; weights and optimizer state were rolled back.
        """
        prompt_ids, target_ids = answer_supervised_ids(self.tokenizer, messages, answer)
        self._check_sessions()
        before = capture_adapter(self.model, self.num_layers)
        saved = self._snapshot()
        t0 = time.perf_counter()
        try:
            loss = lora_update_step(self.model, self.optimizer, prompt_ids, target_ids)
            after = capture_adapter(self.model, self.num_layers)
        except Exception as exc:
            self._restore(saved)
            version = before.digest if before else None
            log.error("kvmemory: the LoRA update failed (%s: %s); adapter weights and optimizer state rolled back "
                      "to version %s", type(exc).__name__, exc, version)
            raise AdapterUpdateError(f"the LoRA update failed ({type(exc).__name__}: {exc}); the adapter weights and "
                                     f"optimizer state were rolled back to version {version}", version) from exc
        train_s = time.perf_counter() - t0
        self.updates += 1
        report = UpdateReport(loss, before.digest if before else None, after.digest if after else None, train_s)
        report.sessions = self.apply(after, report)
        return report

    def apply(self, current=None, report: UpdateReport | None = None) -> dict[str, ReforgeReport]:
        """CacheReforge on every registered session that holds a cache (after an update).
        A session whose maintenance fails has its cache dropped (``KVSession.maintain``; logged)
        and is listed in ``report.dropped``; registry threads busy in a call in ``report.busy``."""
        current = current if current is not None else capture_adapter(self.model, self.num_layers)
        report = report if report is not None else UpdateReport(0.0, None, None, 0.0)
        out = {}
        for key, session in self._idle_sessions(report.busy):
            if not session.token_ids:
                continue
            try:
                out[key] = session.maintain(current=current)
            except Exception as exc:
                report.dropped[key] = f"{type(exc).__name__}: {exc}"
                log.warning("kvmemory: CacheReforge maintenance of %r failed after the adapter update (%s); its cache "
                            "was dropped: its next turn re-prefills", key, report.dropped[key])
        return out

    def register(self, key: str, session) -> None:
        """Add a live session to a mapping registry (the model must be the same object).

        Raises:
            ValueError: another model object. InputTypeError: the registry is a ThreadCaches
                (it creates its sessions itself: lease a thread instead).
        """
        if not isinstance(self.sessions, MutableMapping):
            raise InputTypeError("the registry is a ThreadCaches, which creates its own sessions: use "
                                 "registry.lease(thread_id) instead of register()")
        if not _runs_on(session, self.model):
            raise ValueError(f"session {key!r} runs on a different model object than the adapter being trained")
        self.sessions[key] = session

    def registered(self) -> Iterable[str]:
        return list(self.sessions.thread_ids if isinstance(self.sessions, ThreadCaches) else self.sessions)

    # ------------------------------------------------------------------ internals
    def _check_sessions(self) -> None:
        """Every session runs on this model and can be maintained under its policy (ValueError)."""
        if isinstance(self.sessions, ThreadCaches):
            if not _same_model(self.sessions.model, self.model):
                raise ValueError("the ThreadCaches registry runs on a different model object than the adapter being "
                                 "trained: pass the registry of the model peft wrapped (e.g. ChatKVMemory.threads)")
            live = [(tid, self.sessions.get(tid)) for tid in self.sessions.thread_ids]
        else:
            live = list(self.sessions.items())
        for key, session in live:
            if session is None:
                continue  # evicted since listed
            if not _runs_on(session, self.model):
                raise ValueError(f"session {key!r} runs on a different model object than the adapter being trained")
            try:
                session.reforge.usable_policy()
            except ValueError as exc:
                raise ValueError(f"session {key!r} cannot be maintained after an update: {exc}") from exc

    def _idle_sessions(self, busy: list[str]) -> Iterator[tuple[str, Any]]:
        """``(id, session)`` of every registered session; a registry thread is yielded with its
        lock held (no call may start on it meanwhile) and skipped into ``busy`` when a call holds it."""
        if not isinstance(self.sessions, ThreadCaches):
            yield from ((str(k), s) for k, s in list(self.sessions.items()))
            return
        for tid in self.sessions.thread_ids:
            with self.sessions.idle(tid) as session:
                if session is None:
                    if tid in self.sessions:
                        busy.append(tid)
                    continue
                yield tid, session

    def _snapshot(self) -> tuple[list[torch.Tensor], dict]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return [p.detach().clone() for p in params], copy.deepcopy(self.optimizer.state_dict())

    def _restore(self, saved: tuple[list[torch.Tensor], dict]) -> None:
        values, state = saved
        with torch.no_grad():
            for p, value in zip([p for p in self.model.parameters() if p.requires_grad], values):
                p.copy_(value)
        self.optimizer.load_state_dict(state)


def _check_registry(sessions):
    if isinstance(sessions, (ThreadCaches, MutableMapping)):
        return sessions
    raise InputTypeError(f"sessions must be a ThreadCaches registry (e.g. ChatKVMemory.threads) or a dict "
                         f"{{id: KVSession}} (got {type(sessions).__name__})")


def _same_model(a, b) -> bool:
    """Whether ``a`` and ``b`` are one model: the same object, or a peft wrapper and the model it wraps."""
    def base(m):
        get = getattr(m, "get_base_model", None)
        return get() if callable(get) else m

    return a is b or base(a) is base(b)


def _runs_on(session, model) -> bool:
    return _same_model(getattr(session, "model", None), model)
