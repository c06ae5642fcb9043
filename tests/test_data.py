"""Datasets and partitions: deterministic by seed, disjoint, and cached per node."""

from __future__ import annotations

import numpy as np
import pytest

from client.local_data import load_local_data
from common.config.node import NodeConfig
from common.config.parse import parse_run_config
from common.data.datasets import load_dataset
from common.data.local_split import derive_local_data
from common.data.partitioning import partition_indices


def test_digits_split_is_stratified_and_deterministic():
    a = load_dataset("digits", 0.2, 7)
    b = load_dataset("digits", 0.2, 7)
    assert len(a.train) + len(a.test) == 1797
    assert np.array_equal(a.test.y, b.test.y) and np.array_equal(a.train.x, b.train.x)
    assert (
        a.train.x.shape[1:] == (1, 8, 8) and a.train.x.dtype == np.float32 and a.train.x.max() <= 1
    )
    assert np.all(np.bincount(a.test.y, minlength=10) >= 30)


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "pathological"])
def test_partitions_are_disjoint_and_deterministic(kind):
    y = load_dataset("digits", 0.2, 0).train.y
    parts = [partition_indices(y, kind, 5, i, 3, alpha=0.3, classes_per_client=2) for i in range(5)]
    again = [partition_indices(y, kind, 5, i, 3, alpha=0.3, classes_per_client=2) for i in range(5)]
    assert all(np.array_equal(p, q) for p, q in zip(parts, again))
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat)
    if kind == "iid":
        assert len(flat) == len(y)
    if kind == "pathological":
        assert all(len(np.unique(y[p])) <= 2 for p in parts)
    if kind == "dirichlet":  # skewed: some client misses some label entirely
        assert any(len(np.unique(y[p])) < 10 for p in parts)


def test_partition_id_out_of_range():
    with pytest.raises(ValueError, match="partition-id"):
        partition_indices(np.zeros(10, np.int64), "iid", 2, 2, 0)


def test_local_data_cache_returns_the_same_split(tmp_path, monkeypatch):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path))
    run = parse_run_config({"partitioner": "dirichlet"})
    node = NodeConfig(partition_id=1, num_partitions=4, capacity=0.5)
    first = load_local_data(run, node)
    assert len(list(tmp_path.iterdir())) == 1
    second = load_local_data(run, node)
    direct = derive_local_data(run, node)
    for d in (second, direct):
        assert np.array_equal(first.train.y, d.train.y) and np.array_equal(first.test.x, d.test.x)
    (next(tmp_path.iterdir())).write_bytes(b"torn")
    assert np.array_equal(load_local_data(run, node).train.y, first.train.y)


def test_mnist5k_ships_offline_and_splits():
    s = load_dataset("mnist5k", 0.2, 0)
    assert len(s.train) == 4000 and len(s.test) == 1000
    assert s.train.x.shape[1:] == (1, 28, 28) and s.train.x.dtype == np.float32
    assert 0 <= s.train.x.min() and s.train.x.max() <= 1
    assert np.array_equal(np.bincount(s.test.y), np.full(10, 100))


def test_unknown_dataset():
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("imagenet", 0.2, 0)
