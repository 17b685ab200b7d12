"""System-message edits through ChatKVMemory: a memory line rewritten in the system prompt each turn
(as LangGraph memory apps inject a store's facts), on messages without ids, is repaired in the
thread's cache (Shift + SUR) like a direct KVSession repairs it, not prefilled in a new cache slot."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from kvmemory.guard import DEFAULT_THRESHOLD
from kvmemory.prompt import ChatMessage
from langchain_kvmemory import ChatKVMemory
from langchain_kvmemory.slots import edited_head, pick_slot

BASE = ("You are a helpful travel assistant for a small tour company. Answer briefly and politely, "
        "and use the known facts about the user when they help.\n")
TURNS = [
    ("I want to plan a trip to Norway next summer. What should I see first?",
     "Start with the fjords on the west coast: Geirangerfjord and Naeroyfjord are the most famous, and Bergen "
     "is a good base for both."),
    ("How many days would I need for the fjords and Bergen together?",
     "Plan about five days: two in Bergen, then three for a fjord cruise, the Flam railway and a night in a "
     "fjord village."),
    ("Is it expensive to eat out there?",
     "Yes, Norway is pricey: a simple restaurant meal costs around 25 to 35 euros. Supermarkets and bakeries "
     "keep costs down."),
    ("What about getting from Oslo to Bergen?",
     "Take the Bergen Railway: about seven hours through mountains and plateaus, one of the most scenic train "
     "rides in Europe."),
    ("Should I rent a car for the fjords?",
     "A car gives freedom on the small fjord roads, but ferries and buses connect the main sights well in "
     "summer."),
]
QUESTION = "Can you suggest one more place to visit after that?"


def _messages(facts: str) -> list:
    """The system prompt with its memory line, then the conversation: no message has an id."""
    history = [m for user, answer in TURNS for m in (HumanMessage(user), AIMessage(answer))]
    return [SystemMessage(BASE + "Known facts: " + facts)] + history + [HumanMessage(QUESTION)]


class _Registry:  # the ThreadCaches methods pick_slot reads
    def __init__(self, caches):
        self.caches = caches

    @property
    def thread_ids(self):
        return list(self.caches)  # least recently used first

    def get(self, tid):
        return self.caches.get(tid)


class _Cache:
    def __init__(self, ids, system):
        self.token_ids = ids
        self.messages = [ChatMessage(role="system", content=system, key="s"),
                         ChatMessage(role="user", content="hi", key="u")]


def test_edited_head_tells_a_rewritten_memory_line_from_another_nodes_prompt():
    assert edited_head(BASE + "Known facts: vegetarian.", BASE + "Known facts: vegetarian, travels with a dog.")
    assert edited_head("Known facts: none.\n" + BASE, "Known facts: owns a dog.\n" + BASE)  # the line first
    assert not edited_head("You are a router. Reply with one word: weather or chat.",
                           "You are a friendly assistant. Answer in one short sentence.")
    assert edited_head("", "") and not edited_head("", "You are a router.")


def test_slot_choice_keeps_the_cache_a_system_edit_repairs():
    """A system-edit call goes to the slot holding the thread's cache (its exact prefix ends inside
    the head), not to an empty slot; a slot whose exact prefix covers the head still wins, and a
    different head still opens its own slot."""
    old, new = BASE + "Known facts: vegetarian.", BASE + "Known facts: vegetarian, owns a dog."
    registry = _Registry({"t": _Cache([1, 2, 3, 4, 5, 6], old)})
    prompt, head = [1, 2, 3, 9, 5, 6, 7], 5  # the head's tokens change at position 3
    assert pick_slot(registry, "t", prompt, head, max_slots=4, head_text=new) == ("t", 3)
    assert pick_slot(registry, "t", prompt, head, max_slots=4) == ("t/slot-1", 0)  # no head text: as before
    assert pick_slot(registry, "t", prompt, head, max_slots=4,
                     head_text="You are a router. Reply with one word.") == ("t/slot-1", 0)
    # another slot holding this exact head serves it, edited slots or not
    registry.caches["t/slot-1"] = _Cache([1, 2, 3, 9, 5, 8], new)
    assert pick_slot(registry, "t", prompt, head, max_slots=4, head_text=new) == ("t/slot-1", 5)
    # two slots holding the head edited: the longer exact prefix, then the most recently used
    registry.caches = {"t": _Cache([1, 2, 3, 4], old), "t/slot-1": _Cache([1, 2, 8], old),
                       "t/slot-2": _Cache([1, 2, 3, 7], old)}
    assert pick_slot(registry, "t", prompt, head, max_slots=4, head_text=new) == ("t/slot-2", 3)


@pytest.mark.real_model
def test_system_edit_without_ids_is_repaired_in_the_threads_cache(real):
    """Embedded model, default settings (the guard only observes): the second call changes the
    system message's memory line only. It is repaired in the first call's slot (Shift + SUR at the
    default budget), recomputing under half the prompt, and its answer agrees with Re-prefill's:
    the same greedy tokens as a fresh thread, and the guard's check against Re-prefill (teacher-
    forced over the answer) within its default threshold and with top-1 agreement."""
    llm = ChatKVMemory(model=real, max_tokens=8, guard={"fraction": 1.0})
    cfg = {"configurable": {"thread_id": "memory"}}
    first = llm.invoke(_messages("the user is vegetarian."), cfg)
    edited = llm.invoke(_messages("the user is vegetarian and travels with a dog."), cfg)
    repair, prompt = edited.response_metadata["repair"], edited.usage_metadata["input_tokens"]
    assert edited.response_metadata["cache_slot"] == first.response_metadata["cache_slot"] == "memory"
    assert repair["fallback"] is None and repair["operator"] == "refresh" and repair["budget"] == 5.0
    assert prompt > 300 and repair["recomputed_tokens"] < prompt / 2 and repair["reused_tokens"] > prompt / 2
    edits = repair["edits"]
    # the system message edited (old one deleted, new one inserted before the kept history; the
    # first answer, not sent back, deleted too), the 11 history messages kept, nothing appended
    assert edits.get("append", 0) == 0 and edits.get("insert", 0) + edits.get("replace", 0) == 1
    assert edits["keep"] == 2 * len(TURNS) + 1 and repair["stale_tokens"] > 0
    reference = llm.invoke(_messages("the user is vegetarian and travels with a dog."),
                           {"configurable": {"thread_id": "reprefilled"}})
    assert reference.response_metadata["repair"]["recomputed_tokens"] == prompt  # a fresh prefill
    assert edited.content == reference.content
    llm.guard_summary(wait=True)  # the background check of the repair has finished
    check = llm.guard_for().thread_info("memory")["last_sample"]
    assert check["kl"] < DEFAULT_THRESHOLD and check["tf_agreement"] == 1.0 and not check["escalated"]
