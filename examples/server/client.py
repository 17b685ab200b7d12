"""Talk to the kvmemory agent on the LangGraph Agent Server with ``langgraph-sdk``.

Start the server first (``make serve``, or from this folder:
``../../.venv/bin/langgraph dev --no-browser --port 2024``), then:

    .venv/bin/python examples/server/client.py [--url http://127.0.0.1:2024] [--threads 2] [--turns 3] [--delete]

Each thread is created with ``threads.create``; its turns run with ``runs.wait`` (the first) and
``runs.stream`` (the others, printing each node's update as it arrives). After every turn it
prints, per model call of the turn, what the model's live cache reused: the AI message's
``response_metadata["repair"]`` (``reused_tokens`` of ``prompt_tokens``, ``recomputed_tokens``,
``refreshed_tokens`` after an edit such as a cleared tool output, and the ``operator``). From
turn 2 on, the first call of a turn reuses the whole previous turn from the cache. ``--delete``
deletes the threads at the end (their checkpoints, and the KV blocks only they named).
"""

from __future__ import annotations

import argparse

from langgraph_sdk import get_sync_client

QUESTIONS = [
    "What is the weather in Paris?",
    "And what time is it in Tokyo?",
    "Is it snowing in Oslo?",
    "How is the weather in Rome?",
]


def questions(index: int) -> list[str]:
    """The questions of the ``index``-th thread (each thread starts with another one)."""
    start = index % len(QUESTIONS)
    return QUESTIONS[start:] + QUESTIONS[:start]


def model_calls(messages: list[dict]) -> list[dict]:
    """The AI messages of the last turn (after the last user message) with their repair reports."""
    last_user = max((i for i, m in enumerate(messages) if m.get("type") == "human"), default=-1)
    return [m for m in messages[last_user + 1:] if m.get("type") == "ai"]


def repair_of(message: dict) -> dict:
    """The repair report ChatKVMemory put on an AI message (``response_metadata["repair"]``)."""
    return (message.get("response_metadata") or {}).get("repair") or {}


def describe(message: dict) -> str:
    r = repair_of(message)
    what = (f"tool call {message['tool_calls'][0]['name']}({message['tool_calls'][0]['args']})"
            if message.get("tool_calls") else f"answer {message.get('content', '')!r}")
    return (f"reused {r.get('reused_tokens', 0):>4} of {r.get('prompt_tokens', 0):>4} prompt tokens, "
            f"recomputed {r.get('recomputed_tokens', 0):>3}, refreshed {r.get('refreshed_tokens', 0):>2} "
            f"[{r.get('operator')}]  {what}")


def run_turn(client, thread_id: str, text: str, *, stream: bool) -> list[dict]:
    """One user turn; returns the thread's messages after it (from the thread state)."""
    payload = {"messages": [{"role": "user", "content": text}]}
    if stream:
        for part in client.runs.stream(thread_id, "agent", input=payload, stream_mode="updates"):
            if part.event == "updates" and isinstance(part.data, dict):
                for node, update in part.data.items():
                    count = len((update or {}).get("messages", [])) if isinstance(update, dict) else 0
                    print(f"    [stream] {node}: {count} message(s)")
    else:
        client.runs.wait(thread_id, "agent", input=payload)
    return client.threads.get_state(thread_id)["values"]["messages"]


def main(argv: list[str] | None = None) -> dict[str, list[list[dict]]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:2024")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--turns", type=int, default=3, choices=range(1, len(QUESTIONS) + 1))
    p.add_argument("--delete", action="store_true", help="delete the threads at the end")
    args = p.parse_args(argv)
    client = get_sync_client(url=args.url)
    reports: dict[str, list[list[dict]]] = {}
    for index in range(args.threads):
        thread_id = client.threads.create()["thread_id"]
        print(f"thread {thread_id}")
        reports[thread_id] = []
        for turn, question in enumerate(questions(index)[:args.turns], 1):
            print(f"  turn {turn}: {question}")
            calls = model_calls(run_turn(client, thread_id, question, stream=turn > 1))
            for message in calls:
                print(f"    {describe(message)}")
            reports[thread_id].append([repair_of(m) for m in calls])
    if args.delete:
        for thread_id in reports:
            client.threads.delete(thread_id)
            print(f"deleted thread {thread_id}")
    return reports


if __name__ == "__main__":
    main()
