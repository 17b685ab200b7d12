"""Answers streamed while they hold their thread's lease, and closing one its caller abandoned.

A streamed answer keeps its thread leased until its last chunk, so calls on the same thread wait
for it (:meth:`kvmemory.threads.ThreadCaches.lease`). A stream its caller stops iterating without
closing it would make such a call wait forever:

- a script or notebook (``s = chat.stream(...); next(s)``, then ``chat.invoke(...)`` on the same
  thread id): its one thread is the only one that could resume the stream. A call on the main
  thread therefore first closes a stream the main thread left suspended on its thread slot;
- elsewhere (``async for ... in chat.astream(...): break`` before ``ainvoke``, a ``batch`` after a
  suspended stream, a pool of workers) the next chunk of a live stream may be asked for from any
  OS thread, so nothing proves a stream abandoned but time: a call that has waited
  ``ABANDONED_AFTER_S`` seconds closes the stream holding its thread if nobody iterated it for
  that long, and keeps waiting for one that is being iterated.

A closed stream's cache holds what was streamed (as when any stream is closed early) and the
stream ends at its next iteration. A dropped stream is closed by Python as before (only weak
references are kept here).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Hashable, Iterator

from kvmemory.errors import ThreadBusyError

ABANDONED_AFTER_S = 10.0  # a stream nobody iterates this long while a call waits for its thread is closed


class OpenStreams:
    """The suspended streams of one chat model, one per key (model name, thread slot)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._suspended: dict[Hashable, weakref.ref] = {}

    def wrap(self, key: Hashable, events: Iterator) -> "LeasedStream":
        """``events`` (a generator that holds ``key``'s lease while it runs) as a stream this
        registry may close while it is suspended."""
        return LeasedStream(self, key, events)

    def close_abandoned(self, key: Hashable) -> bool:
        """On the main thread: close the stream on ``key`` that the main thread left suspended;
        True if there was one (its lease is released when this returns)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        stream = self._stream(key)
        return stream is not None and stream.close_if_idle(0.0, by=threading.get_ident())

    @contextlib.contextmanager
    def lease(self, registry, thread_id: str, key: Hashable, reserve_tokens: int):
        """``registry.lease(thread_id)``, closing on the way a stream on ``key`` that nobody has
        iterated for ``ABANDONED_AFTER_S`` seconds (checked each time that long was waited)."""
        with contextlib.ExitStack() as stack:
            while True:
                try:
                    session = stack.enter_context(registry.lease(thread_id, reserve_tokens=reserve_tokens,
                                                                 wait_s=ABANDONED_AFTER_S))
                    break
                except ThreadBusyError:
                    stream = self._stream(key)
                    if stream is not None:
                        stream.close_if_idle(ABANDONED_AFTER_S)
            yield session

    def _stream(self, key: Hashable) -> "LeasedStream | None":
        with self._lock:
            ref = self._suspended.get(key)
        return ref() if ref is not None else None

    def _suspend(self, stream: "LeasedStream") -> None:
        with self._lock:
            self._suspended[stream.key] = weakref.ref(stream)

    def _resume(self, stream: "LeasedStream") -> None:
        with self._lock:
            ref = self._suspended.get(stream.key)
            if ref is not None and ref() is stream:
                del self._suspended[stream.key]


class LeasedStream:
    """An iterator over a leased generator's items that records, between items, since when and
    on which OS thread it is suspended (see :class:`OpenStreams`). Its lock makes an iteration
    and a close never overlap."""

    def __init__(self, owner: OpenStreams, key: Hashable, events: Iterator):
        self._owner, self.key, self._events = owner, key, events
        self._lock = threading.Lock()
        self._suspended: tuple[float, int] | None = None  # (monotonic time, OS thread) while between items
        self._done = False

    def __iter__(self) -> "LeasedStream":
        return self

    def __next__(self):
        with self._lock:
            if self._done:
                raise StopIteration
            self._owner._resume(self)
            self._suspended = None
            try:
                item = next(self._events)
            except BaseException:
                self._done = True  # finished or failed: nothing left to close
                raise
            self._suspended = (time.monotonic(), threading.get_ident())
            self._owner._suspend(self)
        return item

    def close_if_idle(self, idle_s: float, by: int | None = None) -> bool:
        """Close the stream if it has been suspended for at least ``idle_s`` seconds (and, with
        ``by``, by that OS thread); True if it was closed."""
        with self._lock:
            if self._done or self._suspended is None:
                return False
            since, thread = self._suspended
            if time.monotonic() - since < idle_s or (by is not None and thread != by):
                return False
            self._close()
        return True

    def close(self) -> None:
        """End the stream: its generator exits (releasing the lease) and later iterations stop."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        self._done = True
        self._suspended = None
        self._owner._resume(self)
        self._events.close()
