"""The live cache of one conversation: token ids, per-layer K/V, segment table, and the calls
that keep them in step with an edited message list."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import weakref
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

from . import kvcache, window_checkpoint
from .capabilities import model_capabilities
from .edits import common_prefix_length, plan_edits
from .errors import ContextOverflowError, InputError, InputTypeError, UnknownMessageError
from .engine import status as engine_status
from .engine import forward_rows, share_cores
from .lookup import checked_prompt_lookup, propose
from .policy import RepairPolicy, RepairReport
from .shift import RotaryShifter, ShiftUnsupportedError
from .prompt import (
    ChatMessage, RenderedPrompt, TemplateError, normalize_messages, normalize_tools, render_prompt, segment_prompt,
)
from .reforge.state import CacheView, ReforgeConfig, ReforgeReport, ReforgeState
from .reforge.versions import AdapterState
from .repair import RepairJob, RepairResult, check_policy_fits, repair
from .selection.exposure import CALIBRATION_TEXT

log = logging.getLogger(__name__)

KEEP_TOOLS = object()  # prepare(tools=...) omitted: the session keeps its tools
ANSWER_END_ROWS = 8  # rows an answer's end-of-turn text takes when committed (allocated with the answer)
PROMPT_LOOKUP_TOKENS = 2  # draft tokens checked per greedy forward (kvmemory.lookup; measured in docs/engine.md)

# transformers' LogitsProcessor convention: (input_ids [1, L], scores [1, vocab]) -> scores
LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class _RequestPlan:
    """What ``prepare`` decided before the repair: the repair job (new rendering, edit plan, the
    policy whose operator runs), the held message ids strict erase removes, the adapter the rows
    are computed under, and what the report says beside the repair: why the template gives no
    stable spans, CacheReforge maintenance since the last report, why the cache was dropped or not restored."""

    job: RepairJob
    erased: list[str]
    adapter: AdapterState | None
    template_fallback: str | None
    maintenance: ReforgeReport | None
    dropped: str | None
    restored: str | None = None  # a sliding-window checkpoint gave back the prompt's rows (what it says)


class _RepairRun(NamedTuple):
    """The repair step's output: the repaired cache and its report, the CacheReforge boundary
    states captured meanwhile, and the rows strict erase overwrote first (None: no erase)."""

    result: RepairResult
    captures: list
    scrubbed: dict[str, int] | None


@dataclasses.dataclass
class Generation:
    """A decoded answer. ``first_logits``: fp32 ``[vocab]`` distribution logits of the first
    answer token; ``decode_ms``: milliseconds spent decoding; ``finish_reason``: stop | length."""

    text: str
    token_ids: list[int]
    first_logits: torch.Tensor
    finish_reason: str
    decode_ms: float


class KVSession:
    """One conversation's live KV cache.

    ``prepare(messages)`` brings the cache to the rendered prompt of ``messages``: an append-only
    turn prefills only the new tokens (an identical one none); an edit anywhere in the history
    is repaired under the session's :class:`RepairPolicy` (Shift + budgeted Semantic-Unit
    Refresh by default). Stale rows a sparse repair leaves (after ``exact_rows``) are repaired
    once: later requests keep them unless their policy asks for more (``stale_budget``).
    ``generate()`` then decodes from the live cache and keeps the answer's rows.

    Invariant: ``token_ids`` (one per cached row) always equal the tokenization of the messages
    the session claims to hold, followed by the tokens it generated since.
    """

    def __init__(
        self, model, tokenizer, policy: RepairPolicy | str | None = None, *, tools: list | None = None,
        reforge: ReforgeConfig | None = None, cache_factory: Callable[[Any], Any] | None = None,
        prompt_lookup: int = PROMPT_LOOKUP_TOKENS, batcher=None,
    ):
        """Args:
            model: a transformers causal LM (eval mode); tokenizer: its tokenizer, with a chat template.
            policy: RepairPolicy or label (``"sur@5"`` default). ``reforge``: CacheReforge settings.
            tools: OpenAI-format tools (or typed Python functions with docstrings) the prompt
                offers: rendered by the chat template when it uses ``tools``, otherwise folded
                into the system message (``prompt.render_text``). Settable later (``session.tools``).
            cache_factory: ``config -> Cache`` for the empty cache (default: a DynamicCache laid
                out for the config), e.g. ``lambda c: QuantizedCache("fp8", c)``. A cache whose
                layers are not plain tensors is never spliced: edits re-prefill (reported).
            prompt_lookup: greedy decoding checks up to this many draft tokens per forward,
                copied from what followed the answer's last tokens earlier in the conversation
                (:mod:`kvmemory.lookup`; the same answer, fewer forwards when the answer repeats
                its context); 0 decodes one token per forward. Settable later.
            batcher: a :class:`~kvmemory.engine.batching.DecodeBatcher` shared by sessions of this
                model (``decode_batcher(model)``): their decode steps (a token and its draft) run in
                one kernel call when they decode at the same time, each answer bit for bit its
                answer alone (same thread count). None: every step alone.

        Raises:
            InputTypeError: ``model`` has no transformers config or ``tokenizer`` cannot render chats.
            InputError: the tokenizer has no chat template (base models), or a bad policy label,
                or ``prompt_lookup`` not an int >= 0.
            InputTypeError / InputError: malformed ``tools`` (see ``prompt.normalize_tools``).
        """
        _check_model_and_tokenizer(model, tokenizer)
        self.prompt_lookup = prompt_lookup
        self.batcher = batcher
        self._open_stream = None  # weak reference to the stream_tokens generator last handed out
        self.model = model
        self.tokenizer = tokenizer
        self.cache_factory = cache_factory or kvcache.new_cache
        self.policy = RepairPolicy.coerce(policy) if policy is not None else RepairPolicy()
        self.tools = tools
        self.capabilities = model_capabilities(model.config)  # static facts, reported to callers
        self._shifter = self._make_shifter()
        self.max_context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        # CacheReforge: per-layer adapter anchors + boundary states (inert without LoRA layers)
        self.reforge = ReforgeState(model, reforge)
        self.pending_erasures: list[str] = []  # ids strictly erased here, not yet purged from a store
        # CacheReforge maintenance since the last prepare's report (e.g. by OnlineAdapter.update), and
        # why the cache lost rows it would have held (a failed maintenance dropped it, or the thread's
        # stored cache could not be restored, see note_lost_reuse): the next report says so
        self._unreported_maintenance = None
        self._dropped_reason: str | None = None
        self.reset()

    @property
    def prompt_lookup(self) -> int:
        """Draft tokens greedy decoding checks per forward (0: one token per forward)."""
        return self._prompt_lookup

    @prompt_lookup.setter
    def prompt_lookup(self, tokens: int) -> None:
        self._prompt_lookup = checked_prompt_lookup(tokens)

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The OpenAI-format tools every rendering of this conversation offers (None: none)."""
        return self._tools

    @tools.setter
    def tools(self, tools) -> None:
        self._tools = normalize_tools(tools)

    def _make_shifter(self) -> RotaryShifter | None:
        try:
            return RotaryShifter(self.model)
        except ShiftUnsupportedError:
            return None

    # ----------------------------------------------------------------- state
    def reset(self) -> None:
        """Forget everything (the next ``prepare`` re-prefills)."""
        if getattr(self, "_open_stream", None) is not None:  # it must not append to the new state later
            self.settle_stream()
        self.cache = self._new_cache()
        self.token_ids: list[int] = []
        self.exact_rows = 0  # leading rows equal to a Re-prefill; rows after it are stale
        # budget b (%) the stale rows were repaired under (the smallest, over several edits; 0 when
        # unknown): a request whose policy asks no more keeps them as they are
        self.stale_budget = 0.0
        self.rendered: RenderedPrompt | None = None
        self.next_logits: torch.Tensor | None = None
        # while a stream is suspended: draft tokens whose rows follow the answered ids, and the
        # logits after each of them ([k, vocab]); None otherwise
        self._draft: tuple[list[int], torch.Tensor] | None = None
        # fp32 logits after the last cached row, keyed by _rows_key(): they survive an answer's end
        # (its end-of-turn token is never cached), so that an identical request needs no forward
        self._row_logits: tuple[tuple, torch.Tensor] | None = None
        self.last_report: RepairReport | None = None
        self._replay_margin = 0.0  # the last prepare's policy.replay_margin (decode-time Replay)
        self.answer_committed = False  # rendered holds the last answer as a message (no generation prompt)
        # sliding-window layers only: their rows at the last prompt's end (window_checkpoint.py)
        self._window_checkpoint: window_checkpoint.WindowCheckpoint | None = None
        self.reforge.reset()

    def restore(self, state, *, rendered: RenderedPrompt | None) -> None:
        """Replace what the session holds with an exported state (``persistence.CacheState``,
        already checked against this model by ``persistence.import_state``): its K/V layers, token ids,
        exact rows, stale budget, pending logits, tools and per-layer adapter versions;
        ``rendered``: its messages rendered with this session's tokenizer (None: no messages)."""
        device = next(self.model.parameters()).device
        self.reset()
        self._unreported_maintenance = self._dropped_reason = None  # about the replaced cache
        self.tools = state.tools
        self.cache = kvcache.from_tensors([(k.to(device), v.to(device)) for k, v in state.layers])
        self.token_ids = list(state.token_ids)
        self.exact_rows = min(state.exact_rows, len(state.token_ids))
        self.stale_budget = state.stale_budget if self.exact_rows < len(state.token_ids) else 0.0
        self.rendered = rendered
        self.next_logits = None if state.next_logits is None else state.next_logits.to(device)
        self.answer_committed = state.answer_committed
        self.reforge.restore_versions(state.adapter_versions)

    def _new_cache(self):
        return self.cache_factory(self.model.config)

    @property
    def messages(self) -> list[ChatMessage]:
        """The messages whose rendered prompt the cache holds (empty before the first prepare)."""
        return list(self.rendered.messages) if self.rendered else []

    @property
    def state_version(self) -> tuple:
        """A value that changes whenever the cache changes (for persistence: is the stored copy
        still this state?). A repair or prefill builds a new rendering, decoding adds token ids,
        an import replaces the cache object, CacheReforge maintenance rewrites layers in place
        under a new adapter version. Only equality between two reads is meaningful."""
        return (id(self.cache), len(self.token_ids), self.exact_rows, id(self.rendered),
                self.next_logits is None, tuple(self.reforge.anchors.layer_versions), self.reforge.logits_version)

    @property
    def memory_bytes(self) -> int:
        """Bytes held for this conversation: the cache's storage (K/V rows; for a quantized cache
        its packed payload, scales and residual buffer, see :func:`kvcache.cache_nbytes`) plus
        CacheReforge's retained boundary states (hidden states ``[1, N, hidden]`` per restart
        layer; 0 without LoRA layers), plus a sliding-window checkpoint's rows (0 without one)."""
        checkpoint = self._window_checkpoint.nbytes if self._window_checkpoint is not None else 0
        return kvcache.cache_nbytes(self.cache) + self.reforge.boundary_bytes + checkpoint

    def fork(self) -> "KVSession":
        """An independent copy (cache cloned) sharing the model, e.g. to try several repairs."""
        self.settle_stream()
        other = object.__new__(KVSession)
        other.__dict__.update(self.__dict__)
        other.cache = kvcache.clone_cache(self.cache)
        other.token_ids = list(self.token_ids)
        other.next_logits = None if self.next_logits is None else self.next_logits.clone()
        other._row_logits = None if self._row_logits is None else (self._row_logits[0], self._row_logits[1].clone())
        other.reforge = self.reforge.clone()
        other.pending_erasures = list(self.pending_erasures)
        other.last_report = None if self.last_report is None else dataclasses.replace(self.last_report)
        return other

    # --------------------------------------------------------------- prepare
    def prepare(
        self, messages: Sequence[Mapping[str, Any] | ChatMessage], *, policy: RepairPolicy | None = None,
        erase: str | None = None, tools: Any = KEEP_TOOLS, rendered: RenderedPrompt | None = None,
    ) -> RepairReport:
        """Bring the cache to ``messages`` (rendered with the chat template + generation prompt).

        Args:
            messages: ``[{"role", "content", "id"?}, ...]``; ids let edits be recognised as
                replacements; without ids, messages match by role and content.
            policy: overrides the session policy for this call: a RepairPolicy or a label such
                as ``"sur@5"``, ``"shift"``, ``"replay"``, ``"reprefill"``, ``"dirty"``;
                ``"reprefill:always"`` re-prefills the whole prompt even without an edit.
            tools: the tools this and later renderings offer (as in the constructor; None: no
                tools); omitted: the session's tools stay.
            rendered: ``messages`` already rendered and tokenized with those tools, e.g. by
                ``prompt.render_prompt(..., segments=False)`` to pick a cache first: used instead
                of rendering them again; ignored when the messages to render differ from its
                ``messages`` (``dirty`` adds the held ones).

        Returns:
            RepairReport (tokens reused / recomputed, operator, budget, latency ms, fallback).

        Raises:
            MessageError: malformed messages or an empty list.
            ContextOverflowError: the prompt does not fit the model's context (checked after
                tokenizing, before any forward).
            InputError / InputTypeError: an invalid policy or policy label.
            ValueError: ``erase`` is not ``"strict"`` / ``"none"``, or strict erase with ``dirty``.
        The session is unchanged when an error is raised before repair starts; if the repair
        itself fails, the session resets (the next call re-prefills) and the error propagates.
        A suspended stream is closed first (see :meth:`stream_tokens`).
        """
        t0 = time.perf_counter()
        self.settle_stream()
        if tools is not KEEP_TOOLS:
            self.tools = tools
        request = self._plan(messages, policy, erase, rendered)  # plan -> repair -> apply
        with share_cores():  # threads from the cores other processes and calls leave free
            return self._apply(request, self._repair(request), t0)

    def note_lost_reuse(self, reason: str) -> None:
        """Record why this session holds less than the thread's stored state (e.g. its stored
        cache could not be restored): the next :meth:`prepare` reports it once in
        ``RepairReport.fallback``. A reason already pending stays; :meth:`restore` clears it."""
        if reason and not self._dropped_reason:
            self._dropped_reason = reason

    def _plan(self, messages, policy: RepairPolicy | str | None, erase: str | None,
              rendered: RenderedPrompt | None) -> _RequestPlan:
        """Plan: render ``messages``, diff them against the held rendering (the EditPlan) and
        decide the operator (strict erase replays, ``dirty`` keeps the held messages). The cache
        changes only by CacheReforge maintenance due first, or by a sliding-window checkpoint
        restored (an exact state of the last prompt). Raises what :meth:`prepare` raises before
        the repair starts."""
        policy = RepairPolicy.coerce(policy) if policy is not None else self.policy
        check_policy_fits(policy, self.model)
        new_messages = normalize_messages(messages)
        erased = self._erased_keys(new_messages, erase if erase is not None else policy.erase, policy)
        if erased and policy.operator != "reprefill":
            policy = policy.model_copy(update={"operator": "replay"})  # nothing after the edit point is reused
        if policy.operator == "dirty" and self.rendered is not None:
            new_messages = self._dirty_messages(new_messages)
        new, template_fallback = self._render(new_messages, rendered=rendered)
        self._check_fits(len(new))
        adapter = self._sync_adapter(recover=True)  # an adapter update first: it may leave rows stale (exact_rows)
        maintenance, dropped = self._unreported_maintenance, self._dropped_reason
        self._unreported_maintenance = self._dropped_reason = None
        restored = self._restore_window_checkpoint(new.token_ids, adapter) if not erased else None
        old = self.rendered if template_fallback is None else None
        plan = plan_edits(self.token_ids, old, new, self.exact_rows, self._kept_rows(policy))
        query = new_messages[-1].content
        job = RepairJob(
            model=self.model,
            # longrope's factor set depends on the largest position, so check per call
            capabilities=model_capabilities(self.model.config, max(len(self.token_ids), len(new)) - 1),
            shifter=self._shifter, cache=self.cache, cached_ids=self.token_ids, new=new, plan=plan, policy=policy,
            query_ids=self.tokenizer(query, add_special_tokens=False)["input_ids"] or list(new.token_ids[-1:]),
            query_text=query,
            new_cache=self._new_cache,
            last_logits=None if erased else self._logits_after_cache(),
            calibration_ids=lambda: self.tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"],
        )
        return _RequestPlan(job, erased, adapter, template_fallback, maintenance, dropped, restored)

    def _restore_window_checkpoint(self, new_ids, adapter) -> str | None:
        """Give the cache back the rows it held at the last prompt's end when ``new_ids`` drop rows
        after it that sliding-window layers have evicted (an identical repeat after an answer past
        the window, an answer rendered differently from its decoded tokens): the repair then only
        extends that prompt. Returns the report's note, or None when no checkpoint serves."""
        checkpoint = self._window_checkpoint
        if not window_checkpoint.restorable(checkpoint, self.token_ids, new_ids) or (
                checkpoint.versions != self._rows_key()[1:]):  # rows computed under another adapter
            return None
        window_checkpoint.restore(self.cache, checkpoint)
        del self.token_ids[checkpoint.rows:]
        self.exact_rows, self.rendered = min(self.exact_rows, checkpoint.exact_rows), checkpoint.rendered
        self.reforge.commit([], source_rows=None, rows=checkpoint.rows, recomputed_all=False, current=adapter)
        self.next_logits, self.answer_committed = checkpoint.logits.clone(), False
        self._row_logits = (self._rows_key(), self.next_logits)
        return (f"sliding-window checkpoint: the rows after token {checkpoint.rows} were dropped by restoring the "
                f"window layers' rows at that prompt's end ({checkpoint.nbytes / 2**20:.1f} MiB kept), not re-prefilled")

    def _repair(self, request: _RequestPlan) -> _RepairRun:
        """Repair: run the branch the plan chose (strict erase first overwrites the rows it
        recomputes). A failed repair resets the session (the next call re-prefills) and re-raises."""
        job = request.job
        scrubbed = self._overwrite_from(min(job.plan.exact_prefix, len(job.new) - 1)) if request.erased else None
        try:
            with self.reforge.recording() as captures:
                result = repair(job)
        except Exception:
            self.reset()
            raise
        return _RepairRun(result, captures, scrubbed)

    def _apply(self, request: _RequestPlan, run: _RepairRun, t0: float) -> RepairReport:
        """Apply: hold the repaired cache with its ids, messages and CacheReforge boundary states,
        and complete the report."""
        job, result = request.job, run.result
        report = result.report
        kept = torch.arange(report.reused_tokens) if request.erased else job.plan.source_rows()
        self.reforge.commit(run.captures, source_rows=kept, rows=len(job.new), recomputed_all=report.reused_tokens == 0,
                            current=request.adapter)
        if request.erased:
            self.pending_erasures.extend(k for k in request.erased if k not in self.pending_erasures)
        self._complete_report(report, request, run.scrubbed, t0)
        self._record_stale_budget(job.plan, job.policy, result.exact_rows, len(job.new))
        self.cache, self.token_ids, self.rendered = result.cache, list(job.new.token_ids), job.new
        self.next_logits, self.exact_rows = result.next_logits, result.exact_rows
        self._row_logits = (self._rows_key(), result.next_logits)
        self.last_report, self.answer_committed = report, False
        self._window_checkpoint = window_checkpoint.take(self.cache, self.token_ids, self.next_logits, self.exact_rows,
                                                         self.rendered, self._rows_key()[1:])
        self._replay_margin = job.policy.replay_margin
        return report

    def _complete_report(self, report: RepairReport, request: _RequestPlan, scrubbed: dict[str, int] | None,
                         t0: float) -> None:
        """The report's session entries (their only writer): strict erase, CacheReforge
        maintenance, engine and the whole call's latency; the session's fallbacks follow the
        repair's."""
        if request.erased:
            report.erased = {"mode": "strict", "messages": request.erased, "from_row": report.reused_tokens,
                             "rows_recomputed": report.recomputed_tokens, **scrubbed}
        if request.job.plan.common_prefix < len(request.job.cached_ids):  # only an edit loses segment reuse
            report.note_fallback(request.template_fallback)
        if request.maintenance is not None:  # CacheReforge moved the cache to a new adapter since the last report
            report.adapter = request.maintenance.as_dict()
            report.note_fallback(request.maintenance.fallback)
        report.note_fallback(request.dropped)  # the cache was dropped or not restored: this call recomputed it
        if request.restored:
            report.capability_notes.append(request.restored)
        report.engine = engine_status(self.model).as_dict()
        report.latency_ms = (time.perf_counter() - t0) * 1000.0 + report.replayed_probe_ms  # rendering and planning included
        if report.fallback:
            log.warning("kvmemory: exact recomputation instead of %s: %s", request.job.policy.label, report.fallback)

    def _kept_rows(self, policy: RepairPolicy) -> int:
        """Leading cached rows this request keeps without repair: all of them when the stale rows
        (after ``exact_rows``) were already repaired under a budget the policy does not exceed
        (their allowance belonged to the edit that made them stale); only the exact rows when
        the policy asks for more (a higher budget, or Replay / Re-prefill, which make every row
        exact), so that the stale rows join this repair's suffix again."""
        if policy.needs_exact or (policy.operator != "dirty" and policy.effective_budget > self.stale_budget):
            return self.exact_rows
        return len(self.token_ids)

    def _record_stale_budget(self, plan, policy: RepairPolicy, exact_rows: int, rows: int) -> None:
        """Remember the budget the stale rows are now repaired under: this policy's when it
        charged an allowance (on its own suffix, or on every stale row); unchanged when stale rows
        were only kept."""
        if exact_rows >= rows:
            self.stale_budget = 0.0
        elif plan.stale_tokens or not plan.kept_stale_tokens:
            self.stale_budget = policy.effective_budget

    def _logits_after_cache(self) -> torch.Tensor | None:
        """fp32 ``[vocab]`` logits predicting the token after the last cached row, when known:
        the pending ``next_logits``, or those kept when the last answer ended."""
        if self.next_logits is not None:
            return self.next_logits
        if self._row_logits is not None and self._row_logits[0] == self._rows_key():
            return self._row_logits[1]
        return None

    def _rows_key(self) -> tuple:
        """Changes whenever the cached rows may have: their count, and the adapter versions
        CacheReforge records (its maintenance rewrites rows and only updates ``next_logits``)."""
        return len(self.token_ids), self.reforge.logits_version, tuple(self.reforge.anchors.layer_versions)

    def _render(self, messages: list[ChatMessage], previous="session",
                rendered: RenderedPrompt | None = None) -> tuple[RenderedPrompt, str | None]:
        """Render with segments, from ``rendered`` when it holds these messages (tokenized with
        the session's tools); on a template that rewrites history, tokens only (+ the reason)."""
        previous = self.rendered if previous == "session" else previous
        if rendered is None or rendered.messages != tuple(messages):
            rendered = render_prompt(self.tokenizer, messages, tools=self.tools, previous=previous,
                                     segments=False)
        try:
            return segment_prompt(self.tokenizer, rendered, tools=self.tools, previous=previous), None
        except TemplateError as exc:
            return rendered, str(exc)  # no stable message spans: reuse only the exact common token prefix

    def _erased_keys(self, new_messages: list[ChatMessage], erase: str, policy: RepairPolicy) -> list[str]:
        """Ids of held messages that ``new_messages`` delete or replace, under strict erase
        (empty otherwise). Raises ValueError for an unknown mode or strict erase with ``dirty``."""
        if erase not in ("none", "strict"):
            raise ValueError(f"erase must be 'strict' or 'none' (got {erase!r})")
        if erase == "none" or self.rendered is None:
            return []
        new = {m.key: m.content_hash for m in new_messages}
        erased = [m.key for m in self.messages if new.get(m.key) != m.content_hash]
        if erased and policy.operator == "dirty":
            raise ValueError("erase='strict' recomputes what the deleted text influenced; the 'dirty' reference "
                             "keeps it by design: use another operator or erase='none'")
        return erased

    def _overwrite_from(self, start: int) -> dict[str, int]:
        """Zero the cached K/V rows ``[start, N)`` and the retained CacheReforge boundary rows
        from ``start`` in place, so no copy of a state derived from erased text stays in memory
        (the repair then recomputes them). A cache whose rows are not plain tensors (quantized)
        is zeroed whole; the repair's cache gate then re-prefills it into a fresh cache of the
        same kind and reports that in ``RepairReport.fallback``. Returns the row counts overwritten."""
        rows = kvcache.overwrite_rows_from(self.cache, start)
        return {"rows_overwritten": rows, "boundary_rows_overwritten": self.reforge.overwrite_rows_from(start)}

    def _dirty_messages(self, new_messages: list[ChatMessage]) -> list[ChatMessage]:
        """Dirty reference: the cached messages unedited, plus the genuinely new ones."""
        old = self.messages
        old_keys = {m.key for m in old}
        return old + [m for m in new_messages if m.key not in old_keys]

    def _check_fits(self, prompt_tokens: int, answer_tokens: int = 1) -> None:
        if self.max_context and prompt_tokens + answer_tokens > self.max_context:
            raise ContextOverflowError(
                f"the prompt has {prompt_tokens} tokens and the model's context is {self.max_context}: "
                "remove or summarise older messages (kvmemory repairs the cache after the edit) or use a "
                "model with a longer context"
            )

    # ------------------------------------------------------- edits by id
    def _index_of(self, key: str) -> int:
        for i, m in enumerate(self.messages):
            if m.key == key:
                return i
        known = ", ".join(repr(m.key) for m in self.messages) or "none (call prepare first)"
        raise UnknownMessageError(f"no message with id {key!r} in this session; known ids: {known}")

    def delete_message(self, key: str, *, policy: RepairPolicy | None = None, erase: str | None = None) -> RepairReport:
        """Delete the message with id ``key`` and repair (``erase="strict"``: see :meth:`prepare`).
        Raises UnknownMessageError."""
        msgs = self.messages
        del msgs[self._index_of(key)]
        return self.prepare(msgs, policy=policy, erase=erase)

    def replace_message(
        self, key: str, content: str, *, policy: RepairPolicy | None = None, erase: str | None = None
    ) -> RepairReport:
        """Give message ``key`` new content (same id) and repair (``erase="strict"`` erases the
        old content: see :meth:`prepare`). Raises UnknownMessageError."""
        msgs = self.messages
        i = self._index_of(key)
        old = msgs[i]
        msgs[i] = {"role": old.role, "content": content, "id": old.key, **old.extra}
        return self.prepare(msgs, policy=policy, erase=erase)

    def defer_erasures(self, message_ids) -> None:
        """Keep strictly erased ``message_ids`` until a checkpoint store takes them (no store
        purged them yet)."""
        self.pending_erasures.extend(k for k in message_ids if k not in self.pending_erasures)

    def take_erasures(self) -> list[str]:
        """Return and clear the ids strictly erased from this cache that a checkpoint store has
        not purged yet (see ``KVCheckpointSaver.erase_messages``)."""
        taken, self.pending_erasures = self.pending_erasures, []
        return taken

    def insert_message(
        self, before_key: str, message: Mapping[str, Any], *, policy: RepairPolicy | None = None
    ) -> RepairReport:
        """Insert ``message`` before message ``before_key`` and repair. Raises UnknownMessageError."""
        msgs: list = self.messages
        msgs.insert(self._index_of(before_key), message)
        return self.prepare(msgs, policy=policy)

    # -------------------------------------------------------------- decode
    def generate(
        self,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        logits_processor: LogitsProcessor | None = None,
        prompt_lookup: int | None = None,
    ) -> Generation:
        """Decode an answer from the live cache (greedy unless ``temperature`` > 0).

        Stops at an end-of-turn token or after ``max_new_tokens``. The answer's rows stay in the
        cache, so the next turn that includes this answer reuses them. After a ``length`` stop,
        calling ``generate`` again continues the same answer. ``logits_processor`` follows the
        transformers ``LogitsProcessor`` call convention, ``prompt_lookup`` overrides the
        session's draft length (see :meth:`stream_tokens`).
        Greedy answers after a repair whose policy sets ``replay_margin`` replay the stale rows
        exactly at the first pick with a thinner top-1/top-2 margin (``last_report.decode_replay``;
        see :class:`~kvmemory.policy.RepairPolicy`).

        Raises:
            InputError / InputTypeError: ``max_new_tokens`` not an int >= 1, ``temperature`` not a
                finite number >= 0, ``seed`` not an int, ``logits_processor`` not callable.
            RuntimeError: nothing to continue: no ``prepare`` yet, or the answer already ended
                with an end-of-turn token (call ``prepare`` with the next messages).
            ContextOverflowError: no room left in the model's context.
        """
        t0 = time.perf_counter()
        if self.next_logits is not None:
            self._sync_adapter()  # the first-token logits below must be the maintained ones
        first = self.next_logits
        tokens = self.stream_tokens(max_new_tokens, temperature=temperature, seed=seed,
                                    logits_processor=logits_processor, prompt_lookup=prompt_lookup)
        out = list(tokens)
        reason = "length" if self.next_logits is not None else "stop"
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        return Generation(text, out, first, reason, (time.perf_counter() - t0) * 1000.0)

    def stream_tokens(
        self,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        logits_processor: LogitsProcessor | None = None,
        prompt_lookup: int | None = None,
    ) -> Iterator[int]:
        """Decode from the live cache, yielding each answer token id as soon as it is picked.

        A yielded token's row is computed when the iteration resumes or is closed, so a streamed
        chunk never waits for a forward pass. The session is consistent whenever the iterator is
        not suspended: closing it early leaves the answer so far in the cache (the last yielded
        token included) with its next-token logits pending (like a ``length`` stop). A stream left
        suspended (a ``for`` loop left with ``break``) is closed that way by the session's next
        ``prepare``, ``stream_tokens``, ``generate``, ``fork`` or ``check_invariants``. After an
        end-of-turn token, ``next_logits`` is None.

        Args:
            logits_processor: called as ``processor(input_ids, scores)`` before each pick, with
                ``input_ids`` LongTensor ``[1, L]`` (the cached ids, last = the token picked
                before) and ``scores`` fp32 ``[1, vocab]``; returns the scores to pick from
                (e.g. ``xgrammar.contrib.hf.LogitsProcessor`` for constrained decoding). It is
                called once per picked token, in order, with or without prompt lookup.
            prompt_lookup: draft tokens checked per greedy forward (default: the session's
                ``prompt_lookup``; 0: one token per forward). Greedy only: sampling always
                decodes one token per forward. Caches whose rows cannot always be dropped again
                (quantized or sliding-window layers) decode one token per forward too.

        Raises:
            ValueError, RuntimeError, ContextOverflowError: as :meth:`generate`, when the
                iteration starts.
        """
        self.settle_stream()
        stream = self._decode(max_new_tokens, temperature, seed, logits_processor, prompt_lookup)
        self._open_stream = weakref.ref(stream)
        return stream

    def settle_stream(self) -> None:
        """Close this session's suspended stream, if any (its last yielded token gets its row, the
        rows of an unchecked draft are dropped): the cache then holds exactly the streamed answer."""
        stream = self._open_stream() if self._open_stream is not None else None
        self._open_stream = None
        if stream is not None and not stream.gi_running:
            stream.close()

    def _decode(self, max_new_tokens, temperature, seed, logits_processor, prompt_lookup) -> Iterator[int]:
        """:meth:`stream_tokens`' generator (checks run when the iteration starts)."""
        _check_decoding(max_new_tokens, temperature, seed, logits_processor)
        lookup = self.prompt_lookup if prompt_lookup is None else checked_prompt_lookup(prompt_lookup)
        if self.next_logits is None:
            raise RuntimeError("call prepare(messages) before generate(): the cache has no pending prompt")
        self._check_fits(len(self.token_ids))
        stop_ids = self.stop_token_ids()
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        limit = min(max_new_tokens, (self.max_context or 1 << 30) - len(self.token_ids))
        capacity = len(self.token_ids) + limit + ANSWER_END_ROWS
        adapter = self._sync_adapter()  # an adapter update since the last call is repaired first
        drafting = temperature <= 0 and lookup > 0 and kvcache.plain_layers(self.cache)
        self._draft = None
        # the cached ids and the answer so far, grown in place: no per-token copy of the history
        # for the logits processor's input_ids or the draft lookup (~0.4 ms a token at 2 K ids)
        history = torch.empty(len(self.token_ids) + limit + 1, dtype=torch.long)
        history[:len(self.token_ids)] = torch.tensor(self.token_ids, dtype=torch.long)
        batching = self.batcher.decoding() if self.batcher is not None else contextlib.nullcontext()
        with batching:
            yield from self._decode_steps(limit, stop_ids, adapter, capacity, history, lookup if drafting else 0,
                                          temperature, generator, logits_processor)

    def _decode_steps(self, limit: int, stop_ids, adapter, capacity: int, history: torch.Tensor, lookup: int,
                      temperature: float, generator, logits_processor) -> Iterator[int]:
        """The decode loop of :meth:`_decode` (``lookup``: draft tokens per forward, 0: none)."""
        try:
            for emitted in range(1, limit + 1):
                with share_cores():  # each step's torch work too, not only its forward
                    token = self._next_token(adapter, capacity, emitted, history, temperature, generator,
                                             logits_processor)
                n = len(self.token_ids)
                if token in stop_ids:
                    self.next_logits = None
                    return
                history[n] = token
                try:
                    yield token  # leaves as soon as it is picked; its row is computed on resume or close
                except BaseException:  # closed (or thrown into): settle on this token, no new draft
                    self._append_token(token, adapter, capacity, draft_tokens=0)
                    raise
                with share_cores():
                    self._append_token(token, adapter, capacity, draft_tokens=min(lookup, limit - emitted),
                                       history=history[:n + 1].numpy())
        finally:
            self._drop_draft(adapter)

    def _next_token(self, adapter, capacity: int, emitted: int, history: torch.Tensor, temperature: float,
                    generator, logits_processor) -> int:
        """The token picked from the pending logits (after decode-time Replay when due and the
        logits processor)."""
        margin = self._thin_margin() if temperature <= 0 else None
        if margin is not None:
            self._replay_stale(adapter, capacity, answered=emitted - 1, margin=margin)
        n = len(self.token_ids)
        logits = self.next_logits
        if logits_processor is not None:
            logits = logits_processor(history[None, :n].clone(), logits[None].clone())[0]
        return _pick(logits, temperature, generator)

    def _thin_margin(self) -> float | None:
        """The pending pick's top-1/top-2 logit margin (nats, before any logits processor) when
        decode-time Replay is due: stale rows remain and it is below the policy's
        ``replay_margin``; None otherwise."""
        if self._replay_margin <= 0 or self.exact_rows >= len(self.token_ids):
            return None
        top = torch.topk(self.next_logits.float(), 2).values
        margin = float(top[0] - top[1])
        return margin if margin < self._replay_margin else None

    def _replay_stale(self, adapter, capacity: int, answered: int, margin: float) -> None:
        """Recompute every row after ``exact_rows`` (the stale suffix and the answer so far) in one
        forward from the exact prefix, as Replay would, and take the exact next-token logits.
        Recorded in ``last_report.decode_replay`` and ``fallback``. A cache whose rows cannot be
        dropped keeps its rows (decode-time Replay is then off for this answer)."""
        t0 = time.perf_counter()
        start = self.exact_rows
        tail = self.token_ids[start:]
        self._drop_draft(adapter)
        try:
            self._drop_rows_from(start, adapter)
        except ValueError:
            self._replay_margin = 0.0
            return
        logits = self._forward_tracked(torch.tensor(tail), adapter, capacity)
        self.token_ids.extend(tail)
        self.exact_rows, self.stale_budget = len(self.token_ids), 0.0
        self.next_logits = logits
        entry = {"at_token": answered, "margin": margin, "replay_margin": self._replay_margin,
                 "recomputed_tokens": len(tail), "ms": (time.perf_counter() - t0) * 1000.0}
        reason = (f"decode margin {margin:.3g} < {self._replay_margin:g} nats at answer token {answered}: "
                  f"Replay of the {len(tail)} stale and answer rows")
        log.warning("kvmemory: exact recomputation during decoding: %s", reason)
        if self.last_report is not None:
            self.last_report.decode_replay = entry
            self.last_report.note_fallback(reason)

    def _append_token(self, token: int, adapter, capacity: int, draft_tokens: int = 0, history=None) -> None:
        """Give ``token`` (just picked) its cache row and set ``next_logits`` to the logits after it.
        Its row is already there when it equals the next token of the pending draft (checked in
        the last forward); otherwise the draft's rows are dropped and ``token`` is forwarded with
        up to ``draft_tokens`` new draft tokens (:func:`kvmemory.lookup.propose`), whose rows and
        logits are kept pending until the next picks accept or reject them. ``history``: the ids
        up to and including ``token`` (an int64 array), where the draft is looked up; needed when
        ``draft_tokens`` > 0."""
        draft = self._draft
        if draft is not None and draft[0] and draft[0][0] == token:
            tokens, logits = draft
            self._draft = (tokens[1:], logits[1:])
            self._accept(token, logits[0])
            return
        self._drop_draft(adapter)
        guess = propose(history, draft_tokens) if draft_tokens else []
        if not guess:
            self._accept(token, self._forward_tracked(torch.tensor([token]), adapter, capacity))
            return
        rows = self._forward_tracked(torch.tensor([token] + guess), adapter, capacity, every_row=True)
        self._draft = (guess, rows[1:])
        self._accept(token, rows[0])

    def _accept(self, token: int, logits: torch.Tensor) -> None:
        """``token``'s row is computed (right after the cached ids): record it as answered."""
        if self.exact_rows == len(self.token_ids):  # a row computed on an exact cache is exact
            self.exact_rows += 1
        self.token_ids.append(token)
        self.next_logits = logits
        self._row_logits = (self._rows_key(), logits)

    def _drop_draft(self, adapter) -> None:
        """Drop the rows of draft tokens no pick accepted (the cache ends at the answered ids)."""
        if self._draft is None:
            return
        self._draft = None
        extra = kvcache.cache_length(self.cache) - len(self.token_ids)
        if extra > 0:
            kvcache.crop_to(self.cache, len(self.token_ids))
            self.reforge.commit([], source_rows=None, rows=len(self.token_ids), recomputed_all=False, current=adapter)

    def _forward_tracked(self, ids: torch.Tensor, adapter, capacity: int | None = None,
                         every_row: bool = False) -> torch.Tensor:
        """Append ``ids`` (LongTensor ``[m]``) to the cache; CacheReforge records the boundary
        states of the new rows (one recording per forward: a suspended stream must not capture
        other sessions' forwards on the shared model). ``capacity``: rows the cache is expected
        to reach (see ``kvmemory.engine.forward_rows``). Returns the fp32 next-token logits
        (``[vocab]``; with ``every_row`` ``[m, vocab]``, row i after input i)."""
        start = len(self.token_ids)
        with self.reforge.recording() as captures:
            if self.batcher is not None:  # a decode step or a short append batches with other threads'
                logits = self.batcher.step(self.cache, ids, start, capacity, every_row=every_row)
            else:
                logits = forward_rows(self.model, self.cache, ids, start, capacity=capacity, every_row=every_row)
        self.reforge.commit(captures, source_rows=None, rows=start + ids.shape[0], recomputed_all=False, current=adapter)
        self._row_logits = ((start + ids.shape[0],) + self._rows_key()[1:], logits[-1] if every_row else logits)
        return logits

    def _sync_adapter(self, *, recover: bool = False):
        """CacheReforge: if the LoRA adapter changed since the cache was computed, maintain the
        cache under ``self.reforge.config`` first. ``recover``: a maintenance that fails leaves
        the cache dropped (see :meth:`maintain`) and the caller re-prefills instead of raising.
        Returns the active AdapterState (None: no LoRA)."""
        current = self.reforge.current()
        if self.reforge.needs_maintenance(current):
            try:
                self.maintain(current=current)
            except Exception:
                if not recover or self.token_ids:  # not a dropped cache: nothing to recompute from
                    raise
        return current

    def maintain(self, *, current=None, policy: str | None = None):
        """CacheReforge maintenance (paper: CacheReforge §Methodology): bring the cache to the
        active adapter ``current`` (default: read from the model) under ``policy`` (default:
        ``self.reforge.config``'s) and apply the result. Runs by itself before the next forward
        after an adapter update; ``OnlineAdapter.update`` runs it for every registered session.

        Returns:
            ReforgeReport (action, layers ``[start, end)``, recompute %, fallback, ms).

        Raises:
            ValueError: an unusable policy (``ReforgeState.usable_policy``); nothing changed.
            Whatever the maintenance itself raises (e.g. out of memory, rows that cannot be
            written in place): the cache may be half rewritten, so it is dropped first (logged;
            the next ``prepare`` re-prefills and reports why in ``RepairReport.fallback``).
        """
        self.reforge.usable_policy(policy)
        view = CacheView(cache=self.cache, token_ids=self.token_ids, cache_factory=self.cache_factory,
                         row_reuse_reason=self.capabilities.row_reuse_reason)
        try:
            maintained = self.reforge.maintain(view, current=current, policy=policy)
        except Exception as exc:
            reason = (f"CacheReforge maintenance failed ({type(exc).__name__}: {exc}): the cache was dropped and "
                      "re-prefilled")
            log.warning("kvmemory: %s", reason)
            self.reset()
            self._dropped_reason = reason
            raise
        self._unreported_maintenance = maintained.report
        self.cache = maintained.cache
        if maintained.exact_rows is not None:
            self.exact_rows = maintained.exact_rows
        if maintained.next_logits is not None and self.next_logits is not None:  # a pending request's
            self.next_logits = maintained.next_logits
        return maintained.report

    @property
    def adapter_versions(self):
        """VersionReport: the adapter version of every cache layer and whether they mix."""
        return self.reforge.version_report()

    def stop_token_ids(self) -> set[int]:
        """Token ids that end an answer (see :func:`stop_token_ids`)."""
        return stop_token_ids(self.model, self.tokenizer)

    def commit_answer(self, answer: Mapping[str, Any]) -> bool:
        """Hold the answer just decoded as a message of its own (e.g. ``{"role": "assistant",
        "content": text, "id": ...}``): forward the end-of-turn text the chat template writes
        after it and make it a segment, so the next turn reuses its rows and a later edit before
        it Shifts them instead of recomputing them as new text.

        The answer may be cut: by ``max_new_tokens`` (its next-token logits pending) or by the
        caller at a stop sequence (``content`` then ends before the last decoded tokens). The
        cached rows are kept up to the longest prefix their ids share with the rendering of the
        held messages plus ``answer``: exactly the rows a Re-prefill of that rendering computes
        (same ids at the same positions). Rows after it (tokens decoded past a stop sequence, a
        cut tail that re-tokenizes differently) are dropped, and the rendering's remaining tokens
        are computed. The answer then counts as ended (``next_logits`` is None).

        Returns:
            True if committed. False (nothing changed) when there is no answer to hold (no
            ``prepare`` yet, or the last answer is already held), the rendering changes the
            rows of a held message (a template that rewrites history around an answer), or rows
            would have to be dropped from a cache whose layers cannot drop rows (quantized):
            the next ``prepare`` then matches the answer's tokens like any new text.
        """
        if self.rendered is None or self.answer_committed:
            return False
        try:
            messages = normalize_messages(list(self.rendered.messages) + [answer])
            new = render_prompt(self.tokenizer, messages, tools=self.tools, generation_prompt=False,
                                previous=self.rendered)
        except (TemplateError, ValueError):
            return False
        kept = min(common_prefix_length(self.token_ids, new.token_ids), len(new))
        # the assistant opener may re-tokenize with the answer's first characters; a held message may not
        held_messages = self.rendered.segments[-1].token_end if self.rendered.segments else len(self.rendered)
        if kept < held_messages:
            return False
        adapter = self._sync_adapter()
        try:
            self._drop_rows_from(kept, adapter)
        except ValueError:  # layers that cannot drop rows: leave the answer to the next prepare
            return False
        exact = self.exact_rows == kept
        if kept < len(new):
            self._forward_tracked(torch.tensor(new.token_ids[kept:]), adapter)
        if exact:
            self.exact_rows = len(new)
        self.token_ids, self.rendered, self.answer_committed = list(new.token_ids), new, True
        self.next_logits = None
        return True

    def _drop_rows_from(self, start: int, adapter) -> None:
        """Drop the cached rows ``[start, N)``: K/V, ids and CacheReforge boundary rows.

        Raises:
            ValueError: the cache has layers that cannot drop rows (nothing changed).
        """
        if start >= len(self.token_ids):
            return
        kvcache.crop_to(self.cache, start)
        del self.token_ids[start:]
        self.exact_rows = min(self.exact_rows, start)
        self.reforge.commit([], source_rows=None, rows=start, recomputed_all=False, current=adapter)
        self.next_logits, self._row_logits = None, None

    def check_invariants(self) -> None:
        """Raise AssertionError unless the cached ids equal the tokenization of the held messages
        (followed by generated tokens) and the cache has one row per id (a suspended stream is
        closed first, see :meth:`stream_tokens`)."""
        self.settle_stream()
        assert kvcache.cache_length(self.cache) == len(self.token_ids), "cache rows != token ids"
        if self.rendered is not None:
            if self.answer_committed:
                fresh = render_prompt(self.tokenizer, list(self.rendered.messages), tools=self.tools,
                                      generation_prompt=False)
            else:
                fresh, _ = self._render(list(self.rendered.messages), previous=None)
            n = len(fresh.token_ids)
            assert tuple(self.token_ids[:n]) == fresh.token_ids, "cached ids differ from the messages' tokenization"


