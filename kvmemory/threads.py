"""Live caches of many conversation threads: a registry of ``KVSession`` keyed by thread id,
held under a memory budget in bytes with least-recently-used eviction. A thread's cache state is
exported / imported through :mod:`kvmemory.persistence` (the thread's lock held meanwhile).

Threads never share K/V tensors: every thread owns its ``DynamicCache``; only the model and the
tokenizer are shared, so one thread's repair cannot touch another thread's rows.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from . import persistence
from .engine.batching import decode_batcher
from .errors import CacheStateError, ThreadBusyError
from .policy import RepairPolicy
from .session import KVSession

log = logging.getLogger(__name__)


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
        batch_decoding: threads decoding at the same time share one kernel call per token
            (:mod:`kvmemory.engine.batching`; each answer bit for bit its answer alone at the
            same thread count). False (default): every thread decodes alone.

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
        batch_decoding: bool = False,
    ):
        if memory_budget_bytes is not None and memory_budget_bytes < 0:
            raise ValueError(f"memory_budget_bytes must be >= 0 or None for no limit (got {memory_budget_bytes})")
        self.model, self.tokenizer = model, tokenizer
        self.policy = policy
        self.memory_budget_bytes = memory_budget_bytes
        self.on_evict = on_evict
        self.model_name = model_name
        self.batcher = decode_batcher(model) if batch_decoding else None
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
                entry = _Entry(KVSession(self.model, self.tokenizer, self.policy, batcher=self.batcher))
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
    def export_state(self, thread_id: str) -> persistence.CacheState | None:
        """A detached copy of the thread's cache state, or None if the thread is not live or
        holds no rows yet."""
        entry = self._entries.get(str(thread_id))
        if entry is None or not entry.session.token_ids:
            return None
        with entry.lock:
            return persistence.export_state(entry.session, self.model_name)

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

    def import_state(self, thread_id: str, state: persistence.CacheState) -> KVSession:
        """Make ``state`` the thread's live cache (e.g. after a process restart) and enforce the
        budget. Raises CacheStateError (see :func:`kvmemory.persistence.import_state`); the thread
        is then unchanged."""
        if state.model_name and self.model_name and state.model_name != self.model_name:
            raise CacheStateError(f"state was computed by {state.model_name!r}, this registry runs "
                                  f"{self.model_name!r}: re-prefill from the messages")
        with self.lease(thread_id, reserve_tokens=len(state.token_ids)) as session:  # its rows count against the budget
            persistence.import_state(session, state)
        return session

    def note_lost_reuse(self, thread_id: str, reason: str) -> None:
        """Tell the thread's next call why it reuses less than the thread's stored state allows
        (e.g. its stored cache could not be restored): that call's ``RepairReport.fallback`` says
        so (see ``KVSession.note_lost_reuse``). Creates the thread's session if it is not live."""
        with self.lease(thread_id) as session:
            session.note_lost_reuse(reason)


def _check_id(thread_id: Any) -> str:
    if isinstance(thread_id, bool) or not isinstance(thread_id, (str, int)):
        raise TypeError(f"thread_id must be a str (or int), got {type(thread_id).__name__}: pass "
                        "config={'configurable': {'thread_id': '...'}}")
    return str(thread_id)
