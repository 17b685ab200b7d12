"""Threads per call from the cores other processes and concurrent calls leave free
(kvmemory.engine.cores): the count chosen, restored, divided, and what a busy machine gets."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from kvmemory.engine import cores
from kvmemory.engine.cores import CoreShare


class FakeClock:
    """CPU seconds as /proc would tell them: ``others`` cores busy elsewhere, none in this process."""

    def __init__(self, others: float):
        self.others, self.t0 = others, time.monotonic()

    def __call__(self):
        return (time.monotonic() - self.t0) * self.others, 0.0


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _share(others: float, cpus: int = 2) -> CoreShare:
    share = CoreShare(sample_s=0.01, cpus=cpus, sampler=FakeClock(others))
    share.enabled = True
    time.sleep(0.02)
    return share


@pytest.mark.parametrize("others, expected", [(0.0, 2), (0.3, 2), (0.5, 1), (1.0, 1), (2.0, 1)])
def test_a_call_gets_the_cores_other_processes_leave_free(others, expected, two_threads):
    share = _share(others)
    with share.share() as n:
        assert n == expected == torch.get_num_threads()
    assert torch.get_num_threads() == 2  # the caller's setting is back


def test_the_callers_thread_count_stays_the_ceiling(two_threads):
    share = _share(0.0, cpus=8)
    with share.share() as n:
        assert n == 2


def test_concurrent_calls_divide_the_free_cores(two_threads):
    share = _share(0.0, cpus=2)
    inside, release, seen = threading.Event(), threading.Event(), []

    def first():
        with share.share() as n:
            seen.append(("first", n))
            inside.set()
            release.wait(5)

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(5)
    with share.share() as n:  # a second call while the first runs: one core each
        seen.append(("second", n))
    release.set()
    t.join()
    assert seen == [("first", 2), ("second", 1)]
    with share.share() as n:  # alone again
        assert n == 2


def test_a_call_entering_beside_others_keeps_the_users_ceiling(two_threads):
    """torch keeps one thread count per process: a call entering while another runs with its
    share reads that share, not the user's setting. The ceiling stays the one taken when the
    first call entered, so a batch leader computing while the others wait gets every core."""
    share = _share(0.0, cpus=2)
    waiting, release, seen = threading.Event(), threading.Event(), []

    def waiter():
        with share.share():
            with share.waiting():  # waits for a batch another call computes
                waiting.set()
                release.wait(5)

    t = threading.Thread(target=waiter)
    t.start()
    assert waiting.wait(5)
    torch.set_num_threads(1)  # what a concurrent call's share left behind
    with share.share() as n:
        seen.append(n)
        seen.append(share.rebalance())
    release.set()
    t.join()
    assert seen == [2, 2] and torch.get_num_threads() == 2


def test_a_nested_use_keeps_the_outer_count(two_threads):
    share = _share(1.0)
    with share.share() as outer:
        share._busy_elsewhere = 0.0
        with share.share() as inner:
            assert inner == outer == 1 == torch.get_num_threads()


def test_turned_off_every_call_uses_the_callers_count(two_threads):
    share = _share(2.0)
    share.enabled = False
    with share.share() as n:
        assert n == 2


def test_without_proc_only_concurrent_calls_divide(two_threads):
    share = CoreShare(sample_s=0.0, cpus=2, sampler=lambda: None)
    share.enabled = True
    with share.share() as n:
        assert n == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_processes_keeping_every_core_busy_leave_one_thread(two_threads):
    """Real /proc sampling: as many spinning processes as usable CPUs (the measured collapse:
    a 2-thread answer 20x slower beside one busy process)."""
    share = CoreShare(sample_s=0.2)
    share.enabled = True
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(share.cpus)]
    try:
        time.sleep(0.5)
        share.free_cores()  # a sample over the busy interval
        time.sleep(0.5)
        assert share.free_cores() < share.cpus - 0.5
        with share.share() as n:
            assert n == 1
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def test_a_chat_model_call_beside_busy_processes_decodes_on_one_thread(monkeypatch, two_threads):
    """ChatKVMemory on the embedded model: prepare and every decode step run with the call's
    share (the forward sees 1 thread when other processes keep both cores busy), and the
    caller's count is back afterwards."""
    from langchain_core.messages import HumanMessage

    from kvmemory.engine import registry
    from langchain_kvmemory import ChatKVMemory

    monkeypatch.setattr(cores.CORES, "enabled", True)
    monkeypatch.setattr(cores.CORES, "cpus", 2)
    monkeypatch.setattr(cores.CORES, "sample_s", 0.01)
    clock = FakeClock(2.0)
    monkeypatch.setattr(cores.CORES, "_sampler", clock)
    monkeypatch.setattr(cores.CORES, "_sample", (time.monotonic(), clock()))
    seen = []
    engine_for = registry.engine_for

    def recording(model, cache):
        seen.append(torch.get_num_threads())
        return engine_for(model, cache)

    monkeypatch.setattr(registry, "engine_for", recording)
    time.sleep(0.02)
    reply = ChatKVMemory(max_tokens=6).invoke([HumanMessage("Name a colour.")])
    assert reply.content and len(seen) >= 6 and set(seen) == {1}
    assert torch.get_num_threads() == 2
