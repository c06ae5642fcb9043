"""Selection rules: FedFIbOS is an exact minimiser of the masking surrogate; guards, budget,
errors."""

from __future__ import annotations

import math
from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.fisher.selection import (
    budget,
    fisher_scores,
    magnitude_scores,
    masking_error,
    row_guard,
    select_mask,
    select_submodel,
    topk_mask,
)
from common.models.layout import ParamLayout

# ---------------------------------------------------------------------------
# helpers


def _terms(fisher, x):
    """Per-position surrogate terms F_j^2 x_j^2, computed as the selection rule ranks them."""
    return fisher_scores(fisher, x) ** 2


def _eps(terms, keep):
    """eps(S) for a kept set ``keep`` (indices), summed exactly (order-independent)."""
    kept = set(keep)
    return math.fsum(t for j, t in enumerate(terms) if j not in kept)


def _brute_min(terms, k, forced=()):
    """min eps(S) over |S| = k, S containing ``forced``."""
    forced = set(forced)
    free = [j for j in range(len(terms)) if j not in forced]
    need = k - len(forced)
    assert need >= 0
    return min(_eps(terms, forced | set(c)) for c in combinations(free, need))


def _random_case(rng, d):
    """F and x with zeros and ties sprinkled in."""
    kind = rng.integers(4)
    if kind == 0:  # continuous
        f = rng.exponential(size=d)
        x = rng.standard_normal(d)
    elif kind == 1:  # few distinct values: many ties
        f = rng.integers(0, 3, size=d).astype(float)
        x = rng.integers(-2, 3, size=d).astype(float)
    elif kind == 2:  # zeros in both
        f = rng.exponential(size=d) * (rng.random(d) < 0.6)
        x = rng.standard_normal(d) * (rng.random(d) < 0.6)
    else:  # all equal
        f = np.full(d, 0.5)
        x = np.full(d, -2.0)
    return f, x


def _mask_from(keep, d):
    m = np.zeros(d, dtype=bool)
    m[list(keep)] = True
    return m


# ---------------------------------------------------------------------------
# the FedFIbOS rule is an exact minimiser (no guards)


def test_fisher_topk_is_exact_minimiser_random_cases():
    rng = np.random.default_rng(1234)
    for _ in range(150):
        d = int(rng.integers(1, 11))
        k = int(rng.integers(0, d + 1))
        f, x = _random_case(rng, d)
        mask = topk_mask(fisher_scores(f, x), k)
        assert mask.dtype == bool
        assert mask.sum() == k
        terms = _terms(f, x)
        got = _eps(terms, np.flatnonzero(mask))
        assert got == _brute_min(terms, k)
        assert masking_error(f, x, mask) == pytest.approx(got, rel=1e-12, abs=0)


_vals = st.one_of(
    st.just(0.0), st.floats(min_value=0.0, max_value=1e3), st.sampled_from([0.5, 1.0, 2.0])
)


@settings(max_examples=120, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            _vals,
            st.one_of(
                st.just(0.0), st.floats(min_value=-1e3, max_value=1e3), st.sampled_from([1.0, -1.0])
            ),
        ),
        min_size=1,
        max_size=9,
    ),
    k_frac=st.floats(min_value=0.0, max_value=1.0),
)
def test_fisher_topk_is_exact_minimiser_hypothesis(data, k_frac):
    f = np.array([p[0] for p in data])
    x = np.array([p[1] for p in data])
    d = f.size
    k = int(round(k_frac * d))
    mask = topk_mask(fisher_scores(f, x), k)
    assert mask.sum() == k
    terms = _terms(f, x)
    assert _eps(terms, np.flatnonzero(mask)) == _brute_min(terms, k)


