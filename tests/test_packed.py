"""Packed (layer-major) and direct executors against the sequential-interval executor (Appendix
13.2): same K/V at every layer and same next-token logits for the same refresh set (fp32, 1e-4),
R = 1, 4, 16 intervals, sets touching the first and last suffix positions; unselected rows and
the input cache untouched. Plus the choice rule, fallbacks and errors."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend runs in the interpreter here

import pytest  # noqa: E402
import torch  # noqa: E402

from kvmemory import kvcache  # noqa: E402
from kvmemory.executors.sequential import run_direct, run_oneshot, run_sequential  # noqa: E402
from kvmemory.executors import choose_executor  # noqa: E402
from kvmemory.executors.packed import PackedUnsupportedError, packed_unsupported_reason, run_packed  # noqa: E402
from kvmemory.policy import RepairPolicy  # noqa: E402
from kvmemory.selection import to_intervals  # noqa: E402
from support import QUERY, history, prepared, replaced, tiny_model, without  # noqa: E402

TOL = 1e-4
B = 16  # positions per refresh set, in R intervals of B/R


def shifted_session(model, tokenizer):
    """A Shift-repaired session (stale suffix rows) after deleting a middle tool call, with the
    first suffix position f; the prompt ends with the query, so position n-1 yields logits."""
    long_t3 = history()[-1]["content"] + " The locks opened in 1880 and still work. Barges carry grain downstream."
    base = prepared(model, tokenizer, replaced(history(), "t3", long_t3))
    session = base.fork()
    session.prepare(without(replaced(history(), "t3", long_t3), "a2", "t2") + [QUERY], policy=RepairPolicy(operator="shift"))
    f = next(i for i, (a, b) in enumerate(zip(base.token_ids, session.token_ids)) if a != b)
    return session, f


def refresh_set(f: int, n: int, intervals: int, where: str) -> list[int]:
    """B positions in ``intervals`` equal runs spread over the suffix [f, n); ``where`` = first
    (starts at f), last (ends at n-1) or inner (touches neither)."""
    width = B // intervals
    gap = (n - f - B) // (intervals + 1)
    assert gap >= 1, "suffix too short for this set"
    starts = [f + gap + i * (width + gap) for i in range(intervals)]
    offset = {"first": f - starts[0], "last": n - starts[-1] - width, "inner": 0}[where]
    return [s + offset + j for s in starts for j in range(width)]


def _layers(cache):
    return kvcache.layer_tensors(cache)


def assert_equivalent(model, session, positions, run, *, tol=TOL):
    """``run(cache)`` -> (cache, result) must match the sequential executor on the same set."""
    ids = torch.tensor(session.token_ids)
    source = session.cache
    before = [(k.clone(), v.clone()) for k, v in _layers(source)]
    reference = kvcache.clone_cache(source)
    expected = run_sequential(model, reference, ids, to_intervals(positions))
    out_cache, result = run(source)
    assert out_cache is not source
    for (k0, v0), (k1, v1) in zip(before, _layers(source)):  # the input cache is unmodified
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    chosen = torch.zeros(len(ids), dtype=torch.bool)
    chosen[positions] = True
    for (kr, vr), (ko, vo), (k0, v0) in zip(_layers(reference), _layers(out_cache), before):
        torch.testing.assert_close(ko, kr, atol=tol, rtol=0)
        torch.testing.assert_close(vo, vr, atol=tol, rtol=0)
        assert torch.equal(ko[:, :, ~chosen], k0[:, :, ~chosen]) and torch.equal(vo[:, :, ~chosen], v0[:, :, ~chosen])
    stale = chosen.clone()
    stale[session.last_report.spans[0][0]:] = False  # rows Shift computed afresh (the query) stay equal
    if stale.any():  # refreshed stale rows do change
        assert (_layers(out_cache)[-1][1] - before[-1][1])[:, :, stale].abs().max() > 10 * tol
    if positions[-1] == len(ids) - 1:
        torch.testing.assert_close(result.next_logits, expected.next_logits, atol=tol, rtol=0)
    else:
        assert result.next_logits is None and expected.next_logits is None


def _packed(model, backend="sdpa", fused_scatter=False):
    def run(cache, ids, positions):
        return run_packed(model, cache, ids, positions, backend=backend, fused_scatter=fused_scatter)
    return run


def _in_copy(executor, model):
    """Direct / one-shot run in place: give them a copy so the input stays as it was."""
    def run(cache, ids, positions):
        copy = kvcache.clone_cache(cache)
        arg = to_intervals(positions) if executor is run_direct else torch.tensor(positions)
        return copy, executor(model, copy, ids, arg)
    return run


def _check(model, session, f, intervals, where, runner):
    positions = refresh_set(f, len(session.token_ids), intervals, where)
    ids = torch.tensor(session.token_ids)
    assert_equivalent(model, session, positions, lambda cache: runner(cache, ids, positions))


@pytest.fixture(scope="module")
def tiny_shifted(tiny, tokenizer):
    family, model = tiny
    return model, *shifted_session(model, tokenizer)


@pytest.mark.parametrize("where", ["first", "last", "inner"])
@pytest.mark.parametrize("intervals", [1, 4, 16])
def test_packed_equals_sequential_tiny(tiny_shifted, intervals, where):
    model, session, f = tiny_shifted
    _check(model, session, f, intervals, where, _packed(model))


@pytest.mark.parametrize("intervals", [1, 16])
def test_direct_and_oneshot_equal_sequential_tiny(tiny_shifted, intervals):
    model, session, f = tiny_shifted
    _check(model, session, f, intervals, "last", _in_copy(run_direct, model))
    _check(model, session, f, intervals, "last", _in_copy(run_oneshot, model))


@pytest.mark.parametrize("fused_scatter", [False, True])
@pytest.mark.parametrize("where", ["first", "last"])
def test_packed_triton_backend_equals_sequential_tiny(tiny_shifted, where, fused_scatter):
    model, session, f = tiny_shifted
    _check(model, session, f, 4, where, _packed(model, "triton", fused_scatter))


@pytest.fixture(scope="module")
def real_shifted(real):
    return real.model, *shifted_session(real.model, real.tokenizer)


@pytest.mark.real_model
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("intervals", [1, 4, 16])
def test_packed_equals_sequential_real_model(real_shifted, intervals, where):
    model, session, f = real_shifted
    _check(model, session, f, intervals, where, _packed(model))


@pytest.mark.real_model
def test_direct_and_triton_equal_sequential_real_model(real_shifted):
    model, session, f = real_shifted
    _check(model, session, f, 16, "last", _in_copy(run_direct, model))
    _check(model, session, f, 16, "inner", _packed(model, "triton"))


def test_in_place_returns_the_same_cache(tiny_shifted):
    model, session, f = tiny_shifted
    cache = kvcache.clone_cache(session.cache)
    positions = refresh_set(f, len(session.token_ids), 4, "last")
    out, result = run_packed(model, cache, torch.tensor(session.token_ids), positions, in_place=True)
    assert out is cache and result.forwarded_tokens == B and result.next_logits is not None
    # an autograd graph on the logits would pin every layer's activations in callers' memory
    assert not result.next_logits.requires_grad


def test_rows_past_the_cache_end_must_be_selected(tiny_shifted):
    model, session, f = tiny_shifted
    ids = torch.tensor(session.token_ids + [11, 12])
    with pytest.raises(ValueError, match="no cache rows"):
        run_packed(model, session.cache, ids, [f, f + 1, len(ids) - 1])
    grown, result = run_packed(model, session.cache, ids, [f, len(ids) - 2, len(ids) - 1])
    assert kvcache.cache_length(grown) == len(ids) and result.next_logits is not None
    with pytest.raises(ValueError, match="strictly increasing"):
        run_packed(model, session.cache, torch.tensor(session.token_ids), [f + 2, f])


def test_unsupported_models_are_refused_with_a_reason(tokenizer):
    sliding = tiny_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert "full attention" in packed_unsupported_reason(sliding)
    training = tiny_model("llama").train()
    assert "training mode" in packed_unsupported_reason(training)
    with pytest.raises(PackedUnsupportedError, match="training mode"):
        run_packed(training, kvcache.new_cache(training.config), torch.tensor([1, 2]), [0, 1])
    choice = choose_executor("packed", 4, training)
    assert choice.name == "sequential" and "training mode" in choice.fallback


def test_repair_reports_the_executor_and_falls_back(tokenizer):
    """auto → packed for several intervals, direct for one; a training-mode model is refreshed by
    the sequential executor with the reason in the report (and the same rows as packed in eval)."""
    model = tiny_model("llama")
    base = prepared(model, tokenizer, history())
    new = without(history(), "a2", "t2") + [QUERY]
    auto = base.fork()
    report = auto.prepare(new, policy=RepairPolicy(budget=20))
    assert report.intervals > 1 and report.executor == "packed-sdpa" and report.executor_fallback is None
    one = base.fork()
    report = one.prepare(new, policy=RepairPolicy(budget=20, executor="direct"))
    assert report.executor == "direct"
    model.train()
    try:
        fallback = base.fork()
        report = fallback.prepare(new, policy=RepairPolicy(budget=20, executor="packed"))
    finally:
        model.eval()
    assert report.executor == "sequential" and "training mode" in report.executor_fallback
    for (ka, va), (kb, vb) in zip(_layers(auto.cache), _layers(fallback.cache)):
        torch.testing.assert_close(ka, kb, atol=TOL, rtol=0)
        torch.testing.assert_close(va, vb, atol=TOL, rtol=0)


def test_single_interval_auto_uses_direct(tiny_shifted):
    model, _, _ = tiny_shifted
    assert choose_executor("auto", 1, model).name == "direct"
    assert choose_executor("auto", 3, model).name == "packed"
    assert choose_executor("sequential", 3, model).name == "sequential"
    with pytest.raises(ValueError, match="unknown executor"):
        choose_executor("fast", 3, model)


def test_policy_executor_fields_validate_and_labels_still_parse():
    policy = RepairPolicy(executor="packed", backend="triton")
    assert policy.label == "sur@5" and RepairPolicy.coerce("sur@5").executor == "auto"
    with pytest.raises(ValueError):
        RepairPolicy(executor="fast")
    with pytest.raises(ValueError):
        RepairPolicy(backend="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the Triton backend may launch")
def test_triton_backend_without_gpu_or_interpreter_names_the_fix(tiny_shifted, monkeypatch):
    from kvmemory.kernels import TritonUnavailableError

    model, session, f = tiny_shifted
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(TritonUnavailableError, match="backend='sdpa'"):
        run_packed(model, session.cache, torch.tensor(session.token_ids), [f], backend="triton")


class _ScaledLinear(torch.nn.Linear):
    """A wrapped projection (like a LoRA layer): its forward is not ``x @ W^T``."""

    def forward(self, x):
        return 1.5 * super().forward(x)


def _edited_long_prompt(model, n=480):
    """A prefilled random-token prompt of n tokens and the same prompt with the 64 positions of 16
    spread runs of 4 (the last ending at n-1) replaced: those rows are stale and must change."""
    from kvmemory.engine import forward_rows

    ids = torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(0))
    cache = kvcache.new_cache(model.config)
    forward_rows(model, cache, ids, 0)
    positions = [n - 364 + 24 * k + j for k in range(16) for j in range(4)]
    edited = ids.clone()
    edited[positions] = (edited[positions] + 777) % 49000
    return cache, edited, positions


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("wrapped_mlp", [False, True])
def test_multi_tile_attention_and_mlp_paths_equal_sequential(family, wrapped_mlp):
    """64 spread rows: the SDPA plan has several row tiles (each with its own key range) and the MLP
    runs by columns on plain linears or through the module on wrapped ones; K/V at every layer and
    the logits match the sequential executor (1e-4), unselected rows are bit-identical."""
    from kvmemory.engine.traversal import is_plain_mlp
    from kvmemory.executors.packed import row_tiles

    model = tiny_model(family)
    if wrapped_mlp:
        for layer in model.get_decoder().layers:
            old = layer.mlp.up_proj
            layer.mlp.up_proj = _ScaledLinear(old.in_features, old.out_features, bias=False)
            layer.mlp.up_proj.weight.data.copy_(old.weight.data)
    assert all(is_plain_mlp(layer.mlp) != wrapped_mlp for layer in model.get_decoder().layers)
    cache, ids, positions = _edited_long_prompt(model)
    assert len(row_tiles(torch.tensor(positions))) > 1
    before = [(k.clone(), v.clone()) for k, v in _layers(cache)]
    reference = kvcache.clone_cache(cache)
    expected = run_sequential(model, reference, ids, to_intervals(positions))
    out, result = run_packed(model, cache, ids, positions)
    chosen = torch.zeros(len(ids), dtype=torch.bool)
    chosen[positions] = True
    for (kr, vr), (ko, vo), (k0, v0), (k1, v1) in zip(_layers(reference), _layers(out), before, _layers(cache)):
        torch.testing.assert_close(ko, kr, atol=TOL, rtol=0)
        torch.testing.assert_close(vo, vr, atol=TOL, rtol=0)
        assert torch.equal(ko[:, :, ~chosen], k0[:, :, ~chosen]) and torch.equal(vo[:, :, ~chosen], v0[:, :, ~chosen])
        assert torch.equal(k1, k0) and torch.equal(v1, v0)  # the input cache is untouched
    assert (_layers(out)[-1][1] - before[-1][1])[:, :, chosen].abs().max() > 10 * TOL
    torch.testing.assert_close(result.next_logits, expected.next_logits, atol=TOL, rtol=0)


def test_row_tiles_cover_the_rows_and_skip_future_keys():
    from kvmemory.executors.packed import TILE_MAX_ROWS, row_tiles

    assert row_tiles(torch.tensor([7])) == [(0, 1)]
    assert row_tiles(torch.arange(992, 1056)) == [(0, 64)]  # one short interval: one tile
    spread = torch.tensor([542 + 64 * k + j for k in range(16) for j in range(4)])
    for positions in (spread, torch.arange(300), torch.tensor([3, 9, 400, 401, 402, 2000])):
        tiles = row_tiles(positions)
        assert tiles[0][0] == 0 and tiles[-1][1] == len(positions)
        assert all(a < b and b - a <= TILE_MAX_ROWS for a, b in tiles)
        assert all(b0 == a1 for (_, b0), (a1, _) in zip(tiles, tiles[1:]))
    keys = sum((b - a) * (int(spread[b - 1]) + 1) for a, b in row_tiles(spread))
    assert keys < 0.8 * len(spread) * (int(spread[-1]) + 1)  # fewer row × key pairs than one block


def test_boolean_masks_for_huge_refreshes_give_the_same_rows(monkeypatch):
    """Past ADDITIVE_MASK_LIMIT mask elements the tiles keep 1-byte boolean masks: same K/V."""
    from kvmemory.executors import packed

    model = tiny_model("llama")
    cache, ids, positions = _edited_long_prompt(model)
    additive, _ = run_packed(model, cache, ids, positions)
    monkeypatch.setattr(packed, "ADDITIVE_MASK_LIMIT", 0)
    boolean, _ = run_packed(model, cache, ids, positions)
    for (ka, va), (kb, vb) in zip(_layers(additive), _layers(boolean)):
        torch.testing.assert_close(kb, ka, atol=TOL, rtol=0)
        torch.testing.assert_close(vb, va, atol=TOL, rtol=0)


def test_row_tiles_for_many_one_token_intervals_use_row_steps():
    from kvmemory.executors.packed import TILE_MAX_ROWS, TILE_ROW_STEP, row_tiles

    tiles = row_tiles(torch.arange(0, 4000, 2))  # 2000 one-token intervals
    assert all(a % TILE_ROW_STEP == 0 and b - a <= TILE_MAX_ROWS for a, b in tiles) and tiles[-1][1] == 2000
