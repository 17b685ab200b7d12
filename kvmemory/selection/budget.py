"""The exact refresh allowance B(S, b) (paper §7.1, eq. 3)."""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction
from numbers import Real


def _exact_percentage(budget: object) -> Fraction:
    """``budget`` as an exact rational, reading a float as the decimal it prints as.

    Why: float arithmetic gives 1500 * 2.2 / 100 = 33.00000000000001, whose ceiling is 34, so a
    float is converted through its shortest repr ("2.2") rather than its binary value.
    """
    if isinstance(budget, bool) or not isinstance(budget, (Real, Decimal)):
        raise ValueError(
            f"budget must be a number of percent in [0, 100], got {budget!r} ({type(budget).__name__}); "
            "pass e.g. budget=5 or budget=2.5"
        )
    if isinstance(budget, float) or not isinstance(budget, (int, Fraction, Decimal)):
        budget = float(budget)  # numpy scalars and other Reals
        if not math.isfinite(budget):
            raise ValueError(f"budget must be a finite percentage in [0, 100], got {budget!r}; pass e.g. budget=5")
        return Fraction(repr(budget))
    if isinstance(budget, Decimal) and not budget.is_finite():
        raise ValueError(f"budget must be a finite percentage in [0, 100], got {budget!r}; pass e.g. budget=5")
    return Fraction(budget)


def allowance(S: int, budget: float) -> int:
    """Number of stale suffix positions a refresh may recompute: B = min(S, ceil(S·b/100)).

    Args:
        S: retained (stale) suffix length in tokens, an int >= 0.
        budget: b, a percentage of the suffix in [0, 100] (int, float, Fraction or Decimal;
            floats are read as the decimal they print as, so b=5, S=100 gives exactly 5).

    Returns:
        B, an int in [0, S] (tokens). b=0 gives 0; b=100 gives S; any b>0 with S>0 gives >= 1.

    Raises:
        ValueError: S is not a non-negative int, or budget is not a number (str, bool, NaN, inf)
            or lies outside [0, 100]; the message names the fix.

    Source: paper §7.1, eq. (3); §3.1 (budget as a percentage of the S suffix tokens).
    """
    if isinstance(S, bool) or not isinstance(S, int) or S < 0:
        raise ValueError(f"S is the stale suffix length and must be an int >= 0, got {S!r}")
    b = _exact_percentage(budget)
    if not 0 <= b <= 100:
        raise ValueError(
            f"budget is a percentage of the stale suffix and must lie in [0, 100], got {budget!r}; "
            "use 0 for Shift only, 100 for a full Replay, e.g. 5 for 5 %"
        )
    return min(S, math.ceil(S * b / 100))
