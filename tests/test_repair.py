"""Repair operators against Re-prefill: Replay, budget 100, Shift, sparse refresh, edits at the
edges, exact recomputed-token counts, and the cache/tokenization invariant."""

from __future__ import annotations

import pytest
import torch

from kvmemory import kvcache
from kvmemory.executors.sequential import run_sequential
from kvmemory.policy import RepairPolicy
from kvmemory.selection import allowance
from kvmemory.session import KVSession
from support import QUERY, history, prepared, replaced, without

TOL = 1e-4  # fp32 logits / K/V tolerance for equality with Re-prefill

REPLAY = RepairPolicy(operator="replay")
REPREFILL = RepairPolicy(operator="reprefill")
SHIFT = RepairPolicy(operator="shift")


def assert_same_cache(a: KVSession, b: KVSession, tol: float = TOL) -> None:
    assert a.token_ids == b.token_ids
    for (ka, va), (kb, vb) in zip(kvcache.layer_tensors(a.cache), kvcache.layer_tensors(b.cache)):
        torch.testing.assert_close(ka, kb, atol=tol, rtol=0)
        torch.testing.assert_close(va, vb, atol=tol, rtol=0)
    torch.testing.assert_close(a.next_logits, b.next_logits, atol=tol, rtol=0)


EDITS = {
    "delete-middle": lambda h: without(h, "a2", "t2"),
    "delete-first-after-system": lambda h: without(h, "u1"),
    "delete-last": lambda h: without(h, "t3"),
    "delete-all-after-system": lambda h: h[:1],
    "replace-shorter": lambda h: replaced(h, "t2", "[cleared]"),
    "replace-longer": lambda h: replaced(h, "t2", "Port Calder has three lighthouses. " * 6),
    "insert-middle": lambda h: h[:4] + [{"role": "user", "content": "Keep going.", "id": "ins"}] + h[4:],
    "several-edits": lambda h: replaced(without(h, "a1"), "t2", "[cleared]")[:-1],
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_replay_equals_reprefill_tiny(tiny, tokenizer, edit):
    _, model = tiny
    base = prepared(model, tokenizer, history())
    new = EDITS[edit](history()) + [QUERY]
    replay, reprefill = base.fork(), base.fork()
    replay.prepare(new, policy=REPLAY)
    reprefill.prepare(new, policy=REPREFILL)
    assert_same_cache(replay, reprefill)
    replay.check_invariants()


def test_budget_100_is_replay_and_refreshes_whole_suffix(tiny, tokenizer):
    _, model = tiny
    base = prepared(model, tokenizer, history())
    new = without(history(), "a2", "t2") + [QUERY]
    full, replay = base.fork(), base.fork()
    report = full.prepare(new, policy=RepairPolicy(operator="refresh", budget=100))
    replay.prepare(new, policy=REPLAY)
    assert_same_cache(full, replay, tol=0.0)
    assert report.refreshed_tokens == report.stale_tokens > 0


def test_shift_keeps_prefix_rows_and_computes_only_new_text(tiny, tokenizer):
    _, model = tiny
    base = prepared(model, tokenizer, history())
    old_rows = kvcache.layer_tensors(kvcache.clone_cache(base.cache))
    new = without(history(), "a2", "t2") + [QUERY]
    shift = base.fork()
    report = shift.prepare(new, policy=SHIFT)
    shift.check_invariants()
    f = next(i for i, (a, b) in enumerate(zip(base.token_ids, shift.token_ids)) if a != b)
    assert f >= next(s.token_start for s in base.rendered.segments if s.key == "a2")
    assert report.refreshed_tokens == 0 and report.shifted_tokens == report.stale_tokens > 0
    # only text without a valid row is computed: everything after f that is not a kept row
    assert report.recomputed_tokens == len(shift.token_ids) - f - report.stale_tokens
    for (k0, v0), (k1, v1) in zip(old_rows, kvcache.layer_tensors(shift.cache)):
        assert torch.equal(k0[:, :, :f], k1[:, :, :f]) and torch.equal(v0[:, :, :f], v1[:, :, :f])


def _shift_and_replay(model, tokenizer):
    """Shift and Replay sessions after deleting a middle tool call, with the first stale
    position f and the prompt length n."""
    base = prepared(model, tokenizer, history())
    new = without(history(), "a2", "t2") + [QUERY]
    shift, replay = base.fork(), base.fork()
    shift.prepare(new, policy=SHIFT)
    replay.prepare(new, policy=REPLAY)
    return shift, replay, replay.last_report.reused_tokens, len(shift.token_ids)


def test_sequential_intervals_covering_the_suffix_equal_replay(tiny, tokenizer):
    """Forwarding the whole stale suffix as several in-order intervals must equal Replay: each
    interval reads the earlier, already refreshed ones."""
    _, model = tiny
    shift, replay, f, n = _shift_and_replay(model, tokenizer)
    cuts = [f, f + 5, f + 17, (f + n) // 2, n]
    ids = torch.tensor(shift.token_ids)
    out = run_sequential(model, shift.cache, ids, list(zip(cuts[:-1], cuts[1:])))
    torch.testing.assert_close(out.next_logits, replay.next_logits, atol=TOL, rtol=0)
    for (ka, va), (kb, vb) in zip(kvcache.layer_tensors(shift.cache), kvcache.layer_tensors(replay.cache)):
        torch.testing.assert_close(ka, kb, atol=TOL, rtol=0)
        torch.testing.assert_close(va, vb, atol=TOL, rtol=0)


@pytest.mark.parametrize("budget", [2, 5, 20, 60])
def test_sparse_refresh_spends_exact_allowance(tiny, tokenizer, budget):
    _, model = tiny
    base = prepared(model, tokenizer, history())
    s = base.fork()
    report = s.prepare(without(history(), "a2", "t2") + [QUERY], policy=RepairPolicy(budget=budget))
    assert report.refreshed_tokens == allowance(report.stale_tokens, budget)
    s.check_invariants()
    # the repair moves the answer toward Re-prefill but is not bit-identical unless b = 100
    ref = base.fork()
    ref.prepare(s.messages, policy=REPREFILL)
    assert s.next_logits.shape == ref.next_logits.shape


def test_sparse_refresh_changes_only_computed_rows(tiny, tokenizer):
    """Relative to Shift, a sparse refresh rewrites exactly the computed spans; every other row is
    bit-identical, and the refreshed stale rows do change."""
    _, model = tiny
    base = prepared(model, tokenizer, history())
    new = without(history(), "a2", "t2") + [QUERY]
    shift, sur = base.fork(), base.fork()
    shift.prepare(new, policy=SHIFT)
    report = sur.prepare(new, policy=RepairPolicy(budget=20))
    computed = _mask(report.spans, len(sur.token_ids))
    new_text = _mask(shift.last_report.spans, len(sur.token_ids))  # what Shift had to compute
    refreshed = computed & ~new_text
    assert int(computed.sum()) == report.recomputed_tokens
    assert int(refreshed.sum()) == report.refreshed_tokens > 0
    for (ks, vs), (kr, vr) in zip(kvcache.layer_tensors(shift.cache), kvcache.layer_tensors(sur.cache)):
        assert torch.equal(ks[:, :, ~computed], kr[:, :, ~computed])
        assert torch.equal(vs[:, :, ~computed], vr[:, :, ~computed])
    v_shift, v_sur = kvcache.layer_tensors(shift.cache)[-1][1], kvcache.layer_tensors(sur.cache)[-1][1]
    assert (v_shift - v_sur)[:, :, refreshed].abs().max() > 10 * TOL


def _mask(spans, n):
    mask = torch.zeros(n, dtype=torch.bool)
    for a, b in spans:
        mask[a:b] = True
    return mask


def test_near_full_refresh_approaches_reprefill_on_real_model(real):
    """On the real model, Shift differs from Re-prefill and refreshing 90 % of the stale rows
    (dense-token control) brings the first-token distribution much closer."""
    from kvmemory.divergence import first_token_kl

    base = prepared(real.model, real.tokenizer, history())
    new = without(history(), "a2", "t2") + [QUERY]
    logits = {}
    for name, policy in {"shift": SHIFT, "dense@90": RepairPolicy(budget=90, allocator="dense"),
                         "reprefill": REPREFILL}.items():
        s = base.fork()
        s.prepare(new, policy=policy)
        logits[name] = s.next_logits
    shift_kl = first_token_kl(logits["reprefill"], logits["shift"])
    dense_kl = first_token_kl(logits["reprefill"], logits["dense@90"])
    assert shift_kl > 1e-4
    assert dense_kl < shift_kl / 2


def test_mid_conversation_edit_recomputes_from_first_differing_token(tiny, tokenizer):
    _, model = tiny
    base = prepared(model, tokenizer, history() + [QUERY])
    new = replaced(history(), "t2", "Port Calder has four lighthouses.") + [QUERY]
    s = base.fork()
    report = s.prepare(new, policy=REPLAY)
    old_ids, new_ids = base.token_ids, s.token_ids
    f = next(i for i, (a, b) in enumerate(zip(old_ids, new_ids)) if a != b)
    assert report.reused_tokens == f
    assert report.recomputed_tokens == len(new_ids) - f


def test_append_only_turn_prefills_only_new_tokens(tiny, tokenizer):
    _, model = tiny
    s = prepared(model, tokenizer, history() + [QUERY])
    gen = s.generate(max_new_tokens=4)
    before = list(s.token_ids)
    turn = history() + [QUERY, {"role": "assistant", "content": gen.text, "id": "ans"},
                        {"role": "user", "content": "Thanks! And when?", "id": "q2"}]
    report = s.prepare(turn)
    f = next((i for i, (a, b) in enumerate(zip(before, s.token_ids)) if a != b), min(len(before), len(s.token_ids)))
    assert report.reused_tokens == f > 0
    assert report.recomputed_tokens == len(s.token_ids) - f
    assert report.stale_tokens == 0
    s.check_invariants()


def test_real_model_replay_equals_reprefill(real):
    base = prepared(real.model, real.tokenizer, history())
    new = without(history(), "a2", "t2") + [QUERY]
    replay, reprefill = base.fork(), base.fork()
    replay.prepare(new, policy=REPLAY)
    reprefill.prepare(new, policy=REPREFILL)
    assert_same_cache(replay, reprefill)
    a, b = replay.generate(max_new_tokens=8), reprefill.generate(max_new_tokens=8)
    assert a.token_ids == b.token_ids


def test_dirty_keeps_the_deleted_message(tiny, tokenizer):
    _, model = tiny
    base = prepared(model, tokenizer, history())
    s = base.fork()
    report = s.prepare(without(history(), "a2", "t2") + [QUERY], policy=RepairPolicy(operator="dirty"))
    assert [m.key for m in s.messages] == [m["id"] for m in history()] + ["q"]
    # everything up to the old generation prompt's role tokens is reused; nothing is stale
    f = next(i for i, (a, b) in enumerate(zip(base.token_ids, s.token_ids)) if a != b)
    assert report.stale_tokens == 0 and report.reused_tokens == f >= len(base.token_ids) - 3
    s.check_invariants()


def _assert_shift_layer0_equals_reprefill(model, tokenizer, deleted: tuple[str, ...]) -> None:
    """Layer-0 K/V depend only on token and position, so shifted rows must match Re-prefill there
    (up to RoPE rounding) while deeper layers keep the deleted text's influence."""
    base = prepared(model, tokenizer, history())
    new = without(history(), *deleted) + [QUERY]
    shift, ref = base.fork(), base.fork()
    shift.prepare(new, policy=SHIFT)
    ref.prepare(new, policy=REPREFILL)
    layers_shift, layers_ref = kvcache.layer_tensors(shift.cache), kvcache.layer_tensors(ref.cache)
    torch.testing.assert_close(layers_shift[0][0], layers_ref[0][0], atol=TOL, rtol=0)
    torch.testing.assert_close(layers_shift[0][1], layers_ref[0][1], atol=TOL, rtol=0)
    assert (layers_shift[1][0] - layers_ref[1][0]).abs().max() > 10 * TOL  # stale context differs


def test_shift_layer0_rows_equal_reprefill(tiny, tokenizer):
    _assert_shift_layer0_equals_reprefill(tiny[1], tokenizer, ("a2", "t2"))


def test_real_model_shift_layer0_equals_reprefill(real):
    _assert_shift_layer0_equals_reprefill(real.model, real.tokenizer, ("u1",))


def test_bf16_model_repairs(real):
    from kvmemory.models import load_model

    lm = load_model(dtype="bf16")
    s = prepared(lm.model, lm.tokenizer, history())
    report = s.prepare(without(history(), "a2", "t2") + [QUERY], policy=RepairPolicy(budget=5))
    assert report.refreshed_tokens == allowance(report.stale_tokens, 5) > 0
    assert s.cache.layers[0].keys.dtype == torch.bfloat16
    s.check_invariants()
    assert s.generate(max_new_tokens=4).token_ids


def test_three_successive_deletions_equal_one_net_deletion(tiny, tokenizer):
    """Shift three times or once by the net amount: every kept message's rows agree. (The first
    token of a message is excluded: ``<|im_start|>`` is shared by all messages, so the common
    token prefix may keep the deleted message's row for it, which is equally stale.)"""
    _, model = tiny
    base = prepared(model, tokenizer, history())
    stepwise, net = base.fork(), base.fork()
    for mid in ("a1", "a2", "a3"):
        stepwise.delete_message(mid, policy=SHIFT)
    net.prepare(without(history(), "a1", "a2", "a3"), policy=SHIFT)
    assert stepwise.token_ids == net.token_ids
    for seg in net.rendered.segments:
        rows = slice(seg.token_start + 1, seg.token_end)
        for (ka, va), (kb, vb) in zip(kvcache.layer_tensors(stepwise.cache), kvcache.layer_tensors(net.cache)):
            torch.testing.assert_close(ka[:, :, rows], kb[:, :, rows], atol=1e-5, rtol=0)
            torch.testing.assert_close(va[:, :, rows], vb[:, :, rows], atol=0, rtol=0)


def test_full_budget_after_sparse_repairs_still_equals_reprefill(tiny, tokenizer):
    """Stale rows left by earlier sparse repairs count as suffix: Replay recomputes from the first
    stale row, so b = 100 equals Re-prefill after any sequence of edits."""
    _, model = tiny
    s = prepared(model, tokenizer, history())
    s.delete_message("a1", policy=RepairPolicy(budget=10))
    s.replace_message("t2", "[cleared]", policy=SHIFT)
    assert s.exact_rows < len(s.token_ids)
    new = s.messages + [QUERY]
    ref = s.fork()
    report = s.prepare(new, policy=RepairPolicy(budget=100))
    ref.prepare(new, policy=REPREFILL)
    assert_same_cache(s, ref)
    assert s.exact_rows == len(s.token_ids) and report.reused_tokens < report.prompt_tokens


def test_interval_running_past_the_cache_end_grows_the_cache(tiny, tokenizer):
    """An interval [a, b) with a < cache length < b rewrites the rows it covers and appends the
    rest; with a = first stale row it is exactly Replay."""
    _, model = tiny
    shift, replay, f, n = _shift_and_replay(model, tokenizer)
    kvcache.crop_to(shift.cache, n - 7)
    out = run_sequential(model, shift.cache, torch.tensor(shift.token_ids), [(f, n)])
    assert kvcache.cache_length(shift.cache) == n
    torch.testing.assert_close(out.next_logits, replay.next_logits, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="no cache rows"):
        run_sequential(model, shift.cache, torch.tensor(shift.token_ids + [5, 6]), [(f, n)])
