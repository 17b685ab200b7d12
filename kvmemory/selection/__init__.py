"""Budgeted selection of stale KV rows to refresh after a history edit (paper §3.2, §7.1, §7.3, §7.4).

    B = allowance(S, budget)                          # eq. (3)
    positions = select("sur", inp, B, embedding=E)    # or any of ALLOCATOR_NAMES (14)
    intervals = to_intervals(positions)               # execution intervals
"""

from .allocators import (ALLOCATOR_NAMES, ALLOCATOR_TITLES, ALLOCATORS, EXTENSION_ALLOCATORS, KNOWN_ALLOCATORS, PRIVILEGED,
                         SIGNAL_ALLOCATORS, SelectionError, SelectionOptions, select)
from .bm25 import bm25_unit_scores, lexical_terms
from .budget import allowance
from .inputs import MessageSpan, SelectionInput, validate_input
from .intervals import to_intervals
from .regions import Region, content_regions
from .signals import RepairSignals, shared_signals, top_b
from .relevance import relevance_scores, unit_idf
from .unit_allocator import allocate_units, best_envelope_window, forward_envelope, unit_score
from .units import Unit, UnitPartitionError, build_units

__all__ = [
    "ALLOCATOR_NAMES",
    "ALLOCATOR_TITLES",
    "ALLOCATORS",
    "EXTENSION_ALLOCATORS",
    "KNOWN_ALLOCATORS",
    "PRIVILEGED",
    "RepairSignals",
    "shared_signals",
    "SIGNAL_ALLOCATORS",
    "top_b",
    "MessageSpan",
    "Region",
    "SelectionError",
    "SelectionInput",
    "SelectionOptions",
    "Unit",
    "UnitPartitionError",
    "allocate_units",
    "allowance",
    "best_envelope_window",
    "bm25_unit_scores",
    "build_units",
    "content_regions",
    "forward_envelope",
    "lexical_terms",
    "relevance_scores",
    "select",
    "to_intervals",
    "unit_score",
    "unit_idf",
    "validate_input",
]
