"""The fourteen allocators of Appendix 7.4 under the common repair operator: exact allowance B,
eligible positions only, and the signal probes' own contracts."""

from __future__ import annotations

import pytest
import torch

import kvmemory.repair as repair_module
from kvmemory.selection import (ALLOCATOR_NAMES, EXTENSION_ALLOCATORS, KNOWN_ALLOCATORS, PRIVILEGED, SIGNAL_ALLOCATORS,
                                allowance, select, top_b)
from kvmemory.selection.adapted import legolink, low_pass, smooth_spans, span_support
from kvmemory.session import KVSession
from support import QUERY, history, tiny_model, without

@pytest.fixture
def recorded(monkeypatch):
    """Every selection made by repair(): (allocator, B, eligible, positions)."""
    calls = []

    def spy(name, inp, B, **kw):
        positions = select(name, inp, B, **kw)
        calls.append((name, B, list(inp.eligible), positions))
        return positions

    monkeypatch.setattr(repair_module, "select", spy)
    return calls


def _check_all(model, tokenizer, recorded, budgets):
    base = KVSession(model, tokenizer)
    base.prepare(history())
    edited = without(history(), "t2") + [QUERY]
    for name in KNOWN_ALLOCATORS:
        for b in budgets:
            report = base.fork().prepare(edited, policy=f"{name}@{b}")
            name_, B, eligible, positions = recorded[-1]
            assert name_ == name and B == allowance(len(eligible), b) == report.refreshed_tokens, (name, b)
            assert len(positions) == B and positions == sorted(set(positions)) and set(positions) <= set(eligible)
            assert report.fallback is None


def test_every_allocator_spends_exactly_the_allowance_tiny(tokenizer, recorded):
    _check_all(tiny_model("qwen3"), tokenizer, recorded, (2, 80))


@pytest.mark.real_model
def test_every_allocator_spends_exactly_the_allowance_real(real, recorded):
    _check_all(real.model, real.tokenizer, recorded, (5,))
    # the probes switched attention to eager and back: a Re-prefill still matches a fresh forward
    s = KVSession(real.model, real.tokenizer)
    s.prepare(history() + [QUERY])
    ids = torch.tensor([s.token_ids])
    with torch.no_grad():
        fresh = real.model(input_ids=ids).logits[0, -1].float()
    assert torch.allclose(s.next_logits, fresh, atol=1e-4)


def test_registry_and_privileged_flag():
    assert len(ALLOCATOR_NAMES) == 14 and len(set(ALLOCATOR_NAMES)) == 14
    assert ALLOCATOR_NAMES[:5] == ("sur", "dense", "window", "bm25", "random")
    assert PRIVILEGED == {"oracle"} and set(SIGNAL_ALLOCATORS) <= set(KNOWN_ALLOCATORS)
    assert EXTENSION_ALLOCATORS == ("exposure",) and KNOWN_ALLOCATORS == (*ALLOCATOR_NAMES, "exposure")


def test_top_b_breaks_ties_by_earlier_position():
    assert top_b([0.5, 0.9, 0.5, 0.9, 0.1], [10, 11, 12, 13, 14], 3) == [10, 11, 13]
    with pytest.raises(ValueError, match="scores for"):
        top_b([1.0], [1, 2], 1)


def test_legolink_ranks_depth_from_chunk_start_then_chunk():
    class Inp:
        eligible = list(range(100, 1300))  # chunks start at eligible index 0, 512, 1024

    assert legolink(Inp, 3, None, 0) == [100, 612, 1124]
    assert legolink(Inp, 5, None, 0) == [100, 101, 612, 613, 1124]


def test_speccache_spans_and_exact_fill():
    z = [0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.9, 0.0]
    # centred 3-token means: 0, .33, .67, 1, .67, .33, 0, .3, .3, .45 -> runs >= 0.4 at 2-4 and 9
    assert [list(r) for r in smooth_spans(z)] == [[2, 3, 4], [9]]
    assert [list(r) for r in smooth_spans([1.0] * 40)] == [list(range(0, 16)), list(range(16, 32)), list(range(32, 40))]
    for budget in range(0, 11):
        chosen = span_support(z, budget)
        assert len(chosen) == budget and chosen == sorted(set(chosen))
    assert span_support(z, 3) == [2, 3, 4]  # the best span, whole
    # spans [2,3,4] then [9] reach 4 >= 0.7·5 positions; completion adds the best other token (8)
    assert span_support(z, 5) == [2, 3, 4, 8, 9]
    assert span_support([3.0] * 6, 2) == [0, 1]  # flat scores: earliest


def test_cachetune_low_pass_keeps_the_lowest_bins():
    S = 8  # keep floor(0.5 * (4 + 1)) = 2 rFFT bins: constant and the first harmonic
    t = torch.arange(S, dtype=torch.float32)
    slow, fast = torch.cos(2 * torch.pi * t / S), torch.cos(2 * torch.pi * 3 * t / S)
    x = (1.0 + slow + fast)[:, None].repeat(1, 2)
    assert torch.allclose(low_pass(x)[:, 0], 1.0 + slow, atol=1e-5)


def test_signal_allocators_need_signals():
    from kvmemory.selection import MessageSpan, SelectionInput

    inp = SelectionInput("ab", [1, 2], [(0, 1), (1, 2)], [MessageSpan(0, 0, 2, 0, 2)], [0, 1], [1])
    with pytest.raises(ValueError, match="reads model signals"):
        select("prophetkv", inp, 1)
    assert select("legolink", inp, 1) == [0]  # geometry only


def _forward_counter(model):
    calls = [0]
    handle = model.get_decoder().layers[0].register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls, handle


def test_shared_signals_reuse_probes_and_charge_their_time(tokenizer, recorded):
    """Inside shared_signals a probe runs once per edit: later repairs select the same positions
    with fewer forwards, and their selection time still includes the probe's measured time."""
    from kvmemory.selection import shared_signals

    model = tiny_model("llama")
    base = KVSession(model, tokenizer)
    base.prepare(history())
    edited = without(history(), "t2") + [QUERY]
    calls, handle = _forward_counter(model)
    try:
        alone = {}
        for name in sorted(SIGNAL_ALLOCATORS):
            before = calls[0]
            alone[name] = (base.fork().prepare(edited, policy=f"{name}@20").spans, calls[0] - before)
        with shared_signals():
            for name in sorted(SIGNAL_ALLOCATORS):
                first = base.fork().prepare(edited, policy=f"{name}@20")
                before = calls[0]
                second = base.fork().prepare(edited, policy=f"{name}@20")
                repeat_calls = calls[0] - before
                assert first.spans == second.spans == alone[name][0], name
                if name != "legolink":  # the one signal allocator that reads geometry only, no probe
                    assert second.replayed_probe_ms > 0, name
                assert repeat_calls <= alone[name][1], name
                if name not in ("legolink", "cachetune", "exposure"):  # the others' probes are model forwards
                    assert repeat_calls < alone[name][1], name
                assert second.selection_ms >= second.replayed_probe_ms and second.latency_ms >= second.selection_ms
        other = base.fork().prepare(without(history(), "t3") + [QUERY], policy="oracle@20")
        assert other.replayed_probe_ms == 0.0  # outside the block nothing is shared
    finally:
        handle.remove()
