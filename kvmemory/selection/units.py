"""Semantic units: the stale suffix cut at text boundaries, with the 8/128-token size rules (paper §3.2, §7.3)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from ..errors import UnitPartitionError
from .inputs import SelectionInput, validate_input
from .regions import content_regions

MIN_UNIT = 8  # units shorter than this merge with a neighbour in their container
MAX_UNIT = 128  # units longer than this split into balanced chunks


@dataclass(frozen=True)
class Unit:
    """A run of consecutive prompt positions refreshed together.

    ``positions``: sorted, contiguous prompt positions, all eligible.
    ``container``: id of the message or structured container (code, JSON, list) it lies in;
    merges never cross containers.
    """

    positions: tuple[int, ...]
    container: int

    def __len__(self) -> int:
        return len(self.positions)


def _region_labels(inp: SelectionInput) -> list[tuple[int, int]]:
    """(region id, container id) of every eligible position, in eligible order.

    A token belongs to the region holding the midpoint of its char span; template tokens of a
    message outside its content attach to the nearest region (first before, last after the
    content). Positions outside every message form one region/container per inter-message gap.
    """
    starts = [m.token_start for m in inp.messages]
    ids: dict[tuple, int] = {}  # region / container keys -> dense ints
    regions_of: dict[int, tuple] = {}  # message slot -> (regions, doubled starts), computed on first use
    labels = []
    for p in inp.eligible:
        slot = bisect.bisect_right(starts, p) - 1
        if slot < 0 or p >= inp.messages[slot].token_end:
            key = ("gap", slot)
            labels.append((ids.setdefault(key, len(ids)), ids.setdefault(key + ("c",), len(ids))))
            continue
        m = inp.messages[slot]
        if slot not in regions_of:
            regions = content_regions(inp.text, m.content_start, m.content_end)
            regions_of[slot] = (regions, [2 * r.start for r in regions])
        regions, doubled_starts = regions_of[slot]
        a, b = inp.offsets[p]
        mid2 = a + b  # twice the midpoint, to stay in integers
        k = max(0, bisect.bisect_right(doubled_starts, mid2) - 1)
        if mid2 >= 2 * m.content_end:
            k = len(regions) - 1
        container = ("structured", slot, k) if regions[k].structured else ("message", slot)
        labels.append((ids.setdefault(("region", slot, k), len(ids)), ids.setdefault(container, len(ids))))
    return labels


def _runs(eligible: list[int], labels: list[tuple[int, int]]) -> list[Unit]:
    """Maximal runs of eligible positions that share a region and have no gap between them."""
    units: list[Unit] = []
    run: list[int] = []
    for k, p in enumerate(eligible):
        if run and (labels[k] != labels[k - 1] or p != run[-1] + 1):
            units.append(Unit(tuple(run), labels[k - 1][1]))
            run = []
        run.append(p)
    if run:
        units.append(Unit(tuple(run), labels[-1][1]))
    return units


def _split_long(units: list[Unit]) -> list[Unit]:
    """Split units over MAX_UNIT tokens into ceil(n/128) chunks whose sizes differ by at most one."""
    out = []
    for u in units:
        chunks = math.ceil(len(u) / MAX_UNIT)
        base, extra = divmod(len(u), chunks)
        lo = 0
        for c in range(chunks):
            size = base + (c < extra)  # the first `extra` chunks take one more token
            out.append(Unit(u.positions[lo : lo + size], u.container))
            lo += size
    return out


def _joinable(a: Unit, b: Unit) -> bool:
    """``a`` directly precedes ``b`` in the same container (so their union stays contiguous)."""
    return a.container == b.container and a.positions[-1] + 1 == b.positions[0]


def _merge_short(units: list[Unit]) -> list[Unit]:
    """Merge each unit under MIN_UNIT tokens into its shorter joinable neighbour (tie: the preceding one).

    Left to right; a merged unit is re-examined, so it keeps absorbing neighbours until it
    reaches MIN_UNIT or has no joinable neighbour left.
    """
    units = list(units)
    i = 0
    while i < len(units):
        u = units[i]
        prev = units[i - 1] if i > 0 and _joinable(units[i - 1], u) else None
        nxt = units[i + 1] if i + 1 < len(units) and _joinable(u, units[i + 1]) else None
        if len(u) >= MIN_UNIT or (prev is None and nxt is None):
            i += 1
        elif nxt is None or (prev is not None and len(prev) <= len(nxt)):
            units[i - 1 : i + 1] = [Unit(prev.positions + u.positions, u.container)]
            i -= 1
        else:
            units[i : i + 2] = [Unit(u.positions + nxt.positions, u.container)]
    return units


def _check_partition(units: list[Unit], eligible: list[int]) -> None:
    """Raise UnitPartitionError unless the units, in order, are exactly ``eligible`` and contiguous."""
    flat = [p for u in units for p in u.positions]
    contiguous = all(u.positions and u.positions[-1] - u.positions[0] == len(u) - 1 for u in units)
    if flat != eligible or not contiguous:
        raise UnitPartitionError(
            f"semantic units do not partition the {len(eligible)} eligible positions "
            f"({len(flat)} covered, contiguous={contiguous}); this is a kvmemory bug"
        )


def build_units(inp: SelectionInput) -> list[Unit]:
    """Cut the eligible positions into semantic units.

    Boundaries: messages, structured containers in message content (fenced code, JSON, markdown
    lists), paragraphs and pysbd sentences; tokens are placed by their char-span midpoint, and a
    unit never crosses a gap in ``eligible``. Units over 128 tokens split into balanced chunks;
    units under 8 tokens merge with the shorter adjacent unit of their container (tie: the
    preceding one); merged units over 128 tokens split again.

    Args:
        inp: the edited prompt; S = len(inp.eligible) positions (tokens).

    Returns:
        Units in prompt order whose positions partition ``inp.eligible`` exactly (no gaps or
        overlaps); [] when S = 0. Each unit has 1..128 tokens.

    Raises:
        ValueError: inconsistent spans in ``inp`` (see ``validate_input``).
        UnitPartitionError: internal check failed (a bug).

    Source: paper §3.2 (allocating the budget to regions) and §7.3 (segmentation details).
    """
    validate_input(inp)
    eligible = list(inp.eligible)
    units = _runs(eligible, _region_labels(inp))
    units = _split_long(_merge_short(_split_long(units)))
    _check_partition(units, eligible)
    return units
