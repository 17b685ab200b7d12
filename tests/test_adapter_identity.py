"""Adapter identity: the cache's version covers every computing adapter (any name, which ones are
active, disabled or not), and exported / imported caches and checkpointer blobs carry their
adapter versions and the model's identity. Fidelity is checked against Re-prefill."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kvmemory import kvcache
from kvmemory.engine import forward_rows
from kvmemory.reforge import ReforgeConfig
from kvmemory.reforge.profile import ProfileKey, ReforgeProfile
from kvmemory.errors import CacheStateError
from kvmemory.persistence import CacheState
from kvmemory.session import KVSession
from kvmemory.threads import ThreadCaches
from support import QUERY, answer_graph, history, tiny_model

LAYERS = 6
MSGS = history() + [QUERY]
ATOL = 1e-4  # fp32 tiny models: a maintained cache equals Re-prefill to rounding (~3e-7 seen)


def lora(layer: int, target: str = "v_proj") -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=[target], layers_to_transform=[layer])


def nudge(model, adapter: str, scale: float = 1.0, seed: int = 1) -> None:
    """Move every LoRA B of ``adapter`` (new weights under the same adapter name)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f"lora_B.{adapter}." in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def peft_tiny(adapters: dict[str, LoraConfig], seed: int = 0):
    """A 6-layer tiny Llama with the named LoRA adapters (B moved off zero, so each one matters)."""
    (first, config), *rest = adapters.items()
    pm = get_peft_model(tiny_model("llama", seed=seed, num_hidden_layers=LAYERS), config, adapter_name=first)
    for name, cfg in rest:
        pm.add_adapter(name, cfg)
    for i, name in enumerate(adapters):
        nudge(pm, name, seed=10 + i)
    return pm.eval()


def reprefill_logits(model, tokenizer, msgs=MSGS) -> torch.Tensor:
    s = KVSession(model, tokenizer, "reprefill")
    s.prepare(msgs)
    return s.next_logits


def fresh_kv(model, token_ids: list[int]):
    cache = kvcache.new_cache(model.config)
    forward_rows(model, cache, torch.tensor(token_ids), 0)
    return kvcache.layer_tensors(cache)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# ------------------------------------------------------------- adapter identity
def test_adapter_under_another_name_is_tracked_and_maintained(tokenizer):
    pm = peft_tiny({"tuned": lora(2)})
    s = KVSession(pm, tokenizer, "replay")
    s.prepare(MSGS)
    nudge(pm, "tuned", seed=3)  # an update of the only adapter, which is not called "default"
    s.prepare(MSGS)
    assert max_diff(s.next_logits, reprefill_logits(pm, tokenizer)) < ATOL
    report = s.reforge.last_report
    assert (report.action, report.r_kv, report.start) == ("full_suffix", 2, 2)  # a comparable update: bounded by eq. S4
    assert report.incomparable == [] and not s.adapter_versions.stale_layers


def test_two_adapters_alternating_match_a_fresh_prefill(tokenizer):
    """'default' on layer 4, 'b' on layer 1: switching changes layer 1 too, which a version of
    'default' alone never saw (max |Δlogits| ~0.9 before)."""
    pm = peft_tiny({"default": lora(4), "b": lora(1)})
    s = KVSession(pm, tokenizer, "replay")
    s.prepare(MSGS)
    versions = {s.adapter_versions.current}
    for active in ("b", "default", "b"):
        pm.set_adapter(active)
        repair = s.prepare(MSGS)
        assert max_diff(s.next_logits, reprefill_logits(pm, tokenizer)) < ATOL, active
        report = s.reforge.last_report
        assert report.action != "reuse" and report.start <= 1 and report.incomparable  # other adapters: no distance
        assert "layout" in report.note and not s.adapter_versions.stale_layers
        assert repair.adapter == report.as_dict()  # the call's report says the cache was maintained first
        versions.add(s.adapter_versions.current)
    assert len(versions) == 2  # the version is the function: the same adapter again, the same version


