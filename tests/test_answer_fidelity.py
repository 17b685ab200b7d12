"""Answer-level fidelity metrics: teacher-forced agreement / KL over Re-prefill's answer, common prefix."""

import pytest
import torch

from kvmemory.edits import common_prefix_length
from kvmemory_lab.evaluation.answer_fidelity import answer_fidelity, teacher_forced_logits, with_decode_replay
from kvmemory.divergence import first_token_kl
from kvmemory.policy import RepairPolicy
from support import QUERY, history, prepared, without


def test_common_prefix():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([7, 8], [7, 8]) == 2


def test_decode_replay_rows_switch_to_the_reference_at_the_first_thin_margin():
    method = torch.tensor([[3.0, 1.0, 0.0], [2.0, 1.95, 0.0], [0.0, 1.0, 0.99], [5.0, 0.0, 0.0]])
    reference = torch.zeros(4, 3)
    rows = with_decode_replay(method, reference, replay_margin=0.1)  # margins 2, 0.05, 0.01, 5
    assert torch.equal(rows[:1], method[:1]) and torch.equal(rows[1:], reference[1:])
    assert torch.equal(with_decode_replay(method, reference, replay_margin=0.005), method)  # none below 0.005


def test_scores_hand_computed():
    ref = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    same = answer_fidelity(ref, ref.clone(), [0, 1], [0, 1, 2])
    assert (same.tf_agreement, same.tf_kl, same.common_prefix, same.positions) == (1.0, 0.0, 2, 2)
    other = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]])  # second position prefers token 2
    got = answer_fidelity(ref, other, [0, 1], [0, 2])
    assert got.tf_agreement == 0.5 and got.common_prefix == 1
    expected = (first_token_kl(ref[0], other[0]) + first_token_kl(ref[1], other[1])) / 2
    assert got.tf_kl == pytest.approx(expected, rel=1e-6) and got.tf_kl > 0
    with pytest.raises(ValueError, match="same reference answer"):
        answer_fidelity(ref, other[:1], [0, 1], [0])


def _teacher_forcing_matches_decoding(model, tokenizer, steps: int):
    session = prepared(model, tokenizer, history())
    session.prepare(without(history(), "t2") + [QUERY], policy=RepairPolicy(budget=20.0))
    rows_before = len(session.token_ids)
    probe = session.fork()
    # the logits each greedy step used, recorded while decoding step by step (a streamed token is
    # handed out before its row is computed: the pending logits are the ones it was picked from)
    seen, tokens = [], []
    for token in session.stream_tokens(steps):
        seen.append(session.next_logits.clone())
        tokens.append(token)
    rows = teacher_forced_logits(probe, tokens)
    assert rows.shape == (len(tokens), seen[0].shape[0])
    for t in range(len(tokens)):
        assert torch.allclose(rows[t], seen[t], atol=2e-4, rtol=0), t
    # the answer rows were dropped again: decoding from the probe gives the same answer
    assert len(probe.token_ids) == rows_before and probe.cache.get_seq_length() == rows_before
    assert probe.generate(max_new_tokens=steps).token_ids == tokens
    return tokens


def test_teacher_forcing_equals_stepwise_logits_tiny(tiny, tokenizer):
    _, model = tiny
    assert len(_teacher_forcing_matches_decoding(model, tokenizer, 6)) == 6


@pytest.mark.real_model
def test_teacher_forcing_equals_stepwise_logits_real(real):
    assert len(_teacher_forcing_matches_decoding(real.model, real.tokenizer, 12)) >= 2


def test_teacher_forcing_needs_a_prepared_session(tiny, tokenizer):
    _, model = tiny
    session = prepared(model, tokenizer, history())
    session.generate(max_new_tokens=2)
    session.next_logits = None
    with pytest.raises(RuntimeError, match="prepare"):
        teacher_forced_logits(session, [1, 2])
