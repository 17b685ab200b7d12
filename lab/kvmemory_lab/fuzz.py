"""Property-based edit fuzzing: hypothesis generates random edit sequences,
kvmemory repairs the cache after every step, and the invariants of :mod:`kvmemory_lab.invariants`
are checked after every step.

A sequence (:class:`FuzzCase`) is a model, a starting message list and up to 6 :class:`Step`s:
appends (user / assistant / tool), deletions, same-id replacements, insertions in the middle,
summarise-the-head (the first k messages become one summary), clear-tool-output (a tool
message's content becomes a placeholder), remove-all-then-resend (fresh session, reset, only
one message then the whole list again, or the same list once more) and generate-then-append
(decode a few tokens, commit or append them as the assistant's answer). Every step repairs under
its own random policy: budget b in {0, 2, 5, 10, 25, 50, 75, 100} %, any allocator of
:data:`kvmemory.selection.ALLOCATOR_NAMES`, any executor (auto / packed / sequential / direct),
now and then Replay or Re-prefill. Indices are taken modulo the current list length, so every
generated sequence is valid and shrinks to a short one.

Models: tiny random-weight Llama / Qwen2 / Qwen3 configs that share the embedded model's
tokenizer and chat template (fast, most sequences), a tiny Llama with a LoRA adapter (so
CacheReforge retains boundary states) and the embedded SmolLM2-135M-Instruct.
``python -m kvmemory_lab.fuzz`` is not provided; run ``kvmemory bench reliability --profiles fuzz``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kvmemory.executors import EXECUTORS
from kvmemory.policy import RepairPolicy
from kvmemory.selection import ALLOCATOR_NAMES
from kvmemory.testing import tiny_model

from .invariants import check_session, registry_violations, state_violations

log = logging.getLogger(__name__)

TINY_FAMILIES = ("llama", "qwen2", "qwen3")
# tiny-llama-lora: CacheReforge retains boundary states (memory accounting must count them)
MODELS = tuple(f"tiny-{f}" for f in TINY_FAMILIES) + ("tiny-llama-lora", "embedded")
BUDGETS = (0.0, 2.0, 5.0, 10.0, 25.0, 50.0, 75.0, 100.0)  # b in %
OPS = ("append", "delete", "replace", "insert", "summarise", "clear_tool", "resend", "generate")
RESEND_MODES = ("fresh", "reset", "remove_all", "same")
PLACEHOLDER = "[tool output cleared]"
# sequences per model: (tiny models each, embedded). "full" >= 1,000 in total.
PROFILE_SIZES = {"reduced": (6, 2), "full": (250, 50)}
EMBEDDED_MAX_STEPS = 4  # a step on the embedded model costs ~4 s on 2 shared cores (checks included)
MAX_FAILURES = 8  # distinct counterexamples recorded per profile before giving up on more

PHRASES = (
    "Where was the founder of Ostrava Nova born?",
    "search('Ostrava Nova')",
    "Ostrava Nova was founded in 1873 by the engineer Ilse Marrow. The town lies on the Mira River.\n\n"
    "Its mill was the first in the valley.",
    "Port Calder has three lighthouses. The oldest was built in 1790. It is now a museum.",
    "Ilse Marrow (1841-1919) was a hydraulic engineer born in Helmsford, a river port on the Dorne.",
    "ok", "", " ", "\n", "Thanks!", "{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}}",
    "Zürich → Ostrava: 1 234,5 km; 東京", "  leading and trailing spaces  ", "<|im_end|>", "<|im_start|>user",
)
TEXT_ALPHABET = "abcdefghij XYZ.,!?'\n\t0123é東{}<>|_"


def _hypothesis():
    import hypothesis
    from hypothesis import strategies as st

    return hypothesis, st


# ------------------------------------------------------------------ the cases
@dataclass(frozen=True)
class Step:
    """One edit step. ``index`` / ``count`` are taken modulo the current list length; ``mode``:
    resend mode (fresh | reset | remove_all | same) or, for ``generate``, commit | append;
    ``operator`` / ``budget`` (%) / ``allocator`` / ``executor`` form the repair policy."""

    op: str
    role: str = "user"
    text: str = ""
    index: int = 0
    count: int = 1
    anonymous: bool = False
    mode: str = ""
    operator: str = "refresh"
    budget: float = 5.0
    allocator: str = "sur"
    executor: str = "auto"

    @property
    def policy(self) -> RepairPolicy:
        return RepairPolicy(operator=self.operator, budget=self.budget, allocator=self.allocator,
                            executor=self.executor)


@dataclass(frozen=True)
class FuzzCase:
    """A generated sequence: ``start`` messages ``(role, text)`` (ids m0, m1, ...), then ``steps``."""

    model: str
    start: tuple[tuple[str, str], ...]
    steps: tuple[Step, ...]


def texts():
    """Message contents: agent-like phrases (special-token text and empty content included) or short random text."""
    _, st = _hypothesis()
    return st.one_of(st.sampled_from(PHRASES), st.text(alphabet=TEXT_ALPHABET, max_size=40))


def steps():
    """One random :class:`Step` (op, content, position, policy)."""
    _, st = _hypothesis()
    return st.builds(
        Step,
        op=st.sampled_from(OPS),
        role=st.sampled_from(("user", "assistant", "tool", "system")),
        text=texts(),
        index=st.integers(0, 31),
        count=st.integers(1, 8),
        anonymous=st.booleans(),
        mode=st.sampled_from(RESEND_MODES + ("commit", "append")),
        operator=st.sampled_from(("refresh",) * 6 + ("replay", "reprefill")),
        budget=st.sampled_from(BUDGETS),
        allocator=st.sampled_from(ALLOCATOR_NAMES),
        executor=st.sampled_from(EXECUTORS),
    )


def cases(model: str, max_steps: int = 6):
    """A :class:`FuzzCase` on ``model``: 1-5 starting messages (system first, then user / assistant
    / tool turns) and 1-``max_steps`` steps."""
    _, st = _hypothesis()
    message = st.tuples(st.sampled_from(("user", "assistant", "tool")), texts())
    start = st.tuples(st.tuples(st.just("system"), texts()), st.lists(message, min_size=0, max_size=4))
    return st.builds(
        lambda head, steps_: FuzzCase(model, (head[0], *head[1]), tuple(steps_)),
        start, st.lists(steps(), min_size=1, max_size=max_steps),
    )


# -------------------------------------------------------------------- models
def tiny_lora_model(seed: int = 0):
    """A 4-layer tiny Llama with a PEFT LoRA adapter (r = 4) on q/v/down projections of layers 2
    and 3, only layer 2's trainable: CacheReforge then retains the boundary states entering
    layer 2 (its restart layer) for every cached row."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama", seed, layers=4), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[2, 3]))
    for name, p in model.named_parameters():
        if "lora" in name and "layers.2." not in name:
            p.requires_grad_(False)
    return model.eval()


