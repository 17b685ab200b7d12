"""Metric functions of the fidelity evaluation on hand-computed cases (paper eq. 14, Appendix 7.5, 8.3, 11)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvmemory_lab.evaluation import paired_bootstrap
from kvmemory_lab.metrics import (
    drop_normalize,
    extract_answer,
    first_token_kl,
    first_token_tv,
    leaked,
    niah_exact_match,
    niah_values,
    normalized_recovery,
    qa_exact_match,
)


def logits_of(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float64))


def test_tv_and_kl_hand_computed():
    p, q = logits_of([0.5, 0.3, 0.2]), logits_of([0.2, 0.3, 0.5])
    # TV = ½(|0.5−0.2| + 0 + |0.2−0.5|) = 0.3
    assert first_token_tv(p, q) == pytest.approx(0.3, abs=1e-6)
    # KL(p‖q) = 0.5 ln(2.5) + 0.2 ln(0.4)
    assert first_token_kl(p, q) == pytest.approx(0.5 * math.log(2.5) + 0.2 * math.log(0.4), abs=1e-6)
    assert first_token_tv(p, p) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        first_token_tv(p, logits_of([0.5, 0.5]))


def test_normalized_recovery_eq14_undefined_and_unclipped():
    assert normalized_recovery(0.1, 0.4) == pytest.approx(0.75)
    assert normalized_recovery(0.0, 0.4) == 1.0
    assert normalized_recovery(0.6, 0.4) == pytest.approx(-0.5)  # worse than Dirty: negative, not clipped
    assert normalized_recovery(0.2, 0.0) is None  # denominator 0: undefined


def test_niah_list_match_order_multiplicity_and_leak():
    assert niah_values("Numbers: 1234567, 7654321; not 12345678 or 123456") == ["1234567", "7654321"]
    assert niah_exact_match("1234567, 7654321", ["1234567", "7654321"])
    assert not niah_exact_match("7654321, 1234567", ["1234567", "7654321"])  # order matters
    assert not niah_exact_match("1234567, 1234567", ["1234567"])  # multiplicity matters
    assert not niah_exact_match("The number is 1234567.", ["1234567", "7654321"])
    assert leaked("1234567 and 7654321", "7654321") is True
    assert leaked("1234567", "7654321") is False
    assert leaked("1234567", None) is None


def test_qa_exact_match_per_dataset():
    assert extract_answer("Answer: The Beatles\nBecause ...") == "The Beatles"
    assert qa_exact_match("the Beatles.", ["Beatles"], "hotpotqa")
    assert qa_exact_match("Beatles", ["Beatles", "The Fab Four"], "hotpotqa")
    assert not qa_exact_match("Fab Four", ["Beatles", "Fab Four"], "hotpotqa")  # HotpotQA: no aliases
    assert qa_exact_match("Fab Four", ["Beatles", "Fab Four"], "musique")  # aliases count
    assert qa_exact_match("fab four", ["Beatles", "The Fab Four"], "2wikimultihopqa")
    assert drop_normalize("1,000 people") == "1000.0 people"
    assert qa_exact_match("15.0", ["15"], "iirc") and qa_exact_match("12500 BC", ["12,500 BC"], "iirc")
    assert not qa_exact_match("16", ["15"], "iirc")


def test_paired_bootstrap_constant_difference_has_a_point_interval():
    est, lo, hi = paired_bootstrap([100.0] * 6, ["a", "a", "b", "b", "c", "c"])
    assert (est, lo, hi) == (100.0, 100.0, 100.0)


def test_paired_bootstrap_resamples_whole_sources_within_strata():
    # Source a: two placements, both +100; source b: two placements, 0. One stratum, 2 sources:
    # a replicate draws (a,a), (a,b), (b,a) or (b,b) -> pooled mean 100, 50, 50 or 0.
    diff, groups = [100, 100, 0, 0], ["a", "a", "b", "b"]
    est, lo, hi = paired_bootstrap(diff, groups, replicates=4000, seed=1)
    assert est == 50.0 and lo == 0.0 and hi == 100.0
    # With two strata holding one source each, every replicate draws both sources: no spread.
    est, lo, hi = paired_bootstrap(diff, groups, ["x", "x", "y", "y"], replicates=500)
    assert (lo, hi) == (50.0, 50.0)
    # Same seed, same answer (reproducible); numpy percentile with linear interpolation.
    rng = np.random.default_rng(0)
    d = rng.normal(size=40).tolist()
    g = [str(k // 2) for k in range(40)]
    assert paired_bootstrap(d, g) == paired_bootstrap(d, g)
    with pytest.raises(ValueError, match="equal length"):
        paired_bootstrap([1.0], ["a", "b"])
