"""Fidelity guard: a sampled, background check of repaired caches against Re-prefill.

On a configurable fraction of repairs (a seeded draw per thread), the guard copies the repaired
prompt's token ids and the repaired first-token logits, and a worker thread re-prefills the
prompt on a fresh cache to get Re-prefill's first-token distribution. It records the sampled
measure and, above ``threshold``, escalates the thread. Measures:

- ``first_token``: KL(p_reprefill ‖ p_repaired) of the first answer token (the paper's §8);
- ``teacher_forced`` (our extension, the default): Re-prefill decodes up to ``tokens`` greedy
  answer tokens (and its end-of-turn token) and a copy of the repaired cache (taken at
  ``observe``) scores them in one forward. The thread escalates when the repaired cache's top-1
  differs from Re-prefill's token at any of these positions (the two greedy answers split within
  ``tokens`` tokens) or when the mean KL per position exceeds ``threshold``. The sample records
  the mean KL (``kl``) and the teacher-forced top-1 agreement (``tf_agreement``).

Escalation: the thread switches to Replay at once (the default) or its budget b rises by ``step``
points (up to 100 %, i.e. Replay). Escalations apply to the thread's later repairs; the answer of
the sampled repair is never delayed, and the live cache is never read after the copy or written.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from pydantic import Field

from . import kvcache
from .engine import forward_rows
from .divergence import first_token_kl
from .policy import RepairPolicy, RepairReport, Settings

log = logging.getLogger(__name__)

REPAIR_EDITS = ("delete", "replace", "insert")  # edits that leave stale rows (appends are exact)
# calibrated on the quality benchmark's QA and NIAH repairs (benchmarks/results/fidelity/README.md)
DEFAULT_MEASURE = "teacher_forced"
DEFAULT_THRESHOLD = 1e-2
# a thread whose repair diverged gets Replay: on the deletion chats of
# benchmarks/results/fidelity/README.md, raising b by 25 points per escalation (up to 80 %) agreed
# no more often than no guard (4 of 12 answers), Replay on every repair after the first divergence
DEFAULT_ACTION = "replay"


class GuardConfig(Settings):
    """Settings of the fidelity guard.

    Attributes:
        fraction: share of repairs checked, in [0, 1] (0: the guard does nothing).
        threshold: the measure (KL in nats) above which the thread escalates.
        measure: ``first_token`` or ``teacher_forced`` (see the module docstring).
        tokens: answer tokens the ``teacher_forced`` measure decodes and scores (>= 1).
        step: budget points (%) added to the thread's budget per escalation, in (0, 100]
            (``raise_budget`` only).
        action: ``replay`` (switch the thread to Replay at once, the default) or ``raise_budget``
            (b += step, up to 100 = Replay).
        seed: seeds the per-thread draws (thread ``t`` draws from ``Random(f"{seed}:{t}")``).

    Raises:
        pydantic.ValidationError (a ValueError): a value outside its range.
    """

    fraction: float = Field(0.1, ge=0.0, le=1.0)
    threshold: float = Field(DEFAULT_THRESHOLD, ge=0.0)
    measure: Literal["first_token", "teacher_forced"] = DEFAULT_MEASURE
    tokens: int = Field(32, ge=1, le=256)
    step: float = Field(25.0, gt=0.0, le=100.0)
    action: Literal["raise_budget", "replay"] = DEFAULT_ACTION
    seed: int = 0


@dataclass
class GuardSample:
    """One check: ``kl`` in nats (first-token KL, or the mean per position for the teacher-forced
    measure), ``tf_agreement`` (teacher-forced top-1 agreement in [0, 1]; None for the
    first-token measure), the repair's ``operator`` / ``budget`` (%), whether it escalated the
    thread and the thread's budget / operator afterwards, ``prompt_tokens`` re-prefilled and
    ``check_ms`` the background time (ms)."""

    thread_id: str
    kl: float
    operator: str
    budget: float | None
    prompt_tokens: int
    escalated: bool
    budget_after: float | None
    operator_after: str | None
    check_ms: float
    tf_agreement: float | None = None


@dataclass
class _ThreadState:
    draws: random.Random
    budget: float | None = None  # escalated budget override (None: the caller's policy)
    replay: bool = False
    kls: list[float] = field(default_factory=list)
    escalations: int = 0
    pending: int = 0
    last: GuardSample | None = None


class FidelityGuard:
    """Samples repairs, checks them against Re-prefill in a worker thread, escalates threads.

    Usage per repair (what ``ChatKVMemory`` does)::

        policy = guard.policy_for(thread_id, requested_policy)
        report = session.prepare(messages, policy=policy)
        guard.observe(thread_id, session, report)   # returns at once
        guard.thread_info(thread_id)                 # budget now, last finished sample

    Args:
        model: the model the sessions run (shared; the worker only runs inference on it).
        config: a GuardConfig (or its fields as a dict); None: defaults.

    Raises:
        pydantic.ValidationError: a bad config.
    """

    def __init__(self, model, config: GuardConfig | dict | None = None):
        self.model = model
        self.config = config if isinstance(config, GuardConfig) else GuardConfig(**(config or {}))
        self._threads: dict[str, _ThreadState] = {}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._futures: set[Future] = set()

    # ------------------------------------------------------------ policy
    def policy_for(self, thread_id: str, policy: RepairPolicy | str) -> RepairPolicy:
        """``policy`` after the thread's escalations: Replay once switched, else the larger of
        its budget and the escalated one (only Shift / refresh policies are changed)."""
        policy = RepairPolicy.coerce(policy)
        state = self._threads.get(str(thread_id))
        if state is None or policy.operator not in ("refresh", "shift"):
            return policy
        if state.replay:
            return policy.model_copy(update={"operator": "replay"})
        if state.budget is not None and state.budget > policy.effective_budget:
            return policy.model_copy(update={"operator": "refresh", "budget": state.budget})
        return policy

    # ------------------------------------------------------------ sampling
    def observe(self, thread_id: str, session, report: RepairReport) -> bool:
        """Maybe check the repair ``session.prepare`` just made (call right after it).

        Only repairs of edits (delete / replace / insert) are eligible. A sampled repair's token
        ids (``[N]``) and first-token logits (``[vocab]``) are copied here; the Re-prefill runs
        in the guard's worker thread. Returns whether this repair was sampled.
        """
        if self.config.fraction <= 0 or session.next_logits is None:
            return False
        if not any(report.edits.get(kind) for kind in REPAIR_EDITS):
            return False
        tid = str(thread_id)
        with self._lock:
            state = self._state(tid)
            if state.draws.random() >= self.config.fraction:
                return False
            state.pending += 1
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmemory-guard")
        ids = torch.tensor(session.token_ids, dtype=torch.long)
        repaired = session.next_logits.detach().clone()
        # the teacher-forced check scores answer tokens on its own copy of the repaired rows
        copy = None
        if self.config.measure == "teacher_forced":
            copy = (kvcache.clone_cache(session.cache), session.stop_token_ids())
        budget = report.budget if report.operator in ("refresh", "shift", "replay") else None
        future = self._executor.submit(self._check, tid, ids, repaired, report.operator, budget, copy)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._finished)
        return True

    def _state(self, tid: str) -> _ThreadState:
        if tid not in self._threads:
            self._threads[tid] = _ThreadState(random.Random(f"{self.config.seed}:{tid}"))
        return self._threads[tid]

    def _finished(self, future: Future) -> None:
        with self._lock:
            self._futures.discard(future)
        if future.exception() is not None:
            log.warning("kvmemory: fidelity guard check failed: %r", future.exception())

    def _check(self, tid: str, ids: torch.Tensor, repaired: torch.Tensor, operator: str, budget,
               copy=None) -> GuardSample:
        """Worker: Re-prefill ``ids`` on a fresh cache, compare, escalate the thread if needed."""
        t0 = time.perf_counter()
        try:
            device = next(self.model.parameters()).device
            cache = kvcache.new_cache(self.model.config)
            reference = forward_rows(self.model, cache, ids.to(device), 0)
            if copy is None:
                kl, agreement = first_token_kl(reference, repaired.to(reference.device)), None
            else:
                kl, agreement = self._teacher_forced(cache, reference, *copy, repaired, int(ids.shape[0]), device)
        except BaseException:
            with self._lock:
                self._state(tid).pending -= 1
            raise
        with self._lock:
            state = self._state(tid)
            state.pending -= 1
            state.kls.append(kl)
            diverged = kl > self.config.threshold or (agreement is not None and agreement < 1.0)
            escalated = diverged and not state.replay
            if escalated:
                self._escalate(state, budget)
                log.warning("kvmemory: fidelity guard: thread %r repair (%s, b=%s) differs from Re-prefill "
                            "(%s KL %.3g, threshold %.3g nats, top-1 agreement %s): its later repairs use %s", tid,
                            operator, budget, self.config.measure, kl, self.config.threshold, agreement,
                            "Replay" if state.replay else f"budget {state.budget:g} %")
            sample = GuardSample(tid, kl, operator, budget, int(ids.shape[0]), escalated, state.budget,
                                 "replay" if state.replay else None, (time.perf_counter() - t0) * 1000.0, agreement)
            state.last = sample
        return sample

    def _teacher_forced(self, cache, reference, copy, stops: set[int], repaired, n: int, device) -> tuple[float, float]:
        """(mean KL(p_reprefill ‖ p_repaired), top-1 agreement) over the positions of up to
        ``tokens`` greedy Re-prefill answer tokens and the token after them (its end-of-turn token
        when it stopped), the repaired copy scoring them in one forward."""
        rows, answer = [reference], []
        while len(answer) < self.config.tokens - 1:
            token = int(torch.argmax(rows[-1]))
            if token in stops:
                break
            answer.append(token)
            rows.append(forward_rows(self.model, cache, torch.tensor([token], device=device), n + len(answer) - 1))
        scored = [repaired.to(device).float()]
        if answer:
            with torch.no_grad():
                out = self.model(input_ids=torch.tensor([answer], device=device),
                                 position_ids=torch.arange(n, n + len(answer), device=device)[None], cache=copy,
                                 use_cache=True)
            scored += list(out.logits[0].float())
        kl = sum(first_token_kl(r, q) for r, q in zip(rows, scored)) / len(rows)
        agreement = sum(int(torch.argmax(r)) == int(torch.argmax(q)) for r, q in zip(rows, scored)) / len(rows)
        return kl, agreement

    def _escalate(self, state: _ThreadState, budget: float | None) -> None:
        state.escalations += 1
        if self.config.action == "replay":
            state.replay = True
            return
        base = max(state.budget or 0.0, budget or 0.0)
        state.budget = min(100.0, base + self.config.step)
        state.replay = state.budget >= 100.0

    # ------------------------------------------------------------ reading
    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted check has finished (tests, shutdown). Returns whether
        all finished within ``timeout`` seconds (None: no limit)."""
        with self._lock:
            futures = set(self._futures)
        done, not_done = wait(futures, timeout=timeout)
        return not not_done

    def thread_info(self, thread_id: str) -> dict:
        """What the guard knows of one thread (JSON-able): ``budget`` (escalated budget in %,
        None if never escalated), ``replay`` (switched to Replay), ``samples``, ``escalations``,
        ``pending`` checks and ``last_sample`` (the latest finished check, or None)."""
        with self._lock:
            state = self._threads.get(str(thread_id))
            if state is None:
                return {"budget": None, "replay": False, "samples": 0, "escalations": 0, "pending": 0,
                        "last_sample": None}
            return {"budget": state.budget, "replay": state.replay, "samples": len(state.kls),
                    "escalations": state.escalations, "pending": state.pending,
                    "last_sample": asdict(state.last) if state.last else None}

    def summary(self) -> dict:
        """All threads (JSON-able): ``samples``, ``mean_kl`` / ``max_kl`` (nats, None without
        samples), ``escalations``, ``pending``, and ``threads`` with the same fields plus the
        escalated ``budget`` / ``replay`` per thread id."""
        with self._lock:
            threads = {
                tid: {"samples": len(s.kls), "mean_kl": _mean(s.kls), "max_kl": max(s.kls, default=None),
                      "escalations": s.escalations, "budget": s.budget, "replay": s.replay, "pending": s.pending}
                for tid, s in self._threads.items()
            }
            kls = [kl for s in self._threads.values() for kl in s.kls]
            return {"config": self.config.model_dump(), "samples": len(kls), "mean_kl": _mean(kls),
                    "max_kl": max(kls, default=None), "escalations": sum(t["escalations"] for t in threads.values()),
                    "pending": sum(t["pending"] for t in threads.values()), "threads": threads}

    def forget(self, thread_id: str) -> None:
        """Drop a thread's escalations and samples (e.g. when the thread is deleted)."""
        with self._lock:
            self._threads.pop(str(thread_id), None)

    def close(self) -> None:
        """Wait for running checks and stop the worker thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