class ModelPool:
    """Loads each fuzz model once: ``get(name) -> (model, tokenizer)``."""

    def __init__(self, loaded=None):
        self._embedded = loaded
        self._models: dict[str, Any] = {}

    def embedded(self):
        if self._embedded is None:
            from kvmemory.models import load_model

            self._embedded = load_model(None)
        return self._embedded

    def get(self, name: str):
        base = self.embedded()
        if name == "embedded":
            return base.model, base.tokenizer
        if name not in self._models:
            family = name.removeprefix("tiny-")
            self._models[name] = tiny_lora_model() if family == "llama-lora" else tiny_model(family)
        return self._models[name], base.tokenizer


# ------------------------------------------------------------------ running
class _Messages:
    """The caller's message list and its id counter."""

    def __init__(self, start):
        self.items: list[dict] = []
        self.next_id = 0
        for role, text in start:
            self.items.append(self.new(role, text))

    def new(self, role: str, text: str, anonymous: bool = False) -> dict:
        msg = {"role": role, "content": text}
        if not anonymous:
            msg["id"] = f"m{self.next_id}"
            self.next_id += 1
        return msg


def _apply_edit(msgs: _Messages, step: Step) -> None:
    """Edit the caller's list in place as ``step`` says (ops that do not apply are no-ops)."""
    items, n = msgs.items, len(msgs.items)
    if step.op == "append":
        items.append(msgs.new(step.role, step.text, step.anonymous))
    elif step.op == "delete" and n > 1:
        del items[step.index % n]
    elif step.op == "replace":
        i = step.index % n
        items[i] = dict(items[i], content=step.text)
    elif step.op == "insert":
        items.insert(step.index % (n + 1), msgs.new(step.role, step.text, step.anonymous))
    elif step.op == "summarise":
        k = 1 + step.count % n
        items[:k] = [msgs.new("system" if step.role == "system" else "user", "Summary: " + step.text)]
    elif step.op == "clear_tool":
        tools = [i for i, m in enumerate(items) if m["role"] == "tool"]
        if tools:
            i = tools[step.index % len(tools)]
            items[i] = dict(items[i], content=PLACEHOLDER)