def test_fisher_rule_via_select_mask_is_exact_minimiser_without_guards():
    """With a single 2-D tensor and min_per_row=0 there are no forced positions."""
    rng = np.random.default_rng(7)
    layout = ParamLayout.from_arrays({"w": np.zeros((2, 5))})
    for gamma in (0.1, 0.25, 0.5, 0.7, 1.0):
        f, x = _random_case(rng, 10)
        mask = select_mask(layout, x, gamma, "fisher", f, min_per_row=0)
        k = budget(gamma, 10)
        assert mask.sum() == k
        terms = _terms(f, x)
        assert _eps(terms, np.flatnonzero(mask)) == _brute_min(terms, k)


def test_masking_error_definition():
    f = np.array([1.0, 2.0, 0.0, 3.0])
    x = np.array([1.0, -1.0, 5.0, 0.5])
    mask = np.array([True, False, False, False])
    assert masking_error(f, x, mask) == pytest.approx(4.0 + 0.0 + 2.25)
    assert masking_error(f, x, np.ones(4, dtype=bool)) == 0.0
    assert masking_error(f, x, np.zeros(4, dtype=bool)) == pytest.approx(1.0 + 4.0 + 0.0 + 2.25)


# ---------------------------------------------------------------------------
# with guards: exact minimiser among subsets containing the forced set

GUARD_SHAPES = [
    {"w": (3, 3), "b": (3,)},
    {"w": (2, 2, 2), "b": (2,), "v": (1, 2)},
]


def _forced(layout, scores, min_per_row):
    """1-D positions plus the best ``min_per_row`` per row (ties: lower index), by brute force."""
    forced = set(np.flatnonzero(layout.always_kept).tolist())
    if min_per_row > 0:
        for r in np.unique(layout.row_ids[~layout.always_kept]):
            pos = [
                j
                for j in range(layout.size)
                if layout.row_ids[j] == r and not layout.always_kept[j]
            ]
            pos.sort(key=lambda j: (-scores[j], j))
            forced |= set(pos[:min_per_row])
    return forced


def _check_guarded(shapes, f, x, gamma, min_per_row):
    layout = ParamLayout.from_arrays({n: np.zeros(s) for n, s in shapes.items()})
    mask = select_mask(layout, x, gamma, "fisher", f, min_per_row)
    forced = _forced(layout, fisher_scores(f, x), min_per_row)
    size = max(budget(gamma, layout.size), len(forced))
    assert mask.sum() == size
    assert forced <= set(np.flatnonzero(mask).tolist())
    np.testing.assert_array_equal(
        row_guard(fisher_scores(f, x), layout, min_per_row) | layout.always_kept,
        _mask_from(forced, layout.size),
    )
    terms = _terms(f, x)
    assert _eps(terms, np.flatnonzero(mask)) == _brute_min(terms, size, forced)


def test_fisher_rule_with_guards_is_minimiser_over_supersets_of_forced_set():
    rng = np.random.default_rng(99)
    for _ in range(60):
        shapes = GUARD_SHAPES[int(rng.integers(len(GUARD_SHAPES)))]
        d = sum(int(np.prod(s)) for s in shapes.values())
        f, x = _random_case(rng, d)
        gamma = float(rng.choice([0.05, 0.2, 1 / 3, 0.5, 0.75, 1.0]))
        _check_guarded(shapes, f, x, gamma, int(rng.integers(0, 3)))


@settings(max_examples=60, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.5, 1.0, 3.0, 7.25]),
            st.sampled_from([0.0, 1.0, -1.0, 2.5, -0.125]),
        ),
        min_size=12,
        max_size=12,
    ),
    gamma=st.sampled_from([0.01, 0.25, 0.5, 0.6, 0.9, 1.0]),
    min_per_row=st.integers(0, 3),
)
def test_fisher_rule_with_guards_hypothesis(pairs, gamma, min_per_row):
    f = np.array([p[0] for p in pairs])
    x = np.array([p[1] for p in pairs])
    _check_guarded(GUARD_SHAPES[0], f, x, gamma, min_per_row)


