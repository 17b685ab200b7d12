"""The fourteen budget allocators behind one interface (paper §3.2, §4.1, §7.3, §7.4).

SUR and its four matched controls score text (:data:`ALLOCATORS`); the eight prior-work-derived
allocators and the privileged clean-state oracle read model signals of the repair in progress
(:data:`SIGNAL_ALLOCATORS`, implemented in :mod:`.adapted`). All of them spend exactly the allowance B.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Callable

import torch

from ..errors import SelectionError
from .adapted import a3, cacheblend, cachecraft, cachetune, infoflow, legolink, oracle, prophetkv, speccache
from .bm25 import bm25_unit_scores
from .inputs import SelectionInput, validate_input
from .relevance import relevance_scores, unit_idf
from .signals import RepairSignals, top_b
from .unit_allocator import admit_units, allocate_units
from .units import Unit, build_units

FLOAT32_QUANTUM = 2.0**149  # every float32 is an integer multiple of 2^-149 (its smallest subnormal)


@dataclass(frozen=True)
class SelectionOptions:
    """Options of the text allocators beyond the paper (defaults: the paper's rules).

    ``relevance``: ``paper`` (eq. 1) or ``idf`` (query tokens and the identical-token bonus
    weighted by their inverse frequency over the semantic units, :func:`relevance.unit_idf`).
    ``ties``: ``earliest`` (paper) or ``latest`` unit first on equal unit scores (sur).
    ``tail_tokens``: the last ``tail_tokens`` eligible positions (nearest the query) are taken
    first, inside B; the allocator spends the rest."""

    relevance: str = "paper"
    ties: str = "earliest"
    tail_tokens: int = 0


PAPER = SelectionOptions()


def _token_scores(inp: SelectionInput, embedding: torch.Tensor, options: SelectionOptions = PAPER) -> list[float]:
    """r_i of every eligible token (eq. 7), as Python floats aligned with ``inp.eligible``."""
    suffix_ids = [inp.token_ids[p] for p in inp.eligible]
    weights = None
    if options.relevance == "idf":
        units = [[inp.token_ids[p] for p in u.positions] for u in build_units(inp)]
        weights = unit_idf(units, inp.query_ids)
    return relevance_scores(embedding, suffix_ids, inp.query_ids, query_weights=weights).tolist()


def _sur(inp: SelectionInput, budget: int, embedding: torch.Tensor | None, seed: int,
         options: SelectionOptions = PAPER) -> list[int]:
    """Semantic-Unit Refresh: embedding relevance, ranked units, forward-envelope partial window (§7.3)."""
    return allocate_units(build_units(inp), _token_scores(inp, embedding, options), budget, options.ties)


def _dense(inp: SelectionInput, budget: int, embedding: torch.Tensor | None, seed: int,
           options: SelectionOptions = PAPER) -> list[int]:
    """Dense tokens: the B eligible positions with the highest r_i, earlier position first on ties (§7.4)."""
    r = _token_scores(inp, embedding, options)
    top = sorted(range(len(r)), key=lambda k: (-r[k], k))[:budget]
    return sorted(inp.eligible[k] for k in top)


def _window(inp: SelectionInput, budget: int, embedding: torch.Tensor | None, seed: int,
            options: SelectionOptions = PAPER) -> list[int]:
    """Max-relevance contiguous: the width-B run of eligible positions with the largest Σ r_i, earliest on ties (§7.4)."""
    # Exact integer sums, so equal windows (e.g. repeated text) tie exactly and the earliest wins.
    prefix = [0, *accumulate(int(x * FLOAT32_QUANTUM) for x in _token_scores(inp, embedding, options))]
    sums = [prefix[s + budget] - prefix[s] for s in range(len(prefix) - budget)]
    start = sums.index(max(sums))
    return list(inp.eligible[start : start + budget])


def _unit_text(inp: SelectionInput, unit: Unit) -> str:
    """The prompt text covered by the unit's tokens."""
    spans = [inp.offsets[p] for p in unit.positions]
    return inp.text[min(a for a, _ in spans) : max(b for _, b in spans)]


def _bm25(inp: SelectionInput, budget: int, embedding: torch.Tensor | None, seed: int) -> list[int]:
    """BM25 (same units): lexical unit scores broadcast to tokens, then SUR's unit allocator (§7.4)."""
    units = build_units(inp)
    unit_scores = bm25_unit_scores([_unit_text(inp, u) for u in units], inp.query_text)
    # Every token carries its unit's score, so the top-4 mean ranks units by BM25 and the
    # partial window (flat envelope) starts at the unit's first token.
    token_scores = [s for u, s in zip(units, unit_scores) for _ in u.positions]
    return allocate_units(units, token_scores, budget)


def _random(inp: SelectionInput, budget: int, embedding: torch.Tensor | None, seed: int) -> list[int]:
    """Random semantic units: seeded permutation of SUR's units, a seeded exact-width window in the last (§7.4)."""
    units = build_units(inp)
    rng = random.Random(seed)
    order = list(range(len(units)))
    rng.shuffle(order)
    return admit_units(units, order, budget, lambda j, w: rng.randrange(len(units[j]) - w + 1))


Allocator = Callable[[SelectionInput, int, "torch.Tensor | None", int], list[int]]
ALLOCATORS: dict[str, Allocator] = {"sur": _sur, "dense": _dense, "window": _window, "bm25": _bm25, "random": _random}
NEEDS_EMBEDDING = frozenset({"sur", "dense", "window"})

SignalAllocator = Callable[[SelectionInput, int, RepairSignals, int], list[int]]


def _exposure(inp: SelectionInput, budget: int, signals: RepairSignals, seed: int) -> list[int]:
    """B positions with the most estimated attention on the removed rows (our extension;
    :mod:`.exposure`). Selection cost: no forward, attention logits at every other layer."""
    return top_b(signals.removed_exposure().tolist(), inp.eligible, budget)


SIGNAL_ALLOCATORS: dict[str, SignalAllocator] = {
    "prophetkv": prophetkv,
    "infoflow": infoflow,
    "cachecraft": cachecraft,
    "cacheblend": cacheblend,
    "a3": a3,
    "legolink": legolink,
    "cachetune": cachetune,
    "speccache": speccache,
    "oracle": oracle,
    "exposure": _exposure,
}
EXTENSION_ALLOCATORS: tuple[str, ...] = ("exposure",)  # beyond the paper; SUR stays the reference
KNOWN_ALLOCATORS: tuple[str, ...] = (*ALLOCATORS, *SIGNAL_ALLOCATORS)
# the 14 of Appendix 7.4, in its order
ALLOCATOR_NAMES: tuple[str, ...] = tuple(n for n in KNOWN_ALLOCATORS if n not in EXTENSION_ALLOCATORS)
PRIVILEGED = frozenset({"oracle"})  # needs a full clean recomputation to select (Appendix 7.4)
ALLOCATOR_TITLES = {
    "sur": "SUR", "dense": "Dense tokens (same score)", "window": "Max-relevance contiguous",
    "bm25": "BM25 (same units)", "random": "Random semantic units", "prophetkv": "ProphetKV-Adapted",
    "infoflow": "InfoFlow-Motivated", "cachecraft": "Cache-Craft-Adapted", "cacheblend": "CacheBlend-Adapted",
    "a3": "A3-Adapted", "legolink": "LegoLink-Adapted", "cachetune": "CacheTune-Adapted",
    "speccache": "SpecCache-Adapted (aux = embedded model)", "oracle": "Clean-state oracle (privileged)",
    "exposure": "Exposure to the removed rows (our extension)",
}


def _check_selection(name: str, positions: list[int], inp: SelectionInput, budget: int) -> None:
    """Raise SelectionError unless ``positions`` are B unique sorted eligible positions."""
    ok = len(positions) == budget and all(a < b for a, b in zip(positions, positions[1:]))
    if not ok or not set(positions) <= set(inp.eligible):
        raise SelectionError(f"allocator {name!r} returned {len(positions)} positions for B={budget} that are not unique, sorted and eligible; this is a kvmemory bug")


def select(
    name: str,
    inp: SelectionInput,
    B: int,
    *,
    embedding: torch.Tensor | None = None,
    seed: int = 0,
    signals: RepairSignals | None = None,
    options: SelectionOptions = PAPER,
) -> list[int]:
    """Choose exactly B stale positions to refresh with the allocator ``name``.

    Args:
        name: "sur" (Semantic-Unit Refresh), "dense" (top-B tokens), "window" (max-relevance
            contiguous), "bm25" (BM25 on the same units), "random" (random semantic units), or
            one of the signal allocators of :data:`SIGNAL_ALLOCATORS` (see ALLOCATOR_TITLES), which
            include "exposure" (our extension, :mod:`.exposure`).
        inp: the edited prompt; S = len(inp.eligible).
        B: allowance in tokens, 0 <= B <= S (see ``allowance``).
        embedding: the model's input embedding table [V, H]; required by sur, dense and window.
        seed: RNG seed of the random allocator (a fixed seed per case).
        signals: model probes over the repair in progress; required by the signal allocators
            (:func:`kvmemory.repair.repair` passes them).
        options: :class:`SelectionOptions` beyond the paper (IDF relevance and the tie rule for
            sur / dense / window; ``tail_tokens`` for every allocator). Default: the paper's rules.

    Returns:
        B unique, sorted prompt positions from ``inp.eligible``; [] for B = 0, all of them for B = S.

    Raises:
        ValueError: unknown name (lists the valid ones); B not an int in [0, S]; missing embedding
            (sur, dense, window) or query_text (bm25) or signals (signal allocators); empty
            query_ids (sur, dense, window); inconsistent spans in ``inp``.
        SelectionError, UnitPartitionError: internal checks failed (a bug).

    Source: paper §3.2 and §7.3 (SUR, Algorithm 1), §7.4 and Table 1 (controls, adapted allocators
    and oracle), §7.1
    (every allocator receives the same exact allowance).
    """
    if name not in KNOWN_ALLOCATORS:
        raise ValueError(f"unknown allocator {name!r}: use one of {', '.join(KNOWN_ALLOCATORS)}")
    S = len(inp.eligible)
    if isinstance(B, bool) or not isinstance(B, int) or not 0 <= B <= S:
        raise ValueError(f"B must be an int in [0, S={S}] (compute it with allowance(S, budget)), got {B!r}")
    if name in NEEDS_EMBEDDING and embedding is None:
        raise ValueError(f"allocator {name!r} scores tokens with the input embedding table: pass embedding=model.get_input_embeddings().weight")
    if name == "bm25" and inp.query_text is None:
        raise ValueError("allocator 'bm25' scores words: build the SelectionInput with query_text=<the next query>")
    if name in SIGNAL_ALLOCATORS and name != "legolink" and signals is None:
        raise ValueError(f"allocator {name!r} reads model signals: pass signals=RepairSignals(...) (repair() does)")
    validate_input(inp)
    if B == 0:
        return []
    if B == S:  # Algorithm 1 line 2: a full budget is a full suffix replay
        return list(inp.eligible)
    tail = list(inp.eligible[S - min(options.tail_tokens, B):]) if options.tail_tokens else []
    rest = replace(inp, eligible=list(inp.eligible[: S - len(tail)])) if tail else inp
    positions = _run(name, rest, B - len(tail), embedding, seed, signals, options) if B > len(tail) else []
    positions = sorted(positions + tail)
    _check_selection(name, positions, inp, B)
    return positions


def _run(name, inp, B, embedding, seed, signals, options) -> list[int]:
    if name in SIGNAL_ALLOCATORS:
        return SIGNAL_ALLOCATORS[name](inp, B, signals, seed)
    if name in ("sur", "dense", "window"):
        return ALLOCATORS[name](inp, B, embedding, seed, options)
    return ALLOCATORS[name](inp, B, embedding, seed)