def stop_token_ids(model, tokenizer) -> set[int]:
    """Token ids that end an answer: the model's generation config's and the tokenizer's eos ids."""
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    return ids


def _check_model_and_tokenizer(model, tokenizer) -> None:
    if not hasattr(getattr(model, "config", None), "get_text_config"):
        raise InputTypeError(
            f"model must be a transformers causal LM (got {type(model).__name__}): load one with "
            "kvmemory.load_model(...).model or AutoModelForCausalLM.from_pretrained"
        )
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise InputTypeError(f"tokenizer must be a transformers tokenizer (got {type(tokenizer).__name__})")
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(
            "the tokenizer has no chat template (base models ship none): set tokenizer.chat_template to a Jinja "
            "template (e.g. one from an instruct model of the same family) before creating the session"
        )


def _check_decoding(max_new_tokens, temperature, seed, logits_processor) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool):
        raise InputTypeError(f"max_new_tokens must be an int (got {type(max_new_tokens).__name__})")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise InputTypeError(f"temperature must be a number (got {type(temperature).__name__})")
    if not math.isfinite(temperature) or temperature < 0:
        raise InputError(f"temperature must be a finite number >= 0 (got {temperature}); 0 decodes greedily")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise InputTypeError(f"seed must be an int or None (got {type(seed).__name__})")
    if logits_processor is not None and not callable(logits_processor):
        raise InputTypeError("logits_processor must be callable as processor(input_ids, scores)")


def _pick(logits: torch.Tensor, temperature: float, generator) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