@pytest.mark.parametrize("name", ["default", "tuned"])
def test_disable_adapter_is_a_version_never_judged_by_distance(tokenizer, name):
    """A calibrated rule with zero sensitivity would reuse any comparable update; disabling the
    adapter is not comparable (a different layout), so the layers are recomputed anyway."""
    pm = peft_tiny({name: lora(2)})
    key = ProfileKey(model="m", update_target="v_proj@2", adapter_config="a", context_regime="c")
    profile = ReforgeProfile(key=key, num_layers=LAYERS, sensitivity=[0.0] * LAYERS, delta=[None] * LAYERS,
                             drift_threshold=None, thresholds={})
    s = KVSession(pm, tokenizer, "replay", reforge=ReforgeConfig(profile=profile))
    s.prepare(MSGS)
    on = s.adapter_versions.current
    with pm.disable_adapter():
        s.prepare(MSGS)
        assert max_diff(s.next_logits, reprefill_logits(pm, tokenizer)) < ATOL
        assert s.reforge.last_report.incomparable == [2, 3, 4, 5]
        assert s.adapter_versions.current == "base"  # disabled computes what the plain model computes
    s.prepare(MSGS)
    assert max_diff(s.next_logits, reprefill_logits(pm, tokenizer)) < ATOL
    assert s.adapter_versions.current == on


def test_lora_attached_after_the_session_was_created(tokenizer):
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    s = KVSession(model, tokenizer, "replay")
    s.prepare(MSGS)
    assert s.reforge.boundary_bytes == 0  # inert without adapters: no boundary states, no hooks
    base = s.adapter_versions.current
    pm = get_peft_model(model, lora(3), adapter_name="late")  # wraps `model` in place
    nudge(pm, "late")
    s.prepare(MSGS)
    assert max_diff(s.next_logits, reprefill_logits(pm, tokenizer)) < ATOL
    assert base == "base" != s.adapter_versions.current
    report = s.reforge.last_report
    assert report.incomparable == [3, 4, 5] and report.start == 0 and "embedding" in report.note


def test_config_adapter_only_chooses_the_restart_layers(tokenizer):
    pm = peft_tiny({"default": lora(4), "b": lora(1)})
    for name, p in pm.named_parameters():
        p.requires_grad_("lora_" in name)  # both adapters trainable
    assert KVSession(pm, tokenizer).reforge.boundaries.layers == (1, 4)
    assert KVSession(pm, tokenizer, reforge=ReforgeConfig(adapter="b")).reforge.boundaries.layers == (1,)
    with pytest.raises(ValueError, match="names no adapter"):
        KVSession(pm, tokenizer, reforge=ReforgeConfig(adapter="missing"))


# ------------------------------------------------------- stored states carry versions
def _exported(model, tokenizer, msgs=MSGS, name="tiny") -> CacheState:
    reg = ThreadCaches(model, tokenizer, "replay", model_name=name)
    with reg.lease("a") as s:
        s.prepare(msgs)
    state = reg.export_state("a")
    return CacheState.from_parts(state.tensors(), state.metadata())  # what a safetensors blob holds


def test_import_after_new_weights_under_the_same_name_is_maintained(tokenizer):
    pm = peft_tiny({"default": lora(2)})
    state = _exported(pm, tokenizer)
    nudge(pm, "default", seed=5)  # a reload of new weights under the same adapter name
    session = ThreadCaches(pm, tokenizer, "replay", model_name="tiny").import_state("a", state)
    assert session.adapter_versions.stale_layers == [0, 1, 2, 3, 4, 5]  # restored: not current
    report = session.prepare(MSGS)
    assert max_diff(session.next_logits, reprefill_logits(pm, tokenizer)) < ATOL  # was ~0.7
    assert report.reused_tokens == len(session.token_ids)  # the rows were kept, their layers maintained
    maintained = session.reforge.last_report
    assert maintained.incomparable == [2, 3, 4, 5] and maintained.reanchored == [0, 1]  # no θ stored: exact
    for (k, v), (fk, fv) in zip(kvcache.layer_tensors(session.cache), fresh_kv(pm, session.token_ids)):
        assert max_diff(k, fk) < ATOL and max_diff(v, fv) < ATOL


def test_import_under_the_same_adapter_reuses_without_maintenance(tokenizer):
    pm = peft_tiny({"default": lora(2)})
    state = _exported(pm, tokenizer)
    session = ThreadCaches(pm, tokenizer, "replay", model_name="tiny").import_state("a", state)
    assert not session.adapter_versions.stale_layers
    session.prepare(MSGS)
    assert session.reforge.last_report is None  # nothing to maintain
    assert max_diff(session.next_logits, reprefill_logits(pm, tokenizer)) < ATOL