# ---------------------------------------------------------------------------
# magnitude selection does not minimise eps


def test_magnitude_rule_is_strictly_worse_on_constructed_case():
    layout = ParamLayout.from_arrays({"w": np.zeros((2, 2))})
    x = np.array([1.0, 2.0, 3.0, 4.0])
    f = np.array([10.0, 5.0, 0.1, 0.01])
    fis = select_mask(layout, x, 0.5, "fisher", f, min_per_row=0)
    mag = select_mask(layout, x, 0.5, "magnitude", min_per_row=0)
    np.testing.assert_array_equal(fis, [True, True, False, False])
    np.testing.assert_array_equal(mag, [False, False, True, True])
    assert masking_error(f, x, fis) == pytest.approx(0.09 + 0.0016)
    assert masking_error(f, x, mag) == pytest.approx(100.0 + 100.0)
    assert masking_error(f, x, mag) > masking_error(f, x, fis)


def test_magnitude_rule_ignores_fisher():
    layout = ParamLayout.from_arrays({"w": np.zeros((2, 3))})
    x = np.array([0.1, -5.0, 0.3, 2.0, -0.2, 1.0])
    a = select_mask(layout, x, 0.5, "magnitude", min_per_row=0)
    b = select_mask(layout, x, 0.5, "magnitude", np.arange(6.0), min_per_row=0)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, topk_mask(magnitude_scores(x), 3))
    np.testing.assert_array_equal(np.flatnonzero(a), [1, 3, 5])


# ---------------------------------------------------------------------------
# budget


@pytest.mark.parametrize("gamma", [1e-9, 1 / 16, 0.1, 0.25, 1 / 3, 0.5, 0.7, 0.999, 1.0])
@pytest.mark.parametrize("d", [0, 1, 7, 10, 100, 151306])
def test_budget_is_ceil(gamma, d):
    assert budget(gamma, d) == math.ceil(gamma * d)
    assert 0 <= budget(gamma, d) <= d
    if d > 0:
        assert budget(gamma, d) >= 1


def test_budget_exact_dyadic_values():
    assert budget(1 / 16, 100) == 7
    assert budget(0.25, 100) == 25
    assert budget(0.5, 3) == 2
    assert budget(1.0, 5) == 5


@pytest.mark.parametrize(
    "gamma", [0.0, -0.0, -0.5, 1.0000001, 2.0, float("nan"), float("inf"), float("-inf")]
)
def test_budget_rejects_bad_gamma(gamma):
    with pytest.raises(ValueError):
        budget(gamma, 10)


def test_budget_rejects_negative_d():
    with pytest.raises(ValueError):
        budget(0.5, -1)


def _cnn_like_layout():
    rng = np.random.default_rng(0)
    shapes = {
        "c.w": (4, 2, 3, 3),
        "c.b": (4,),
        "f.w": (5, 8),
        "f.b": (5,),
        "o.w": (3, 5),
        "o.b": (3,),
    }
    return ParamLayout.from_arrays({n: rng.standard_normal(s) for n, s in shapes.items()}), rng


@pytest.mark.parametrize("rule", ["fisher", "magnitude"])
@pytest.mark.parametrize("min_per_row", [0, 1, 2, 5, 100])
@pytest.mark.parametrize("gamma", [0.01, 0.1, 0.3, 0.5, 1.0])
def test_guards_and_count(rule, min_per_row, gamma):
    layout, rng = _cnn_like_layout()
    x = rng.standard_normal(layout.size)
    f = rng.exponential(size=layout.size) * (rng.random(layout.size) < 0.8)
    mask = select_mask(layout, x, gamma, rule, f, min_per_row)
    scores = fisher_scores(f, x) if rule == "fisher" else magnitude_scores(x)
    forced = layout.always_kept | row_guard(scores, layout, min_per_row)
    k = budget(gamma, layout.size)
    assert mask.sum() == max(k, int(forced.sum()))
    assert np.all(mask[layout.always_kept])
    assert np.all(mask[forced])
    # every row of every >=2-D tensor keeps >= min_per_row (or the whole row when shorter)
    for t, start in zip(layout.tensors, layout.offsets[:-1]):
        if len(t.shape) < 2:
            continue
        rows = mask[start : start + t.size].reshape(t.rows, -1)
        per_row = t.size // t.rows
        assert np.all(rows.sum(axis=1) >= min(min_per_row, per_row))
    # the free part is the top of the remaining scores
    free_kept = scores[mask & ~forced]
    free_dropped = scores[~mask]
    if free_kept.size and free_dropped.size:
        assert free_kept.min() >= free_dropped.max()


