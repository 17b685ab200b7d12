"""OnlineAdapter over a ChatKVMemory's thread registry: every argument is checked before the
LoRA step, a step that fails is rolled back, and a thread whose maintenance fails after the step
has its cache dropped and re-prefilled exactly (reported), while the other threads are served
from their maintained caches."""

from __future__ import annotations

import logging

import pytest
import torch
from langchain_core.messages import HumanMessage

from kvmemory import InputTypeError, KVSession, kvcache
from kvmemory.errors import AdapterUpdateError
from kvmemory.reforge import ReforgeConfig, capture_adapter
from kvmemory.online_adapter import OnlineAdapter
from kvmemory.reforge.profile import ProfileKey, ReforgeProfile
from kvmemory.threads import ThreadCaches
from langchain_kvmemory import ChatKVMemory
from langchain_kvmemory.online_training import trained_messages
from support import QUERY, history, tiny_model
from test_reforge import LAYERS, lora_tiny

ROWS_ATOL = 1e-4  # K/V rows against Re-prefill (fp32, transformers: LoRA runs outside the quantized engine)
LOGPROB_ATOL = 2e-3  # logits within 1e-3 move a log-softmax by at most twice that
QUESTION = HumanMessage("Where was Ilse Marrow born? Answer in one word.", id="q1")
FOLLOW_UP = HumanMessage("Spell it backwards.", id="q2")


def _digest(model) -> str:
    return capture_adapter(model, LAYERS).digest


# ------------------------------------------------------------------ tiny model: checks, rollback
def test_arguments_are_checked_before_any_update(tokenizer):
    pm = lora_tiny(targets=("v_proj",), layers=(2,))
    with pytest.raises(InputTypeError, match="ThreadCaches registry"):
        OnlineAdapter(pm, tokenizer, ["not", "a", "registry"])
    with pytest.raises(ValueError, match="different model"):
        OnlineAdapter(pm, tokenizer, ThreadCaches(tiny_model("llama"), tokenizer))
    key = ProfileKey(model="other", update_target="v_proj@2", adapter_config="a", context_regime="c")
    wrong = ReforgeProfile(key=key, num_layers=30, sensitivity=[1.0] * 30, delta=[1.0] * 30, drift_threshold=None,
                           thresholds={})
    ok = KVSession(pm, tokenizer, reforge=ReforgeConfig())
    miscalibrated = KVSession(pm, tokenizer, reforge=ReforgeConfig(profile=wrong))  # a profile of another model
    for session in (ok, miscalibrated):
        session.prepare(history()[:2])
    with pytest.raises(ValueError, match="'miscalibrated'.*30 layers"):
        OnlineAdapter(pm, tokenizer, {"ok": ok, "miscalibrated": miscalibrated})
    online = OnlineAdapter(pm, tokenizer, {"ok": ok}, lr=5e-2)
    online.sessions["miscalibrated"] = miscalibrated  # the registry is shared: sessions join after construction
    before = _digest(pm)
    with pytest.raises(ValueError, match="'miscalibrated'.*30 layers"):
        online.update(history()[:2], "Helmsford")
    with pytest.raises(ValueError, match="empty"):
        online.update(history()[:2], " ")
    assert _digest(pm) == before and online.updates == 0 and not online.optimizer.state  # no step ran
    assert ok.prepare(history()[:2]).adapter is None  # nothing to maintain


