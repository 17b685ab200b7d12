"""A tool-using agent's history edited in the middle, repaired instead of re-prefilled.

Run: .venv/bin/python examples/agents/edit_history.py
Turn 1 prefills the history; turn 2 clears an old tool output (same id, new content) and asks a
follow-up; turn 3 deletes a message. Each turn prints what the live cache reused and recomputed.
"""

from kvmemory import KVSession, RepairPolicy, load_model

HISTORY = [
    {"role": "system", "content": "You are a travel assistant. Use the tool results.", "id": "sys"},
    {"role": "user", "content": "Plan a day in Lisbon.", "id": "u1"},
    {"role": "tool", "content": '{"weather": "sunny", "high_c": 24, "low_c": 16}', "id": "weather"},
    {"role": "tool", "content": "Belem Tower opens at 10:00. The tram 28 crosses Alfama. "
     "Pasteis de nata are best warm.", "id": "sights"},
    {"role": "user", "content": "What is the weather like?", "id": "q1"},
]


def show(turn: str, report) -> None:
    print(f"{turn:<22} prompt {report.prompt_tokens:4d} | reused {report.reused_tokens:4d} | "
          f"recomputed {report.recomputed_tokens:4d} (refreshed {report.refreshed_tokens}) | "
          f"{report.latency_ms:6.0f} ms | fallback: {report.fallback}")


def main() -> None:
    lm = load_model()
    session = KVSession(lm.model, lm.tokenizer, RepairPolicy(budget=5))
    show("prefill", session.prepare(HISTORY))
    answer = session.generate(max_new_tokens=24).text
    print("  answer:", answer)

    cleared = [dict(m, content="[cleared]") if m["id"] == "weather" else m for m in HISTORY]
    turn2 = cleared + [{"role": "assistant", "content": answer, "id": "a1"},
                       {"role": "user", "content": "When does Belem Tower open?", "id": "q2"}]
    show("clear tool output", session.prepare(turn2))
    print("  answer:", session.generate(max_new_tokens=24).text)

    show("delete first question", session.delete_message("u1"))
    print("  answer:", session.generate(max_new_tokens=24).text)


if __name__ == "__main__":
    main()
