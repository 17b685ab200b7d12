"""Live caches of many conversation threads: a registry of ``KVSession`` keyed by thread id,
held under a memory budget in bytes with least-recently-used eviction, plus the export / import
of one thread's cache state (for checkpointers that persist it, e.g. as safetensors).

Threads never share K/V tensors: every thread owns its ``DynamicCache``; only the model and the
tokenizer are shared, so one thread's repair cannot touch another thread's rows.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from transformers.cache_utils import DynamicLayer

from . import kvcache
from .errors import CacheStateError, ThreadBusyError
from .policy import RepairPolicy
from .prompt import TemplateError, normalize_messages, render_prompt
from .reforge.versions import LayerAnchors, base_weights_digest
from .session import KVSession

log = logging.getLogger(__name__)

# /2 records the model dtype, a base-weights digest and the per-layer adapter versions; /1 states
# are still read, but never imported (their rows cannot be tied to a model or an adapter version)
STATE_FORMAT = "kvmemory.thread-state/2"
READABLE_FORMATS = ("kvmemory.thread-state/1", STATE_FORMAT)


@dataclass
class CacheState:
    """Everything one thread's live cache holds, detached from the model.

    Attributes:
        token_ids: the N cached token ids (prompt of ``messages`` + tokens generated since).
        messages: the messages the cache holds, as ``{"role", "content", "id", ...extra}``
            dicts (``id`` is the session's key, so anonymous messages keep matching).
        tools: the tool schemas the prompt was rendered with (JSON-able), or None.
        exact_rows: leading rows equal to a Re-prefill; later rows are stale (after Shift/SUR).
        layers: per layer ``(keys, values)``, each ``[1, kv_heads, N, head_dim]``.
        next_logits: fp32 ``[vocab]`` logits of the pending next token, or None when the last
            answer ended (a new ``prepare`` is due).
        model_name: free text naming the model the rows came from (checked on import).
        answer_committed: the last message is an answer held as a message (rendered without a
            generation prompt, see ``KVSession.commit_answer``).
        model_dtype: the model's parameter dtype (``"torch.float32"``), checked on import.
        weights_digest: digest of the model's base weights (``base_weights_digest``), checked
            on import ("" in format-1 states: not importable).
        adapter_versions: the adapter version that produced each cache layer and the pending
            logits (``ReforgeState.export_versions``: digests only, no θ); None in format-1
            states (not importable). Layers whose version differs from the live adapter's are
            recomputed by CacheReforge before the restored cache is used.
        stale_budget: budget b (%) the stale rows (after ``exact_rows``) were repaired under, so
            a restored cache does not spend a later request's allowance on them again (0: unknown).
    """

    token_ids: list[int]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    exact_rows: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    next_logits: torch.Tensor | None = None
    model_name: str = ""
    answer_committed: bool = False
    model_dtype: str = ""
    weights_digest: str = ""
    adapter_versions: dict[str, Any] | None = None
    stale_budget: float = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes of K/V held (what a persisted copy of the rows costs)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``{name: tensor}`` for ``safetensors.torch.save_file``: ``layers.{i}.keys``,
        ``layers.{i}.values`` ``[1, kv_heads, N, head_dim]``, ``token_ids`` int64 ``[N]`` and
        ``next_logits`` ``[vocab]`` when pending. Tensors are made contiguous (not copied otherwise)."""
        out = {"token_ids": torch.tensor(self.token_ids, dtype=torch.long)}
        for i, (k, v) in enumerate(self.layers):
            out[f"layers.{i}.keys"] = k.contiguous()
            out[f"layers.{i}.values"] = v.contiguous()
        if self.next_logits is not None:
            out["next_logits"] = self.next_logits.contiguous()
        return out

    def metadata(self) -> dict[str, str]:
        """String metadata for a safetensors header (messages, tools, exact_rows, model identity,
        adapter versions, format)."""
        return {
            "format": STATE_FORMAT,
            "messages": json.dumps(self.messages, default=str),
            "tools": json.dumps(self.tools, default=str),
            "exact_rows": str(self.exact_rows),
            "model_name": self.model_name,
            "answer_committed": "1" if self.answer_committed else "0",
            "model_dtype": self.model_dtype,
            "weights_digest": self.weights_digest,
            "adapter_versions": json.dumps(self.adapter_versions),
            "stale_budget": repr(self.stale_budget),
        }

    @classmethod
    def from_parts(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> "CacheState":
        """Inverse of :meth:`tensors` + :meth:`metadata` (also reads format-1 states, which then
        carry no model digest or adapter versions and are refused by :func:`import_state`).

        Raises:
            CacheStateError: unknown format, missing tensors, or inconsistent row counts.
        """
        if metadata.get("format") not in READABLE_FORMATS:
            raise CacheStateError(f"not a kvmemory thread state (format {metadata.get('format')!r}, "
                                  f"expected {STATE_FORMAT!r})")
        try:
            token_ids = tensors["token_ids"].tolist()
            n_layers = len([k for k in tensors if k.endswith(".keys")])
            layers = [(tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]) for i in range(n_layers)]
            state = cls(
                token_ids=token_ids,
                messages=json.loads(metadata["messages"]),
                tools=json.loads(metadata["tools"]),
                exact_rows=int(metadata["exact_rows"]),
                layers=layers,
                next_logits=tensors.get("next_logits"),
                model_name=metadata.get("model_name", ""),
                answer_committed=metadata.get("answer_committed") == "1",
                model_dtype=metadata.get("model_dtype", ""),
                weights_digest=metadata.get("weights_digest", ""),
                adapter_versions=json.loads(metadata.get("adapter_versions", "null")),
                stale_budget=float(metadata.get("stale_budget", "0")),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise CacheStateError(f"incomplete thread state ({exc!r}): re-prefill from the messages") from exc
        for k, v in state.layers:
            if k.shape[2] != len(token_ids) or v.shape[2] != len(token_ids):
                raise CacheStateError(f"a layer holds {k.shape[2]} rows for {len(token_ids)} token ids")
        return state


def export_state(session: KVSession, model_name: str = "") -> CacheState:
    """Detached copy of ``session``'s cache state (K/V cloned: later repairs never alter it).

    The state records the model's dtype, its base-weights digest (computed once per model
    object, see ``base_weights_digest``) and the adapter version of every cache layer.

    Raises:
        CacheStateError: the session holds no rows yet (nothing to export), its cache has
            sliding-window or quantized layers (capability gate: restored threads re-prefill), or
            its layers carry no adapter versions.
    """
    if not session.token_ids:
        raise CacheStateError("the session holds no cache rows yet: nothing to export")
    odd = sorted({type(layer).__name__ for layer in session.cache.layers if type(layer) is not DynamicLayer})
    if odd:  # capability gate: a sliding or quantized layer does not show every row in keys/values
        raise CacheStateError(f"the cache has {', '.join(odd)} layers, which a state cannot hold row for row: "
                              "the thread re-prefills from its messages after a restore (exact)")
    versions = session.reforge.export_versions()
    if versions is None:
        raise CacheStateError("the cache's layers carry no adapter versions: a restore could not tell which "
                              "adapter computed them; the thread re-prefills from its messages after a restore")
    held = [{"role": m.role, "content": m.content, "id": m.key, **m.extra} for m in session.messages]
    return CacheState(
        token_ids=list(session.token_ids),
        messages=held,
        tools=session.tools,
        exact_rows=session.exact_rows,
        layers=[(k.clone(), v.clone()) for k, v in kvcache.layer_tensors(session.cache)],
        next_logits=None if session.next_logits is None else session.next_logits.clone(),
        model_name=model_name,
        answer_committed=session.answer_committed,
        model_dtype=str(_model_dtype(session.model)),
        weights_digest=base_weights_digest(session.model),
        adapter_versions=versions,
        stale_budget=session.stale_budget,
    )


def import_state(session: KVSession, state: CacheState) -> None:
    """Load ``state`` into ``session`` (replacing what it held); the next ``prepare`` reuses it.

    The messages are re-rendered with the session's tokenizer and their tokenization must be
    the prefix of ``state.token_ids``, so a state can never claim rows for other text. The
    cache layers keep the adapter versions they were computed under: if the live adapter
    differs (e.g. new weights loaded under the same adapter name), the next ``prepare`` /
    ``generate`` recomputes the affected layers exactly first (CacheReforge, reported in
    ``session.reforge.last_report``).

    Raises:
        CacheStateError: layer count, K/V shapes or dtype differ from the model's cache layout;
            the state was computed by other base weights (weights digest) or another dtype; it
            records no adapter versions (format 1) or malformed ones; or the token ids are not
            the rendering of the stored messages. The session is unchanged then.
    """
    _check_layout(session, state)
    _check_identity(session, state)
    rendered = None
    if state.messages:
        try:
            messages = normalize_messages(state.messages)
            rendered = render_prompt(session.tokenizer, messages, tools=state.tools,
                                     generation_prompt=not state.answer_committed)
        except (TemplateError, ValueError) as exc:
            raise CacheStateError(f"stored messages do not render ({exc})") from exc
        if tuple(state.token_ids[: len(rendered)]) != rendered.token_ids:
            raise CacheStateError("stored token ids are not the tokenization of the stored messages "
                                  "(different tokenizer or chat template?): re-prefill from the messages")
    session.restore(state, rendered=rendered)
    stale = session.reforge.version_report().stale_layers
    if stale:
        log.info("kvmemory: the restored cache's layers %s were computed under another adapter version than the "
                 "live one: CacheReforge recomputes them before the cache is used", stale)


def _model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def _check_identity(session: KVSession, state: CacheState) -> None:
    """The state must come from this model (dtype, base-weights digest) and say which adapter
    version computed each layer."""
    if not state.weights_digest or state.adapter_versions is None:
        raise CacheStateError("the state records no model weights digest or adapter versions (an older format): "
                              "its rows cannot be tied to this model; re-prefill from the messages")
    dtype = str(_model_dtype(session.model))
    if state.model_dtype != dtype:
        raise CacheStateError(f"state was computed in {state.model_dtype or 'an unknown dtype'}, the model runs in "
                              f"{dtype}: re-prefill from the messages")
    if state.weights_digest != base_weights_digest(session.model):
        raise CacheStateError("state was computed by a model with other base weights (weights digest differs): "
                              "re-prefill from the messages")
    try:
        LayerAnchors(session.reforge.num_layers).restore(state.adapter_versions)
    except ValueError as exc:
        raise CacheStateError(f"the state's adapter versions are unusable ({exc}): re-prefill from the messages") from exc


def _check_layout(session: KVSession, state: CacheState) -> None:
    expected = kvcache.new_cache(session.model.config)
    text = session.model.config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype = next(session.model.parameters()).dtype
    if len(state.layers) != len(expected.layers):
        raise CacheStateError(f"state has {len(state.layers)} layers, the model {len(expected.layers)}")
    for i, (k, v) in enumerate(state.layers):
        for name, t in (("keys", k), ("values", v)):
            if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != kv_heads or t.shape[3] != head_dim:
                raise CacheStateError(f"layer {i} {name} have shape {tuple(t.shape)}, expected "
                                      f"[1, {kv_heads}, N, {head_dim}]")
            if t.dtype != dtype:
                raise CacheStateError(f"layer {i} {name} are {t.dtype}, the model runs in {dtype}")


@dataclass
class _Entry:
    session: KVSession
    lock: threading.Lock = field(default_factory=threading.Lock)


class ThreadCaches:
    """Live caches of many threads under one memory budget.

    Each thread id maps to its own :class:`KVSession` (created on first use). After every use the
    registry evicts least-recently-used idle threads until the bytes of all threads (K/V +
    CacheReforge boundary states) fit in ``memory_budget_bytes``; an evicted thread simply
    re-prefills on its next turn (its messages live with the caller, e.g. in a LangGraph
    checkpoint). A thread larger than the whole budget
    is evicted too, after its call, and the reason is logged.

    Args:
        model, tokenizer: shared by all threads.
        policy: repair policy of new sessions (RepairPolicy or label such as ``"sur@5"``).
        memory_budget_bytes: cap on the bytes (K/V + boundary states) of all live threads (None: unlimited).
        on_evict: called as ``on_evict(thread_id, session)`` before a thread is dropped, with
            the thread's lock held (for example to persist its state first; it must not lease
            the thread again).
        model_name: recorded in exported states.

    Raises:
        ValueError: ``memory_budget_bytes`` < 0.
    """

    def __init__(
        self,
        model,
        tokenizer,
        policy: RepairPolicy | str | None = None,
        *,
        memory_budget_bytes: int | None = None,
        on_evict: Callable[[str, KVSession], None] | None = None,
        model_name: str = "",
    ):
        if memory_budget_bytes is not None and memory_budget_bytes < 0:
            raise ValueError(f"memory_budget_bytes must be >= 0 or None for no limit (got {memory_budget_bytes})")
        self.model, self.tokenizer = model, tokenizer
        self.policy = policy
        self.memory_budget_bytes = memory_budget_bytes
        self.on_evict = on_evict
        self.model_name = model_name
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest use first
        self._lock = threading.Lock()  # guards the dict, never held while the model runs
        self._changed = threading.Condition(self._lock)  # notified when a call ends or a thread is dropped
        self._admitted: dict[int, tuple[str, int]] = {}  # ticket -> (thread id, reserved bytes) of running calls
        self._tickets = itertools.count()
        self.evictions = 0
        # checkpoint stores persisting these threads, which purge strictly erased messages
        # (KVCheckpointSaver registers itself; weak: a store dropped by its owner is gone)
        self.erase_stores: weakref.WeakSet = weakref.WeakSet()

    # -------------------------------------------------------------- access
    def _entry(self, thread_id: str) -> _Entry:
        thread_id = _check_id(thread_id)
        with self._lock:
            entry = self._entries.get(thread_id)
            if entry is None:
                entry = _Entry(KVSession(self.model, self.tokenizer, self.policy))
                self._entries[thread_id] = entry
            self._entries.move_to_end(thread_id)
            return entry

    @contextmanager
    def lease(self, thread_id: str, *, reserve_tokens: int = 0, wait_s: float | None = None) -> Iterator[KVSession]:
        """Exclusive use of a thread's session (created on first use) for one model call.

        Calls on the same thread wait for each other; calls on different threads run freely.
        The lock is a plain ``threading.Lock``, so a streaming generator may end the lease from
        another worker thread.

        Args:
            reserve_tokens: the most cache rows the call may hold (prompt + answer tokens). Under a
                budget the call is admitted only once its reservation fits next to every idle
                thread and every admitted call: least-recently-used idle threads are evicted
                first, and when that is not enough the call waits for other calls to end. So
                concurrent calls never hold more K/V than the budget (one call alone larger than
                the whole budget still runs, and its thread is dropped after it). 0: no
                reservation (the budget is then enforced only when the lease ends).
            wait_s: the longest wait for another call on the thread to end (None: as long as it takes).

        Raises:
            TypeError: ``thread_id`` is not a str or int.
            ThreadBusyError (TimeoutError): another call held the thread for more than ``wait_s`` seconds.
        """
        thread_id = _check_id(thread_id)
        ticket = self._admit(thread_id, max(0, int(reserve_tokens)) * self.bytes_per_token)
        try:
            while True:
                entry = self._entry(thread_id)
                if not entry.lock.acquire(timeout=-1 if wait_s is None else wait_s):
                    raise ThreadBusyError(f"thread {thread_id!r} was held by another call for more than {wait_s} s")
                if self._entries.get(thread_id) is entry:
                    break
                entry.lock.release()  # evicted while we waited for it: take a fresh session
            try:
                yield entry.session
            finally:
                entry.lock.release()
                with self._lock:
                    if self._entries.get(thread_id) is entry:
                        self._entries.move_to_end(thread_id)
        finally:
            self._release(ticket)
            self.enforce_budget()

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes one cached token costs over all layers: 2 x layers x kv_heads x head_dim x
        bytes per element (an upper bound for sliding-window layers)."""
        text = self.model.config.get_text_config()
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return 2 * text.num_hidden_layers * kv_heads * head_dim * next(self.model.parameters()).element_size()

    def _committed_bytes(self) -> dict[str, int]:
        """Per thread, what it may hold now: its K/V bytes, or its reservation while a call runs
        (caller holds ``_lock``)."""
        held = {tid: e.session.memory_bytes for tid, e in self._entries.items()}
        for tid, need in self._admitted.values():
            held[tid] = max(held.get(tid, 0), need)
        return held

    def _admit(self, thread_id: str, need: int) -> int | None:
        """Block until ``need`` bytes for a call on ``thread_id`` fit the budget (see :meth:`lease`);
        returns the admission ticket (None without a budget or a reservation)."""
        if self.memory_budget_bytes is None or need <= 0:
            return None
        while True:
            with self._changed:
                held = self._committed_bytes()
                held[thread_id] = max(held.get(thread_id, 0), need)
                excess = sum(held.values()) - self.memory_budget_bytes
                victims: list = []
                if excess > 0:
                    protected = {tid for tid, _ in self._admitted.values()} | {thread_id}
                    victims, freed = self._pick_victims(protected, excess)
                    if freed < excess:  # evicting every idle thread would not make room
                        for _, entry in victims:
                            entry.lock.release()
                        victims = []
                        if self._admitted:
                            self._changed.wait()  # a running call will end and free its reservation
                            continue
                        log.warning("kvmemory: a call on thread %r may hold %d bytes of K/V, more than the "
                                    "budget of %d leaves: it runs alone", thread_id, need, self.memory_budget_bytes)
                if not victims:
                    ticket = next(self._tickets)
                    self._admitted[ticket] = (thread_id, need)
                    return ticket
            self._evict(victims)  # outside the registry lock (on_evict may write files); then re-check

    def _release(self, ticket: int | None) -> None:
        with self._changed:  # also without a ticket: the thread just became idle, hence evictable
            self._admitted.pop(ticket, None)
            self._changed.notify_all()

    def _pick_victims(self, protected: set[str], excess: int) -> tuple[list, int]:
        """Least-recently-used idle threads holding at least ``excess`` bytes (or all idle ones), with
        their locks taken so no call can start on them (caller holds ``_lock``)."""
        victims, freed = [], 0
        for tid, entry in self._entries.items():
            if freed >= excess:
                break
            if tid in protected or not entry.lock.acquire(blocking=False):
                continue  # admitted or in use right now
            victims.append((tid, entry))
            freed += entry.session.memory_bytes
        return victims, freed

    def _evict(self, victims: list) -> list[str]:
        """Hand each victim to ``on_evict`` (its lock still held: the state cannot change and the
        thread still counts as live), then drop it and release its lock."""
        evicted = []
        for tid, entry in victims:
            try:
                size = entry.session.memory_bytes
                if self.memory_budget_bytes is not None and size > self.memory_budget_bytes:
                    log.warning("kvmemory: thread %r holds %d bytes of K/V, more than the whole budget "
                                "(%d): dropped; its next turn re-prefills", tid, size, self.memory_budget_bytes)
                if self.on_evict is not None:
                    try:
                        self.on_evict(tid, entry.session)
                    except Exception:  # persisting is best effort: the thread re-prefills without it
                        log.exception("kvmemory: on_evict failed for thread %r", tid)
                with self._changed:
                    if self._entries.get(tid) is entry:
                        del self._entries[tid]
                        self.evictions += 1
                        evicted.append(tid)
                        self._changed.notify_all()
            finally:
                entry.lock.release()
            log.info("kvmemory: evicted thread %r (least recently used) to stay within %d bytes",
                     tid, self.memory_budget_bytes)
        return evicted

    def session(self, thread_id: str) -> KVSession:
        """The thread's session without a lease (for inspection; not for concurrent calls)."""
        return self._entry(thread_id).session

    def get(self, thread_id: str) -> KVSession | None:
        """The thread's session if it is live, else None (unlike :meth:`session`, never creates one)."""
        entry = self._entries.get(str(thread_id))
        return None if entry is None else entry.session

    def __contains__(self, thread_id: object) -> bool:
        return str(thread_id) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def thread_ids(self) -> list[str]:
        """Live thread ids, least recently used first."""
        return list(self._entries)

    @property
    def memory_bytes(self) -> int:
        """Bytes held by all live threads (K/V + CacheReforge boundary states, see
        ``KVSession.memory_bytes``)."""
        return sum(e.session.memory_bytes for e in list(self._entries.values()))

    # ------------------------------------------------------------ eviction
    def enforce_budget(self) -> list[str]:
        """Evict least-recently-used idle threads until all K/V fits the budget.

        Returns:
            the evicted thread ids (oldest first). Threads in use (leased) or admitted are skipped.
        """
        if self.memory_budget_bytes is None:
            return []
        with self._changed:
            excess = sum(self._committed_bytes().values()) - self.memory_budget_bytes
            if excess <= 0:
                return []
            victims, _ = self._pick_victims({tid for tid, _ in self._admitted.values()}, excess)
        return self._evict(victims)

    def drop(self, thread_id: str) -> bool:
        """Forget a thread's cache (its next turn re-prefills). Returns whether it was live."""
        with self._lock:
            return self._entries.pop(thread_id, None) is not None

    # ----------------------------------------------------- export / import
    def export_state(self, thread_id: str) -> CacheState | None:
        """A detached copy of the thread's cache state, or None if the thread is not live or
        holds no rows yet."""
        entry = self._entries.get(str(thread_id))
        if entry is None or not entry.session.token_ids:
            return None
        with entry.lock:
            return export_state(entry.session, self.model_name)

    @contextmanager
    def idle(self, thread_id: str) -> Iterator[KVSession | None]:
        """The thread's session with its lock held, if it is live and no call runs on it now;
        else None, without waiting. A call in progress holds a half-prepared state (rows of a
        prompt without its answer, or a repair under way): a reader such as a checkpoint ``put``
        must not persist it, and must not wait for the call either (LangGraph writes checkpoints
        in the background while the next node runs)."""
        entry = self._entries.get(str(thread_id))
        if entry is None or not entry.lock.acquire(blocking=False):
            yield None
            return
        try:
            yield entry.session if self._entries.get(str(thread_id)) is entry else None
        finally:
            entry.lock.release()

    def import_state(self, thread_id: str, state: CacheState) -> KVSession:
        """Make ``state`` the thread's live cache (e.g. after a process restart) and enforce the
        budget. Raises CacheStateError (see :func:`import_state`); the thread is then unchanged."""
        if state.model_name and self.model_name and state.model_name != self.model_name:
            raise CacheStateError(f"state was computed by {state.model_name!r}, this registry runs "
                                  f"{self.model_name!r}: re-prefill from the messages")
        with self.lease(thread_id, reserve_tokens=len(state.token_ids)) as session:  # its rows count against the budget
            import_state(session, state)
        return session


def _check_id(thread_id: Any) -> str:
    if isinstance(thread_id, bool) or not isinstance(thread_id, (str, int)):
        raise TypeError(f"thread_id must be a str (or int), got {type(thread_id).__name__}: pass "
                        "config={'configurable': {'thread_id': '...'}}")
    return str(thread_id)
