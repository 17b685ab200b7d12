"""``kvmemory bench agent-loop`` end to end on the embedded model: the create_agent loop's six
hops per system, quiet and beside a busy process, the written files; and the llama.cpp peer
(where llama-cpp-python is installed) answering under the same grammar."""

from __future__ import annotations

import json

import pytest

from kvmemory.engine import CORES
from kvmemory_lab.cli import main


def test_the_agent_loop_benchmark_times_six_hops_quiet_and_busy(tmp_path):
    sharing = CORES.enabled
    out = tmp_path / "loop"
    status = main(["bench", "agent-loop", "--trials", "1", "--variants", "after_user", "--conditions", "quiet,busy",
                   "--systems", "kvmemory sur@5,kvmemory reprefill:always", "--max-tokens", "24", "--out", str(out)])
    assert status == 0
    assert CORES.enabled == sharing  # the benchmark's per-system setting does not leak
    data = json.loads((out / "agent_loop.json").read_text())
    loops = data["loops"]
    assert {(x["condition"], x["system"]) for x in loops} == {
        (c, s) for c in ("quiet", "busy") for s in ("kvmemory sur@5", "kvmemory reprefill:always")}
    for loop in loops:  # a call after each user turn, then the answer: six hops, three calls
        assert len(loop["hop_ms"]) == 6 and loop["tool_calls"] == 3 and loop["total_ms"] >= sum(loop["hop_ms"])
    sur = [x for x in loops if x["system"] == "kvmemory sur@5"]
    always = [x for x in loops if x["system"] == "kvmemory reprefill:always"]
    assert all(max(x["reused_tokens"][1:]) > 200 for x in sur)  # later hops reuse the thread's cache
    assert all(x["reused_tokens"] == [0] * 6 for x in always)
    md = (out / "agent_loop.md").read_text()
    assert "busy ÷ quiet" in md and "kvmemory sur@5 loop time ÷" in md and "CPU flags" in md
    assert (out / "agent_loop.png").stat().st_size > 1000


def test_the_llama_cpp_peer_calls_a_tool_under_the_same_grammar():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is the bench extra's (compiles ~15 min)")
    from langchain_core.messages import HumanMessage

    from kvmemory.models import embedded_gguf_path
    from kvmemory_lab.bench.agent_loop import TOOLS
    from kvmemory_lab.bench.llama_chat import LlamaCppChat

    llm = LlamaCppChat(gguf=str(embedded_gguf_path()), max_tokens=40, auto_tool_calls="after_user")
    reply = llm.bind_tools(TOOLS).invoke([HumanMessage("What is the weather in Paris?")])
    assert len(reply.tool_calls) == 1 and reply.tool_calls[0]["name"] in {"get_weather", "get_opening_hours"}
    text = llm.invoke([HumanMessage("Say hello.")])
    assert text.content and not text.tool_calls
