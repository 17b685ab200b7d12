"""Helpers shared by the tests: tiny random-weight models and a small agent history."""

from __future__ import annotations

import torch

from kvmemory.session import KVSession
from kvmemory.testing import tiny_config, tiny_loaded, tiny_model  # noqa: F401  (the one tiny test model)


def reprefill_logits(model, token_ids) -> torch.Tensor:
    """Re-prefill: one plain forward of the whole prompt without a cache (fp32 ``[vocab]``)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(token_ids)])).logits[0, -1].float()


def assert_engine_matches_forward(engine, ids: torch.Tensor, prefill: int, draft: int, rtol: float):
    """Through ``engine``: prefill ``ids[:prefill]``, a ``draft``-row append checked row by row,
    then one decoded token at a time to the end; every logit row equals the model's own forward
    of all ``ids`` within ``rtol`` of its largest logit. Returns the engine's cache and that forward."""
    from kvmemory import kvcache

    cache = kvcache.new_cache(engine.model.config)
    end = prefill + draft
    logits = [engine.forward_rows(cache, ids[:prefill], 0)]
    logits += list(engine.forward_rows(cache, ids[prefill:end], prefill, every_row=True))
    logits += [engine.forward_rows(cache, ids[i:i + 1], i) for i in range(end, len(ids))]
    with torch.no_grad():
        ref = engine.model(input_ids=ids[None]).logits[0].float()
    torch.testing.assert_close(torch.stack(logits), ref[[prefill - 1, *range(prefill, len(ids))]],
                               atol=rtol * ref.abs().max().item(), rtol=0)
    return cache, ref


def history() -> list[dict]:
    return [
        {"role": "system", "content": "You answer questions about the passages the tool returns.", "id": "sys"},
        {"role": "user", "content": "Where was the founder of Ostrava Nova born?", "id": "u1"},
        {"role": "assistant", "content": "search('Ostrava Nova')", "id": "a1"},
        {"role": "tool", "content": "Ostrava Nova was founded in 1873 by the engineer Ilse Marrow. "
         "The town lies on the Mira River.\n\nIts mill was the first in the valley.", "id": "t1"},
        {"role": "assistant", "content": "search('lighthouses')", "id": "a2"},
        {"role": "tool", "content": "Port Calder has three lighthouses. The oldest was built in 1790. "
         "It is now a museum.", "id": "t2"},
        {"role": "assistant", "content": "search('Ilse Marrow')", "id": "a3"},
        {"role": "tool", "content": "Ilse Marrow (1841-1919) was a hydraulic engineer born in Helmsford, "
         "a river port on the Dorne. She designed its canal locks.", "id": "t3"},
    ]


QUERY = {"role": "user", "content": "Answer: where was the founder of Ostrava Nova born?", "id": "q"}


def without(msgs, *ids):
    return [m for m in msgs if m["id"] not in ids]


def replaced(msgs, mid, content):
    return [dict(m, content=content) if m["id"] == mid else m for m in msgs]


def prepared(model, tokenizer, msgs) -> KVSession:
    s = KVSession(model, tokenizer)
    s.prepare(msgs)
    return s


def answer_graph(registry, saver):
    """A one-node LangGraph agent that leases the thread's session from ``registry`` and answers
    with 4 greedy tokens; checkpoints go to ``saver``."""
    from langchain_core.messages import AIMessage
    from langgraph.graph import START, MessagesState, StateGraph

    def answer(state: MessagesState, config):
        roles = {"system": "system", "human": "user", "ai": "assistant"}
        with registry.lease(config["configurable"]["thread_id"]) as session:
            session.prepare([{"role": roles[m.type], "content": m.content, "id": m.id} for m in state["messages"]])
            text = session.generate(4).text
        return {"messages": [AIMessage(text)]}

    builder = StateGraph(MessagesState)
    builder.add_node("answer", answer)
    builder.add_edge(START, "answer")
    return builder.compile(checkpointer=saver)
