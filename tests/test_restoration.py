"""FedGMR restoration schedules and nested masks (common/submodels/restoration.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.fisher.selection import budget
from common.models.layout import ParamLayout
from common.submodels.restoration import (
    MIN_DENSITY,
    RestorationMasks,
    random_priority,
    restoration_budget,
    restore_mask,
)

unit = st.floats(min_value=1e-3, max_value=1.0)
schedules = st.sampled_from(["linear", "step"])
kinds = st.sampled_from(["memory", "bandwidth"])


@settings(max_examples=300, deadline=None)
@given(
    schedule=schedules,
    capacity=unit,
    start=unit,
    ceiling=unit,
    rounds=st.integers(1, 50),
    factor=st.floats(1.05, 8.0),
    times=st.lists(st.floats(0, 120), min_size=2, max_size=20),
    kind=kinds,
)
def test_budget_monotone_and_bounded(
    schedule, capacity, start, ceiling, rounds, factor, times, kind
):
    times = sorted(times)
    g = [
        restoration_budget(schedule, t, capacity, start, ceiling, rounds, factor, kind)
        for t in times
    ]
    end = min(ceiling, capacity) if kind == "memory" else ceiling
    assert all(b >= a for a, b in zip(g, g[1:])), g
    assert all(0 < v <= end for v in g), (g, end)
    assert kind == "bandwidth" or all(v <= capacity for v in g)  # memory: a hard cap
    # from the start on, never below the start density
    g0 = restoration_budget(schedule, 0, capacity, start, ceiling, rounds, factor, kind)
    assert g0 == pytest.approx(min(end, max(MIN_DENSITY, start * capacity)))
    assert all(v >= g0 for v in g)


@settings(max_examples=200, deadline=None)
@given(
    schedule=schedules,
    capacity=unit,
    start=unit,
    ceiling=unit,
    rounds=st.integers(1, 50),
    factor=st.floats(1.05, 8),
    kind=kinds,
)
def test_budget_reaches_the_ceiling_at_restore_rounds(
    schedule, capacity, start, ceiling, rounds, factor, kind
):
    end = min(ceiling, capacity) if kind == "memory" else ceiling
    assert (
        restoration_budget(schedule, rounds, capacity, start, ceiling, rounds, factor, kind) == end
    )
    assert (
        restoration_budget(schedule, rounds + 7.5, capacity, start, ceiling, rounds, factor, kind)
        == end
    )


def test_bandwidth_kind_grows_a_small_client_to_the_full_model():
    # capacity 1/16 starts at 0.25 / 16 in both kinds; memory stops at 1/16, bandwidth reaches the
    # whole model
    for kind, end in (("memory", 0.0625), ("bandwidth", 1.0)):
        g = [restoration_budget("linear", t, 0.0625, 0.25, 1.0, 10, kind=kind) for t in (0, 5, 10)]
        assert g == pytest.approx([0.015625, 0.015625 + (end - 0.015625) / 2, end])
    with pytest.raises(ValueError, match="capacity kind"):
        restoration_budget("linear", 0, 0.5, 0.25, 1.0, 10, kind="disk")  # type: ignore[arg-type]


def test_budget_exact_values():
    # linear: 0.25 * 0.5 = 0.125 at t=0 growing to 0.5 at t=10
    assert restoration_budget("linear", 0, 0.5, 0.25, 1.0, 10) == pytest.approx(0.125)
    assert restoration_budget("linear", 4, 0.5, 0.25, 1.0, 10) == pytest.approx(0.125 + 0.375 * 0.4)
    # ceiling below capacity caps the growth
    assert restoration_budget("linear", 10, 1.0, 0.25, 0.6, 10) == pytest.approx(0.6)
    # step: 0.125 -> 0.25 -> 0.5 -> 1.0, three doublings over 9 rounds: one every 3 rounds
    got = [restoration_budget("step", t, 1.0, 0.125, 1.0, 9, 2.0) for t in range(11)]
    assert got == pytest.approx([0.125] * 3 + [0.25] * 3 + [0.5] * 3 + [1.0] * 2)
    # tiny capacities start at the floor, not at start * capacity
    assert restoration_budget("linear", 0, 0.02, 0.1, 1.0, 5) == pytest.approx(MIN_DENSITY)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(schedule="cubic"),
        dict(capacity=0.0),
        dict(capacity=1.5),
        dict(start=0.0),
        dict(ceiling=1.2),
        dict(restore_rounds=0),
        dict(t=-1.0),
        dict(schedule="step", factor=1.0),
    ],
)
def test_budget_rejects_bad_arguments(kwargs):
    args = dict(
        schedule="linear",
        t=1.0,
        capacity=0.5,
        start=0.25,
        ceiling=1.0,
        restore_rounds=5,
        factor=2.0,
    )
    args.update(kwargs)
    with pytest.raises(ValueError):
        restoration_budget(**args)


@settings(max_examples=200, deadline=None)
@given(
    d=st.integers(1, 300),
    seed=st.integers(0, 2**31),
    ks=st.lists(st.integers(0, 300), min_size=1, max_size=8),
)
def test_masks_nested_and_of_exact_size(d, seed, ks):
    rng = np.random.default_rng(seed)
    forced = rng.random(d) < 0.05
    prev = None
    for k in sorted(min(k, d) for k in ks):
        scores = rng.normal(
            size=d
        )  # scores may change between steps (fisher rule): nesting must hold anyway
        new = restore_mask(prev, k, scores, forced)
        held = forced | (prev if prev is not None else False)
        assert np.all(new[held]), "restoration dropped a held position"
        assert int(new.sum()) == max(k, int(held.sum()))
        # the added positions are the best-scoring ones not already held (brute force)
        added = np.flatnonzero(new & ~held)
        rest = np.flatnonzero(~new & ~held)
        if added.size and rest.size:
            assert scores[added].min() >= scores[rest].max()
        prev = new


def test_random_priority_is_deterministic_per_client():
    a = random_priority(1000, 7, "edge-1")
    assert np.array_equal(a, random_priority(1000, 7, "edge-1"))
    assert not np.array_equal(a, random_priority(1000, 7, "edge-2"))
    assert not np.array_equal(a, random_priority(1000, 8, "edge-1"))


def _layout() -> ParamLayout:
    return ParamLayout.from_arrays(
        {"w1": np.zeros((8, 20)), "b1": np.zeros(8), "w2": np.zeros((4, 8)), "b2": np.zeros(4)}
    )


@pytest.mark.parametrize("rule", ["random", "fisher"])
def test_restoration_state_grows_masks_per_client(rule):
    layout = _layout()
    d = layout.size
    rng = np.random.default_rng(0)
    masks = RestorationMasks(layout, "linear", 0.25, 1.0, 4, 2.0, rule, seed=3, min_per_row=1)
    capacity = 0.5
    prev = None
    sizes = []
    for t in range(7):
        x = rng.normal(size=d).astype(np.float32)
        fisher = rng.random(d).astype(np.float32) if t > 0 else None  # first round: no Fisher yet
        mask, source = masks.mask("client-a", float(t), capacity, x, fisher)
        assert source == (rule if rule == "random" or t > 0 else "magnitude")
        if prev is not None:
            assert np.all(mask[prev])
        forced = int(layout.always_kept.sum()) + 8 + 4  # biases + one weight per row of w1 and w2
        k = budget(masks.density(t, capacity), d)
        assert mask.sum() == max(k, forced)
        assert mask.sum() <= budget(capacity, d)
        sizes.append(int(mask.sum()))
        # asking again at the same time is idempotent
        again, src = masks.mask("client-a", float(t), capacity, x, fisher)
        assert np.array_equal(again, mask) and src == "kept"
        prev = mask
    assert sizes[-1] == budget(capacity, d) and sizes[0] < sizes[-1]


def test_restoration_state_restarts_a_client_whose_capacity_changed():
    layout = _layout()
    masks = RestorationMasks(layout, "linear", 0.5, 1.0, 2, 2.0, "random", seed=0, min_per_row=1)
    x = np.ones(layout.size, dtype=np.float32)
    big, _ = masks.mask("c", 2.0, 1.0, x, None)
    assert big.all()
    small, _ = masks.mask("c", 3.0, 0.5, x, None)
    assert small.sum() == budget(0.5, layout.size)


@pytest.mark.parametrize("kind", ["memory", "bandwidth"])
def test_sync_strategy_masks_grow_with_rounds(kind):
    from common.config.parse import parse_run_config
    from server.strategy import SubmodelStrategy
    from server.strategy_core.node_registry import NodeProfile

    layout = _layout()
    # the paper's text: a linear schedule and random restoration (the defaults are the published
    # code's)
    options = {
        "gmr-schedule": "linear",
        "gmr-selection": "random",
        "gmr-restore-rounds": 3,
        "gmr-start": 0.5,
        "capacity-kind": kind,
    }
    cfg = parse_run_config({"method": "fedgmr", **options})
    strategy = SubmodelStrategy(cfg, layout)
    strategy.registry.nodes = {
        7: NodeProfile(0.5, "cpu", 10, 2, "edge-7"),
        9: NodeProfile(1.0, "cpu", 10, 2, "edge-9"),
    }
    strategy.x = np.random.default_rng(1).normal(size=layout.size).astype(np.float32)
    for node_id, capacity in ((7, 0.5), (9, 1.0)):
        masks = [strategy.node_mask(node_id, rnd)[0] for rnd in range(1, 6)]
        sizes = [int(m.sum()) for m in masks]
        assert all(np.all(b[a]) for a, b in zip(masks, masks[1:]))  # nested
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
        end = (
            capacity if kind == "memory" else 1.0
        )  # a bandwidth-limited node grows to the full model
        assert sizes[3] == sizes[4] == budget(end, layout.size)  # ceiling reached at round 1 + 3
    # central evaluation of a capacity level: the submodel a client of that capacity holds, not a
    # fresh one
    level, source = strategy.level_mask(6 - 1, 0.5)
    assert source == "held" and np.array_equal(
        level, strategy.method.restoration.clients["edge-7"].mask
    )
    assert set(strategy.method.restoration.clients) == {"edge-7", "edge-9"}
    fresh, _ = strategy.level_mask(
        1 - 1, 0.25
    )  # no client of that capacity: a fresh, unremembered mask
    assert fresh.sum() <= budget(0.25, layout.size) and set(
        strategy.method.restoration.clients
    ) == {"edge-7", "edge-9"}
