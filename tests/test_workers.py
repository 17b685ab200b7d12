"""Many workers, one truth, on the real deployment pattern: two worker processes, each with its
own embedded model and one compiled LangGraph graph over PostgresSaver + the Redis block store,
each turn of a thread handed to another worker than the last (the random routing of
``kvmemory bench persistence`` in its hardest, deterministic form); and a worker killed mid-call."""

from __future__ import annotations

import uuid

import pytest

from kvmemory_lab.harness.workers import QUESTIONS, Cluster, WorkerOptions, thread_messages
from servers import postgres_url, redis_url  # noqa: F401  (fixtures)


@pytest.mark.real_model
def test_two_worker_processes_share_threads_without_reprefill_or_lost_messages(postgres_url, redis_url):
    options = WorkerOptions(postgres_url=postgres_url, redis_url=redis_url, namespace=f"kvmt-{uuid.uuid4().hex[:6]}",
                            max_tokens=8, block_tokens=32, lease_ttl_s=3.0)
    texts = QUESTIONS[:3]
    tag = uuid.uuid4().hex[:6]
    single = [f"single-{tag}-{i}" for i in range(2)]
    routed = [f"routed-{tag}-{i}" for i in range(2)]
    crashed = f"crash-{tag}"
    with Cluster(2, options) as cluster:
        alone = cluster.run_turns(single, texts, route="first")
        shared = cluster.run_turns(routed, texts, route="alternate")
        survived = cluster.run_turns([crashed], texts[:2], crash={(crashed, 1)})
        survivors = cluster.alive()
    assert len(survivors) == 1  # the worker that took turn 1 died mid-call
    reuse = {r["turn"]: r["reused_tokens"] for r in alone}
    assert {r["worker"] for r in shared} == {"w0", "w1"}
    assert all(r["restored"] == 1 for r in shared if r["turn"] > 0)  # each later turn resumed on another worker
    for r in shared:  # any worker reuses what one worker alone would (same texts, greedy answers)
        assert r["reused_tokens"] == reuse[r["turn"]] and r["restore_failure"] is None
        assert r["turn"] == 0 or r["reused_tokens"] > 0  # no Re-prefill after the first turn
    for thread in [*single, *routed]:  # system + (user, answer) per turn, each once
        messages = thread_messages(options, thread)
        assert [m.type for m in messages] == ["system"] + ["human", "ai"] * len(texts)
        assert [m.content for m in messages if m.type == "human"] == texts
    assert [(r["turn"], r["worker"] in survivors) for r in survived][-1] == (1, True)  # the job was resent
    messages = thread_messages(options, crashed)
    assert [m.type for m in messages] == ["system", "human", "ai", "human", "ai"]  # no message lost or doubled
    assert [m.content for m in messages if m.type == "human"] == texts[:2]
