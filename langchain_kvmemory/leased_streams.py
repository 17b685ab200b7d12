"""Answers streamed while they hold their thread's lease, and closing one its caller abandoned.

A streamed answer keeps its thread leased until its last chunk, so calls on the same thread wait
for it (:meth:`kvmemory.threads.ThreadCaches.lease`). A script or notebook that stops iterating
a stream without closing it (``s = chat.stream(...); next(s)``, then ``chat.invoke(...)`` on the
same thread id) would wait forever: its one thread is the only one that could resume the stream.
So a call on the main thread first closes a stream the main thread left suspended on the same
thread slot: the thread's cache then holds what was streamed (as when any stream is closed
early) and the abandoned stream ends at its next iteration. Calls on other OS threads keep
waiting: in a thread pool (a web server's workers, LangChain's async executor) the next chunk
of a live stream may be asked for from any worker, so a suspended stream is no proof of an
abandoned one there. A dropped stream is closed by Python as before (only weak references are
kept here).
"""

from __future__ import annotations

import threading
import weakref
from typing import Hashable, Iterator


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
        with self._lock:
            ref = self._suspended.get(key)
            stream = ref() if ref is not None else None
            if stream is None or stream.suspended_by != threading.get_ident():
                return False
            del self._suspended[key]
        stream.close()
        return True

    def _suspend(self, stream: "LeasedStream") -> None:
        with self._lock:
            self._suspended[stream.key] = weakref.ref(stream)

    def _resume(self, stream: "LeasedStream") -> None:
        with self._lock:
            ref = self._suspended.get(stream.key)
            if ref is not None and ref() is stream:
                del self._suspended[stream.key]


class LeasedStream:
    """An iterator over a leased generator's items that records, between items, which OS thread
    left it suspended (see :class:`OpenStreams`)."""

    def __init__(self, owner: OpenStreams, key: Hashable, events: Iterator):
        self._owner, self.key, self._events = owner, key, events
        self.suspended_by: int | None = None
        self._done = False

    def __iter__(self) -> "LeasedStream":
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        self._owner._resume(self)
        self.suspended_by = None
        try:
            item = next(self._events)
        except BaseException:
            self._done = True  # finished or failed: nothing left to close
            raise
        self.suspended_by = threading.get_ident()
        self._owner._suspend(self)
        return item

    def close(self) -> None:
        """End the stream: its generator exits (releasing the lease) and later iterations stop."""
        self._done = True
        self._owner._resume(self)
        self._events.close()
