"""Per-level masks: computed once while the model and the ranking stay the same, and equal to a
fresh selection."""

from __future__ import annotations

import numpy as np
import pytest

from common.config.parse import parse_run_config
from common.fisher.level_masks import LevelMasks
from common.fisher.selection import powered, select_mask
from common.methods import create_method
from common.models.layout import ParamLayout

ARRAYS = {"w1": np.zeros((8, 12)), "b1": np.zeros(8), "w2": np.zeros((5, 8)), "b2": np.zeros(5)}
LAYOUT = ParamLayout.from_arrays(ARRAYS)
D = LAYOUT.size


def _x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(D).astype(np.float32)


def test_one_computation_per_level_while_model_and_token_are_equal():
    cache, calls = LevelMasks(), []

    def compute(gamma):
        def run():
            calls.append(gamma)
            return np.arange(D) < int(gamma * D)

        return run

    x = _x(0)
    a = cache.get(x, ("t", 1), 0.5, compute(0.5))
    assert cache.get(x.copy(), ("t", 1), 0.5, compute(0.5)) is a  # an equal model in a new array
    cache.get(x, ("t", 1), 0.25, compute(0.25))
    assert calls == [0.5, 0.25] and (cache.hits, cache.misses) == (1, 2)
    with pytest.raises(ValueError, match="read-only"):
        a[0] = not a[0]
    y = x.copy()
    y[3] += 1
    cache.get(y, ("t", 1), 0.5, compute(0.5))  # one value changed
    cache.get(y, ("t", 2), 0.5, compute(0.5))  # the estimate changed
    cache.get(y, ("t", 2), 0.25, compute(0.25))  # the earlier 0.25 mask was dropped with the rest
    assert calls == [0.5, 0.25, 0.5, 0.5, 0.25]
    cache.clear()
    cache.get(y, ("t", 2), 0.25, compute(0.25))
    assert calls[-1] == 0.25 and len(calls) == 6


def _fedfibos():
    method = create_method(parse_run_config({"method": "fedfibos", "min-per-row": 1}))
    method.start_server(LAYOUT)
    return method


def test_prior_ranked_masks_equal_a_fresh_selection_and_are_shared_by_level():
    method = _fedfibos()
    guards = (
        method.guards.min_per_row,
        method.guards.keep_vectors,
    )  # the run's guards, whatever their defaults
    power = method.opts.fisher_power  # F^power x^2, whatever the default
    x = _x(1)
    before, source = method.mask_for(None, 1, 0.25, x)  # no Fisher yet: magnitude
    assert source == "magnitude"
    assert np.array_equal(before, select_mask(LAYOUT, x, 0.25, "magnitude", None, *guards))
    rng = np.random.default_rng(2)
    for i, key in enumerate(("a", "b", "c", "d")):
        method.fisher.update(key, rng.lognormal(0, 2, D).astype(np.float32), 10.0 + i, 1)
    prior = method.fisher.global_prior()
    for gamma in (0.25, 0.0625):
        want = select_mask(LAYOUT, x, gamma, "fisher", powered(prior, power), *guards)
        level, source = method.mask_for(None, 2, gamma, x)
        assert source == "prior" and np.array_equal(level, want)
        stranger, source = method.mask_for("never-seen", 2, gamma, x.copy())
        assert source == "prior" and stranger is level  # one mask per level, not one per client
    own, source = method.mask_for("a", 2, 0.25, x)
    assert source == "client"
    own_estimate = powered(method.fisher.estimate("a", 2), power)
    assert np.array_equal(own, select_mask(LAYOUT, x, 0.25, "fisher", own_estimate, *guards))
    assert method.level_masks.misses == 3  # magnitude 0.25, prior 0.25, prior 0.0625
    method.fisher.update(
        "e", rng.lognormal(0, 2, D).astype(np.float32), 5.0, 2
    )  # the prior changes
    after, _ = method.mask_for(None, 3, 0.25, x)
    prior = powered(method.fisher.global_prior(), power)
    assert np.array_equal(after, select_mask(LAYOUT, x, 0.25, "fisher", prior, *guards))
    method.load_state(
        method.state_bytes()
    )  # a restored state is a new object: nothing stale is reused
    again, _ = method.mask_for(None, 3, 0.25, x)
    assert again is not after and np.array_equal(again, after)


def test_power_zero_ranks_by_magnitude_and_asks_no_node_for_a_fisher():
    """``F^0 x^2`` is magnitude alone: no warm-up, no refresh, no Fisher bytes, no DP budget."""
    from common.methods import method_spec
    from common.methods.specs.privacy import node_noise_multiplier

    raw = {"method": "fedfibos", "min-per-row": 1, "fedfibos-byte-budget": 0}
    run = parse_run_config({**raw, "fedfibos-fisher-power": 0})
    spec = method_spec("fedfibos")
    assert not spec.reads_fisher(run) and spec.upload_encoding(run) == "none"
    assert spec.reads_fisher(parse_run_config(raw))
    method = create_method(run)
    method.start_server(LAYOUT)
    assert method.opening() == "none"
    x = _x(3)
    for server_round in (0, 1, 5):
        mask, source = method.mask_for("a", server_round, 0.25, x)
        assert source == "magnitude"
        assert method.fisher_request("a", server_round, x, mask) is None
    guards = (method.guards.min_per_row, method.guards.keep_vectors)
    assert np.array_equal(mask, select_mask(LAYOUT, x, 0.25, "magnitude", None, *guards))
    dp = {"dp-epsilon": 8.0, "model": "cnn-gn", "num-rounds": 10}
    z = {}
    for name, r in (
        ("power 0", {**raw, "fedfibos-fisher-power": 0}),
        ("power 1", raw),
        ("fedavg", {"method": "fedavg"}),
    ):
        dp_run = parse_run_config({**r, **dp})
        z[name] = node_noise_multiplier(dp_run, method_spec(r["method"]).reads_fisher(dp_run), 300)
    assert z["power 0"] == z["fedavg"] < z["power 1"]  # the budget goes to training alone
