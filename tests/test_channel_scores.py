"""CA-HFP channel scores and selection, checked against brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.models.architectures import build_model, model_layout
from common.models.layout import ParamLayout, TensorSpec
from common.submodels.channel_scores import (
    ChannelReport,
    ChannelScoreState,
    ClientChannelScores,
    channel_scores,
    channel_sums,
    kept_count,
    personal_state,
    score_capacity,
    top_channels,
)
from common.submodels.width import TensorChannels, channel_graph, channel_mask, group_sizes


def _dropped_sum(layout, graph, values, group, channel):
    """Brute force: sum of ``values`` over the positions that vanish when one channel alone is
    dropped."""
    keep = {g: np.ones(n, dtype=bool) for g, n in group_sizes(layout, graph).items()}
    keep[group][channel] = False
    return float(values[~channel_mask(layout, graph, keep)].sum())


def _toy(a: int, b: int, rep: int, k: int) -> tuple[ParamLayout, dict[str, TensorChannels]]:
    """A small graph with every feature: 1-D tensors, a group mapped to itself, in_repeat, ungrouped
    outputs."""
    layout = ParamLayout(
        (
            TensorSpec("l1.weight", (a, 2, k, k)),
            TensorSpec("l1.bias", (a,)),
            TensorSpec("self.weight", (a, a, k, k)),
            TensorSpec("l2.weight", (b, a, 1, 1)),
            TensorSpec("fc.weight", (3, b * rep)),
            TensorSpec("fc.bias", (3,)),
        )
    )
    graph = {
        "l1.weight": TensorChannels("A"),
        "l1.bias": TensorChannels("A"),
        "self.weight": TensorChannels("A", "A"),
        "l2.weight": TensorChannels("B", "A"),
        "fc.weight": TensorChannels(None, "B", rep),
        "fc.bias": TensorChannels(None),
    }
    return layout, graph


@settings(max_examples=40, deadline=None)
@given(
    a=st.integers(1, 5),
    b=st.integers(1, 4),
    rep=st.integers(1, 3),
    k=st.integers(1, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_channel_sums_equal_brute_force_on_any_toy_graph(a, b, rep, k, seed):
    layout, graph = _toy(a, b, rep, k)
    values = np.random.default_rng(seed).normal(size=layout.size)
    sums = channel_sums(layout, graph, values)
    for group, n in group_sizes(layout, graph).items():
        brute = [_dropped_sum(layout, graph, values, group, c) for c in range(n)]
        np.testing.assert_allclose(sums[group], brute, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name,in_channels", [("cnn", 1), ("resnet18", 3)])
def test_channel_sums_equal_brute_force_on_the_real_graphs(name, in_channels):
    layout = model_layout(build_model(name, 10, in_channels, 0))
    graph = channel_graph(name, layout)
    rng = np.random.default_rng(1)
    values = rng.normal(size=layout.size)
    sums = channel_sums(layout, graph, values)
    for group, n in group_sizes(layout, graph).items():
        for c in rng.choice(n, size=2, replace=False):
            assert sums[group][c] == pytest.approx(
                _dropped_sum(layout, graph, values, group, c), rel=1e-9, abs=1e-9
            )


@pytest.mark.parametrize("name,in_channels", [("cnn", 1), ("resnet18", 3)])
def test_channel_score_is_abs_first_order_sum_plus_curvature_sum(name, in_channels):
    layout = model_layout(build_model(name, 10, in_channels, 0))
    graph = channel_graph(name, layout)
    rng = np.random.default_rng(2)
    g, w = rng.normal(size=(2, layout.size))
    h = rng.exponential(size=layout.size)
    scores = channel_scores(layout, graph, g, h, w)
    for group, n in group_sizes(layout, graph).items():
        assert np.all(scores[group] >= 0)
        for c in rng.choice(n, size=2, replace=False):
            brute = abs(_dropped_sum(layout, graph, g * w, group, c)) + _dropped_sum(
                layout, graph, h * w * w, group, c
            )
            assert scores[group][c] == pytest.approx(brute, rel=1e-9)


def test_channel_score_examples_and_bad_input():
    layout, graph = _toy(2, 1, 1, 1)  # l1 (2 channels), a self map, l2 reading both, fc reading l2
    g = np.zeros(layout.size)
    h = np.zeros(layout.size)
    w = np.ones(layout.size)
    g[0] = -3.0  # l1.weight[0, 0]: only in channel A0
    h[1] = 2.0  # l1.weight[0, 1]
    scores = channel_scores(layout, graph, g, h, w)
    assert scores["A"].tolist() == [3.0 + 2.0, 0.0] and scores["B"].tolist() == [0.0]
    with pytest.raises(ValueError, match="non-negative"):
        channel_scores(layout, graph, g, -np.ones(layout.size), w)
    with pytest.raises(ValueError, match="shape"):
        channel_scores(layout, graph, g[:-1], h, w)


@settings(max_examples=60, deadline=None)
@given(
    scores=st.lists(st.integers(-3, 3), min_size=1, max_size=30),
    data=st.data(),
)
def test_top_channels_keeps_k_highest_with_lower_index_on_ties(scores, data):
    k = data.draw(st.integers(1, len(scores)))
    kept = top_channels(np.array(scores, dtype=float), k)
    assert kept.size == k and np.all(np.diff(kept) > 0)
    # brute force: sort by (-score, index)
    expected = sorted(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k])
    assert kept.tolist() == expected


def test_top_channels_ranks_flagged_channels_first_and_rejects_bad_input():
    priority = np.array([9.0, 1.0, 5.0, 2.0])
    assert top_channels(priority, 2, first=np.array([False, True, False, True])).tolist() == [1, 3]
    assert top_channels(priority, 3, first=np.array([False, True, False, False])).tolist() == [
        0,
        1,
        2,
    ]
    with pytest.raises(ValueError, match="keep"):
        top_channels(priority, 0)
    with pytest.raises(ValueError, match="finite"):
        top_channels(np.array([1.0, np.nan]), 1)


@pytest.mark.parametrize("gamma", [1.0, 0.5, 0.25, 0.125, 0.0625, 1 / 64])
def test_kept_count_matches_the_width_rule(gamma):
    for size in (1, 3, 32, 64, 512):
        assert kept_count(size, gamma) == max(1, math.ceil(math.sqrt(gamma) * size))


def test_state_first_selects_by_norm_then_by_weighted_scores_and_keeps_unheld_values():
    state = ChannelScoreState.empty({"A": 4, "B": 2})
    norms = {"A": np.array([1.0, 4.0, 3.0, 2.0]), "B": np.array([0.0, 1.0])}
    assert not state.any_measured
    first = state.select(norms, 0.25)  # sqrt(1/4) = 1/2: 2 of 4, 1 of 2
    assert first["A"].tolist() == [1, 2] and first["B"].tolist() == [1]
    state.update(
        [
            ChannelReport(
                {"A": np.array([1, 2]), "B": np.array([1])}, {"A": [1.0, 5.0], "B": [2.0]}, 1.0
            ),
            ChannelReport(
                {"A": np.array([2, 3]), "B": np.array([0, 1])},
                {"A": [2.0, 7.0], "B": [1.0, 5.0]},
                3.0,
            ),
        ]
    )
    assert state.score["A"].tolist() == [0.0, 1.0, (5.0 + 3 * 2.0) / 4, 7.0]
    assert state.measured["A"].tolist() == [False, True, True, True]
    assert state.score["B"].tolist() == [1.0, (2.0 + 3 * 5.0) / 4]
    # channel 0 of A was never held: it is handed out first so that it gets measured once
    assert state.select(norms, 0.25)["A"].tolist() == [0, 3]
    assert state.select(norms, 0.25)["B"].tolist() == [1]
    state.update(
        [ChannelReport({"A": np.array([0]), "B": np.array([0])}, {"A": [0.5], "B": [9.0]}, 2.0)]
    )
    assert state.score["A"].tolist() == [
        0.5,
        1.0,
        2.75,
        7.0,
    ]  # unheld channels keep their last value
    assert state.select(norms, 0.25)["A"].tolist() == [2, 3]
    assert state.select(norms, 0.25)["B"].tolist() == [0]


def test_state_rejects_bad_reports():
    state = ChannelScoreState.empty({"A": 3})
    with pytest.raises(ValueError, match="positive"):
        state.update([ChannelReport({"A": np.array([0])}, {"A": [1.0]}, 0.0)])
    with pytest.raises(ValueError, match="finite"):
        state.update([ChannelReport({"A": np.array([0, 1])}, {"A": [1.0, np.inf]}, 1.0)])
    with pytest.raises(ValueError, match="scores"):
        state.update([ChannelReport({"A": np.array([0, 1])}, {"A": [1.0]}, 1.0)])


def _report(a, scores):
    return ChannelReport({"A": np.array(a)}, {"A": scores}, 5.0)


def test_client_states_are_their_own_and_fall_back_to_the_pooled_scores():
    pooled = ChannelScoreState.empty({"A": 4})
    pooled.update([_report([0, 1, 2], [1.0, 2.0, 3.0])])
    clients = ClientChannelScores({"A": 4}, max_clients=3)
    clients.update("a", _report([1, 3], [9.0, 0.5]))
    own = personal_state(clients.get("a"), pooled)
    # own where measured; elsewhere the pooled score on the client's scale: channel 1 is the only
    # one both measured, 9.0 (own) against 2.0 (pooled), so pooled scores count 4.5 times
    assert own.score["A"].tolist() == [4.5, 9.0, 13.5, 0.5]
    assert own.measured["A"].tolist() == [True, True, True, True]
    assert personal_state(None, pooled) is pooled
    norms = {"A": np.zeros(4)}
    assert own.select(norms, 0.25)["A"].tolist() == [1, 2]
    assert pooled.select(norms, 0.25)["A"].tolist() == [
        2,
        3,
    ]  # channel 3 unmeasured in the pool: first
    clients.update("a", _report([0], [4.0]))
    assert clients.get("a").score["A"].tolist() == [
        4.0,
        9.0,
        0.0,
        0.5,
    ]  # its last report per channel


def test_client_states_evict_the_least_recent_within_the_budget():
    sizes = {"A": 100, "B": 28}
    cap = score_capacity(0.01, sizes)
    assert cap == int(0.01 * 2**20 // (9 * 128))
    clients = ClientChannelScores(sizes, max_clients=cap)
    both = ChannelReport({"A": np.array([0]), "B": np.array([0])}, {"A": [1.0], "B": [1.0]}, 1.0)
    for i in range(cap + 3):
        clients.update(f"c{i}", both)
        if i == cap - 1:
            clients.update(
                "c0", both
            )  # c0 reported again just before the state is full: c1 is the least recent
    assert len(clients.clients) == cap and clients.evictions == 3
    assert [k for k in ("c0", "c1", "c2", "c3", "c4") if clients.get(k) is not None] == ["c0", "c4"]
    assert clients.memory_bytes() <= 0.01 * 2**20
    with pytest.raises(ValueError, match="max_clients"):
        ClientChannelScores(sizes, max_clients=0)
