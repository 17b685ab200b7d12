"""Divergence of a repaired cache's next-token distribution from Re-prefill's (paper §4.2).

The fidelity guard samples it at run time; the lab's benchmarks report it.
"""

from __future__ import annotations

import torch


def first_token_kl(reference_logits: torch.Tensor, method_logits: torch.Tensor) -> float:
    """KL(p_reference ‖ p_method) in nats between two next-token distributions.

    Args:
        reference_logits, method_logits: ``[vocab]`` logits (any float dtype; computed in fp32).

    Raises:
        ValueError: shapes differ.
    """
    if reference_logits.shape != method_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(reference_logits.shape)} vs {tuple(method_logits.shape)}")
    log_p = torch.log_softmax(reference_logits.float(), dim=-1)
    log_q = torch.log_softmax(method_logits.float(), dim=-1)
    return float(torch.sum(log_p.exp() * (log_p - log_q)).clamp(min=0.0))