def test_a_step_that_fails_half_way_is_rolled_back(tokenizer, caplog):
    """Adam steps its parameter groups one after another: a second group that cannot step
    (capturable on CPU) raises after the first group's weights moved."""
    pm = lora_tiny(targets=("v_proj", "q_proj"), layers=(2,))
    trainable = [p for p in pm.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam([{"params": trainable[:2]}, {"params": trainable[2:], "capturable": True}], lr=5e-2)
    session = KVSession(pm, tokenizer, "replay", reforge=ReforgeConfig())
    session.prepare(history() + [QUERY])
    online = OnlineAdapter(pm, tokenizer, {"t": session}, optimizer=optimizer)
    before, weights = _digest(pm), [p.detach().clone() for p in trainable]
    with caplog.at_level(logging.ERROR, logger="kvmemory.online_adapter"), \
            pytest.raises(AdapterUpdateError, match="rolled back") as failed:
        online.update(history()[:2], "Helmsford")
    assert failed.value.version == before == _digest(pm) and online.updates == 0
    assert all(torch.equal(p, w) for p, w in zip(trainable, weights)) and not optimizer.state
    assert "rolled back" in caplog.text
    assert session.prepare(history() + [QUERY]).adapter is None  # the cache was never out of date


def test_a_thread_busy_in_a_call_maintains_itself_at_its_next_forward(tokenizer):
    pm = lora_tiny(targets=("v_proj",), layers=(2,))
    registry = ThreadCaches(pm, tokenizer, "replay")
    online = OnlineAdapter(pm, tokenizer, registry, lr=5e-2)
    with pytest.raises(InputTypeError, match="lease"):
        online.register("x", KVSession(pm, tokenizer))
    for tid in ("idle", "busy"):
        with registry.lease(tid) as session:
            session.prepare(history() + [QUERY])
    with registry.lease("busy") as busy:  # a call runs on this thread during the update
        report = online.update(history()[:2], "Helmsford")
        assert set(report.sessions) == {"idle"} and report.busy == ["busy"] and not report.dropped
        assert busy.adapter_versions.mixed or busy.adapter_versions.stale_layers  # not maintained under the call
    with registry.lease("busy") as session:
        repair = session.prepare(history() + [QUERY])
    assert repair.adapter["adapter_version"] == report.version_after and repair.adapter["action"] == "full_suffix"
    fresh = KVSession(pm, tokenizer, "reprefill")
    fresh.prepare(history() + [QUERY])
    torch.testing.assert_close(registry.session("busy").next_logits, fresh.next_logits, atol=1e-4, rtol=0)
    assert registry.session("idle").prepare(history() + [QUERY]).adapter["adapter_version"] == report.version_after


# ------------------------------------------------------------------ the embedded model + LoRA
@pytest.fixture
def lora_real(real):
    from kvmemory_lab.reforge.workload import attach_lora

    model, _, _ = attach_lora(real.model, "v_proj", 15, 8, 16)
    yield model
    model.unload()  # give the shared fixture its plain model back


def _held_rows(chat: ChatKVMemory, thread: str) -> int:
    return len(chat.threads.session(thread).token_ids)


def _assert_equals_reprefill(chat: ChatKVMemory, answer, thread: str, turn: list) -> None:
    """The thread's answer and cache rows equal a Re-prefill of ``turn`` (a fresh thread)."""
    reference = chat.invoke(turn, config={"configurable": {"thread_id": thread + "-reprefill"}})
    assert reference.response_metadata["repair"]["reused_tokens"] == 0 and answer.content == reference.content
    for a, b in zip(answer.response_metadata["logprobs"]["content"], reference.response_metadata["logprobs"]["content"],
                    strict=True):
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        for x, y in zip(a["top_logprobs"], b["top_logprobs"]):
            assert x["logprob"] == pytest.approx(y["logprob"], abs=LOGPROB_ATOL)
    live, fresh = chat.threads.session(thread), chat.threads.session(thread + "-reprefill")
    assert live.token_ids == fresh.token_ids
    for (k, v), (rk, rv) in zip(kvcache.layer_tensors(live.cache), kvcache.layer_tensors(fresh.cache)):
        torch.testing.assert_close(k, rk, atol=ROWS_ATOL, rtol=0)
        torch.testing.assert_close(v, rv, atol=ROWS_ATOL, rtol=0)


@pytest.mark.real_model
def test_an_update_over_chat_threads_serves_the_next_call_from_the_maintained_cache(real, lora_real):
    chat = ChatKVMemory(model=real, max_tokens=6, logprobs=True, top_logprobs=3)
    cfg = {"configurable": {"thread_id": "ttt"}}
    first = chat.invoke([QUESTION], config=cfg)
    held = _held_rows(chat, "ttt")
    online = OnlineAdapter(lora_real, real.tokenizer, chat.threads, lr=5e-2)
    report = online.update(trained_messages(real.tokenizer, [QUESTION]), "Helmsford")
    assert report.version_before != report.version_after and not report.dropped and not report.busy
    assert set(report.sessions) == {"ttt"} and report.sessions["ttt"].action == "full_suffix"
    assert report.sessions["ttt"].start == 15 and report.sessions["ttt"].rows == held

    turn = [QUESTION, first, FOLLOW_UP]
    second = chat.invoke(turn, config=cfg)
    repair = second.response_metadata["repair"]
    # the call is served from the cache the update maintained, and its report says so
    assert repair["adapter"]["action"] == "full_suffix" and repair["adapter"]["adapter_version"] == report.version_after
    assert repair["fallback"] is None and repair["reused_tokens"] == held
    _assert_equals_reprefill(chat, second, "ttt", turn)


@pytest.mark.real_model
def test_a_thread_whose_maintenance_fails_after_the_step_is_recomputed_exactly(real, lora_real, caplog):
    """A thread whose rows were computed under torch.inference_mode cannot be rewritten in place
    outside it: its maintenance fails after the LoRA step. Its cache is dropped and its next call
    re-prefills (reported); the other thread is maintained and served from its cache."""
    chat = ChatKVMemory(model=real, max_tokens=6, logprobs=True, top_logprobs=3)
    kept, failing = {"configurable": {"thread_id": "kept"}}, {"configurable": {"thread_id": "inference"}}
    first = chat.invoke([QUESTION], config=kept)
    with torch.inference_mode():
        other = chat.invoke([QUESTION], config=failing)
    held = _held_rows(chat, "kept")
    online = OnlineAdapter(lora_real, real.tokenizer, chat.threads, lr=5e-2)
    with caplog.at_level(logging.WARNING):
        report = online.update(trained_messages(real.tokenizer, [QUESTION]), "Helmsford")
    assert report.version_after != report.version_before and online.updates == 1
    assert set(report.sessions) == {"kept"} and set(report.dropped) == {"inference"}
    assert "inference" in report.dropped["inference"].lower() and "dropped" in caplog.text
    assert chat.threads.session("inference").token_ids == []  # nothing half rewritten is kept

    turn = [QUESTION, other, FOLLOW_UP]
    recomputed = chat.invoke(turn, config=failing)
    repair = recomputed.response_metadata["repair"]
    assert repair["reused_tokens"] == 0 and "maintenance failed" in repair["fallback"]
    _assert_equals_reprefill(chat, recomputed, "inference", turn)

    turn = [QUESTION, first, FOLLOW_UP]
    served = chat.invoke(turn, config=kept)
    assert served.response_metadata["repair"]["adapter"]["adapter_version"] == report.version_after
    assert served.response_metadata["repair"]["reused_tokens"] == held
    _assert_equals_reprefill(chat, served, "kept", turn)
