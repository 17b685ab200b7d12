"""Templates that render a message by its neighbours: Qwen2.5's chat template opens one user turn
before the first of consecutive tool results and closes it after the last. Edits among such a
group are repairs of the message's span plus the delimiter tokens that move (Replay equals
Re-prefill), not exact fallbacks; a template that rewrites a message's own text still falls back."""

from __future__ import annotations

import copy

import pytest
import torch

from kvmemory import kvcache
from kvmemory.errors import TemplateError
from kvmemory.policy import RepairPolicy
from kvmemory.prompt import normalize_messages, render_prompt
from kvmemory.session import KVSession
from support import tiny_model

# Qwen2.5's grouping rule for tool results, in ChatML (the real template is tested on the real
# model in test_qwen_models.py)
GROUPING = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
HISTORY = [
    {"role": "system", "content": "Answer from the search results.", "id": "s"},
    {"role": "user", "content": "Which city is the capital of the country where the Rhine ends?", "id": "u"},
    {"role": "assistant", "content": "search('Rhine mouth'); search('Dutch capital'); search('Rhine length')", "id": "a"},
    {"role": "tool", "content": "The Rhine flows into the North Sea in the Netherlands near Rotterdam.", "id": "t1"},
    {"role": "tool", "content": "Amsterdam is the capital of the Netherlands; The Hague is the seat of government.", "id": "t2"},
    {"role": "tool", "content": "The Rhine is about 1,230 kilometres long.", "id": "t3"},
]
APPENDED = {"role": "tool", "content": "Rotterdam is the largest port in Europe.", "id": "t4"}
EDITS = {
    "delete-first": lambda h: [m for m in h if m["id"] != "t1"],
    "delete-middle": lambda h: [m for m in h if m["id"] != "t2"],
    "delete-last": lambda h: [m for m in h if m["id"] != "t3"],
    "clear-middle": lambda h: [dict(m, content="[cleared]") if m["id"] == "t2" else m for m in h],
    "append": lambda h: h + [APPENDED],
}
ATOL = 1e-4  # fp32 K/V rows and logits


@pytest.fixture(scope="module")
def grouping(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = GROUPING
    return tok


@pytest.fixture(scope="module")
def qwen2():
    return tiny_model("qwen2")


def test_group_members_get_their_own_tokens_and_the_closer_goes_with_the_last(grouping):
    prompt = render_prompt(grouping, normalize_messages(HISTORY))
    spans = {seg.key: prompt.text[seg.char_start:seg.char_end] for seg in prompt.segments}
    assert spans["t1"].startswith("<|im_start|>user\n<tool_response>") and "<|im_end|>" not in spans["t1"]
    assert spans["t2"] == "\n<tool_response>\n" + HISTORY[4]["content"] + "\n</tool_response>"
    assert spans["t3"].endswith("</tool_response><|im_end|>\n")
    assert "".join(spans.values()) + "<|im_start|>assistant\n" == prompt.text


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edits_in_a_group_are_repairs_equal_to_reprefill_under_replay(qwen2, grouping, edit):
    base = KVSession(qwen2, grouping)
    base.prepare(HISTORY)
    new = EDITS[edit](HISTORY)
    replay, reprefill = base.fork(), base.fork()
    report = replay.prepare(new, policy=RepairPolicy(operator="replay"))
    reprefill.prepare(new, policy=RepairPolicy(operator="reprefill"))
    assert report.fallback is None and report.operator == "replay"
    assert report.reused_tokens > len(replay.token_ids) // 2  # the group's other members are reused
    assert replay.token_ids == reprefill.token_ids
    for (ka, va), (kb, vb) in zip(kvcache.layer_tensors(replay.cache), kvcache.layer_tensors(reprefill.cache)):
        torch.testing.assert_close(ka, kb, atol=ATOL, rtol=0)
        torch.testing.assert_close(va, vb, atol=ATOL, rtol=0)
    torch.testing.assert_close(replay.next_logits, reprefill.next_logits, atol=ATOL, rtol=0)
    replay.check_invariants()


def test_deleting_the_last_member_recomputes_only_the_moved_closer(qwen2, grouping):
    base = KVSession(qwen2, grouping)
    base.prepare(HISTORY)
    s = base.fork()
    report = s.prepare(EDITS["delete-last"](HISTORY), policy=RepairPolicy(budget=5))
    closer = len(grouping("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    assert report.fallback is None and report.stale_tokens == 0
    assert report.recomputed_tokens == closer  # t2's tokens reused; only the closer and generation prompt computed


def test_a_template_that_rewrites_a_message_when_others_follow_still_falls_back(grouping):
    rewriting = copy.deepcopy(grouping)
    # the last message is upper-cased: its text changes once another message follows
    rewriting.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.upper() if loop.last else m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="renders message 0 differently"):
        render_prompt(rewriting, normalize_messages(HISTORY[:2]))
