"""Invariants of a live cache, checked on a :class:`~kvmemory.session.KVSession` after any call.

Each check returns a list of violation descriptions (empty: the invariant holds), so a fuzzer
can report every broken invariant of a step at once instead of stopping at the first assert:

(a) :func:`token_violations`: the cached token ids equal the tokenization (``render_prompt``
    through the chat template) of the messages the session claims to hold, plus the tokens it
    generated since; the messages are the ones the caller sent.
(b) :func:`segment_violations`: the segment table partitions the prompt tokens: one segment per
    message, contiguous, no gaps or overlaps, and it equals a from-scratch rendering's table
    (``render_prompt`` reuses the previous boundaries; that shortcut must not change them).
    Segments + generation prompt + generated tokens cover exactly the cache length.
(c) :func:`memory_violations` (and :func:`registry_violations`, :func:`state_violations`): the
    byte counts the session, a ``ThreadCaches`` registry or a ``CacheState`` report equal the
    bytes of the storages their tensors actually hold (a view of a larger storage holds all of
    it), CacheReforge boundary states included.
(d) :func:`fidelity_violations`: the leading ``exact_rows`` K/V rows equal a Re-prefill of the
    cached ids (the claim Replay relies on), and repairing the session at budget b = 100 %
    gives Re-prefill's next-token logits (fp32: ``atol`` 1e-4, or 1e-5 of the largest value)
    — the SUR paper's limit case b = 100 % = Replay (§7.1, eq. 3 with B = S).

The reference Re-prefill is the model's own full forward (``model(input_ids, past_key_values=
DynamicCache)``), not kvmemory's executors, so a shared bug cannot hide.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from kvmemory import kvcache
from kvmemory.edits import common_prefix_length
from kvmemory.policy import RepairPolicy
from kvmemory.prompt import ChatMessage, TemplateError, normalize_messages, render_prompt

FIDELITY_ATOL = 1e-4  # fp32 equality tolerance for logits and exact rows
# ... scaled up for large values: fp32 summation order (AVX2 vs AVX-512 kernels, oneDNN vs our
# engine) moves K/V of magnitude ~15 by up to ~1e-4 after a few layers; a wrong row moves them by O(1)
FIDELITY_RTOL = 1e-5


def check_session(
    session,
    expected: Sequence[Mapping | ChatMessage] | None = None,
    *,
    fidelity: bool = True,
    policy: RepairPolicy | None = None,
    atol: float = FIDELITY_ATOL,
) -> list[str]:
    """All invariants (a)–(d) of ``session``; see the module docstring.

    Args:
        session: a KVSession (any state, including before the first ``prepare``).
        expected: the messages the caller last sent (None: not checked against the caller).
        fidelity: run the Re-prefill comparisons of (d) (one full forward + one Replay).
        policy: executor / allocator for the b = 100 % repair of (d) (default: the session's).
        atol: absolute tolerance of (d) on fp32 logits and K/V rows (raised to
            ``FIDELITY_RTOL`` × the reference's largest magnitude where that is larger).

    Returns:
        violation descriptions, each prefixed by its invariant letter; empty when all hold.
    """
    out = token_violations(session, expected) + segment_violations(session) + memory_violations(session)
    if fidelity and session.token_ids:
        out += fidelity_violations(session, policy=policy, atol=atol)
    return out


# ------------------------------------------------------------------ (a) tokens
def token_violations(session, expected: Sequence[Mapping | ChatMessage] | None = None) -> list[str]:
    """(a) The cached ids are the rendering of the held messages (+ generated tokens after it).

    Renders ``session.messages`` from scratch (no previous rendering) with a generation prompt,
    or without one when the last answer was committed as a message.
    """
    out = []
    rows = kvcache.cache_length(session.cache)
    if rows != len(session.token_ids):
        out.append(f"(a) the cache holds {rows} rows for {len(session.token_ids)} token ids")
    if expected is not None:
        want = [(m.role, m.content, m.key) for m in normalize_messages(expected)]
        have = [(m.role, m.content, m.key) for m in session.messages]
        if want != have:
            out.append(f"(a) the session holds {len(have)} messages {_keys(have)}, the caller sent "
                       f"{len(want)} {_keys(want)}" + ("" if _keys(have) != _keys(want) else " (contents differ)"))
    if session.rendered is None:
        if session.token_ids:
            out.append(f"(a) {len(session.token_ids)} token ids but no rendered messages")
        return out
    fresh = _fresh_render(session)
    if fresh is None:
        return out  # a template without stable spans: only the ids the session rendered can be compared
    if tuple(session.rendered.token_ids) != fresh.token_ids:
        out.append(f"(a) the session's rendering ({len(session.rendered)} tokens) differs from a fresh one "
                   f"({len(fresh)} tokens) at token {common_prefix_length(session.rendered.token_ids, fresh.token_ids)}")
    n = len(fresh.token_ids)
    if len(session.token_ids) < n or tuple(session.token_ids[:n]) != fresh.token_ids:
        out.append(f"(a) cached ids differ from the messages' tokenization at token "
                   f"{common_prefix_length(session.token_ids, fresh.token_ids)} (cached {len(session.token_ids)}, "
                   f"rendered {n})")
    return out


def _fresh_render(session):
    try:
        return render_prompt(session.tokenizer, list(session.rendered.messages), tools=session.tools,
                             generation_prompt=not session.answer_committed)
    except TemplateError:
        return None


# ---------------------------------------------------------------- (b) segments
def segment_violations(session) -> list[str]:
    """(b) The segment table partitions the prompt tokens and covers the cache exactly."""
    rendered = session.rendered
    if rendered is None:
        return []
    segs, out = rendered.segments, []
    if not segs:
        return []  # rendered without spans (template fallback): nothing to partition
    if len(segs) != len(rendered.messages):
        out.append(f"(b) {len(segs)} segments for {len(rendered.messages)} messages")
    pos, char = 0, 0
    for i, (seg, msg) in enumerate(zip(segs, rendered.messages)):
        if seg.key != msg.key or seg.index != i or seg.content_hash != msg.content_hash:
            out.append(f"(b) segment {i} names {seg.key!r} (index {seg.index}), message {i} is {msg.key!r}")
        if seg.token_start != pos:
            out.append(f"(b) segment {i} starts at token {seg.token_start}, the previous one ended at {pos}")
        if seg.char_start != char:
            out.append(f"(b) segment {i} starts at char {seg.char_start}, the previous one ended at {char}")
        if seg.token_end < seg.token_start or seg.char_end < seg.char_start:
            out.append(f"(b) segment {i} has a negative span {seg.token_start}:{seg.token_end}")
        for t in range(seg.token_start, min(seg.token_end, len(rendered.offsets))):
            a, b = rendered.offsets[t]
            if not seg.char_start <= (a + b) / 2 < seg.char_end:
                out.append(f"(b) token {t} (chars {a}:{b}) lies outside segment {i}'s chars "
                           f"{seg.char_start}:{seg.char_end}")
                break
        if seg.content_end > seg.content_start and rendered.text[seg.content_start:seg.content_end] != msg.content:
            out.append(f"(b) segment {i}'s content span does not hold its message's content")
        pos, char = seg.token_end, seg.char_end
    n = len(rendered.token_ids)
    if pos > n:
        out.append(f"(b) segments end at token {pos}, past the {n} rendered tokens")
    cached = kvcache.cache_length(session.cache)
    if cached < n:
        out.append(f"(b) segments + generation prompt cover {n} tokens, the cache holds only {cached} rows")
    out += _against_fresh_segments(session)
    return out


def _against_fresh_segments(session) -> list[str]:
    """The table built with the previous rendering's boundaries equals a from-scratch one."""
    fresh = _fresh_render(session)
    if fresh is None or not fresh.segments:
        return []
    have = [(s.key, s.token_start, s.token_end, s.char_start, s.char_end) for s in session.rendered.segments]
    want = [(s.key, s.token_start, s.token_end, s.char_start, s.char_end) for s in fresh.segments]
    if have != want:
        i = common_prefix_length(have, want)
        return [f"(b) segment {i} is {have[i] if i < len(have) else None} but a fresh rendering gives "
                f"{want[i] if i < len(want) else None}"]
    return []


# ------------------------------------------------------------------ (c) memory
def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view holds its whole storage)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def session_tensors(session) -> list[torch.Tensor]:
    """The tensors every cache layer holds (K/V; a quantized layer's payload, scales and residual
    buffer) plus CacheReforge's retained boundary states."""
    tensors = [t for layer in session.cache.layers for t in kvcache.held_tensors(layer)]
    return tensors + [b.hidden for b in session.reforge.boundaries.states.values()]


def memory_violations(session) -> list[str]:
    """(c) ``session.memory_bytes`` equals the bytes its K/V and boundary-state tensors hold."""
    held = held_bytes(session_tensors(session))
    if session.memory_bytes != held:
        kv = held_bytes(t for layer in session.cache.layers for t in kvcache.held_tensors(layer))
        return [f"(c) memory_bytes reports {session.memory_bytes} B, the session holds {held} B "
                f"(K/V storages {kv} B, CacheReforge boundary states {session.reforge.boundary_bytes} B)"]
    return []


def registry_violations(caches) -> list[str]:
    """(c) A ``ThreadCaches``' ``memory_bytes`` equals the bytes all its live sessions hold,
    and each session's own accounting holds."""
    sessions = [caches.session(tid) for tid in caches.thread_ids]
    out = [v for s in sessions for v in memory_violations(s)]
    held = sum(held_bytes(session_tensors(s)) for s in sessions)
    if caches.memory_bytes != held:
        out.append(f"(c) ThreadCaches.memory_bytes reports {caches.memory_bytes} B, its {len(sessions)} "
                   f"threads hold {held} B")
    return out


def state_violations(state) -> list[str]:
    """(c) ``CacheState.nbytes`` equals the bytes of its K/V tensors."""
    held = held_bytes(t for kv in state.layers for t in kv)
    return [] if state.nbytes == held else [f"(c) CacheState.nbytes reports {state.nbytes} B, its layers hold {held} B"]


# ---------------------------------------------------------------- (d) fidelity
def reprefill_reference(model, token_ids: Sequence[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model's own full forward of ``token_ids`` (length N) from an empty cache.

    Returns:
        fp32 next-token logits ``[vocab]`` and per layer ``(keys, values)`` ``[1, kv_heads, N, head_dim]``.
    """
    cache = kvcache.new_cache(model.config)
    device = next(model.parameters()).device
    with torch.inference_mode():  # logits_to_keep=1: the LM head over one row, not N (it dominates the cost)
        out = model(input_ids=torch.tensor([list(token_ids)], device=device), cache=cache, use_cache=True,
                    logits_to_keep=1)
    return out.logits[0, -1].float(), kvcache.layer_tensors(cache)


def fidelity_violations(session, *, policy: RepairPolicy | None = None, atol: float = FIDELITY_ATOL) -> list[str]:
    """(d) Exact rows are exact, and a b = 100 % repair gives Re-prefill's next-token logits.

    The b = 100 % repair runs on a fork (the session is unchanged): it re-prepares the held
    messages, so stale rows left by earlier sparse repairs are all recomputed (B = S).
    """
    out = []
    ids = list(session.token_ids)
    ref_logits, rows = reprefill_reference(session.model, ids)
    exact = min(session.exact_rows, len(ids))
    for i, ((k, v), (rk, rv)) in enumerate(zip(kvcache.layer_tensors(session.cache), rows)):
        err = max(_max_abs(k[:, :, :exact], rk[:, :, :exact]), _max_abs(v[:, :, :exact], rv[:, :, :exact]))
        if err > _tolerance(atol, rk[:, :, :exact], rv[:, :, :exact]):
            out.append(f"(d) layer {i}: the {exact} rows claimed exact differ from Re-prefill by {err:.2e}")
            break
    if session.rendered is None:
        return out
    base = policy or session.policy
    full = RepairPolicy(operator="refresh", budget=100.0, allocator=base.allocator, seed=base.seed,
                        executor=base.executor, backend=base.backend)
    fork = session.fork()
    fork.prepare(list(session.rendered.messages), policy=full)
    if fork.answer_committed or fork.next_logits is None:
        return out + ["(d) a b = 100 % repair left no pending next-token logits"]
    if fork.token_ids != ids:  # generated tokens or a committed answer were dropped: another reference
        ref_logits, _ = reprefill_reference(session.model, fork.token_ids)
    err = _max_abs(fork.next_logits.float(), ref_logits)
    if err > _tolerance(atol, ref_logits):
        out.append(f"(d) b = 100 % repair ({full.label}, {full.executor}) logits differ from Re-prefill by {err:.2e}")
    if fork.exact_rows != len(fork.token_ids):
        out.append(f"(d) after a b = 100 % repair only {fork.exact_rows} of {len(fork.token_ids)} rows are exact")
    return out


def _tolerance(atol: float, *references: torch.Tensor) -> float:
    """``atol``, or FIDELITY_RTOL × the largest magnitude of the references where that is larger."""
    largest = max((float(r.abs().max()) for r in references if r.numel()), default=0.0)
    return max(atol, FIDELITY_RTOL * largest)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _keys(items) -> list[str]:
    return [k for _, _, k in items]