def test_forced_set_exceeding_budget_is_the_mask():
    layout = ParamLayout.from_arrays({"w": np.zeros((4, 3)), "b": np.zeros(4)})
    x = np.arange(16.0)
    mask = select_mask(layout, x, 0.01, "magnitude", min_per_row=2)
    # 4 biases + 2 per row of w = 12 > ceil(0.01 * 16) = 1
    assert mask.sum() == 12
    np.testing.assert_array_equal(mask, layout.always_kept | row_guard(x, layout, 2))
    # highest-magnitude two of each row: columns 1 and 2
    np.testing.assert_array_equal(mask[:12].reshape(4, 3), np.tile([False, True, True], (4, 1)))


def test_selection_is_deterministic():
    layout, rng = _cnn_like_layout()
    x = rng.standard_normal(layout.size)
    f = rng.integers(0, 3, size=layout.size).astype(float)  # many ties
    a = select_mask(layout, x.copy(), 0.3, "fisher", f.copy(), 1)
    b = select_mask(layout, x.copy(), 0.3, "fisher", f.copy(), 1)
    np.testing.assert_array_equal(a, b)


def test_ties_broken_by_lower_index_topk():
    scores = np.array([1.0, 2.0, 1.0, 1.0, 2.0, 1.0, 0.0])
    np.testing.assert_array_equal(np.flatnonzero(topk_mask(scores, 3)), [0, 1, 4])
    np.testing.assert_array_equal(np.flatnonzero(topk_mask(scores, 4)), [0, 1, 2, 4])
    np.testing.assert_array_equal(np.flatnonzero(topk_mask(np.zeros(6), 2)), [0, 1])


def test_ties_broken_by_lower_index_select_mask():
    layout = ParamLayout.from_arrays({"w": np.zeros((3, 4)), "b": np.zeros(3)})
    x = np.ones(15)
    f = np.ones(15)
    mask = select_mask(layout, x, 0.5, "fisher", f, min_per_row=1)
    # forced: first of each row (0, 4, 8) and biases (12..14); then lowest other indices 1, 2
    np.testing.assert_array_equal(np.flatnonzero(mask), [0, 1, 2, 4, 8, 12, 13, 14])


def test_topk_mask_respects_forced_and_does_not_modify_it():
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0])
    forced = np.array([False, False, False, False, True])
    mask = topk_mask(scores, 3, forced)
    np.testing.assert_array_equal(mask, [True, True, False, False, True])
    np.testing.assert_array_equal(forced, [False, False, False, False, True])
    np.testing.assert_array_equal(topk_mask(scores, 5, forced), np.ones(5, dtype=bool))
    np.testing.assert_array_equal(topk_mask(scores, 0, forced), forced)


@pytest.mark.parametrize("k", [-1, 6])
def test_topk_mask_k_out_of_range(k):
    with pytest.raises(ValueError):
        topk_mask(np.zeros(5), k)


def test_topk_mask_rejects_non_finite_scores():
    with pytest.raises(ValueError):
        topk_mask(np.array([1.0, np.nan, 0.0]), 1)
    with pytest.raises(ValueError):
        topk_mask(np.array([1.0, np.inf, 0.0]), 1)


