"""The two-dimensional budget (layers × rows): every stale row in the lower layers, the allowance
B in all of them. Checked against an independent construction: Replay's rows in the lower layers
spliced under the Shift cache, then the B rows refreshed through every layer by the sequential
executor."""

from __future__ import annotations

import pytest
import torch

from kvmemory import kvcache
from kvmemory.errors import InputError
from kvmemory.executors.packed import run_packed
from kvmemory.executors.sequential import run_sequential
from kvmemory.policy import RepairPolicy
from kvmemory.selection import to_intervals
from support import QUERY, history, prepared, tiny_model, without
from test_packed import refresh_set, shifted_session

TOL = 1e-4


def _spliced_reference(model, session, f: int, positions: list[int], lower_layers: int):
    """The 2-D result built another way: layers below ``lower_layers`` from a Replay of [f, n),
    the rest from the Shift cache, then ``positions`` through every layer (sequential executor)."""
    ids = torch.tensor(session.token_ids)
    replayed = kvcache.clone_cache(session.cache)
    run_sequential(model, replayed, ids, [(f, len(ids))])
    spliced = kvcache.clone_cache(session.cache)
    for layer, exact in list(zip(spliced.layers, replayed.layers))[:lower_layers]:
        layer.keys.copy_(exact.keys)
        layer.values.copy_(exact.values)
    result = run_sequential(model, spliced, ids, to_intervals(positions))
    return spliced, result


def _check_against_splice(model, session, f: int, lower_layers: int, intervals: int):
    ids = torch.tensor(session.token_ids)
    n = len(ids)
    positions = refresh_set(f, n, intervals, "last")
    expected, expected_out = _spliced_reference(model, session, f, positions, lower_layers)
    got, out = run_packed(model, session.cache, ids, positions, lower_rows=list(range(f, n)), lower_layers=lower_layers)
    for (k0, v0), (k1, v1) in zip(kvcache.layer_tensors(expected), kvcache.layer_tensors(got)):
        torch.testing.assert_close(k1, k0, atol=TOL, rtol=0)
        torch.testing.assert_close(v1, v0, atol=TOL, rtol=0)
    torch.testing.assert_close(out.next_logits, expected_out.next_logits, atol=TOL, rtol=0)
    layers = len(model.get_decoder().layers)
    assert out.forwarded_tokens == round(len(positions) + (n - f - len(positions)) * lower_layers / layers)
    return got


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_lower_layers_equal_replay_below_and_a_refresh_above(family, tokenizer):
    model = tiny_model(family, layers=3)
    session, f = shifted_session(model, tokenizer)
    got = _check_against_splice(model, session, f, lower_layers=2, intervals=4)
    stale = kvcache.layer_tensors(session.cache)[2][1][:, :, f:]
    assert not torch.equal(kvcache.layer_tensors(got)[2][1][:, :, f:], stale)  # the top layer's B rows changed


def test_lower_layer_arguments_are_checked(tokenizer):
    model = tiny_model("llama", layers=2)
    session, f = shifted_session(model, tokenizer)
    ids = torch.tensor(session.token_ids)
    last = [len(ids) - 1]
    with pytest.raises(ValueError, match="lower_layers must be an int in \\[0, 2\\]"):
        run_packed(model, session.cache, ids, last, lower_rows=list(range(f, len(ids))), lower_layers=3)
    with pytest.raises(ValueError, match="needs lower_rows"):
        run_packed(model, session.cache, ids, last, lower_layers=1)
    with pytest.raises(ValueError, match="superset"):
        run_packed(model, session.cache, ids, [f, len(ids) - 1], lower_rows=[f + 1, len(ids) - 1], lower_layers=1)


def test_policy_label_round_trip_and_refusals():
    policy = RepairPolicy.coerce("sur+tail32+lower2@5")
    assert (policy.lower_layers, policy.tail_tokens, policy.budget) == (2, 32, 5.0)
    assert policy.label == "sur+tail32+lower2@5"
    with pytest.raises(InputError, match="fixed-budget refresh"):
        RepairPolicy.coerce("sur+lower2@auto")
    with pytest.raises(ValueError, match="fixed-budget refresh"):
        RepairPolicy(operator="shift", lower_layers=1)


@pytest.mark.real_model
def test_real_model_two_dimensional_repair(real):
    """On the embedded model: the executor matches the splice (3 lower layers, 16 rows in 4
    intervals); through ``prepare``, all layers low equals Replay, none equals SUR, and the report
    charges B + (S - B)·d/L tokens."""
    model, tok = real.model, real.tokenizer
    session, f = shifted_session(model, tok)
    _check_against_splice(model, session, f, lower_layers=3, intervals=4)

    layers = len(model.get_decoder().layers)
    base = prepared(model, tok, history())
    edited = without(history(), "a2", "t2") + [QUERY]

    def repaired(label):
        fork = base.fork()
        report = fork.prepare(edited, policy=label)
        return fork, report

    replay, _ = repaired("replay")
    full, full_report = repaired(f"sur+lower{layers}@5")
    torch.testing.assert_close(full.next_logits, replay.next_logits, atol=TOL, rtol=0)
    sur, sur_report = repaired("sur@5")
    none, none_report = repaired("sur+lower0@5")
    assert torch.equal(none.next_logits, sur.next_logits) and none_report.recomputed_tokens == sur_report.recomputed_tokens
    two, report = repaired("sur+lower4@5")
    B, S = report.refreshed_tokens, report.stale_tokens
    computed = sum(b - a for a, b in report.spans)  # B stale rows + the appended query's new rows
    assert report.recomputed_tokens == round(computed + (S - B) * 4 / layers)
    assert sur_report.recomputed_tokens < report.recomputed_tokens < full_report.recomputed_tokens
    assert report.executor == "packed-sdpa" and report.fallback is None
    fork = base.fork()
    with pytest.raises(InputError, match=f"the model has {layers} layers"):
        fork.prepare(edited, policy=f"sur+lower{layers + 1}@5")
    assert fork.token_ids == base.token_ids and fork.prepare(edited, policy="replay").recomputed_tokens  # nothing lost
