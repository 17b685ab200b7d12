"""Decode-time Replay (``replay_margin``): a greedy pick with a thin top-1/top-2 margin while stale
rows remain replays them and the answer so far exactly; labels, reports and bad input."""

import math

import pytest
import torch

from kvmemory.policy import RepairPolicy
from kvmemory_lab.evaluation.answer_fidelity import teacher_forced_logits
from support import QUERY, history, prepared, reprefill_logits, without

EDIT = without(history(), "a2", "t2") + [QUERY]
ANSWER_TOKENS = 8


def test_labels_round_trip_and_bad_input():
    for label in ("shift:margin=0.03", "sur+idf@5:margin=0.1", "sur@auto:kv_change:0.06:margin=0.01"):
        assert RepairPolicy.coerce(label).label == label
    assert RepairPolicy.coerce("sur@5:margin=0.1") == RepairPolicy(budget=5.0, replay_margin=0.1)
    assert RepairPolicy.coerce("sur@5:margin=0").label == "sur@5"  # 0 is off
    for bad in ("shift:margin=-1", "shift:margin=nan", "shift:margin=", "nope@5:margin=0.1"):
        with pytest.raises(ValueError, match="margin"):
            RepairPolicy.coerce(bad)
    with pytest.raises(ValueError):
        RepairPolicy(replay_margin=-0.5)


def _margins(session, answer_ids) -> list[float]:
    """Top-1/top-2 logit gap (nats) of every pick of ``answer_ids`` on a prepared fork."""
    top = teacher_forced_logits(session.fork(), answer_ids).topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def _mid_answer_margin(margins: list[float], noise: float) -> tuple[int, float]:
    """A pick k >= 1 whose margin is below every earlier one by more than ``noise`` (nats: one
    forward of the answer vs step-by-step decoding), and a margin that first fires there."""
    for k in range(1, len(margins)):
        if margins[k] < min(margins[:k]) - 2 * noise:
            return k, (margins[k] + min(margins[:k])) / 2
    pytest.fail(f"no pick after the first has the thinnest margin so far: {margins}")


def _check_replayed_at(base, model, k: int, margin: float) -> None:
    """Shift with ``margin`` replays before pick ``k``: the answer keeps Shift's first ``k`` tokens,
    the report says where, and every row (stale suffix, answer) then equals a Re-prefill's."""
    shifted = base.fork()
    shifted.prepare(EDIT, policy="shift")
    plain = shifted.generate(ANSWER_TOKENS, prompt_lookup=0).token_ids
    s = base.fork()
    report = s.prepare(EDIT, policy=RepairPolicy(operator="shift", replay_margin=margin))
    stale_rows = len(s.token_ids) - s.exact_rows
    assert stale_rows > 0 and report.decode_replay is None
    answer = s.generate(ANSWER_TOKENS, prompt_lookup=0).token_ids
    info = report.decode_replay
    assert info["at_token"] == k and info["margin"] < margin and info["recomputed_tokens"] == stale_rows + k
    assert "decode margin" in report.fallback and s.last_report is report
    assert answer[:k] == plain[:k]
    assert s.exact_rows == len(s.token_ids)
    s.check_invariants()
    if s.next_logits is not None:  # the rows after the replay are exact: as a forward of all ids
        torch.testing.assert_close(s.next_logits, reprefill_logits(model, s.token_ids), atol=1e-3, rtol=0)


def test_a_huge_margin_replays_before_the_first_pick(tiny, tokenizer):
    _, model = tiny
    base = prepared(model, tokenizer, history())
    s = base.fork()
    report = s.prepare(EDIT, policy="shift:margin=1e9")
    replay = base.fork()
    replay.prepare(EDIT, policy="replay")
    answer = s.generate(ANSWER_TOKENS, prompt_lookup=0).token_ids
    assert report.decode_replay["at_token"] == 0
    assert answer == replay.generate(ANSWER_TOKENS, prompt_lookup=0).token_ids


def test_a_thin_margin_mid_answer_replays_there(tiny, tokenizer):
    _, model = tiny
    base = prepared(model, tokenizer, history())
    shifted = base.fork()
    shifted.prepare(EDIT, policy="shift")
    answer = shifted.fork().generate(ANSWER_TOKENS, prompt_lookup=0).token_ids
    k, margin = _mid_answer_margin(_margins(shifted, answer), noise=5e-4)
    _check_replayed_at(base, model, k, margin)


def test_no_replay_without_stale_rows_or_margin_or_when_sampling(tiny, tokenizer):
    _, model = tiny
    base = prepared(model, tokenizer, history())
    for policy, kwargs in (("shift", {}), ("replay:margin=1e9", {}), ("shift:margin=1e9", {"temperature": 0.7, "seed": 1})):
        s = base.fork()
        report = s.prepare(EDIT, policy=policy)
        s.generate(4, **kwargs)
        assert report.decode_replay is None, policy


def test_forks_do_not_share_the_report(tiny, tokenizer):
    _, model = tiny
    s = prepared(model, tokenizer, history())
    report = s.prepare(EDIT, policy="shift:margin=1e9")
    s.fork().generate(2)
    assert report.decode_replay is None and s.last_report is report


@pytest.mark.real_model
def test_mid_answer_replay_is_exact_real(real):
    """On the real model: the thinnest-margin pick of Shift's answer triggers the replay there,
    and the cache then equals a Re-prefill of the prompt and the answer so far."""
    base = prepared(real.model, real.tokenizer, history())
    shifted = base.fork()
    shifted.prepare(EDIT, policy="shift")
    margins = _margins(shifted, shifted.fork().generate(ANSWER_TOKENS, prompt_lookup=0).token_ids)
    assert not math.isclose(min(margins), max(margins))
    k, margin = _mid_answer_margin(margins, noise=0.01)
    _check_replayed_at(base, real.model, k, margin)
