"""Mask-aware aggregation: x_j + eta * sum_n w_n M_j delta_j / sum_n w_n M_j over the holders of
j."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.aggregation.masked import MaskedUpdate, aggregate_masked, average_held
from common.aggregation.update_means import nonzero_mean_step, participant_mean_step


def _brute(x, masks, deltas, weights, eta):
    """Per-position loop of the aggregation formula (deltas are dense, read only where masked)."""
    out = x.astype(np.float64).copy()
    for j in range(x.size):
        num = 0.0
        den = 0.0
        for m, dl, w in zip(masks, deltas, weights):
            if m[j]:
                num += w * float(dl[j])
                den += w
        if den > 0:
            out[j] = float(x[j]) + eta * num / den
    return out


def _updates(masks, deltas, weights):
    return [
        MaskedUpdate(np.flatnonzero(m).astype(np.int64), dl[m].astype(np.float32), w)
        for m, dl, w in zip(masks, deltas, weights)
    ]


@st.composite
def _rounds(draw):
    d = draw(st.integers(1, 24))
    n = draw(st.integers(0, 5))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(d) * draw(st.sampled_from([1e-3, 1.0, 100.0]))).astype(np.float32)
    masks = [rng.random(d) < draw(st.floats(0.0, 1.0)) for _ in range(n)]
    deltas = [rng.standard_normal(d).astype(np.float32) for _ in range(n)]
    weights = [draw(st.one_of(st.integers(1, 5000), st.floats(1e-3, 1e4))) for _ in range(n)]
    eta = draw(st.sampled_from([0.0, 0.5, 1.0, 1.7]))
    return x, masks, deltas, weights, eta


@settings(max_examples=150, deadline=None)
@given(case=_rounds())
def test_aggregate_matches_brute_force(case):
    x, masks, deltas, weights, eta = case
    x_before = x.copy()
    out = aggregate_masked(x, _updates(masks, deltas, weights), server_lr=eta)
    expected = _brute(x, masks, deltas, weights, eta)
    assert out.dtype == np.float32
    assert out.shape == x.shape
    assert out is not x
    np.testing.assert_allclose(
        out, expected.astype(np.float32), rtol=2e-6, atol=1e-6 * (1 + np.abs(expected).max())
    )
    # nobody held j -> bit-identical
    held = np.zeros(x.size, dtype=bool)
    for m in masks:
        held |= m
    np.testing.assert_array_equal(out[~held].view(np.uint32), x_before[~held].view(np.uint32))
    # the input is untouched
    np.testing.assert_array_equal(x.view(np.uint32), x_before.view(np.uint32))


def test_unheld_positions_are_bit_identical_including_special_values():
    x = np.array([-0.0, 1e-45, np.float32(3.4e38), 1.2345678, -7.0], dtype=np.float32)
    upd = MaskedUpdate(np.array([4], dtype=np.int64), np.array([1.0], dtype=np.float32), 3.0)
    out = aggregate_masked(x, [upd])
    np.testing.assert_array_equal(out[:4].view(np.uint32), x[:4].view(np.uint32))
    assert out[4] == np.float32(-6.0)


def test_no_updates_returns_copy_of_x():
    x = np.arange(5, dtype=np.float32)
    out = aggregate_masked(x, [])
    np.testing.assert_array_equal(out, x)
    assert out is not x
    out[0] = 99
    assert x[0] == 0


def test_example_weighting_matters():
    x = np.zeros(3, dtype=np.float32)
    a = MaskedUpdate(np.array([0, 1], dtype=np.int64), np.array([1.0, 2.0], dtype=np.float32), 3.0)
    b = MaskedUpdate(np.array([1, 2], dtype=np.int64), np.array([0.0, 5.0], dtype=np.float32), 1.0)
    out = aggregate_masked(x, [a, b])
    # position 1: (3 * 2 + 1 * 0) / (3 + 1) = 1.5; an unweighted mean would give 1.0
    np.testing.assert_allclose(out, [1.0, 1.5, 5.0])
    assert out[1] != pytest.approx(1.0)
    swapped = aggregate_masked(
        x,
        [MaskedUpdate(a.indices, a.delta, 1.0), MaskedUpdate(b.indices, b.delta, 3.0)],
    )
    np.testing.assert_allclose(swapped, [1.0, 0.5, 5.0])


def test_server_lr_scales_the_mean_step():
    x = np.full(2, 10.0, dtype=np.float32)
    u = [MaskedUpdate(np.array([0], dtype=np.int64), np.array([4.0], dtype=np.float32), 2.0)]
    np.testing.assert_allclose(aggregate_masked(x, u, server_lr=0.5), [12.0, 10.0])
    np.testing.assert_allclose(aggregate_masked(x, u, server_lr=0.0), [10.0, 10.0])
    np.testing.assert_allclose(aggregate_masked(x, u), [14.0, 10.0])


def test_weight_scale_invariance():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(20).astype(np.float32)
    masks = [rng.random(20) < 0.5 for _ in range(3)]
    deltas = [rng.standard_normal(20).astype(np.float32) for _ in range(3)]
    a = aggregate_masked(x, _updates(masks, deltas, [1.0, 2.0, 5.0]))
    b = aggregate_masked(x, _updates(masks, deltas, [100.0, 200.0, 500.0]))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weight", [0, 0.0, -1.0, -1e-9, float("nan")])
def test_invalid_weight_raises(weight):
    x = np.zeros(3, dtype=np.float32)
    good = MaskedUpdate(np.array([0], dtype=np.int64), np.array([1.0], dtype=np.float32), 1.0)
    bad = MaskedUpdate(np.array([1], dtype=np.int64), np.array([1.0], dtype=np.float32), weight)
    with pytest.raises(ValueError):
        aggregate_masked(x, [good, bad])
    np.testing.assert_array_equal(x, np.zeros(3, dtype=np.float32))


@pytest.mark.parametrize("step", [aggregate_masked, nonzero_mean_step, participant_mean_step])
@pytest.mark.parametrize("index", [-1, 3])
def test_every_aggregation_rejects_indices_outside_the_vector(step, index):
    x = np.zeros(3, dtype=np.float32)
    bad = MaskedUpdate(np.array([0, index], dtype=np.int64), np.ones(2, dtype=np.float32), 1.0)
    with pytest.raises(ValueError, match="outside"):
        step(x, [bad])
    np.testing.assert_array_equal(x, np.zeros(3, dtype=np.float32))


def test_indices_delta_length_mismatch_raises():
    x = np.zeros(3, dtype=np.float32)
    bad = MaskedUpdate(np.array([0, 1], dtype=np.int64), np.array([1.0], dtype=np.float32), 1.0)
    with pytest.raises(ValueError):
        aggregate_masked(x, [bad])


# ---------------------------------------------------------------------------
# average_held (buffers)


@settings(max_examples=80, deadline=None)
@given(
    d=st.integers(1, 20),
    n=st.integers(0, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_average_held_is_weighted_mean_over_holders(d, n, seed):
    rng = np.random.default_rng(seed)
    current = rng.standard_normal(d).astype(np.float32)
    values = [(rng.standard_normal(d) * 3).astype(np.float32) for _ in range(n)]
    masks = [rng.random(d) < 0.6 for _ in range(n)]
    weights = [float(rng.integers(1, 1000)) for _ in range(n)]
    before = current.copy()
    out = average_held(current, values, masks, weights)
    assert out.dtype == np.float32
    for j in range(d):
        holders = [i for i in range(n) if masks[i][j]]
        if not holders:
            assert out[j].view(np.uint32) == before[j].view(np.uint32)
        else:
            w = np.array([weights[i] for i in holders])
            v = np.array([float(values[i][j]) for i in holders])
            assert out[j] == pytest.approx(float(np.sum(w * v) / np.sum(w)), rel=1e-5, abs=1e-5)
    np.testing.assert_array_equal(current, before)


def test_average_held_constructed():
    current = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    values = [
        np.array([10.0, 20.0, 30.0], dtype=np.float32),
        np.array([0.0, 0.0, 0.0], dtype=np.float32),
    ]
    masks = [np.array([True, True, False]), np.array([False, True, False])]
    out = average_held(current, values, masks, [1.0, 4.0])
    # j=0: only client 0 -> 10; j=1: (1*20 + 4*0) / 5 = 4; j=2: nobody -> 3
    np.testing.assert_allclose(out, [10.0, 4.0, 3.0])


def test_average_held_invalid_weight_raises():
    current = np.zeros(2, dtype=np.float32)
    with pytest.raises(ValueError):
        average_held(current, [np.ones(2, dtype=np.float32)], [np.ones(2, dtype=bool)], [0.0])


@settings(max_examples=100, deadline=None)
@given(case=_rounds(), block=st.integers(1, 7))
def test_blocked_accumulation_is_bit_identical_to_one_block(case, block):
    """Any block size gives the same bits as accumulating the whole vector at once."""
    import common.aggregation.masked as agg

    x, masks, deltas, weights, eta = case
    masks = [
        m if i % 2 else np.ones_like(m) for i, m in enumerate(masks)
    ]  # mix in full masks (the slice path)
    updates = _updates(masks, deltas, weights)
    saved = agg.AGGREGATION_BLOCK
    try:
        agg.AGGREGATION_BLOCK = 1 << 30
        whole = aggregate_masked(x, updates, server_lr=eta)
        agg.AGGREGATION_BLOCK = block
        blocked = aggregate_masked(x, updates, server_lr=eta)
    finally:
        agg.AGGREGATION_BLOCK = saved
    assert whole.tobytes() == blocked.tobytes()
    expected = _brute(x, masks, deltas, weights, eta)
    np.testing.assert_allclose(
        whole, expected.astype(np.float32), rtol=2e-6, atol=1e-6 * (1 + np.abs(expected).max())
    )