@dataclass
class SequenceResult:
    """What running one case found: ``steps`` checked, violations ``[(step, text)]``, and how
    many repairs left stale rows (``sparse_repairs``: b < 100 % with S > 0) or fell back to exact
    recomputation (``fallbacks``)."""

    steps: int = 0
    violations: list[tuple[int, str]] = field(default_factory=list)
    sparse_repairs: int = 0
    fallbacks: int = 0


def run_case(case: FuzzCase, pool: ModelPool, *, fidelity: bool = True) -> SequenceResult:
    """Run ``case`` step by step on a fresh thread of a ``ThreadCaches`` registry, checking the
    invariants (a)–(d) after every step (and memory accounting of the registry and of an
    exported ``CacheState``). An exception from kvmemory is a violation too (it is recorded with
    its step; the sequence stops there)."""
    from kvmemory.threads import ThreadCaches

    model, tokenizer = pool.get(case.model)
    caches = ThreadCaches(model, tokenizer, memory_budget_bytes=None)
    msgs = _Messages(case.start)
    result = SequenceResult()

    def check(i: int, step: Step | None, expected) -> None:
        session = caches.session("t")
        found = check_session(session, expected, fidelity=fidelity, policy=step.policy if step else None)
        found += registry_violations(caches)
        if session.token_ids:
            found += state_violations(caches.export_state("t"))
        result.steps += 1
        result.violations += [(i, v) for v in found]

    def prepare(i: int, step: Step | None) -> None:
        with caches.lease("t") as session:
            report = session.prepare(msgs.items, policy=step.policy if step else None)
        result.sparse_repairs += report.refreshed_tokens < report.stale_tokens
        result.fallbacks += report.fallback is not None
        check(i, step, msgs.items)

    try:
        prepare(0, None)
        for i, step in enumerate(case.steps, start=1):
            _run_step(i, step, msgs, caches, prepare, check)
    except Exception as exc:  # a crash on valid input is a counterexample
        log.debug("fuzz case crashed", exc_info=True)
        result.violations.append((result.steps, f"crash: {type(exc).__name__}: {exc}"))
    return result


def _run_step(i: int, step: Step, msgs: _Messages, caches, prepare: Callable, check: Callable) -> None:
    if step.op == "resend":
        if step.mode == "fresh":
            caches.drop("t")
        elif step.mode == "reset":
            caches.session("t").reset()
        elif step.mode == "remove_all":
            saved, msgs.items = msgs.items, [msgs.new(step.role, step.text)]
            prepare(i, step)
            msgs.items = saved
        prepare(i, step)
    elif step.op == "generate":
        if caches.session("t").next_logits is None:  # the last answer ended (committed): a new turn first
            prepare(i, step)
        with caches.lease("t") as session:
            gen = session.generate(max_new_tokens=1 + step.count % 3)
        check(i, step, msgs.items)
        answer = msgs.new("assistant", gen.text)
        committed = False
        if step.mode == "commit":
            with caches.lease("t") as session:
                committed = session.commit_answer(answer)
        msgs.items.append(answer)
        if committed:
            check(i, step, msgs.items)
        else:
            prepare(i, step)
    else:
        _apply_edit(msgs, step)
        prepare(i, step)


# ------------------------------------------------------------------ profiles
@dataclass
class FuzzStats:
    """Counts over a profile run."""

    sequences_tried: int = 0
    steps: int = 0
    invariant_violations: int = 0
    failing_sequences: int = 0
    sparse_repairs: int = 0
    fallbacks: int = 0
    counterexamples: list[str] = field(default_factory=list)
    per_model: dict[str, int] = field(default_factory=dict)


