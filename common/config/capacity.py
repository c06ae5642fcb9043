"""Capacities as exact rationals, so that ``ceil(gamma * d)`` is computed without rounding error.

A capacity reaches the server as a float (``capacity=0.07`` in a node config, ``1/3`` parsed from
``--capacities``). Multiplying that float by ``d`` in floating point can land just above an integer
(``0.07 * 100 = 7.000000000000001``), and ``ceil`` then keeps one parameter more than the operator
asked for. Even the float's exact binary value is not what was meant: ``0.07`` is stored as
``0.070000000000000006661...``. The capacity a float stands for is therefore read as the **simplest
rational that rounds to it** (smallest denominator, then smallest numerator): ``0.07`` is ``7/100``,
``float(1/3)`` is ``1/3``, and ``float(k/d)`` is ``k/d`` for every ``d`` below about ``10**8`` (two
fractions with such denominators differ by far more than the float's rounding interval). A capacity
given as a :class:`~fractions.Fraction` or a fraction string (``"1/3"``, ``"0.07"``) is taken
exactly as written.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache
from typing import Any

from common.config.schema import ConfigError

Capacity = float | int | Fraction | str

#: What a node's capacity limits (``capacity-kind``): ``bandwidth`` (a slow link: a method may grow
#: the node's submodel past it) or ``memory`` (a hard cap on what the node can hold).
CAPACITY_KINDS: tuple[str, ...] = ("bandwidth", "memory")


def simplest_between(lo: Fraction, hi: Fraction | None) -> Fraction:
    """The rational with the smallest denominator (then numerator) strictly inside ``(lo, hi)``.

    Parameters
    ----------
    lo : Fraction
        Lower end, excluded; ``lo >= 0``.
    hi : Fraction or None
        Upper end, excluded, ``hi > lo``; ``None`` for no upper end.
    """
    if lo < 0 or (hi is not None and hi <= lo):
        raise ValueError(f"need 0 <= lo < hi, got lo={lo}, hi={hi}")
    bn, bd = (hi.numerator, hi.denominator) if hi is not None else (1, 0)
    return Fraction(*_simplest_between(lo.numerator, lo.denominator, bn, bd))


def _simplest_between(an: int, ad: int, bn: int, bd: int) -> tuple[int, int]:
    """:func:`simplest_between` of ``(an/ad, bn/bd)`` on integers (``bd == 0``: no upper end)."""
    # Continued-fraction descent (Stern-Brocot): take the integer part shared by both ends, invert
    # the fractional parts, repeat until an integer fits strictly between them. (p0, q0), (p1, q1)
    # are the last two convergents of the partial quotients taken so far.
    p0, q0, p1, q1 = 0, 1, 1, 0
    while True:
        f = an // ad
        if bd == 0 or (f + 1) * bd < bn:  # the smallest integer above lo is below hi
            return (f + 1) * p1 + p0, (f + 1) * q1 + q0
        p0, q0, p1, q1 = p1, q1, f * p1 + p0, f * q1 + q0
        # (lo, hi) - f, inverted: (1 / (hi - f), 1 / (lo - f)); lo == f leaves no upper end.
        an, ad, bn, bd = bd, bn - f * bd, ad, an - f * ad


@lru_cache(maxsize=4096)
def float_fraction(x: float) -> Fraction:
    """The simplest rational that rounds to the float ``x`` (``x >= 0``, finite).

    Every real strictly between the midpoints to ``x``'s neighbouring floats rounds to ``x``; the
    answer is the simplest of those.
    """
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"expected a finite non-negative number, got {x}")
    if x == 0:
        return Fraction(0)
    # Floats are dyadic: over the largest of the three denominators (a power of two) all are
    # integers.
    below, above = math.nextafter(x, 0.0), math.nextafter(x, math.inf)
    (p, q), (pb, qb), (pa, qa) = (v.as_integer_ratio() for v in (x, below, above))
    m = max(q, qb, qa)
    mid = p * (m // q)
    lo, hi = mid + pb * (m // qb), mid + pa * (m // qa)  # twice the midpoints, over 2m
    return Fraction(*_simplest_between(lo, 2 * m, hi, 2 * m))


def capacity_fraction(gamma: Capacity) -> Fraction:
    """A capacity as an exact rational.

    Parameters
    ----------
    gamma : float, int, Fraction or str
        A float is read as the simplest rational that rounds to it (module docstring); an int or a
        Fraction is exact; a string is parsed exactly (``"1/3"``, ``"0.07"``, ``"1"``).
    """
    if isinstance(gamma, bool):
        raise ValueError(f"capacity must be a number, got {gamma!r}")
    if isinstance(gamma, Fraction):
        return gamma
    if isinstance(gamma, int):
        return Fraction(gamma)
    if isinstance(gamma, str):
        try:
            return Fraction(gamma.strip())
        except (ValueError, ZeroDivisionError) as err:
            raise ValueError(f"capacity {gamma!r} is not a number or fraction") from err
    value = float(gamma)
    if math.isnan(value) or value < 0:
        raise ValueError(f"capacity must be in (0, 1], got {gamma}")
    return float_fraction(value)


def ceil_times(gamma: Fraction, d: int) -> int:
    """``ceil(gamma * d)`` in integer arithmetic."""
    return -((-gamma.numerator * d) // gamma.denominator)


def parse_capacity_list(value: Any, key: str = "capacity-mix") -> tuple[float, ...]:
    """``"1,1/4,1/16"`` -> capacities, each in (0, 1]; ``""`` -> none. Errors name ``key``.

    An empty item (``"1,,1"``, a trailing comma) is an error, not skipped: it is a typo whose intent
    (a missing node, or one too many commas) cannot be guessed.
    """
    if not isinstance(value, str):
        raise ConfigError(f"{key}={value!r}: expected a string like '1,1/4,1/16'")
    if not value.strip():
        return ()
    out = []
    for position, item in enumerate((i.strip() for i in value.split(",")), start=1):
        if not item:
            raise ConfigError(
                f"{key}={value!r}: item {position} is empty (two commas in a row, or one at an end)"
            )
        try:
            gamma = capacity_fraction(item)
        except ValueError as err:
            raise ConfigError(f"{key}={value!r}: {item!r} is not a number or fraction") from err
        if not 0 < gamma <= 1:
            raise ConfigError(f"{key}={value!r}: {item!r} is outside (0, 1]")
        out.append(float(gamma))
    return tuple(out)
