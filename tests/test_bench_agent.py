"""``kvmemory bench agent`` end to end on a tiny random-weight Llama folder (the embedded tokenizer,
so the chat template is real) and a stand-in HotpotQA folder: the JSON schema, what each system
prefilled per step, and the written files. llama.cpp cannot be installed here: its code path
runs against a stand-in ``llama_cpp`` module that keeps llama-cpp-python's prefix-reuse rule."""

from __future__ import annotations

import json
import sys
import types

import pytest

from kvmemory_lab.bench.agent import STEPS, agent_chat
from kvmemory_lab.bench.agent_systems import build_session
from kvmemory_lab.cli import main
from kvmemory_lab.demo_cases import HOTPOT_FILE
from support import tiny_model

ROW_KEYS = {"system", "context", "step", "median_ms", "ttft_ms", "prefilled_tokens", "trials_ms", "decode_tok_s"}
META_KEYS = {"command", "threads", "loadavg_start", "loadavg_end", "machine", "torch", "model", "date", "skipped"}


def _stand_in_hotpotqa(folder):
    """Six HotpotQA-shaped items (10 paragraphs, 2 supporting) written for this test."""
    items = []
    for q in range(6):
        titles = [f"Place {q}-{p}" for p in range(10)]
        context = [[t, [f"{t} lies on river {q + p}. ", f"It was founded in {1800 + 7 * p + q}."]]
                   for p, t in enumerate(titles)]
        items.append({"_id": f"standin-{q}", "question": f"Which river does {titles[0]} lie on?",
                      "answer": f"river {q}", "supporting_facts": [[titles[0], 0], [titles[3], 1]],
                      "context": context, "type": "bridge", "level": "hard"})
    path = folder / HOTPOT_FILE
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(items))
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return _stand_in_hotpotqa(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _run(model_dir, data, out, *extra):
    return main(["bench", "agent", "--quick", "--contexts", "512", "--model", str(model_dir), "--data", str(data),
                 "--out", str(out), "--threads", "1", *extra])


def _cells(out) -> tuple[dict, dict]:
    report = json.loads((out / "agent.json").read_text())
    return report, {(r["system"], r["step"]): r for r in report["rows"]}


def test_agent_chat_fits_the_context_and_deletes_a_distractor(data, tokenizer):
    chat = agent_chat(data, tokenizer, 512, room=8000)
    assert chat.prompt_tokens["first"] <= 512 and chat.tool_results >= 3
    history = chat.steps["append"]
    deleted = [m for m in history if m not in chat.steps["delete"]]
    assert [m["role"] for m in deleted] == ["tool"]
    position = history.index(deleted[0])
    assert 2 < position < len(history) - 3  # in the middle of the history, tool turns after it
    assert "Place 0-0" not in deleted[0]["content"] and "Place 0-3" not in deleted[0]["content"]  # not supporting
    assert chat.deleted_tokens > 0 and chat.steps["decode"] == chat.steps["delete"]


def test_bench_agent_runs_every_system_and_step(model_dir, data, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed here anyway: the skip is announced
    assert _run(model_dir, data, tmp_path) == 0
    assert "llama.cpp skipped" in capsys.readouterr().out
    report, cell = _cells(tmp_path)
    assert META_KEYS <= set(report["meta"]) and report["meta"]["command"].startswith("kvmemory bench agent")
    # a folder model has no GGUF blocks: kvmemory's rows run on transformers (named in the system)
    systems = ["kvmemory sur@5 fp32 transformers", "transformers fp32", "transformers bf16"]
    assert report["meta"]["systems"] == systems and set(cell) == {(s, st) for s in systems for st in STEPS}
    for row in report["rows"]:
        assert ROW_KEYS <= set(row) and row["context"] == 512 and len(row["trials_ms"]) == 1
        assert 0 < row["ttft_ms"] <= row["median_ms"]
        assert (row["decode_tok_s"] is not None and row["decode_tok_s"] > 0) == (row["step"] == "decode")
    prompt = {st: cell[("transformers fp32", st)]["prompt_tokens"] for st in STEPS}
    for s in ("transformers fp32", "transformers bf16"):  # Re-prefill computes every prompt token every call
        assert all(cell[(s, st)]["prefilled_tokens"] == prompt[st] for st in STEPS)
    kv = {st: cell[("kvmemory sur@5 fp32 transformers", st)] for st in STEPS}
    assert kv["first"]["prefilled_tokens"] == prompt["first"]
    assert kv["repeat"]["prefilled_tokens"] <= 1 and kv["decode"]["prefilled_tokens"] <= 1
    # the appended turn (+ the generation prompt it replaces) only
    assert kv["append"]["prefilled_tokens"] <= prompt["append"] - prompt["first"] + 3
    assert 0 < kv["delete"]["prefilled_tokens"] < prompt["delete"] // 4
    assert all(kv[st]["fallback"] is None for st in STEPS)
    md = (tmp_path / "agent.md").read_text()
    assert "## Context 512" in md and "Time ratio to transformers bf16" in md and "kvmemory bench agent" in md
    alone = report["meta"]["memory"]["kvmemory_process"]  # measured in a process of its own
    assert 0 < alone["rss_bytes"] <= alone["peak_rss_bytes"] and "kvmemory alone in a fresh process" in md
    assert (tmp_path / "agent.png").stat().st_size > 0


class _StandInLlama:
    """llama-cpp-python's ``Llama`` as the benchmark uses it: byte tokens, a constant answer token,
    and ``generate``'s reuse of the longest common prefix of the cached tokens with the prompt
    minus its last token (the rest is evaluated through ``eval``)."""

    def __init__(self, model_path, *, n_ctx, n_threads, n_threads_batch, verbose):
        self.input_ids, self.n_tokens = [], 0

    def tokenize(self, text, add_bos=True, special=False):
        return list(text)

    def detokenize(self, tokens):
        return bytes(t % 128 for t in tokens)

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        self.input_ids[self.n_tokens:] = list(tokens)
        self.n_tokens += len(tokens)

    def generate(self, tokens, temp=0.8, repeat_penalty=1.1):
        prefix = 0
        for a, b in zip(self.input_ids[: self.n_tokens], tokens[:-1]):
            if a != b:
                break
            prefix += 1
        self.n_tokens, pending = prefix, list(tokens[prefix:])
        while True:
            self.eval(pending)
            yield 65
            pending = [65]


def test_llama_cpp_path_counts_what_llama_cpp_evaluates(model_dir, data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=_StandInLlama, __version__="stand-in"))
    gguf = tmp_path / "model.Q4_1.gguf"
    assert _run(model_dir, data, tmp_path / "out", "--gguf", str(gguf)) == 0
    report, cell = _cells(tmp_path / "out")
    assert report["meta"]["llama_cpp"] == "stand-in" and "llama.cpp Q4_1" in report["meta"]["systems"]
    llama = {st: cell[("llama.cpp Q4_1", st)]["prefilled_tokens"] for st in STEPS}
    assert llama["repeat"] == llama["decode"] == 1  # prefix reuse re-evaluates the last prompt token
    assert 0 < llama["append"] < llama["first"] // 4
    assert llama["append"] < llama["delete"] < llama["first"]  # everything after the deleted result again
    assert "Time ratio to llama.cpp Q4_1" in (tmp_path / "out" / "agent.md").read_text()


def test_bad_options_name_the_fix(data, tmp_path, capsys):
    assert main(["bench", "agent", "--quick", "--policies", "sur@500", "--data", str(data), "--out", str(tmp_path)]) == 2
    assert "--policies" in capsys.readouterr().out
    assert main(["bench", "agent", "--quick", "--data", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "--data" in capsys.readouterr().out
    assert main(["bench", "agent", "--quick", "--engines", "fast", "--data", str(data), "--out", str(tmp_path)]) == 2
    assert "--engines" in capsys.readouterr().out
    assert not (tmp_path / "agent.json").exists()


def test_session_configurations_reject_unknown_engine_options(real):
    config = {"engine": "kvmemory", "policy": "replay", "dtype": "fp32"}
    assert build_session(config, real, None).policy.label == "replay"
    with pytest.raises(ValueError, match="build_session"):
        build_session({**config, "compiled_decode": True}, real, None)
