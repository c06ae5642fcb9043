"""The running sums give each batch rule's vector to the bit for the same updates in the same
order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import common.aggregation.masked as masked_module
import common.aggregation.running_sums as sums_module
from common.aggregation.masked import MaskedUpdate, aggregate_masked
from common.aggregation.running_sums import HolderSum, NonzeroSum, ParticipantSum, UpdateCountSum
from common.aggregation.update_means import (
    nonzero_mean_step,
    participant_mean_step,
    update_count_mean_step,
)


@st.composite
def _rounds(draw):
    """A global vector and a round of updates: sparse, dense (every position) and empty, mixed
    weights.

    Indices int64 or int32 (a validated reply's), deltas read-only (a validated reply's are views of
    what was received): the sums must neither depend on the index type nor write into a delta."""
    d = draw(st.integers(1, 40))
    n = draw(st.integers(0, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = (rng.standard_normal(d) * draw(st.sampled_from([1e-3, 1.0, 100.0]))).astype(np.float32)
    updates = []
    for _ in range(n):
        kind = draw(st.sampled_from(["sparse", "dense", "empty"]))
        held = {"sparse": rng.random(d) < draw(st.floats(0.0, 1.0)), "dense": np.ones(d, bool)}.get(
            kind, np.zeros(d, bool)
        )
        delta = rng.standard_normal(int(held.sum())).astype(np.float32) * np.float32(
            draw(st.sampled_from([1e-6, 1.0]))
        )
        delta[rng.random(delta.size) < 0.2] = 0.0  # FIARSE's rule counts only moved positions
        weight = float(draw(st.one_of(st.integers(1, 60_000), st.floats(1e-3, 1e4))))
        delta.flags.writeable = (
            False  # a validated reply's delta is a read-only view of what was received
        )
        indices = np.flatnonzero(held).astype(
            draw(st.sampled_from([np.int64, np.int32]))
        )  # a reply's are int32
        updates.append(MaskedUpdate(indices, delta, weight))
    eta = draw(st.sampled_from([0.0, 0.5, 1.0, 1.7]))
    block = draw(st.sampled_from([1 << 20, 3, 7]))  # small blocks: every chunk boundary is crossed
    return x, updates, eta, block


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _fold(sums, updates, x):
    for u in updates:
        sums.add(u)
    return sums.apply(x)


@settings(max_examples=200, deadline=None)
@given(case=_rounds())
def test_each_running_sum_is_its_batch_rule_to_the_bit(case):
    x, updates, eta, block = case
    before = x.copy()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sums_module, "AGGREGATION_BLOCK", block)
        mp.setattr(masked_module, "AGGREGATION_BLOCK", block)
        d = x.size
        assert _same(_fold(HolderSum(d, eta), updates, x), aggregate_masked(x, updates, eta))
        assert _same(
            _fold(ParticipantSum(d, eta), updates, x), participant_mean_step(x, updates, eta)
        )
        assert _same(_fold(NonzeroSum(d, eta), updates, x), nonzero_mean_step(x, updates, eta))
        counted = np.flatnonzero(np.arange(d) % 3 == 0).astype(np.int64)
        counts = (np.arange(counted.size, dtype=np.int64) % 4) + 1
        fixed = counted < 2
        rolled = UpdateCountSum(d, counted, counts, fixed, eta)
        out = _fold(rolled, updates, x)
        expected, running = update_count_mean_step(x, updates, counted, counts, fixed, eta)
        assert _same(out, expected) and np.array_equal(rolled.running, running)
        assert np.array_equal(
            counts, (np.arange(counted.size) % 4) + 1
        )  # the counts before the round stay
    assert _same(x, before)  # the global vector is read, never written


@settings(max_examples=100, deadline=None)
@given(case=_rounds(), seed=st.integers(0, 2**32 - 1))
def test_another_order_moves_a_value_by_at_most_one_float32_step(case, seed):
    """Float64 sums in another order differ in their last bits only: at most one ulp after the
    float32 rounding."""
    x, updates, eta, _ = case
    order = np.random.default_rng(seed).permutation(len(updates))
    a = _fold(HolderSum(x.size, eta), updates, x)
    b = _fold(HolderSum(x.size, eta), [updates[i] for i in order], x)
    assert _same(b, aggregate_masked(x, [updates[i] for i in order], eta))
    assert np.all(np.abs(np.nextafter(a, np.inf) - a) >= np.abs(a - b))


def test_a_refused_update_leaves_the_sums_as_if_it_never_came():
    x = np.arange(6, dtype=np.float32)
    good = MaskedUpdate(np.array([0, 2, 5], np.int64), np.array([1.0, -2.0, 0.5], np.float32), 3.0)
    bad = [
        MaskedUpdate(
            np.array([0, 6], np.int64), np.array([1.0, 1.0], np.float32), 1.0
        ),  # index past d
        MaskedUpdate(
            np.array([1, 2], np.int64), np.array([1.0], np.float32), 1.0
        ),  # lengths differ
        MaskedUpdate(np.array([1], np.int64), np.array([1.0], np.float32), 0.0),  # no weight
    ]
    for make in (
        lambda: HolderSum(6),
        lambda: ParticipantSum(6),
        lambda: NonzeroSum(6),
        lambda: UpdateCountSum(
            6, np.array([1, 5], np.int64), np.array([1, 2], np.int64), np.array([True, False])
        ),
    ):
        clean = make()
        clean.add(good)
        dirty = make()
        for u in bad:
            with pytest.raises(ValueError):
                dirty.add(u)
        dirty.add(good)
        assert dirty.count == clean.count == 1
        assert _same(dirty.apply(x), clean.apply(x))


def test_nothing_added_leaves_the_vector():
    x = np.array([1.5, -2.0, 3.25], np.float32)
    for sums in (HolderSum(3), ParticipantSum(3), NonzeroSum(3)):
        out = sums.apply(x)
        assert _same(out, x) and out is not x