def fuzz_model(model: str, examples: int, *, seed: int, pool: ModelPool, stats: FuzzStats,
               progress: Callable[[], None] | None = None, max_steps: int = 6) -> None:
    """Run hypothesis on ``model`` until ``examples`` sequences ran without a failure (each
    failure is shrunk, recorded as a counterexample, and the search restarts with the next
    seed, at most :data:`MAX_FAILURES` times)."""
    hypothesis, _ = _hypothesis()
    attempt = 0
    failing: list[tuple[FuzzCase, SequenceResult]] = []
    while True:
        target = stats.per_model.get(model, 0) + examples
        failing.clear()

        @hypothesis.settings(max_examples=max(1, examples), deadline=None, database=None, derandomize=False,
                             suppress_health_check=list(hypothesis.HealthCheck), print_blob=False,
                             report_multiple_bugs=False)
        @hypothesis.seed(seed * 1000 + attempt)
        @hypothesis.given(cases(model, max_steps))
        def prop(case: FuzzCase) -> None:
            result = run_case(case, pool)
            stats.sequences_tried += 1
            stats.steps += result.steps
            stats.sparse_repairs += result.sparse_repairs
            stats.fallbacks += result.fallbacks
            stats.per_model[model] = stats.per_model.get(model, 0) + 1
            if progress:
                progress()
            if result.violations:
                failing.append((case, result))
                raise AssertionError(result.violations[0][1])

        try:
            prop()
            return
        except AssertionError:
            case, result = failing[-1]  # hypothesis replays the shrunk example last
            stats.failing_sequences += 1
            stats.invariant_violations += len(result.violations)
            stats.counterexamples.append(f"{case!r} -> step {result.violations[0][0]}: {result.violations[0][1]}")
            log.warning("fuzz counterexample on %s: %s", model, stats.counterexamples[-1])
        attempt += 1
        examples = target - stats.per_model.get(model, 0)
        if attempt >= MAX_FAILURES or examples <= 0:
            return


def run_fuzz_profile(size: str, *, seed: int = 0, workdir: Path | None = None, progress: bool = False,
                     models: tuple[str, ...] = MODELS, pool: ModelPool | None = None) -> dict:
    """The ``fuzz`` profile of ``kvmemory bench reliability`` (see :mod:`kvmemory_lab.bench.reliability`).

    Args:
        size: ``"reduced"`` (``make test``: a few sequences per tiny model) or ``"full"``
            (:data:`PROFILE_SIZES`: 250 on each of the 4 tiny models + 50 on the embedded
            model = 1,050; at most 4 steps per embedded sequence).
        seed: hypothesis seed (the run is deterministic for a given seed).
        workdir: unused (the fuzz profile writes no files); accepted for the common interface.
        progress: show a tqdm bar over the sequences.
        models: subset of :data:`MODELS` to fuzz.
        pool: models already loaded (tests pass one to share the embedded model).

    Returns:
        ``{"sequences_tried", "steps", "invariant_violations", "failing_sequences", "sparse_repairs"
        (steps that left stale rows: b < 100 %), "fallbacks" (exact recomputation instead), "ok",
        "models": {name: sequences}, "counterexamples": [str], "seconds_per_sequence"}``.

    Raises:
        ValueError: unknown ``size`` or model name.
    """
    if size not in PROFILE_SIZES:
        raise ValueError(f"unknown fuzz profile size {size!r}: use one of {', '.join(PROFILE_SIZES)}")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown fuzz model(s) {unknown}: use {', '.join(MODELS)}")
    tiny_n, embedded_n = PROFILE_SIZES[size]
    plan = [(m, embedded_n if m == "embedded" else tiny_n) for m in models]
    plan = [(m, n) for m, n in plan if n > 0]
    pool = pool or ModelPool()
    stats = FuzzStats()
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(n for _, n in plan), desc="fuzz sequences", unit="seq")
    for model, n in plan:
        fuzz_model(model, n, seed=seed, pool=pool, stats=stats, progress=bar.update if bar else None,
                   max_steps=EMBEDDED_MAX_STEPS if model == "embedded" else 6)
    if bar:
        bar.close()
    seconds = time.perf_counter() - t0
    return {
        "sequences_tried": stats.sequences_tried,
        "steps": stats.steps,
        "invariant_violations": stats.invariant_violations,
        "failing_sequences": stats.failing_sequences,
        "sparse_repairs": stats.sparse_repairs,
        "fallbacks": stats.fallbacks,
        "ok": stats.invariant_violations == 0 and stats.failing_sequences == 0,
        "models": dict(stats.per_model),
        "counterexamples": stats.counterexamples,
        "seconds_per_sequence": round(seconds / max(1, stats.sequences_tried), 3),
    }
