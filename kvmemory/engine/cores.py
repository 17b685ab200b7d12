"""How many threads a call that computes rows may use: the cores other processes leave free,
shared among this process's concurrent calls.

Why: the engine's kernels and torch's operators split each step over OpenMP threads that meet
after every linear (hundreds of times per decoded token). When another process keeps a core
busy, the thread the OS puts beside it is preempted for whole time slices and every meeting
waits for it. Measured on a 2-core Xeon with one busy process beside it: a 48-token answer of
the embedded model took 17-22 s with 2 threads and 0.9 s with 1 (0.6 s with 2 on the quiet
machine). Two calls of one process running at once (LangGraph threads, branches) oversubscribe
the cores the same way.

So each call runs with ``min(ceiling, free cores // concurrent calls)`` threads, at least one:
``ceiling`` is ``torch.get_num_threads()`` when the first of the concurrent calls entered (the
user's setting stays the upper bound; torch keeps one count per process, so the count is re-set
as calls enter and leave); free cores are the CPUs this process may run on minus what other
processes kept busy over the last sample (Linux: ``/proc/stat`` minus this process's ``/proc/self/stat``, sampled at
most every 0.25 s while calls run). Without ``/proc`` only the division among concurrent calls
applies. ``KVMEMORY_SHARE_CORES=0`` turns it off (every call uses the ceiling).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import torch

SAMPLE_S = 0.25  # seconds between samples of the other processes' CPU use
# a core counts as free while other processes use less than this share of it: a thread beside
# a busier one waits on it at every meeting
BUSY_SHARE = 0.35
_JIFFY_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _cpu_seconds() -> tuple[float, float] | None:
    """(seconds every CPU of the machine spent busy, seconds this process spent on a CPU) so
    far, or None where ``/proc`` does not tell."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy * _JIFFY_S, (int(own[11]) + int(own[12])) * _JIFFY_S  # utime + stime


class CoreShare:
    """The process's share of the machine's cores (one per process: :data:`CORES`)."""

    def __init__(self, sample_s: float = SAMPLE_S, cpus: int | None = None, sampler=_cpu_seconds):
        self.sample_s = sample_s
        self._sampler = sampler  # () -> (machine busy s, own s) or None
        self.cpus = cpus or _usable_cpus()
        self.enabled = os.environ.get("KVMEMORY_SHARE_CORES", "1") != "0"
        self._lock = threading.Lock()
        self._local = threading.local()
        self._active = 0  # calls running now
        self._inside = 0  # calls inside share(), waiting ones included
        self._ceiling = 1  # the callers' thread count, taken when no call is inside
        self._busy_elsewhere = 0.0  # cores other processes kept busy over the last sample
        self._sample = (time.monotonic(), sampler())

    def free_cores(self) -> float:
        """Cores other processes left free over the last sample (refreshed when older than
        ``sample_s``); all usable CPUs where ``/proc`` does not tell."""
        with self._lock:
            self._refresh()
            return max(0.0, self.cpus - self._busy_elsewhere)

    @contextmanager
    def share(self) -> Iterator[int]:
        """Run the block with this call's share of threads (yields the count). Nested uses in
        one thread keep the outer count; the caller's thread count is restored on exit.

        torch's thread count is one per process, not per thread: the ceiling is taken when no
        other call is inside (a call entering beside one that runs with 1 would read 1: measured,
        batched decode steps then ran on one core of two), and a call leaving sets the count
        for the calls still inside."""
        if not self.enabled or getattr(self._local, "inside", False):
            yield torch.get_num_threads()
            return
        mine = torch.get_num_threads()
        with self._lock:
            self._refresh()
            if self._inside == 0:
                self._ceiling = mine
            ceiling = self._ceiling
            self._inside += 1
            self._active += 1
            n = self._threads(ceiling, self._active)
        self._local.inside = True
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        try:
            yield n
        finally:
            self._local.inside = False
            with self._lock:
                self._active -= 1
                self._inside -= 1
                left = ceiling if self._inside == 0 else self._threads(ceiling, self._active)
            if torch.get_num_threads() != left:
                torch.set_num_threads(left)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Inside :meth:`share`: the call waits for another thread's work on its behalf (a
        batched decode step) and counts as idle meanwhile."""
        if not self.enabled or not getattr(self._local, "inside", False):
            yield
            return
        with self._lock:
            self._active -= 1
        try:
            yield
        finally:
            with self._lock:
                self._active += 1

    def rebalance(self) -> int:
        """Inside :meth:`share`: choose this call's thread count again from the cores and calls
        now (a batch leader computes for the calls waiting on it). Returns the count."""
        if not self.enabled or not getattr(self._local, "inside", False):
            return torch.get_num_threads()
        with self._lock:
            self._refresh()
            n = self._threads(self._ceiling, self._active)
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        return n

    def _threads(self, ceiling: int, calls: int) -> int:
        free = int(self.cpus - self._busy_elsewhere + BUSY_SHARE)
        return max(1, min(ceiling, free // max(1, calls)))

    def _refresh(self) -> None:
        """Take a new sample when the last is older than ``sample_s`` (lock held)."""
        now = time.monotonic()
        then, before = self._sample
        if now - then < self.sample_s:
            return
        after = self._sampler()
        self._sample = (now, after)
        if before is None or after is None:
            return
        busy, own = after[0] - before[0], after[1] - before[1]
        self._busy_elsewhere = max(0.0, (busy - own) / (now - then))


CORES = CoreShare()


def share_cores():
    """``with share_cores():`` runs a block that computes rows with this call's share of the
    cores (see the module docstring); used around every engine verb and repair."""
    return CORES.share()
