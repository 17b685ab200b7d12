"""Answer-level fidelity against Re-prefill: teacher-forced agreement, per-token KL, common prefix.

First-token KL and whole-answer equality say whether a repaired cache starts like Re-prefill and
whether it ends with the same text; they do not say how far the answer stays on track. Here the
repaired cache scores Re-prefill's own greedy answer in one forward (teacher forcing): at every
answer position t we compare the repaired next-token distribution with Re-prefill's at the same
position, given the same history and the same previous answer tokens.

    reference_rows = teacher_forced_logits(reprefilled_fork, ref_answer_ids)   # [T, vocab]
    method_rows = teacher_forced_logits(repaired_fork, ref_answer_ids)         # [T, vocab]
    scores = answer_fidelity(reference_rows, method_rows, ref_answer_ids, method_answer_ids)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmemory import kvcache
from kvmemory.edits import common_prefix_length


@dataclass(frozen=True)
class AnswerFidelity:
    """Scores of one repaired answer against Re-prefill's (our extension beyond the paper's §8).

    ``tf_agreement``: fraction in [0, 1] of Re-prefill's T answer positions where the repaired
    cache's top-1 token equals Re-prefill's (teacher-forced); ``tf_kl``: mean over the T positions
    of KL(p_reprefill ‖ p_repaired) in nats; ``common_prefix``: length in tokens of the common
    prefix of the two greedy answers; ``positions``: T."""

    tf_agreement: float
    tf_kl: float
    common_prefix: int
    positions: int


def teacher_forced_logits(session, answer_ids: Sequence[int]) -> torch.Tensor:
    """Next-token logits of a prepared session at every position of ``answer_ids``, in one forward.

    Row 0 is the session's pending first-token logits; row t (t >= 1) predicts the token after
    ``answer_ids[:t]``. The answer rows are removed from the cache afterwards, so the session can
    still decode its own answer (``generate`` / ``verified_greedy``) from the same state.

    Args:
        session: a :class:`kvmemory.session.KVSession` right after ``prepare`` (first-token
            logits pending, the cache holding exactly the prompt rows).
        answer_ids: T >= 0 token ids (e.g. Re-prefill's ``Generation.token_ids``, stop token
            excluded). T = 0 scores the first position only.

    Returns:
        fp32 logits ``[max(T, 1), vocab]`` on the CPU.

    Raises:
        RuntimeError: the session has no pending prompt (call ``prepare`` first).
    """
    if session.next_logits is None:
        raise RuntimeError("teacher_forced_logits needs a prepared session: call prepare(messages) first")
    first = session.next_logits.float().cpu()[None]
    inputs = list(answer_ids)[:-1]
    if not inputs:
        return first
    start = len(session.token_ids)
    with torch.no_grad():
        out = session.model(input_ids=torch.tensor([inputs]), position_ids=torch.arange(start, start + len(inputs))[None],
                            cache=session.cache, use_cache=True)
    kvcache.crop_to(session.cache, start)
    return torch.cat([first, out.logits[0].float().cpu()])


def with_decode_replay(method_rows: torch.Tensor, reference_rows: torch.Tensor, replay_margin: float) -> torch.Tensor:
    """Teacher-forced rows of a repair under decode-time Replay (``RepairPolicy.replay_margin``).

    Forced along Re-prefill's answer, the repaired cache picks as ``method_rows`` until the first
    position whose top-1/top-2 logit margin is below ``replay_margin`` (nats); there the session
    replays its stale rows exactly, so from that position on its rows are Re-prefill's (equal up
    to fp32 summation order). Pass only when the repair left stale rows (else nothing replays).

    Args:
        method_rows, reference_rows: ``[T, vocab]`` from :func:`teacher_forced_logits`.
        replay_margin: nats (> 0).

    Returns:
        ``[T, vocab]``: ``method_rows`` before the first thin margin, ``reference_rows`` after.
    """
    top = method_rows.topk(2, dim=-1).values
    thin = ((top[:, 0] - top[:, 1]) < replay_margin).nonzero()
    if not len(thin):
        return method_rows
    first = int(thin[0])
    return torch.cat([method_rows[:first], reference_rows[first:]])


def answer_fidelity(reference_rows: torch.Tensor, method_rows: torch.Tensor, reference_ids: Sequence[int],
                    method_ids: Sequence[int]) -> AnswerFidelity:
    """Teacher-forced agreement and mean KL over Re-prefill's answer, and the greedy common prefix.

    Args:
        reference_rows, method_rows: ``[T', vocab]`` from :func:`teacher_forced_logits` on the
            Re-prefill and the repaired session with the same ``reference_ids``.
        reference_ids: Re-prefill's greedy answer (T tokens; the top-1 targets when T > 0, else
            Re-prefill's top-1 first token).
        method_ids: the repaired session's own greedy answer (for the common prefix).

    Raises:
        ValueError: the two row blocks differ in shape.
    """
    if reference_rows.shape != method_rows.shape:
        raise ValueError(f"teacher-forced rows differ in shape: {tuple(reference_rows.shape)} vs {tuple(method_rows.shape)}; "
                         "score both sessions with the same reference answer")
    targets = torch.tensor(list(reference_ids)) if len(reference_ids) else reference_rows.argmax(-1)
    top1 = method_rows.argmax(-1)
    log_p = torch.log_softmax(reference_rows.float(), dim=-1)
    log_q = torch.log_softmax(method_rows.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0.0)
    return AnswerFidelity(
        tf_agreement=float((top1 == targets).float().mean()),
        tf_kl=float(kl.mean()),
        common_prefix=common_prefix_length(reference_ids, method_ids),
        positions=int(targets.numel()),
    )
