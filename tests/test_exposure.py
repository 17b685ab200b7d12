"""The exposure allocator (our extension): each stale row's attention on the removed rows,
estimated from the dirty cache alone, against the attention a real forward computes."""

from __future__ import annotations

import pytest
import torch

from kvmemory import kvcache
from kvmemory.selection.exposure import CALIBRATION_TEXT, estimated_exposure, fit_query_predictors, probe_layers
from kvmemory.selection.signals import capture_attention, eager_attention, forward_at
from kvmemory.session import KVSession
from kvmemory.shift import RotaryShifter
from kvmemory.testing import tiny_model
from support import QUERY, history, without


def _true_exposure(model, ids, old_rows, removed, layer) -> torch.Tensor:
    """Attention mass on ``removed`` of each row in ``old_rows`` at ``layer``, from an eager forward."""
    captured = {}
    with eager_attention(model), capture_attention(model, lambda i, w: captured.__setitem__(i, w), [layer]):
        forward_at(model, kvcache.new_cache(model.config), ids, 0)
    weights = captured[layer][0]  # [heads, N, N]
    return weights[:, old_rows][..., removed].sum(dim=-1).mean(dim=0)


def _calibration(tokenizer) -> list[int]:
    return tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"]


def _dirty(model, tokenizer):
    session = KVSession(model, tokenizer)
    session.prepare(history())
    n = len(session.token_ids)
    removed = list(range(n // 3, n // 3 + 12))
    old_rows = [r for r in range(n // 3, n) if r not in removed]
    return session, removed, old_rows


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_estimate_is_the_attention_when_keys_and_values_determine_the_state(family, tokenizer):
    # tiny models: 2 KV heads x 16 dims for K and for V = 64 = the hidden size, so the query is a
    # linear function of the cached K/V and the fitted predictor recovers it (up to the ridge)
    model = tiny_model(family)
    session, removed, old_rows = _dirty(model, tokenizer)
    shifter = RotaryShifter(model)
    for layer in (0, 1):
        est = estimated_exposure(model, session.cache, old_rows, removed, shifter, _calibration(tokenizer), layers=[layer])
        true = _true_exposure(model, session.token_ids, old_rows, removed, layer)
        assert torch.allclose(est, true, atol=2e-4), (family, layer, (est - true).abs().max())
    assert float(est.sum()) > 0


def test_without_removed_rows_every_score_is_zero(tokenizer):
    model = tiny_model("llama")
    session, _, old_rows = _dirty(model, tokenizer)
    assert estimated_exposure(model, session.cache, old_rows, [], RotaryShifter(model), [1, 2]).abs().sum() == 0


def test_a_model_without_rotary_keys_is_refused():
    with pytest.raises(ValueError, match="use sur"):
        estimated_exposure(tiny_model("llama"), None, [1], [0], None, [1, 2])


def test_the_query_predictor_is_fitted_once_per_model_and_text(tokenizer):
    model = tiny_model("qwen3")  # q_norm / k_norm: the predictor maps the normalised keys
    ids = _calibration(tokenizer)
    first = fit_query_predictors(model, ids, (0, 1))
    assert fit_query_predictors(model, ids, (0, 1)) is first
    assert fit_query_predictors(model, ids[:50], (0, 1)) is not first
    assert first[1].shape == (2 * 2 * 16 + 1, 4 * 16)


def test_probe_layers_are_every_other_layer():
    assert probe_layers(24) == tuple(range(1, 24, 2)) and probe_layers(2) == (1,) and probe_layers(1) == (0,)


@pytest.mark.real_model
def test_estimate_ranks_rows_as_the_true_attention_on_the_real_model(real):
    # SmolLM2-135M: K and V give 384 of the 576 hidden dimensions, so the query is estimated,
    # not recovered; its top decile must still be mostly the true top decile at every probe layer
    session, removed, old_rows = _dirty(real.model, real.tokenizer)
    shifter = RotaryShifter(real.model)
    k = len(old_rows) // 10
    for layer in probe_layers(real.model.config.num_hidden_layers):
        est = estimated_exposure(real.model, session.cache, old_rows, removed, shifter, _calibration(real.tokenizer),
                                 layers=[layer])
        true = _true_exposure(real.model, session.token_ids, old_rows, removed, layer)
        overlap = len(set(est.topk(k).indices.tolist()) & set(true.topk(k).indices.tolist())) / k
        assert overlap >= 0.5, (layer, overlap)


@pytest.mark.real_model
@pytest.mark.real_model
def test_exposure_repair_on_the_real_model_refreshes_rows_next_to_the_removed_message(real):
    base = KVSession(real.model, real.tokenizer)
    base.prepare(history())
    report = base.fork().prepare(without(history(), "t2") + [QUERY], policy="exposure@10")
    assert report.fallback is None and report.refreshed_tokens > 0
    # the row right after the cut attended to the removed message most: it is refreshed
    first_stale = base.fork().prepare(without(history(), "t2") + [QUERY], policy="replay").spans[0][0]
    assert report.spans[0][0] == first_stale