def test_model_identity_and_old_states_are_refused(tokenizer):
    model = tiny_model("llama")
    state = _exported(model, tokenizer)
    assert state.weights_digest and state.model_dtype == "torch.float32" and state.adapter_versions
    other = tiny_model("llama", seed=1)  # same layout and name, other weights
    with pytest.raises(CacheStateError, match="other base weights"):
        ThreadCaches(other, tokenizer, model_name="tiny").import_state("a", state)
    with pytest.raises(CacheStateError, match="dtype|runs in"):
        ThreadCaches(model, tokenizer).import_state("a", CacheState(**{**state.__dict__, "model_dtype": "torch.bfloat16"}))
    old = {k: v for k, v in state.metadata().items() if k not in ("weights_digest", "adapter_versions", "model_dtype")}
    old_state = CacheState.from_parts(state.tensors(), {**old, "format": "kvmemory.thread-state/1"})  # still readable
    reg = ThreadCaches(model, tokenizer)
    with pytest.raises(CacheStateError, match="older format"):
        reg.import_state("a", old_state)  # no versions: never trusted as current
    bad = {**state.adapter_versions, "layer_versions": ["nope"] * 2}
    with pytest.raises(CacheStateError, match="adapter versions"):
        reg.import_state("a", CacheState(**{**state.__dict__, "adapter_versions": bad}))
    assert reg.session("a").token_ids == []  # refused imports leave the thread empty
    assert ThreadCaches(model, tokenizer).import_state("a", state).token_ids == state.token_ids


def test_checkpointer_restart_after_new_adapter_weights_maintains_the_restored_cache(tmp_path, tokenizer):
    from langchain_core.messages import HumanMessage, SystemMessage

    from langchain_kvmemory.blobs import BlobRef
    from langchain_kvmemory.checkpointer import CACHE_KEY, KVCheckpointSaver

    pm = peft_tiny({"default": lora(2)})
    db, config = tmp_path / "chk.sqlite", {"configurable": {"thread_id": "t"}}
    turn1 = [SystemMessage("You are brief.", id="sys"), HumanMessage("Name a colour of the sky.", id="u1")]
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(pm, tokenizer), layout="blobs") as saver:
        answer_graph(saver.threads, saver).invoke({"messages": turn1}, config)
    nudge(pm, "default", seed=7)  # the next process loads new weights under the same name
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(pm, tokenizer), layout="blobs") as saver:
        answer_graph(saver.threads, saver).invoke({"messages": [HumanMessage("And at night?", id="u2")]}, config)
        assert "t" in saver.restored_from and not saver.restore_failures  # the blob was used...
        session = saver.threads.session("t")
        newest = CacheState.from_parts(*saver.store.get(BlobRef.from_dict(saver.get_tuple(config).metadata[CACHE_KEY])))
    current = session.adapter_versions.current
    assert set(newest.adapter_versions["layer_versions"]) == {current} == {newest.adapter_versions["logits_version"]}
    rows = session.exact_rows
    assert rows > 20
    for (k, v), (fk, fv) in zip(kvcache.layer_tensors(session.cache), fresh_kv(pm, session.token_ids)):
        # rows claimed exact equal a fresh prefill (K differed by 0.25 before)
        assert max_diff(k[:, :, :rows], fk[:, :, :rows]) < ATOL and max_diff(v[:, :, :rows], fv[:, :, :rows]) < ATOL
    assert session.reforge.last_report.incomparable  # ...after its stale layers were recomputed


def test_checkpointer_refuses_a_blob_of_other_base_weights(tmp_path, tokenizer):
    from langchain_core.messages import HumanMessage

    from langchain_kvmemory.checkpointer import KVCheckpointSaver

    db, config = tmp_path / "chk.sqlite", {"configurable": {"thread_id": "t"}}
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(tiny_model("llama"), tokenizer)) as saver:
        answer_graph(saver.threads, saver).invoke({"messages": [HumanMessage("Hi", id="u1")]}, config)
    with KVCheckpointSaver.from_sqlite(db, ThreadCaches(tiny_model("llama", seed=1), tokenizer)) as saver:
        answer_graph(saver.threads, saver).invoke({"messages": [HumanMessage("Again", id="u2")]}, config)
        assert saver.restore_failures["t"].startswith("incompatible") and "weights" in saver.restore_failures["t"]
