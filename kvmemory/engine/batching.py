"""Batched decoding across threads (continuous batching on the CPU engine).

Decoding reads every weight block once per token, so N threads decoding one at a time read the
weights N times. When several sessions of one model decode at the same time, each decode step
becomes a request to the model's :class:`DecodeBatcher`: the decoded token, with the draft tokens
prompt lookup asks to verify. One of the waiting threads (the leader) computes every pending
request in one kernel call (``QuantizedLlama.decode_batch``: each linear reads its blocks once per
4 rows, each thread's rows attend to its own cache) and hands each thread its logits. Threads join
and leave between steps; a thread decoding alone takes its own step as before. Each row's
arithmetic is the one it gets alone, operation for operation, so a thread's answer is bit for bit
its answer alone at the same thread count.

Only decode steps (up to 4 tokens) on the exact block engine are batched. Longer appends, repairs
(Shift, the packed refresh) and anything on transformers' forward (adapters, other caches) run as
before, between the batched steps of the other threads: a batch touches only the caches of the
threads waiting in it, each of which holds its thread's lease.

Use: ``KVSession(..., batcher=decode_batcher(model))`` (sessions of one model share it), or
``ChatKVMemory(batch_decoding=True)`` for every thread it serves. Opt-in, by measurement: a batch
reads the weights once, but each row still reads its own cache and the rows' attention runs one
after another, so on long contexts of a small model (the embedded one at 2 K: ~94 MB of fp32
K/V per token against ~100 MB of blocks) concurrent calls on separate cores decode faster.
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from .cores import CORES
from .llama import BATCH_TOKENS, QuantizedLlama
from .registry import engine_for, forward_rows

MAX_ROWS = 16  # rows per batch, drafts included (the kernel reads the blocks once per 4 of them)
# How long a leader waits for the other decoding threads' next steps: longer than Python's GIL
# switch interval (5 ms), which a thread between two steps may wait out. Measured (Qwen 0.5B, four
# 2 K threads, 2 threads): with 2 ms one step in ten split into two kernel calls, with 6 ms none.
GATHER_S = 0.006


@dataclass
class _Request:
    cache: object
    token_ids: torch.Tensor  # [m]: the decoded token and its draft
    start: int
    capacity: int | None
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


class DecodeBatcher:
    """One model's batched decode steps (see the module docstring). Thread-safe.

    ``batches`` / ``batched_rows``: how many kernel calls took more than one thread's rows, and
    how many rows they took (for reports and benchmarks).
    """

    def __init__(self, model, max_rows: int = MAX_ROWS, gather_s: float = GATHER_S):
        self.model_ref = weakref.ref(model)
        self.max_rows, self.gather_s = max_rows, gather_s
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._busy = False  # a leader is gathering or computing
        self._decoders = 0  # sessions inside a decode loop (they will submit steps soon)
        self.batches = 0
        self.batched_rows = 0

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Mark a session's decode loop: the leader waits up to ``gather_s`` for the steps of
        every marked session before computing a batch."""
        with self._cond:
            self._decoders += 1
        try:
            yield
        finally:
            with self._cond:
                self._decoders -= 1
                self._cond.notify_all()

    @property
    def crowded(self) -> bool:
        """More than one session is decoding now (their steps batch)."""
        return self._decoders > 1

    def step(self, cache, token_ids: torch.Tensor, start: int, capacity: int | None = None,
             every_row: bool = False) -> torch.Tensor:
        """``forward_rows(model, cache, token_ids, start, capacity=capacity, every_row=every_row)``
        for a decoded token and its draft (LongTensor ``[m]``), batched with other threads' steps
        when they decode too (m <= 4; longer inputs run alone). Returns fp32 logits as
        ``forward_rows`` does: ``[vocab]``, or ``[m, vocab]`` with ``every_row``. Raises what the
        forward raises (each thread of a failed batch gets the error)."""
        model = self.model_ref()
        engine = engine_for(model, cache)
        if (not self.crowded or not isinstance(engine, QuantizedLlama) or engine.int8
                or token_ids.shape[0] > BATCH_TOKENS):
            return forward_rows(model, cache, token_ids, start, capacity=capacity, every_row=every_row)
        request = _Request(cache, token_ids, start, capacity)
        with self._cond:
            self._pending.append(request)
            self._cond.notify_all()
            with CORES.waiting():  # a thread waiting on the leader computes nothing
                while self._busy and not request.done:
                    self._cond.wait()
            if request.done:
                return self._result(request, every_row)
            self._busy = True  # this thread leads the next batch
            batch = self._gather(request)
        try:
            logits = self._run(engine, batch)
        except BaseException as exc:  # every thread of the batch learns it
            logits, failure = None, exc
        else:
            failure = None
        with self._cond:
            for i, r in enumerate(batch):
                r.logits, r.error, r.done = (None if logits is None else logits[i].clone()), failure, True
            self._busy = False
            self._cond.notify_all()
        return self._result(request, every_row)

    def _gather(self, own: _Request) -> list[_Request]:
        """The leader's batch (lock held): its own request and the others pending, after waiting
        up to ``gather_s`` for every decoding session's step; at most ``max_rows`` rows in all."""
        deadline = time.monotonic() + self.gather_s
        while len(self._pending) < self._decoders and self._rows(self._pending) < self.max_rows:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with CORES.waiting():
                self._cond.wait(left)
        batch = [own]
        for r in self._pending:
            if r is not own and self._rows(batch) + r.token_ids.shape[0] <= self.max_rows:
                batch.append(r)
        self._pending = [r for r in self._pending if not any(r is b for b in batch)]
        return batch

    @staticmethod
    def _rows(requests: list[_Request]) -> int:
        return sum(r.token_ids.shape[0] for r in requests)

    def _run(self, engine: QuantizedLlama, batch: list[_Request]) -> list[torch.Tensor]:
        """One kernel call for the batch (one request: its plain forward), with the cores this
        call may use now that the others wait. Returns each request's logits ``[m, vocab]``."""
        CORES.rebalance()
        if len(batch) == 1:
            r = batch[0]
            return [forward_rows(self.model_ref(), r.cache, r.token_ids, r.start, capacity=r.capacity, every_row=True)]
        self.batches += 1
        self.batched_rows += self._rows(batch)
        return engine.decode_batch([r.cache for r in batch], [r.token_ids for r in batch],
                                   [r.start for r in batch], [r.capacity for r in batch])

    @staticmethod
    def _result(request: _Request, every_row: bool) -> torch.Tensor:
        if request.error is not None:
            raise request.error
        return request.logits if every_row else request.logits[-1]


_BATCHERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_BATCHERS_LOCK = threading.Lock()


def decode_batcher(model) -> DecodeBatcher:
    """The model's :class:`DecodeBatcher` (one per model object, created on first use)."""
    with _BATCHERS_LOCK:
        if model not in _BATCHERS:
            _BATCHERS[model] = DecodeBatcher(model)
        return _BATCHERS[model]
