"""Greedy answers verified against a draft equal step-by-step greedy decoding (quality benchmark)."""

import pytest
import torch

from kvmemory_lab.evaluation.decoding import proposal, verified_greedy
from kvmemory.policy import RepairPolicy
from support import history, prepared, without


def _drafts(reference: list[int]) -> dict[str, list[int]]:
    changed = list(reference)
    if len(changed) > 3:
        changed[3] = (changed[3] + 1) % 1000  # the draft goes wrong at its 4th token
    return {"same": reference, "diverging": changed, "empty": [], "wrong-first": [reference[0] + 1] + reference[1:],
            "short": reference[:2]}


def _check(session, max_new_tokens: int) -> int:
    stepwise = session.fork().generate(max_new_tokens=max_new_tokens)
    assert len(stepwise.token_ids) >= 2, "the test needs an answer of a few tokens"
    for name, draft in _drafts(stepwise.token_ids).items():
        got = verified_greedy(session.fork(), draft, max_new_tokens)
        assert got.token_ids == stepwise.token_ids, name
        assert got.text == stepwise.text and got.finish_reason == stepwise.finish_reason, name
        assert torch.equal(got.first_logits, stepwise.first_logits), name
    # alternatives: a wrong draft plus answers that agree with the greedy one only after it leaves the draft
    ref = stepwise.token_ids
    wrong = _drafts(ref)["diverging"]
    alternatives = [ref[:3] + [(ref[3] + 7) % 1000] if len(ref) > 3 else [], ref[:-1], [ref[0]]]
    got = verified_greedy(session.fork(), wrong, max_new_tokens, alternatives=alternatives)
    assert got.token_ids == ref and got.text == stepwise.text and got.finish_reason == stepwise.finish_reason
    return len(stepwise.token_ids)


def test_proposal_picks_the_longest_agreeing_answer():
    candidates = [[1, 2, 3], [1, 2, 4, 5, 6], [9, 9], [1, 2, 4, 5]]
    assert proposal([1, 2, 4], candidates, 10) == [4, 5, 6]
    assert proposal([1, 2, 4], candidates, 2) == [4, 5]  # the limit cuts it
    assert proposal([7], candidates, 10) == [7]  # nobody agrees: the greedy token alone
    assert proposal([1, 2, 3], candidates, 10) == [3]


def test_verified_equals_stepwise_tiny(tiny, tokenizer):
    _, model = tiny
    session = prepared(model, tokenizer, history())
    session.prepare(without(history(), "m2"), policy=RepairPolicy(operator="refresh", budget=20))
    assert _check(session, 12) == 12  # random weights rarely stop: a length stop


@pytest.mark.real_model
def test_verified_equals_stepwise_real(real):
    session = prepared(real.model, real.tokenizer, history())
    session.prepare(without(history(), "m2"), policy=RepairPolicy(operator="refresh", budget=5))
    _check(session, 24)


def test_verified_rejects_bad_input(tiny, tokenizer):
    _, model = tiny
    session = prepared(model, tokenizer, history())
    with pytest.raises(ValueError, match="max_new_tokens"):
        verified_greedy(session.fork(), [1, 2], 0)
    done = session.fork()
    done.next_logits = None
    with pytest.raises(RuntimeError, match="prepare"):
        verified_greedy(done, [1, 2], 4)