def test_fisher_scores_is_f_times_abs_x():
    f = np.array([0.0, 1.0, 2.0, 0.5])
    x = np.array([3.0, -2.0, 0.0, -4.0])
    np.testing.assert_array_equal(fisher_scores(f, x), [0.0, 2.0, 0.0, 2.0])
    np.testing.assert_array_equal(magnitude_scores(x), [3.0, 2.0, 0.0, 4.0])


# ---------------------------------------------------------------------------
# select_submodel on named arrays

NAMED = {"conv.weight": (4, 2, 3), "conv.bias": (4,), "fc.weight": (3, 8), "fc.bias": (3,)}


@pytest.mark.parametrize("rule", ["fisher", "magnitude"])
@pytest.mark.parametrize("gamma", [0.1, 0.5, 1.0])
def test_select_submodel_matches_select_mask(rule, gamma):
    rng = np.random.default_rng(5)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in NAMED.items()}
    fisher = (
        {n: rng.exponential(size=s).astype(np.float32) for n, s in NAMED.items()}
        if rule == "fisher"
        else None
    )
    masks = select_submodel(params, gamma, rule, fisher, min_per_row=1)
    assert list(masks) == list(NAMED)
    for n, s in NAMED.items():
        assert masks[n].shape == s
        assert masks[n].dtype == bool
    layout = ParamLayout.from_arrays(params)
    f = None if fisher is None else layout.flatten(fisher)
    flat = select_mask(layout, layout.flatten(params), gamma, rule, f, 1)
    np.testing.assert_array_equal(np.concatenate([m.reshape(-1) for m in masks.values()]), flat)
    assert masks["conv.bias"].all() and masks["fc.bias"].all()
    assert np.all(masks["fc.weight"].sum(axis=1) >= 1)
    assert np.all(masks["conv.weight"].reshape(4, -1).sum(axis=1) >= 1)


def test_select_submodel_returns_independent_arrays():
    rng = np.random.default_rng(6)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in NAMED.items()}
    masks = select_submodel(params, 0.5, "magnitude")
    names = list(masks)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not np.may_share_memory(masks[a], masks[b])


def test_select_submodel_default_rule_is_fisher():
    rng = np.random.default_rng(8)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in NAMED.items()}
    with pytest.raises(ValueError):
        select_submodel(params, 0.5)  # fisher rule without a Fisher estimate


# ---------------------------------------------------------------------------
# errors


def _small():
    layout = ParamLayout.from_arrays({"w": np.zeros((2, 3)), "b": np.zeros(2)})
    return layout, np.linspace(-1, 1, 8), np.ones(8)


@pytest.mark.parametrize("bad", [np.nan, -1e-12, -1.0, np.inf])
def test_fisher_with_bad_values_raises(bad):
    layout, x, f = _small()
    f[3] = bad
    with pytest.raises(ValueError):
        select_mask(layout, x, 0.5, "fisher", f)
    with pytest.raises(ValueError):
        fisher_scores(f, x)


def test_fisher_wrong_shape_raises():
    layout, x, _ = _small()
    with pytest.raises(ValueError):
        select_mask(layout, x, 0.5, "fisher", np.ones(7))
    with pytest.raises(ValueError):
        select_mask(layout, x, 0.5, "fisher", np.ones((8, 1)))


def test_x_wrong_shape_raises():
    layout, x, f = _small()
    with pytest.raises(ValueError):
        select_mask(layout, x[:-1], 0.5, "fisher", f[:-1])
    with pytest.raises(ValueError):
        select_mask(layout, x.reshape(2, 4), 0.5, "magnitude")


def test_unknown_rule_raises():
    layout, x, f = _small()
    with pytest.raises(ValueError, match="rule"):
        select_mask(layout, x, 0.5, "random", f)  # type: ignore[arg-type]


