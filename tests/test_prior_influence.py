"""The certified reach of one client over the trimmed Fisher prior and the masks ranked by it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.fisher.prior_influence import (
    contested_by_level,
    contested_positions,
    sort_columns,
    trim_count,
    trimmed_mean_bounds,
)
from common.fisher.selection import budget, select_mask
from common.fisher.state import FisherState
from common.models.layout import ParamLayout


def _trimmed(values: np.ndarray, k: int) -> np.ndarray:
    s = np.sort(values, axis=0)
    return s[k : len(values) - k].mean(axis=0, dtype=np.float64).astype(np.float32)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(3, 9),
    m=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    trim=st.sampled_from([0.1, 0.2, 0.45]),
)
def test_interval_contains_every_single_replacement_and_is_attained(n, m, seed, trim):
    rng = np.random.default_rng(seed)
    values = rng.lognormal(0, 1.5, (n, m)).astype(np.float32)
    k = trim_count(trim, n)
    mean, lo, hi = trimmed_mean_bounds(values, k)
    np.testing.assert_array_equal(mean, _trimmed(values, k))
    for i in range(n):  # brute force: each client replaced by extremes and by random values
        for repl in (
            np.zeros(m),
            np.full(m, 1e30),
            rng.lognormal(0, 3, m),
            values[i] * 5,
            values[i] / 5,
        ):
            moved = values.copy()
            moved[i] = repl
            t = _trimmed(moved, k)
            assert np.all(lo <= t) and np.all(t <= hi)
    cols = np.arange(m)
    low, high = values.copy(), values.copy()
    low[values.argmax(axis=0), cols] = (
        0.0  # the largest value withdrawn: the lowest reachable prior
    )
    high[values.argmin(axis=0), cols] = 1e30
    np.testing.assert_array_equal(lo, _trimmed(low, k))
    np.testing.assert_array_equal(hi, _trimmed(high, k))


def test_bounds_reject_what_they_cannot_bound():
    with pytest.raises(ValueError, match="k"):
        trimmed_mean_bounds(np.ones((4, 3)), 0)  # a plain mean has no bound
    with pytest.raises(ValueError, match="k"):
        trimmed_mean_bounds(np.ones((4, 3)), 2)
    with pytest.raises(ValueError, match="2-D"):
        trimmed_mean_bounds(np.ones(4), 1)
    assert trim_count(0.0, 10) == 0 and trim_count(0.1, 2) == 0 and trim_count(0.1, 3) == 1
    assert trim_count(0.45, 10) == 4


def _layout(rows: int, cols: int) -> ParamLayout:
    return ParamLayout.from_arrays(
        {
            "w": np.zeros((rows, cols), np.float32),
            "b": np.zeros(rows, np.float32),
            "v": np.zeros((2, rows), np.float32),
        }
    )


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 8),
    gamma=st.sampled_from([0.05, 0.2, 0.5, 0.9]),
    min_per_row=st.integers(0, 2),
    width=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_masks_in_the_interval_agree_outside_contested_positions(
    rows, cols, gamma, min_per_row, width, seed
):
    layout = _layout(rows, cols)
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, layout.size)
    centre = rng.lognormal(0, 1, layout.size)
    lo = (centre * (1 - width * rng.random(layout.size))).astype(np.float32)
    hi = (centre * (1 + width * rng.random(layout.size))).astype(np.float32)
    contested = contested_positions(layout, x, gamma, lo, hi, min_per_row)
    corners = [lo, hi] + [np.where(rng.random(layout.size) < 0.5, lo, hi) for _ in range(8)]
    inside = [(lo + rng.random(layout.size) * (hi - lo)).astype(np.float32) for _ in range(8)]
    reference = select_mask(layout, x, gamma, "fisher", lo, min_per_row)
    for f in corners + inside:
        mask = select_mask(layout, x, gamma, "fisher", f, min_per_row)
        assert not np.any((mask != reference) & ~contested)
    if width == 0.0:
        assert (
            contested.sum() <= 1
        )  # a point interval decides every position but the one at the threshold


def test_contested_share_grows_with_the_interval():
    layout = _layout(64, 64)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, layout.size)
    centre = rng.lognormal(0, 2, layout.size)
    shares = [
        contested_positions(layout, x, 0.25, centre / (1 + w), centre * (1 + w)).mean()
        for w in (0.0, 0.1, 0.5, 2.0)
    ]
    assert shares[0] * layout.size <= 1  # only the position at the threshold itself is left open
    assert shares == sorted(shares) and shares[1] > shares[0] and shares[-1] > 0.2


def test_fisher_state_interval_covers_a_shaped_attack_and_a_stale_client():
    """In the poisoning world: the measured flips of a strong attack stay inside the certified
    set."""
    layout = _layout(128, 64)
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, layout.size)
    base = rng.lognormal(0, 2, layout.size)
    clients = [base * rng.lognormal(0, 0.5, layout.size) for _ in range(10)]

    def state(uploads):
        s = FisherState(layout.size, staleness_decay=0.7, trim=0.1)
        for i, f in enumerate(uploads):
            s.update(i, f, 100, 1)
        return s

    honest = state(clients)
    prior = honest.global_prior()
    kept = select_mask(layout, x, 0.25, "fisher", prior)
    below = np.flatnonzero(~kept & ~layout.always_kept)
    target = below[np.argsort(-(prior * np.abs(x))[below])][: layout.size // 10]
    attack = np.full(layout.size, 1e-12)
    attack[target] = 1.0
    poisoned = state([*clients[:9], attack])
    for client, rnd in ((None, 2), (3, 5), (0, 2)):
        lo, hi = honest.estimate_interval(client, rnd)
        contested = contested_positions(layout, x, 0.25, lo, hi)
        ranked = [
            s.global_prior() if client is None else s.estimate(client, rnd)
            for s in (poisoned, honest)
        ]
        flipped = select_mask(layout, x, 0.25, "fisher", ranked[0]) != select_mask(
            layout, x, 0.25, "fisher", ranked[1]
        )
        assert flipped.any() or client == 0
        assert not np.any(flipped & ~contested)
        if client == 0:  # fresh: ranked by its own estimate, out of every other client's reach
            assert contested.sum() <= 1  # only the position at the threshold itself
    plain = FisherState(layout.size, trim=0.0)
    for i, f in enumerate(clients):
        plain.update(i, f, 100, 1)
    assert plain.prior_interval() is None  # a weighted mean has no bound


def test_prior_interval_matches_the_prior_in_fp16_and_across_blocks(monkeypatch):
    import common.fisher.state as fs

    monkeypatch.setattr(fs, "PRIOR_BLOCK", 7)  # several blocks of positions
    rng = np.random.default_rng(2)
    uploads = rng.lognormal(0, 1, (5, 50))
    s = FisherState(50, trim=0.2, precision="fp16")
    for i, f in enumerate(uploads):
        s.update(i, f, 10, 1)
    lo, hi = s.prior_interval()
    stored = np.stack([c.fisher for c in s.clients.values()])
    mean, lo_ref, hi_ref = trimmed_mean_bounds(stored, 1)
    np.testing.assert_array_equal(s.global_prior(), mean)
    np.testing.assert_array_equal(lo, lo_ref)
    np.testing.assert_array_equal(hi, hi_ref)
    assert np.all(lo <= mean) and np.all(mean <= hi)


def _contested_by_gathering(layout, x, gamma, lo, hi, min_per_row):
    """Reference: the contested set computed on gathered eligible positions with a partition per
    row."""
    s_lo, s_hi = lo.astype(np.float64) * np.abs(x), hi.astype(np.float64) * np.abs(x)
    eligible = ~layout.always_kept
    guard = sum(
        t.rows * min(t.size // t.rows, min_per_row) for t in layout.tensors if len(t.shape) >= 2
    )
    need = budget(gamma, layout.size) - int(layout.always_kept.sum()) - guard
    contested = np.zeros(layout.size, dtype=bool)
    if need >= int(eligible.sum()) - guard:
        return contested
    not_guard, in_guard = np.zeros(layout.size, bool), np.zeros(layout.size, bool)
    for t, start in zip(layout.tensors, layout.offsets[:-1]):
        if len(t.shape) < 2:
            continue
        per_row, block = t.size // t.rows, slice(int(start), int(start) + t.size)
        if min_per_row == 0:
            not_guard[block] = True
            continue
        for r in range(t.rows):
            row = slice(block.start + r * per_row, block.start + (r + 1) * per_row)
            lo_r, hi_r = s_lo[row], s_hi[row]
            if per_row <= min_per_row:
                in_guard[row] = True
                continue
            mth_lo = np.sort(lo_r)[::-1][min_per_row - 1]
            not_guard[row] = hi_r < mth_lo
            for j in range(per_row):
                others = np.sort(np.delete(hi_r, j))[::-1]
                in_guard[row.start + j] = lo_r[j] > others[min_per_row - 1]
    rest = eligible & ~in_guard
    unsure = guard - int(in_guard.sum())
    if need > 0:
        t_hi = np.sort(s_hi[rest])[::-1][need - 1]
        t_lo = np.sort(s_lo[rest])[::-1][need + unsure - 1]
        surely_in = in_guard | (s_lo > t_hi)
    else:
        t_lo, surely_in = np.inf, in_guard
    return eligible & ~(surely_in | (not_guard & (s_hi < t_lo)))


def _tied_case(
    shapes: list[tuple[int, int]], seed: int
) -> tuple[ParamLayout, np.ndarray, np.ndarray, np.ndarray]:
    """Matrices of ``shapes`` plus a bias, with weights and prior bounds from few distinct values
    (many ties)."""
    layout = ParamLayout.from_arrays(
        {f"w{i}": np.zeros(s) for i, s in enumerate(shapes)} | {"b": np.zeros(2)}
    )
    rng = np.random.default_rng(seed)
    d = layout.size
    lo = rng.integers(0, 3, d).astype(np.float32)
    hi = lo + rng.integers(0, 2, d).astype(np.float32)
    return layout, rng.integers(-2, 3, d).astype(np.float32), lo, hi


@settings(max_examples=150, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6)), min_size=1, max_size=3),
    gamma=st.floats(0.05, 1.0),
    min_per_row=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_contested_positions_match_a_per_row_reference(shapes, gamma, min_per_row, seed):
    """Ties included (few distinct values): the vectorised bounds equal a row-by-row computation."""
    layout, x, lo, hi = _tied_case(shapes, seed)
    got = contested_positions(layout, x, gamma, lo, hi, min_per_row)
    assert np.array_equal(got, _contested_by_gathering(layout, x, gamma, lo, hi, min_per_row))


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(0, 40),
    m=st.integers(0, 9),
    dtype=st.sampled_from([np.float16, np.float32]),
    seed=st.integers(0, 9),
)
def test_sorting_network_sorts_columns_like_np_sort(n, m, dtype, seed):
    values = (
        np.random.default_rng(seed).integers(0, 4, (n, m)).astype(dtype)
    )  # ties in every column
    got = sort_columns(values)
    assert got.dtype == np.float32
    assert np.array_equal(got, np.sort(values, axis=0).astype(np.float32))


def test_sort_columns_past_the_network_and_across_tiles(monkeypatch):
    import common.fisher.prior_influence as pi

    values = np.random.default_rng(0).lognormal(size=(7, 300)).astype(np.float32)
    monkeypatch.setattr(pi, "_TILE", 64)
    assert np.array_equal(sort_columns(values), np.sort(values, axis=0))
    monkeypatch.setattr(pi, "NETWORK_MAX_ROWS", 3)
    assert np.array_equal(sort_columns(values), np.sort(values, axis=0))


@settings(max_examples=80, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6)), min_size=1, max_size=3),
    gammas=st.lists(st.floats(0.02, 1.0), min_size=1, max_size=5),
    min_per_row=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_level_at_once_equals_each_level_alone(shapes, gammas, min_per_row, seed):
    """Shared bounds and one multi-rank partition give each level's per-row reference (ties, repeats
    included)."""
    layout, x, lo, hi = _tied_case(shapes, seed)
    got = contested_by_level(layout, x, gammas + gammas[:1], lo, hi, min_per_row)
    assert len(got) == len(gammas) + 1
    for gamma, contested in zip(gammas + gammas[:1], got):
        assert np.array_equal(
            contested, _contested_by_gathering(layout, x, gamma, lo, hi, min_per_row)
        )
