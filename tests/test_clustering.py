"""Clustered aggregation (``cluster-by``, ACFL): the placement rule on hand-made signatures, the
refusals, in-process federations with clusters, and a resume that keeps them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.aggregation.clustering import centred, cosine, held_cosine, place, unit
from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from tests.inprocess_grid import inprocess_federation


def _placements(signatures, threshold, max_clusters):
    directions: list = []
    out = []
    for s in signatures:
        c = place(s, directions, threshold, max_clusters)
        if c == len(directions):
            directions.append(None)
        directions[c] = unit(s) if directions[c] is None else directions[c] + unit(s)
        out.append(c)
    return out


def test_nodes_join_the_cluster_of_their_own_direction():
    rng = np.random.default_rng(0)
    axes = np.eye(3, 30) * 10  # three orthogonal groups
    groups = [0, 1, 0, 2, 1, 2, 0, 1]
    signatures = [axes[g] + rng.normal(0, 0.5, 30) for g in groups]
    got = _placements(signatures, threshold=0.5, max_clusters=4)
    assert got == [0, 1, 0, 2, 1, 2, 0, 1]  # clusters open in the order their groups first appear


def test_the_bound_sends_the_rest_to_the_most_similar_cluster():
    a, b, c, d = (np.array(v) for v in ([1.0, 0.0], [0.0, 1.0], [-1.0, 0.2], [0.1, 1.0]))
    # c is like neither cluster (-0.98 and 0.20 < 0.5), but the bound is two: it joins the second.
    assert _placements([a, b, c, d], 0.5, max_clusters=2) == [0, 1, 1, 1]
    assert _placements([a, b, c, d], 0.5, max_clusters=3) == [0, 1, 2, 1]
    assert _placements([a, b], threshold=-1.0, max_clusters=4) == [0, 0]


def test_centring_removes_what_every_node_learns_alike_and_lets_the_groups_show():
    rng = np.random.default_rng(1)
    common, axes = rng.normal(0, 1, 40) * 10, np.eye(2, 40) * 3
    groups = [0, 1, 0, 1, 0, 1]
    signatures = {f"n{i}": common + axes[g] + rng.normal(0, 0.2, 40) for i, g in enumerate(groups)}
    levels = {k: 1.0 for k in signatures}
    raw = _placements([signatures[k] for k in sorted(signatures)], 0.5, 4)
    assert raw == [0] * 6  # the common part makes everyone alike
    ready = centred(signatures, levels)
    assert _placements([ready[k] for k in sorted(ready)], 0.5, 4) == [0, 1, 0, 1, 0, 1]


def test_centring_is_per_capacity_level_and_on_held_positions():
    signatures = {
        "a": np.array([2.0, 4.0, 0.0]),
        "b": np.array([4.0, 0.0, 6.0]),
        "c": np.array([1.0, 1.0, 1.0]),  # alone at its level: the mean of all
    }
    got = centred(signatures, {"a": 1.0, "b": 1.0, "c": 0.25})
    np.testing.assert_allclose(got["a"], [-1.0, 0.0, 0.0])  # held: 2 - 3, 4 - 4; not held: 0
    np.testing.assert_allclose(got["b"], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(got["c"], [1 - 7 / 3, 1 - 2.5, 1 - 3.5])
    lone = centred({"a": np.array([1.0, 2.0])}, {"a": 1.0})
    np.testing.assert_array_equal(lone["a"], [1.0, 2.0])


def test_a_cluster_without_members_takes_the_first_node():
    assert place(np.ones(3), [None], 0.9, 4) == 0
    assert place(np.ones(3), [], 0.9, 4) == 0


def test_similarity_is_measured_on_the_positions_a_node_trained():
    full = np.array([1.0, 2.0, -3.0, 4.0])
    sub = np.array([1.0, 2.0, 0.0, 0.0])  # a submodel's update, agreeing where it was held
    assert held_cosine(sub, full) == pytest.approx(1.0)
    assert cosine(sub, full) < 0.5
    assert held_cosine(np.zeros(4), full) == 0.0


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.lists(st.floats(-5, 5), min_size=4, max_size=4), min_size=1, max_size=12),
    st.floats(-1, 1),
    st.integers(1, 5),
)
def test_placement_always_names_an_existing_or_the_next_cluster_within_the_bound(
    rows, threshold, max_clusters
):
    got = _placements([np.array(r) for r in rows], threshold, max_clusters)
    assert got[0] == 0
    assert max(got) < max_clusters
    for i, c in enumerate(got):
        assert c <= max(got[:i], default=-1) + 1  # a new cluster is the next index


@pytest.mark.parametrize(
    ("settings_", "key"),
    [
        ({"cluster-by": "updates", "cluster-threshold": 1.5}, "cluster-threshold"),
        ({"cluster-by": "updates", "cluster-threshold": -1.1}, "cluster-threshold"),
        ({"cluster-by": "updates", "cluster-max": 0}, "cluster-max"),
        ({"cluster-by": "kmeans"}, "cluster-by"),
        ({"cluster-by": "updates", "method": "cahfp"}, "cluster-by"),
        ({"cluster-by": "updates", "method": "fedgmr"}, "cluster-by"),
        ({"cluster-by": "fisher", "method": "fiarse"}, "cluster-by"),
    ],
)
def test_bad_cluster_settings_are_refused_naming_the_key(settings_, key):
    with pytest.raises(ConfigError, match=key):
        parse_run_config(settings_)


def test_the_methods_kept_per_cluster():
    from common.methods import registry

    kept = sorted(name for name, spec in registry().items() if spec.clusters)
    assert kept == ["fedavg", "fedavg-drop", "fedfibos", "fedrolex", "fiarse", "heterofl"]


NODES = {61: 1.0, 62: 0.25, 63: 1.0, 64: 0.25}
RUN = {
    "num-rounds": 3,
    "local-epochs": 1,
    "eval-every": 3,
    "seed": 4,
    "node-groups": 2,
    "group-shift": "permute-labels",
    "cluster-by": "updates",
    "cluster-threshold": 0.99,  # every node its own cluster, up to the bound
    "cluster-max": 3,
}


def _run(tmp_path, monkeypatch, run, rounds=None, first_round=1, state=None, x0=None):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    fed = inprocess_federation(run, NODES)
    if state is not None:
        fed.strategy.load_state(state)
        fed.strategy.first_round = first_round
    start = fed.x0 if x0 is None else x0
    fed.strategy.start(
        fed.grid,
        fed.strategy.to_arrays(start),
        rounds or run["num-rounds"],
        60.0,
        evaluate_fn=fed.evaluate_fn,
    )
    return fed


@pytest.mark.parametrize("method", ["fedavg", "fedfibos", "fiarse"])
def test_a_clustered_federation_trains_one_model_per_cluster(tmp_path, monkeypatch, method):
    fed = _run(tmp_path, monkeypatch, {**RUN, "method": method})
    strategy = fed.strategy
    records = [r for r in fed.records if r["round"] > 0]
    # Round 1 trains the first cluster; its replies place the four nodes in three clusters: the
    # first three each open one (no similarity reaches 0.99), the fourth joins the most similar.
    placed = records[0]["clusters"]["of"]
    assert [placed[f"partition-{i}"] for i in range(3)] == [0, 1, 2]
    sizes = records[0]["clusters"]["sizes"]
    assert len(sizes) == 3 and sum(sizes) == 4 and sizes[placed["partition-3"]] == 2
    assert records[-1]["clusters"]["unplaced"] == []
    models = [strategy.x] + [c.x for c in strategy.clusters.clusters[1:]]
    assert not np.array_equal(models[0], models[1]) and not np.array_equal(models[1], models[2])
    assert all(c["status"] == "ok" for r in records for c in r["clients"])
    saved = strategy.final_models()
    assert list(saved) == ["model.pt", "model-cluster-1.pt", "model-cluster-2.pt"]
    assert all(np.array_equal(a, b) for a, b in zip(saved.values(), models))
    last = records[-1]
    # The global figure is the clusters' models on the server's test set, weighted by their nodes.
    assert last["global"]["accuracy"] == pytest.approx(
        float(np.dot(sizes, last["clusters"]["accuracy"]) / 4)
    )
    assert last["local"] is not None and 0 <= last["local"]["accuracy"] <= 1


def test_fisher_similarity_places_nodes_by_their_warm_up_fisher_after_round_one(
    tmp_path, monkeypatch
):
    run = {**RUN, "method": "fedfibos", "cluster-by": "fisher", "fedfibos-byte-budget": 0}
    fed = _run(tmp_path, monkeypatch, run, rounds=2)
    first = next(r for r in fed.records if r["round"] == 1)
    assert first["clusters"]["unplaced"] == []  # the warm-up's Fisher placed every node
    assert sum(first["clusters"]["sizes"]) == len(NODES)


def test_a_resumed_clustered_run_keeps_its_clusters_and_ends_where_the_whole_run_does(
    tmp_path, monkeypatch
):
    run = {**RUN, "method": "fedavg", "num-rounds": 4, "eval-every": 0}
    whole = _run(tmp_path / "whole", monkeypatch, run)
    half = _run(tmp_path / "half", monkeypatch, {**run, "num-rounds": 2})
    state, x = half.strategy.state_bytes(), half.strategy.x.copy()
    resumed = _run(tmp_path / "resumed", monkeypatch, run, first_round=3, state=state, x0=x)
    assert resumed.strategy.clusters.of == whole.strategy.clusters.of
    assert np.array_equal(resumed.strategy.x, whole.strategy.x)
    for a, b in zip(resumed.strategy.clusters.clusters[1:], whole.strategy.clusters.clusters[1:]):
        assert np.array_equal(a.x, b.x)
    assert [r["global"]["accuracy"] for r in resumed.records if r["round"] > 2] == [
        r["global"]["accuracy"] for r in whole.records if r["round"] > 2
    ]


def test_a_checkpoint_without_clusters_is_refused_by_a_clustered_run(tmp_path, monkeypatch):
    unclustered = {**RUN, "method": "fedfibos", "cluster-by": "off", "num-rounds": 1}
    plain = _run(tmp_path / "plain", monkeypatch, unclustered)
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    clustered = inprocess_federation({**RUN, "method": "fedfibos"}, NODES)
    with pytest.raises(ValueError, match="holds no clusters"):
        clustered.strategy.load_state(plain.strategy.state_bytes())


def test_the_benchmark_scores_clusters_against_the_true_groups():
    from benchmarks.benchmark import cluster_ari

    exact = {
        "of": {"partition-0": 1, "partition-1": 0, "partition-2": 1},
        "unplaced": ["partition-3"],
    }
    assert cluster_ari({**exact, "sizes": [2, 2]}, 2) == pytest.approx(1.0)  # labels may differ
    mixed = {"of": {"partition-0": 0, "partition-1": 0, "partition-2": 1, "partition-3": 1}}
    assert cluster_ari({**mixed, "unplaced": [], "sizes": [2, 2]}, 2) < 0.5
    assert np.isnan(cluster_ari({"of": {"node-a": 0}, "unplaced": [], "sizes": [1]}, 2))
