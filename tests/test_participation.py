"""Partial participation: sample size, determinism per seed, its rate, config errors, the strategy's
use."""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from server.participation import sample_clients, sample_size
from tests.inprocess_grid import inprocess_federation

KEYS = [f"client-{i:03d}" for i in range(100)]


@given(
    n=st.integers(0, 500),
    fraction=st.floats(min_value=1e-6, max_value=1.0, allow_nan=False),
    min_nodes=st.integers(1, 600),
)
def test_sample_size_is_floor_of_the_exact_product_bounded_by_min_and_n(n, fraction, min_nodes):
    exact = math.floor(Fraction(repr(fraction)) * n)
    assert sample_size(n, fraction, min_nodes) == min(n, max(exact, min_nodes))


def test_sample_size_takes_the_written_decimal_not_its_binary_rounding():
    assert int(0.29 * 100) == 28  # what float arithmetic gives
    assert sample_size(100, 0.29, 1) == 29
    assert sample_size(100, 0.1, 1) == 10
    assert sample_size(3, 0.1, 2) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 0.0, 1), "fraction"),
        ((10, 1.5, 1), "fraction"),
        ((10, 0.5, 0), "min_nodes"),
        ((-1, 0.5, 1), "n_"),
    ],
)
def test_sample_size_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        sample_size(*args)


def test_the_sample_is_a_function_of_seed_and_round_not_of_key_order():
    a = sample_clients(KEYS, 0.1, 1, seed=7, server_round=3)
    b = sample_clients(list(reversed(KEYS)), 0.1, 1, seed=7, server_round=3)
    assert a == b and len(a) == 10 and a == sorted(a) and set(a) <= set(KEYS)
    assert sample_clients(KEYS, 0.1, 1, seed=8, server_round=3) != a
    assert sample_clients(KEYS, 0.1, 1, seed=7, server_round=4) != a


def test_every_client_is_sampled_at_the_configured_rate():
    rounds = 2000
    counts = Counter(k for r in range(1, rounds + 1) for k in sample_clients(KEYS, 0.1, 1, 0, r))
    assert sum(counts.values()) == 10 * rounds
    rates = np.array([counts[k] / rounds for k in KEYS])
    # Binomial(2000, 0.1): sd 0.0067 per client; 0.035 is over 5 sd, so only a biased sampler fails.
    assert np.all(np.abs(rates - 0.1) < 0.035), rates


def test_fraction_one_returns_everyone_without_drawing():
    assert sample_clients(KEYS[:5], 1.0, 1, 0, 1) == KEYS[:5]
    assert sample_clients(KEYS[:5], 0.2, 3, 0, 1) == sorted(sample_clients(KEYS[:5], 0.2, 3, 0, 1))
    assert len(sample_clients(KEYS[:5], 0.2, 3, 0, 1)) == 3


def test_duplicate_keys_are_an_error():
    with pytest.raises(ValueError, match="distinct"):
        sample_clients(["a", "a", "b"], 0.5, 1, 0, 1)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"fraction-train": 0.0}, "fraction-train"),
        ({"fraction-train": 1.5}, "fraction-train"),
        ({"min-train-nodes": 0}, "min-train-nodes"),
        ({"method": "fedgmr", "gmr-mode": "async", "fraction-train": 0.5}, "fraction-train"),
    ],
)
def test_bad_participation_settings_fail_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        parse_run_config(override)


def test_a_federation_trains_the_seeded_sample_each_round(tmp_path, monkeypatch):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    run_config = {
        "method": "fedfibos",
        "num-rounds": 3,
        "local-epochs": 1,
        "eval-every": 0,
        "seed": 5,
        "fraction-train": 0.5,
        "min-train-nodes": 2,
        "fedfibos-byte-budget": 0,  # the warm-up with discovery
    }
    capacities = {21: 1.0, 22: 0.25, 23: 1.0, 24: 0.25, 25: 0.0625, 26: 1.0}
    fed = inprocess_federation(run_config, capacities)
    grid, strategy, records = fed.grid, fed.strategy, fed.records
    strategy.start(
        grid, strategy.to_arrays(fed.x0), fed.cfg.num_rounds, 60.0, evaluate_fn=fed.evaluate_fn
    )
    trained = [m for m in grid.handled if m.metadata.message_type == "train"]
    assert len(trained) == 3 * 3  # the Fisher warm-up rode on discovery ...
    assert records[0]["fisher_warmup"]["replies"] == 6  # ... and asked every node that can train
    keys = {nid: strategy.registry.nodes[nid].key for nid in capacities}
    for rec in records[1:]:
        expected = sample_clients(list(keys.values()), 0.5, 2, 5, rec["round"])
        assert sorted(keys[c["node_id"]] for c in rec["clients"]) == expected
        assert rec["sent"] == rec["replies"] == 3 and rec["eligible"] == 6


def test_min_train_nodes_above_the_connected_nodes_stops_with_a_clear_message(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    run_config = {
        "num-rounds": 1,
        "local-epochs": 1,
        "eval-every": 0,
        "min-train-nodes": 3,
        "poll-interval": 0.01,
    }
    fed = inprocess_federation(run_config, {31: 1.0, 32: 0.25})
    with pytest.raises(
        RuntimeError, match=r"min-train-nodes=3: only 2 node\(s\) can train after waiting 1 s"
    ):
        fed.strategy.start(
            fed.grid, fed.strategy.to_arrays(fed.x0), 1, 1.0, evaluate_fn=fed.evaluate_fn
        )