def test_fisher_rule_without_fisher_raises():
    layout, x, _ = _small()
    with pytest.raises(ValueError):
        select_mask(layout, x, 0.5, "fisher", None)


def test_bad_gamma_raises_in_select_mask():
    layout, x, f = _small()
    with pytest.raises(ValueError):
        select_mask(layout, x, 0.0, "fisher", f)
    with pytest.raises(ValueError):
        select_mask(layout, x, 1.5, "magnitude")


def test_select_submodel_bad_fisher_tensors_raise():
    params = {"w": np.ones((2, 3), dtype=np.float32), "b": np.ones(2, dtype=np.float32)}
    with pytest.raises(ValueError):
        select_submodel(params, 0.5, "fisher", {"w": np.ones((2, 3))})
    with pytest.raises(ValueError):
        select_submodel(params, 0.5, "fisher", {"w": np.ones((3, 2)), "b": np.ones(2)})
    with pytest.raises(ValueError):
        select_submodel(params, 0.5, "fisher", {"w": -np.ones((2, 3)), "b": np.ones(2)})


# ---------------------------------------------------------------------------
# the per-tensor guard and the partition-based top-k against sort-based references


def _guard_by_sort(scores, layout, m):
    """Reference guard: sort every row by (-score, index) and keep its first ``m``."""
    keep = np.zeros(layout.size, dtype=bool)
    for t, start in zip(layout.tensors, layout.offsets[:-1]):
        if len(t.shape) < 2 or m <= 0:
            continue
        per_row = t.size // t.rows
        for r in range(t.rows):
            base = int(start) + r * per_row
            order = sorted(range(per_row), key=lambda j: (-scores[base + j], j))
            keep[[base + j for j in order[:m]]] = True
    return keep


def _topk_by_sort(scores, k, forced):
    """Reference top-k: forced, then free positions by (-score, index) until ``k``."""
    mask = forced.copy()
    free = sorted((j for j in range(scores.size) if not forced[j]), key=lambda j: (-scores[j], j))
    mask[free[: max(k - int(forced.sum()), 0)]] = True
    return mask


_shapes = st.lists(
    st.one_of(st.tuples(st.integers(1, 4)), st.tuples(st.integers(1, 4), st.integers(1, 6))),
    min_size=1,
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(shapes=_shapes, m=st.integers(0, 4), gamma=st.floats(0.01, 1.0), seed=st.integers(0, 2**16))
def test_guard_and_selection_match_sort_references(shapes, m, gamma, seed):
    """Few distinct values, so ties inside rows and at the threshold are common."""
    layout = ParamLayout.from_arrays({f"t{i}": np.zeros(s) for i, s in enumerate(shapes)})
    rng = np.random.default_rng(seed)
    d = layout.size
    f = rng.integers(0, 3, size=d).astype(np.float32)
    x = rng.integers(-2, 3, size=d).astype(np.float32)
    scores = fisher_scores(f, x)
    guard = row_guard(scores, layout, m)
    assert np.array_equal(guard, _guard_by_sort(scores, layout, m))
    forced = guard | layout.always_kept
    want = _topk_by_sort(scores, budget(gamma, d), forced)
    assert np.array_equal(select_mask(layout, x, gamma, "fisher", f, m), want)
    assert np.array_equal(topk_mask(scores.astype(np.float32), budget(gamma, d), forced), want)


def test_capacity_one_is_every_position_without_scoring():
    layout = ParamLayout.from_arrays({"w": np.zeros((3, 4)), "b": np.zeros(3)})
    x = np.arange(15, dtype=np.float32)
    assert select_mask(layout, x, 1.0, "fisher", np.zeros(15, dtype=np.float32)).all()
    assert select_mask(layout, x, 1.0, "magnitude").all()
    with pytest.raises(ValueError, match="shape"):
        select_mask(layout, x, 1.0, "fisher", np.zeros(14))
