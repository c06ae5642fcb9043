"""The label-inference attacks of the leak benchmark: exact on hand-made uploads, and the command
end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.privacy.label_inference import (
    find_classifier,
    fisher_scores,
    held_from_shares,
    held_from_update,
    mixture_shares,
    score_attack,
    shares,
    split_at_largest_gap,
    update_scores,
)
from common.models.layout import ParamLayout


def _layout(classes: int = 3, hidden: int = 2) -> ParamLayout:
    arrays = {
        "fc1.weight": np.zeros((hidden, 4), np.float32),
        "fc1.bias": np.zeros(hidden, np.float32),
        "fc2.weight": np.zeros((classes, hidden), np.float32),
        "fc2.bias": np.zeros(classes, np.float32),
    }
    return ParamLayout.from_arrays(arrays)


def test_the_classifier_is_the_last_matrix_with_a_row_per_class_and_its_bias():
    layout = _layout()
    c = find_classifier(layout, 3)
    assert (c.weight, c.bias, c.num_classes) == (slice(10, 16), slice(16, 19), 3)
    with pytest.raises(ValueError, match="no classifier with 7 rows"):
        find_classifier(layout, 7)


def test_scores_read_each_class_row_with_its_bias():
    layout = _layout()
    c = find_classifier(layout, 3)
    flat = np.zeros(layout.size)
    flat[10:16] = [1, 3, 0, 0, 5, 5]  # rows: (1, 3), (0, 0), (5, 5)
    flat[16:19] = [2, 0, -1]
    assert fisher_scores(flat, c).tolist() == [2.0, 0.0, 3.0]
    held = np.zeros(layout.size, dtype=bool)
    held[[10, 16, 14]] = (
        True  # class 0: a weight and its bias; class 2: one weight; class 1: nothing
    )
    assert update_scores(flat, held, c).tolist() == [1.5, 0.0, 5.0]


def test_the_largest_gap_on_a_log_scale_splits_the_held_classes():
    assert split_at_largest_gap(np.array([1.0, 1.2, 90.0, 110.0, 0.9])).tolist() == [
        False,
        False,
        True,
        True,
        False,
    ]
    assert split_at_largest_gap(np.array([2.0, 2.0, 2.0])).all()
    assert held_from_update(np.array([-1.0, 0.5, 0.0])).tolist() == [False, True, False]
    assert held_from_update(np.array([-1.0, -0.2, -3.0])).tolist() == [
        False,
        True,
        False,
    ]  # none rose: the top
    assert held_from_shares(np.array([0.01, 0.02, 0.97]), 0.05).tolist() == [False, False, True]


def test_shares_sum_to_one_over_the_held_classes():
    got = shares(np.array([3.0, -1.0, 1.0]), np.array([True, False, True]))
    assert got.tolist() == [0.75, 0.0, 0.25]
    assert shares(np.array([-1.0, -2.0]), np.array([True, True])).tolist() == [0.5, 0.5]


@settings(max_examples=40, deadline=None)
@given(
    classes=st.integers(2, 6),
    seed=st.integers(0, 2**31 - 1),
    raw=st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6),
)
def test_a_mixture_of_per_class_signatures_gives_back_its_shares(classes, seed, raw):
    rng = np.random.default_rng(seed)
    signatures = rng.gamma(1.0, size=(classes, 40))
    weights = np.array(raw[:classes]) + 1e-3
    q = weights / weights.sum()
    positions = rng.random(40) < 0.8
    positions[: classes + 2] = True  # enough equations for the unknowns
    got = mixture_shares(q @ signatures, signatures, positions)
    assert np.allclose(got, q, atol=1e-6)


def test_no_signal_gives_uniform_shares():
    assert mixture_shares(np.zeros(5), np.ones((2, 5)), np.ones(5, dtype=bool)).tolist() == [
        0.5,
        0.5,
    ]


def test_the_attack_is_scored_against_the_guess_that_reads_no_upload():
    counts = np.array([[10, 0, 0], [10, 5, 0], [0, 0, 4], [6, 6, 0]])
    inferred = np.array(
        [[True, False, False], [True, False, False], [False, False, True], [True, True, False]]
    )
    inferred_shares = inferred / inferred.sum(axis=1, keepdims=True)
    score = score_attack(inferred, inferred_shares, counts)
    # Truth: {0}, {0, 1}, {2}, {0, 1}; the guess "held where most nodes hold it" is {0} for every
    # node.
    assert score.membership == pytest.approx(11 / 12) and score.membership_chance == pytest.approx(
        8 / 12
    )
    assert score.exact == pytest.approx(3 / 4) and score.exact_chance == pytest.approx(1 / 4)
    # Node 1: inferred (1, 0) against the true (2/3, 1/3): TV 1/3; the others are exact.
    assert score.share_error == pytest.approx((1 / 3) / 4)
    # A class at most min_share of a node's examples is not held: node 1's class 1 (a third) is not,
    # at 0.4.
    assert score_attack(
        inferred, inferred_shares, counts, min_share=0.4
    ).membership == pytest.approx(12 / 12)


def test_the_leak_command_writes_its_table(tmp_path):
    from benchmarks.privacy.leak_bench import main

    code = main(
        [
            "--partitions",
            "pathological:2",
            "--seeds",
            "0",
            "--capacities",
            "1,1/4",
            "--clients-per-capacity",
            "1",
            "--fisher-examples",
            "8",
            "--model",
            "cnn",
            "--epsilons",
            "0,8",
            "--dp-rounds",
            "5",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    rows = json.loads((tmp_path / "leak.json").read_text())
    assert {r["epsilon"] for r in rows} == {0.0, 8.0}
    kinds = {(r["source"], r["attack"], r["capacity"]) for r in rows if r["epsilon"] == 8.0}
    for source in ("fedfibos Fisher", "fedfibos update", "fedavg update"):
        for attack in ("classifier", "signature"):
            assert {
                (source, attack, "all"),
                (source, attack, "1"),
                (source, attack, "0.25"),
            } <= kinds
    assert all(0 <= r["membership"] <= 1 and 0 <= r["share_error"] <= 1 for r in rows)
    with pytest.raises(SystemExit):
        main(["--partitions", "dirichlet:0.1,shards", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["--min-share", "1.5", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # batch statistics: no per-example bound
        main(["--model", "cnn-bn", "--epsilons", "4", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["--epsilons", "-1", "--out", str(tmp_path)])
