"""FedGMR asynchronous aggregation arithmetic and the staleness bound
(common/aggregation/asynchronous.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.time_to_accuracy import accuracy_curve, time_to_target
from common.aggregation.asynchronous import (
    TooStale,
    apply_async_update,
    mask_overlap,
    staleness_weight,
)
from common.aggregation.masked import MaskedUpdate


def _update(indices, delta):
    return MaskedUpdate(
        np.asarray(indices, dtype=np.int64), np.asarray(delta, dtype=np.float32), 10.0
    )


def test_staleness_weight_values():
    assert staleness_weight(0, 0.5) == 1.0
    assert staleness_weight(3, 0.5) == pytest.approx(0.5)
    assert staleness_weight(1, 2.0) == pytest.approx(0.25)
    assert staleness_weight(7, 0.0) == 1.0
    with pytest.raises(ValueError):
        staleness_weight(-1, 0.5)


def test_fresh_reply_is_applied_whole_and_only_on_its_mask():
    x = np.arange(6, dtype=np.float32)
    changed = np.zeros(6, dtype=np.int64)
    step = apply_async_update(x, changed, 0, _update([1, 4], [0.5, -2.0]), 0, 1.0, 0.5, 3)
    assert step.x.tolist() == [0, 1.5, 2, 3, 2.0, 5]
    assert (step.staleness, step.overlap, step.weight, step.version) == (0, 0.0, 1.0, 1)
    assert step.last_changed.tolist() == [0, 1, 0, 0, 1, 0]
    assert x.tolist() == list(range(6)) and changed.tolist() == [0] * 6  # inputs untouched


def test_stale_reply_is_weighted_by_overlap_times_staleness():
    x = np.zeros(8, dtype=np.float32)
    changed = np.zeros(8, dtype=np.int64)
    # three updates applied after version 0 (the version the late reply was sent at), touching 0..5
    for idx in ([0, 1], [2, 3], [4, 5]):
        step = apply_async_update(
            x, changed, int(changed.max()), _update(idx, [1.0, 1.0]), int(changed.max()), 1, 1, 9
        )
        x, changed = step.x, step.last_changed
    assert changed.tolist() == [1, 1, 2, 2, 3, 3, 0, 0]
    # the late reply held 4..7: half of its positions (4, 5) changed since version 0
    late = _update([4, 5, 6, 7], [2.0, 2.0, 2.0, 2.0])
    step = apply_async_update(x, changed, 3, late, 0, 0.5, 1.0, 9)
    assert step.staleness == 3
    assert step.overlap == 0.5
    s = (1 + 0.5 * 3) ** -1.0
    assert step.weight == pytest.approx(s)
    expected = np.array(
        [1, 1, 1, 1, 1 + 0.5 * s * 2, 1 + 0.5 * s * 2, 0.5 * s * 2, 0.5 * s * 2], dtype=np.float32
    )
    np.testing.assert_array_equal(step.x, expected)
    # a stale reply whose mask nobody touched is not discounted
    untouched = apply_async_update(x, changed, 3, _update([6, 7], [1.0, 1.0]), 0, 1.0, 1.0, 9)
    assert (untouched.overlap, untouched.weight) == (0.0, 1.0)


def test_staleness_bound_drops_the_reply():
    x = np.zeros(4, dtype=np.float32)
    changed = np.array([5, 5, 5, 5], dtype=np.int64)
    ok = apply_async_update(x, changed, 5, _update([0], [1.0]), 3, 1.0, 0.5, max_staleness=2)
    assert ok.staleness == 2
    with pytest.raises(TooStale, match="gmr-max-staleness=2"):
        apply_async_update(x, changed, 5, _update([0], [1.0]), 2, 1.0, 0.5, max_staleness=2)
    with pytest.raises(ValueError):
        apply_async_update(x, changed, 5, _update([0], [1.0]), 6, 1.0, 0.5, 9)  # sent in the future


@settings(max_examples=200, deadline=None)
@given(
    d=st.integers(1, 60),
    seed=st.integers(0, 2**31),
    version=st.integers(0, 20),
    lr=st.floats(0.01, 2.0),
    a=st.floats(0, 3),
)
def test_update_matches_brute_force(d, seed, version, lr, a):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=d).astype(np.float32)
    changed = rng.integers(0, version + 1, size=d).astype(np.int64)
    sent = int(rng.integers(0, version + 1))
    idx = np.flatnonzero(rng.random(d) < 0.5)
    delta = rng.normal(size=idx.size).astype(np.float32)
    step = apply_async_update(x, changed, version, _update(idx, delta), sent, lr, a, 100)
    touched = sum(1 for j in idx if changed[j] > sent)
    o = touched / idx.size if idx.size else 0.0
    w = (1 + o * (version - sent)) ** (-a)
    want = x.astype(np.float64).copy()
    for j, dj in zip(idx, delta):
        want[j] += lr * w * float(dj)
    np.testing.assert_allclose(step.x, want.astype(np.float32), rtol=1e-6, atol=1e-6)
    assert step.overlap == pytest.approx(o) and mask_overlap(idx, changed, sent) == pytest.approx(o)
    assert set(np.flatnonzero(step.last_changed == version + 1)) >= set(idx)
    outside = np.setdiff1d(np.arange(d), idx)
    np.testing.assert_array_equal(step.x[outside], x[outside])
    np.testing.assert_array_equal(step.last_changed[outside], changed[outside])


def test_time_to_target():
    assert time_to_target([0, 10, 20, 30], [0.1, 0.5, 0.85, 0.9], 0.8) == 20
    assert time_to_target([0, 10], [0.1, 0.5], 0.8) is None
    assert time_to_target([], [], 0.5) is None
    with pytest.raises(ValueError):
        time_to_target([0, 10, 5], [0.1, 0.2, 0.3], 0.5)
    with pytest.raises(ValueError):
        time_to_target([0], [0.1, 0.2], 0.5)


def test_accuracy_curve_from_sync_and_async_records():
    sync = [
        {"round": 0, "global": {"accuracy": 0.1}},
        {"round": 1, "round_seconds": 12.0, "global": {"accuracy": 0.6}},
        {"round": 2, "round_seconds": 8.0, "global": {"accuracy": 0.8}},
    ]
    assert accuracy_curve(sync) == ([0.0, 12.0, 20.0], [0.1, 0.6, 0.8])
    asyn = [
        {"round": 0, "wall_seconds": 0.0, "global": {"accuracy": 0.1}},
        {"round": 1, "wall_seconds": 5.5, "round_seconds": 5.5, "global": {"accuracy": 0.7}},
    ]
    assert accuracy_curve(asyn) == ([0.0, 5.5], [0.1, 0.7])
