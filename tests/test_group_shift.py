"""A fleet with true groups (``node-groups``, ``group-shift``): each group sees the shared pool
shifted, the server's test set mixes them, and bad settings are refused naming the key."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config.node import parse_node_config
from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.data.arrays import ArrayDataset
from common.data.datasets import load_run_dataset, load_server_data
from common.data.group_shift import (
    group_of,
    label_permutation,
    shift_examples,
    shift_partition,
    shift_test_set,
)
from common.data.local_split import derive_local_data
from tests.inprocess_grid import inprocess_federation


def _images(n: int = 6, side: int = 3, classes: int = 5) -> ArrayDataset:
    x = np.arange(n * side * side, dtype=np.float32).reshape(n, 1, side, side)
    return ArrayDataset(x, np.arange(n, dtype=np.int64) % classes, classes)


def test_partition_p_is_in_group_p_mod_groups():
    assert [group_of(p, 4) for p in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert [group_of(p, 1) for p in range(3)] == [0, 0, 0]
    with pytest.raises(ValueError, match="at least 1"):
        group_of(0, 0)


@pytest.mark.parametrize("group", [0, 1, 2, 3])
def test_rotate_turns_each_image_by_its_groups_quarter_turns(group):
    data = _images()
    shifted = shift_partition(data, "rotate", partition_id=group + 4, groups=4, seed=0)
    for a, b in zip(data.x, shifted.x):
        np.testing.assert_array_equal(b[0], np.rot90(a[0], k=group))
    np.testing.assert_array_equal(shifted.y, data.y)  # same labels
    assert shifted.x.flags.c_contiguous


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 3), st.integers(1, 6))
def test_turning_back_restores_the_images(group, n):
    data = _images(n)
    there = shift_examples(data, "rotate", np.full(n, group, np.int64), 0)
    back = shift_examples(there, "rotate", np.full(n, (4 - group) % 4, np.int64), 0)
    np.testing.assert_array_equal(back.x, data.x)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 20), st.integers(0, 50), st.integers(0, 2**31))
def test_a_label_permutation_is_a_bijection_fixed_by_the_seed(classes, group, seed):
    perm = label_permutation(classes, group, seed)
    assert sorted(perm.tolist()) == list(range(classes))
    np.testing.assert_array_equal(perm, label_permutation(classes, group, seed))
    if group == 0:
        np.testing.assert_array_equal(perm, np.arange(classes))


def test_permute_labels_renames_labels_and_keeps_images():
    data = _images(10, classes=10)
    shifted = shift_partition(data, "permute-labels", partition_id=1, groups=2, seed=3)
    perm = label_permutation(10, 1, 3)
    assert not np.array_equal(perm, np.arange(10))  # group 1 really is renamed
    np.testing.assert_array_equal(shifted.y, perm[data.y])
    np.testing.assert_array_equal(shifted.x, data.x)


def test_one_group_changes_nothing_and_the_test_set_mixes_the_groups():
    data = _images(8)
    assert shift_partition(data, "rotate", 3, 1, 0) is data
    assert shift_test_set(data, "rotate", 1, 0) is data
    mixed = shift_test_set(data, "rotate", 4, 0)
    for i, (a, b) in enumerate(zip(data.x, mixed.x)):
        np.testing.assert_array_equal(b[0], np.rot90(a[0], k=i % 4))


def test_rotate_refuses_what_it_cannot_turn():
    flat = ArrayDataset(np.zeros((2, 1, 3, 4), np.float32), np.zeros(2, np.int64), 2)
    with pytest.raises(ValueError, match="square images"):
        shift_examples(flat, "rotate", np.ones(2, np.int64), 0)
    with pytest.raises(ValueError, match="four groups"):
        shift_examples(_images(2), "rotate", np.array([0, 4]), 0)
    with pytest.raises(ValueError, match="2 examples"):
        shift_examples(_images(2), "rotate", np.zeros(3, np.int64), 0)


@pytest.mark.parametrize(
    ("settings_", "key"),
    [
        ({"node-groups": 0}, "node-groups"),
        ({"node-groups": 5}, "node-groups"),  # rotate has four quarter turns
        ({"node-groups": 2, "group-shift": "mirror"}, "group-shift"),
        ({"node-groups": 2, "dataset": "node", "classes": "2"}, "node-groups"),
        (
            {"node-groups": 2, "dataset": "rotten_tomatoes", "model": "fasttext"},
            "group-shift",
        ),
    ],
)
def test_bad_group_settings_are_refused_naming_the_key(settings_, key):
    with pytest.raises(ConfigError, match=key):
        parse_run_config(settings_)


def test_more_than_four_groups_permute_labels():
    assert parse_run_config({"node-groups": 8, "group-shift": "permute-labels"}).node_groups == 8


def test_a_nodes_partition_and_the_servers_test_set_are_shifted_as_their_groups(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path))
    node = parse_node_config({"partition-id": 3, "num-partitions": 4, "capacity": 1})
    plain = derive_local_data(parse_run_config({}), node)
    run = parse_run_config({"node-groups": 2})
    grouped = derive_local_data(run, node)  # partition 3: group 1, one quarter turn
    np.testing.assert_array_equal(grouped.train.x, np.rot90(plain.train.x, k=1, axes=(-2, -1)))
    np.testing.assert_array_equal(grouped.test.y, plain.test.y)
    test = load_server_data(run).test
    assert test is not None
    pool_test = load_run_dataset(run).test
    np.testing.assert_array_equal(test.x[0::2], pool_test.x[0::2])
    np.testing.assert_array_equal(test.x[1::2], np.rot90(pool_test.x[1::2], k=1, axes=(-2, -1)))


def test_a_two_round_federation_of_two_groups_trains_and_reports_adapted_accuracy(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    run = {"num-rounds": 2, "local-epochs": 1, "eval-every": 1, "seed": 5, "adapt-steps": 3}
    run |= {"node-groups": 2, "group-shift": "permute-labels", "method": "fiarse"}
    fed = inprocess_federation(run, {31: 1.0, 32: 0.25, 33: 1.0, 34: 0.25})
    fed.strategy.start(
        fed.grid, fed.strategy.to_arrays(fed.x0), 2, 60.0, evaluate_fn=fed.evaluate_fn
    )
    trained = [r for r in fed.records if r["round"] > 0]
    assert len(trained) == 2
    assert all(0 <= r["local"]["adapted_accuracy"] <= 1 for r in trained)
    assert all(c["status"] == "ok" for r in trained for c in r["clients"])
