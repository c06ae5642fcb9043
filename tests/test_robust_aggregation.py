"""Robust mask-aware aggregation: per-position trimmed means over holders and median-norm clipping,
exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.aggregation.masked import MaskedUpdate, aggregate_masked
from common.aggregation.robust import (
    clip_to_median_norm,
    robust_mean_step,
    trimmed_holder_mean_step,
)
from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.methods import create_method
from common.methods.round_fold import Accepted, BufferedFold, IncrementalFold
from common.models.architectures import build_model, model_layout
from common.wire.validation import TrainReply


def _updates(draw_masks: np.ndarray, deltas: np.ndarray) -> list[MaskedUpdate]:
    return [
        MaskedUpdate(np.flatnonzero(m).astype(np.int64), deltas[i][m].astype(np.float32), 1.0 + i)
        for i, m in enumerate(draw_masks)
    ]


def _brute_force(
    x: np.ndarray, masks: np.ndarray, deltas: np.ndarray, trim: float, lr: float
) -> np.ndarray:
    out = x.astype(np.float64).copy()
    for j in range(x.size):
        held = np.sort(deltas[masks[:, j], j].astype(np.float64))
        h = held.size
        if h == 0:
            continue
        cut = min(max(int(np.floor(trim * h)), int(trim > 0)), (h - 1) // 2) if h >= 3 else 0
        out[j] += lr * held[cut : h - cut].mean()
    return out


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 9),
    d=st.integers(1, 40),
    trim=st.sampled_from([0.0, 0.1, 0.2, 0.34, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_the_trimmed_holder_mean_equals_a_loop_over_positions(n, d, trim, seed):
    rng = np.random.default_rng(seed)
    masks = rng.random((n, d)) < 0.6
    deltas = rng.normal(size=(n, d)).astype(np.float32) * rng.choice([1.0, 100.0], size=(n, 1))
    x = rng.normal(size=d).astype(np.float32)
    got = trimmed_holder_mean_step(x, _updates(masks, deltas), trim, server_lr=0.7)
    want = _brute_force(x, masks, deltas, trim, 0.7)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
    unheld = ~masks.any(axis=0)
    assert np.array_equal(got[unheld], x[unheld])  # nobody held it: exactly unchanged


def test_one_attacker_among_three_holders_is_cut_whatever_the_share():
    """The positions only the three capacity-1 nodes of a small fleet hold: 0.2 of 3 rounds to none,
    yet the attacker must be cut (measured: with nothing cut, a scale:-10 attacker kept the model at
    chance)."""
    x = np.zeros(3, dtype=np.float32)
    honest = [MaskedUpdate(np.arange(3), np.full(3, 0.1, dtype=np.float32), 1.0) for _ in range(2)]
    attacker = MaskedUpdate(np.arange(3), np.full(3, -1.0, dtype=np.float32), 1.0)
    assert np.allclose(trimmed_holder_mean_step(x, [*honest, attacker], 0.2), 0.1)
    assert np.allclose(trimmed_holder_mean_step(x, [*honest, attacker], 0.0), -0.8 / 3)


def test_the_median_ignores_one_scaled_update_the_mean_does_not():
    x = np.zeros(4, dtype=np.float32)
    honest = [MaskedUpdate(np.arange(4), np.full(4, 0.1, dtype=np.float32), 1.0) for _ in range(4)]
    attacker = MaskedUpdate(np.arange(4), np.full(4, -1000.0, dtype=np.float32), 1.0)
    assert np.allclose(trimmed_holder_mean_step(x, [*honest, attacker], 0.5), 0.1)
    assert np.all(aggregate_masked(x, [*honest, attacker]) < -100)
    clipped = clip_to_median_norm([*honest, attacker], factor=1.0)
    assert np.linalg.norm(clipped[-1].delta) == pytest.approx(
        0.2, rel=1e-5
    )  # the honest norm, 0.1 * sqrt(4)
    assert clipped[0] is honest[0]  # an update within the bound is left as it is
    assert np.allclose(
        robust_mean_step(x, [*honest, attacker], "norm-clip", 0.2, 1.0), 0.06, atol=1e-6
    )


@settings(max_examples=80)
@given(
    n=st.integers(2, 8),
    d=st.integers(1, 30),
    scale=st.floats(1e-3, 1e6),
    factor=st.floats(0.1, 4.0),
    seed=st.integers(0, 2**16),
)
def test_norm_clip_bounds_one_nodes_contribution_whatever_its_scale(n, d, scale, factor, seed):
    """One node scales its update by anything: after the clip no update is longer than ``factor``
    times the round's median norm, and no position of the global model moves further than that."""
    rng = np.random.default_rng(seed)
    masks = rng.random((n, d)) < 0.7
    masks[:, 0] = True  # every node holds something
    deltas = rng.normal(size=(n, d)).astype(np.float32)
    deltas[-1] *= np.float32(scale)
    updates = _updates(masks, deltas)
    norms = [float(np.linalg.norm(u.delta.astype(np.float64))) for u in updates]
    bound = factor * float(np.median(norms))
    clipped = clip_to_median_norm(updates, factor)
    for before, after, norm in zip(updates, clipped, norms, strict=True):
        assert float(np.linalg.norm(after.delta.astype(np.float64))) <= bound * (1 + 1e-5)
        assert np.array_equal(after.indices, before.indices)
        if norm <= bound:
            assert after is before
    x = rng.normal(size=d).astype(np.float32)
    step = robust_mean_step(x, updates, "norm-clip", 0.2, factor).astype(np.float64) - x
    assert np.all(np.abs(step) <= bound * (1 + 1e-5) + 1e-6)


