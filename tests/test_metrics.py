"""Metric functions on hand-computed cases."""

import math

import pytest
import torch

from kvmemory_lab.metrics import answers_agree, contains_gold, exact_match, first_token_kl, normalize_answer


def test_first_token_kl_matches_hand_computation():
    p, q = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.25, 0.5, 0.25])
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)  # = 0.25 ln 2
    assert first_token_kl(p.log(), q.log()) == pytest.approx(expected, abs=1e-7)
    assert first_token_kl(p.log(), p.log() + 3.0) == pytest.approx(0.0, abs=1e-7)  # shift-invariant logits
    with pytest.raises(ValueError, match="shapes"):
        first_token_kl(p, torch.zeros(4))


def test_answer_normalization_and_matching():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert exact_match("the eiffel tower.", "Eiffel Tower")
    assert not exact_match("It is the Eiffel Tower", "Eiffel Tower")
    assert contains_gold("It is the Eiffel Tower.", "Eiffel Tower")
    assert not contains_gold("Belem", "Bel") and not contains_gold("anything", "")
    assert answers_agree(" Paris\n", "Paris") and not answers_agree("Paris", "paris")
