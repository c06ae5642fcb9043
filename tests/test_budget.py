"""``budget()``: ``ceil(gamma * d)`` computed exactly, for float, fraction and string capacities."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.config.capacity import capacity_fraction, float_fraction, simplest_between
from common.fisher.selection import budget


def test_every_k_over_d_up_to_2000_gives_exactly_k():
    """``ceil((k/d) * d)`` is ``k``; the floating-point product overshot it for 74,789 of these
    pairs."""
    wrong = [(k, d) for d in range(1, 2001) for k in range(1, d + 1) if budget(k / d, d) != k]
    assert wrong == []


def test_the_reported_case_and_fraction_strings():
    assert math.ceil(0.07 * 100) == 8  # what floating point gives
    assert budget(0.07, 100) == 7
    assert budget("0.07", 100) == 7
    assert budget("1/3", 3) == 1 and budget("1/3", 4) == 2
    assert budget(Fraction(2, 3), 3) == 2
    assert budget(1, 10) == 10 and budget(1.0, 0) == 0


@given(st.integers(1, 10**6), st.integers(1, 10**6), st.integers(0, 10**9))
def test_a_rational_capacity_stays_exact_as_a_float_a_string_and_a_fraction(p, q, d):
    p, q = min(p, q), max(p, q)
    expected = -((-p * d) // q)  # ceil(p d / q) in integers
    assert budget(p / q, d) == expected
    assert budget(f"{p}/{q}", d) == expected
    assert budget(Fraction(p, q), d) == expected


@given(st.floats(min_value=1e-12, max_value=1.0, allow_nan=False))
def test_a_float_stands_for_the_simplest_rational_that_rounds_to_it(x):
    r = float_fraction(x)
    assert float(r) == x
    if r.denominator <= 2000:  # brute force: no smaller denominator rounds to x
        for q in range(1, r.denominator):
            assert all(float(Fraction(p, q)) != x for p in (math.floor(x * q), math.ceil(x * q)))


def test_simplest_between_matches_brute_force():
    values = sorted({Fraction(p, q) for q in range(1, 13) for p in range(0, 3 * q + 1)})
    for i, lo in enumerate(values):
        for hi in values[i + 1 : i + 12]:
            inside = [
                Fraction(p, q)
                for q in range(1, 40)
                for p in range(0, 3 * q + 1)
                if lo < Fraction(p, q) < hi
            ]
            best = min(inside, key=lambda f: (f.denominator, f.numerator))
            assert simplest_between(lo, hi) == best, (lo, hi)
    assert simplest_between(Fraction(5, 2), None) == 3
    assert simplest_between(Fraction(0), Fraction(1, 1000)) == Fraction(1, 1001)


@pytest.mark.parametrize(
    "bad", [0.0, -0.25, 1.5, float("nan"), float("inf"), "1/0", "half", "2/3x", True, 0, "3/2"]
)
def test_capacities_outside_0_1_are_refused(bad):
    with pytest.raises(ValueError):
        budget(bad, 100)


def test_capacity_fraction_keeps_exact_inputs():
    assert capacity_fraction(Fraction(1, 7)) == Fraction(1, 7)
    assert capacity_fraction(" 0.0625 ") == Fraction(1, 16)
    assert capacity_fraction(5 / 7) == Fraction(
        5, 7
    )  # its shortest decimal, 0.7142857142857143, is above 5/7