def test_bad_rules_are_refused():
    x = np.zeros(3, dtype=np.float32)
    with pytest.raises(ValueError, match="trim"):
        trimmed_holder_mean_step(x, [], 0.6)
    with pytest.raises(ValueError, match="factor"):
        clip_to_median_norm([], 0.0)
    with pytest.raises(ValueError, match="unknown robust"):
        robust_mean_step(x, [], "krum", 0.1, 1.0)


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"robust-aggregation": "krum"}, "robust-aggregation"),
        ({"robust-trim": 0.7}, "robust-trim"),
        ({"robust-clip-factor": 0.0}, "robust-clip-factor"),
        ({"robust-aggregation": "trimmed", "method": "cahfp"}, "robust-aggregation"),
    ],
)
def test_bad_robust_settings_are_refused_naming_the_key(raw, key):
    with pytest.raises(ConfigError, match=key):
        parse_run_config(raw)


@pytest.mark.parametrize("method", ["fedavg", "fedfibos", "fiarse"])
def test_a_robust_rule_buffers_the_round_and_replaces_the_methods_mean(method):
    run = parse_run_config({"method": method, "robust-aggregation": "trimmed", "robust-trim": 0.5})
    m = create_method(run)
    layout = model_layout(build_model("cnn", 10, 1, seed=0))
    m.start_server(layout)
    d = layout.size
    x = np.zeros(d, dtype=np.float32)
    fold = m.round_fold(x, 1, 1)
    assert isinstance(fold, BufferedFold)
    rng = np.random.default_rng(0)
    updates = [
        MaskedUpdate(np.arange(d), rng.normal(size=d).astype(np.float32), 10.0) for _ in range(5)
    ]
    for i, u in enumerate(updates):
        fold.add(Accepted(i, f"k{i}", TrainReply(u, None, {"num-examples": 10.0})))
    assert np.array_equal(fold.finish(), trimmed_holder_mean_step(x, updates, 0.5, run.server_lr))
    plain = create_method(parse_run_config({"method": method}))
    plain.start_server(layout)
    assert isinstance(plain.round_fold(x, 1, 1), IncrementalFold)


def test_the_attack_knob_picks_every_nth_partition_and_poisons_what_it_says():
    from client.bench_attack import attacks, poisoned_data, poisoned_update
    from common.config.node import parse_node_config
    from common.data.arrays import ArrayDataset
    from common.methods.contract.payloads import LocalUpdate
    from common.wire import protocol as P

    run = parse_run_config({"bench-attack": "scale:-10", "bench-attack-every": 4})
    nodes = [
        parse_node_config({"partition-id": i, "num-partitions": 9, "capacity": 1.0})
        for i in range(9)
    ]
    assert [i for i, n in enumerate(nodes) if attacks(run, n)] == [0, 4, 8]
    assert not any(attacks(parse_run_config({}), n) for n in nodes)
    update = LocalUpdate({P.DELTA: np.array([1.0, -2.0], dtype=np.float32)}, 5, 0.1, 0.1, 0.0)
    assert np.array_equal(poisoned_update(run, update).arrays[P.DELTA], [-10.0, 20.0])
    data = ArrayDataset(np.zeros((3, 1, 2, 2), dtype=np.uint8), np.array([0, 1, 2]), 4)
    assert poisoned_data(run, data) is data
    targeted = parse_run_config({"bench-attack": "labels:3"})
    assert np.array_equal(poisoned_data(targeted, data).y, [3, 3, 3])
    assert poisoned_update(targeted, update) is update
    with pytest.raises(ValueError, match="outside"):
        poisoned_data(parse_run_config({"bench-attack": "labels:7"}), data)
    with pytest.raises(ConfigError, match="bench-attack"):
        parse_run_config({"bench-attack": "krum"})
