"""Heterogeneous-rank LoRA: the maths on constructed cases, and the method on the tiny
transformer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.aggregation.masked import MaskedUpdate
from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.models.layout import ParamLayout
from common.submodels.lora_ranks import (
    aggregate_lora,
    allocate_ranks,
    held_ranks,
    layer_fisher_mass,
    lora_pairs,
    lora_rank,
    rank_mask,
)
from tests.tiny_text import tiny_text_run

A, B, HEAD = "m.lora_A.default.weight", "m.lora_B.default.weight", "head.bias"


def _layout() -> ParamLayout:
    """One adapted 2x2 layer at rank 2, and a 2-entry head."""
    return ParamLayout.from_arrays({A: np.zeros((2, 2)), B: np.zeros((2, 2)), HEAD: np.zeros(2)})


def _update(layout, x, mask, a, b, head, weight) -> MaskedUpdate:
    """A client's reply: its trained factors (of its own rank) and head, as the change of its held
    positions."""
    trained = np.zeros(layout.size)
    parts = layout.unflatten(trained)
    parts[A][: a.shape[0]] = a
    parts[B][:, : b.shape[1]] = b
    parts[HEAD][:] = head
    flat = layout.flatten(parts)
    idx = np.flatnonzero(mask)
    return MaskedUpdate(idx, (flat[idx] - x[idx]).astype(np.float32), weight)


@pytest.fixture
def mixed_ranks():
    """Global A = I, B = 0 (LoRA's start); client 1 at rank 2 (weight 1), client 2 at rank 1 (weight
    3)."""
    layout = _layout()
    pairs = lora_pairs(layout)
    x = layout.flatten({A: np.eye(2), B: np.zeros((2, 2)), HEAD: np.zeros(2)})
    m1, m2 = rank_mask(layout, pairs, {"m": 2}), rank_mask(layout, pairs, {"m": 1})
    u1 = _update(layout, x, m1, np.eye(2), np.array([[2.0, 0], [0, 1]]), [1.0, 0.0], 1.0)
    u2 = _update(layout, x, m2, np.array([[1.0, 1.0]]), np.array([[1.0], [0.0]]), [0.0, 2.0], 3.0)
    return layout, pairs, x, [u1, u2]


def test_rank_masks_hold_the_leading_components(mixed_ranks) -> None:
    layout, pairs, _, _ = mixed_ranks
    assert pairs[0].layer == "m" and (pairs[0].max_rank, pairs[0].fan_in, pairs[0].fan_out) == (
        2,
        2,
        2,
    )
    mask = layout.unflatten(rank_mask(layout, pairs, {"m": 1}))
    assert mask[A].tolist() == [[True, True], [False, False]]  # row 0 of A
    assert mask[B].tolist() == [[True, False], [True, False]]  # column 0 of B
    assert mask[HEAD].all()
    assert held_ranks(layout, pairs, rank_mask(layout, pairs, {"m": 1})) == {"m": 1}
    with pytest.raises(ValueError, match="prefix"):
        held_ranks(
            layout,
            pairs,
            layout.flatten({A: [[0, 0], [1, 1]], B: [[0, 1], [0, 1]], HEAD: [1, 1]}) > 0,
        )
    with pytest.raises(ValueError, match="outside"):
        rank_mask(layout, pairs, {"m": 3})
    assert [lora_rank(g, 8) for g in (1, 0.25, 1 / 16, 1 / 64)] == [8, 2, 1, 1]


def test_zero_padding_averages_padded_factors_over_all_clients(mixed_ranks) -> None:
    layout, pairs, x, updates = mixed_ranks
    out = layout.unflatten(aggregate_lora(x, layout, pairs, updates, "zero-pad"))
    # p = (1/4, 3/4): A = 1/4 I + 3/4 [[1, 1], [0, 0]]; B = 1/4 [[2, 0], [0, 1]] + 3/4 [[1, 0], [0,
    # 0]]
    np.testing.assert_allclose(out[A], [[1.0, 0.75], [0.0, 0.25]], atol=1e-7)
    np.testing.assert_allclose(out[B], [[1.25, 0.0], [0.0, 0.25]], atol=1e-7)
    np.testing.assert_allclose(
        out[HEAD], [0.25, 1.5], atol=1e-7
    )  # both held the head: 1/4 [1, 0] + 3/4 [0, 2]


def test_holders_average_each_component_over_the_clients_that_held_it(mixed_ranks) -> None:
    layout, pairs, x, updates = mixed_ranks
    out = layout.unflatten(aggregate_lora(x, layout, pairs, updates, "holders"))
    np.testing.assert_allclose(
        out[A], [[1.0, 0.75], [0.0, 1.0]], atol=1e-7
    )  # row 1: client 1 alone
    np.testing.assert_allclose(out[B], [[1.25, 0.0], [0.0, 1.0]], atol=1e-7)
    np.testing.assert_allclose(out[HEAD], [0.25, 1.5], atol=1e-7)


def test_svd_redistribution_keeps_the_mean_product_sorted_by_singular_value(mixed_ranks) -> None:
    layout, pairs, x, updates = mixed_ranks
    out = layout.unflatten(aggregate_lora(x, layout, pairs, updates, "svd"))
    # mean product: 1/4 [[2, 0], [0, 1]] + 3/4 [[1], [0]] @ [[1, 1]] = [[1.25, 0.75], [0, 0.25]]
    np.testing.assert_allclose(out[B] @ out[A], [[1.25, 0.75], [0.0, 0.25]], atol=1e-6)
    np.testing.assert_allclose(
        out[A] @ out[A].T, np.eye(2), atol=1e-6
    )  # A's rows: right singular vectors
    s = np.linalg.norm(out[B], axis=0)  # B's columns carry the singular values, largest first
    assert s[0] >= s[1]
    assert s[0] ** 2 + s[1] ** 2 == pytest.approx(
        1.25**2 + 0.75**2 + 0.25**2, abs=1e-6
    )  # Frobenius norm
    assert s[0] * s[1] == pytest.approx(1.25 * 0.25, abs=1e-6)  # |det|
    # a rank-1 client next receives the best rank-1 approximation: its error is the second singular
    # value
    rank1 = np.outer(out[B][:, 0], out[A][0])
    assert np.linalg.norm(rank1 - [[1.25, 0.75], [0.0, 0.25]]) == pytest.approx(s[1], abs=1e-6)
    np.testing.assert_allclose(out[HEAD], [0.25, 1.5], atol=1e-7)


def test_fisher_rank_split_on_a_constructed_case() -> None:
    # mass 3:1:0:0, 8 units, ranks in [1, 4]: one unit each, the other 4 split 3:1
    assert allocate_ranks(np.array([3.0, 1.0, 0.0, 0.0]), 8, 4).tolist() == [4, 2, 1, 1]
    # layer 0 would take 1 + 10/12 * 4 > 4: capped; its surplus splits 1:1 over layers 1 and 2, 0.5
    # each, and the one unit left by rounding goes to the lower index
    assert allocate_ranks(np.array([10.0, 1.0, 1.0, 0.0]), 8, 4).tolist() == [4, 2, 1, 1]
    assert allocate_ranks(np.zeros(3), 6, 4).tolist() == [2, 2, 2]  # no Fisher yet: uniform
    assert allocate_ranks(np.array([1.0, 1.0]), 100, 4).tolist() == [
        4,
        4,
    ]  # budget clipped to L * max
    with pytest.raises(ValueError, match="non-negative"):
        allocate_ranks(np.array([1.0, -1.0]), 4, 4)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=8),
    st.integers(0, 80),
    st.integers(1, 10),
)
def test_fisher_rank_split_spends_the_budget_within_bounds_and_follows_the_mass(
    mass, budget, max_rank
) -> None:
    mass = np.array(mass)
    ranks = allocate_ranks(mass, budget, max_rank)
    assert ranks.sum() == min(max(budget, mass.size), mass.size * max_rank)
    assert ranks.min() >= 1 and ranks.max() <= max_rank
    for i in range(mass.size):
        for j in range(mass.size):
            if mass[i] > mass[j]:
                assert ranks[i] >= ranks[j]


def test_layer_fisher_mass_is_the_mean_over_measured_entries() -> None:
    layout = _layout()
    pairs = lora_pairs(layout)
    # a rank-1 client measured row 0 of A and column 0 of B; the rest is zero (never measured)
    fisher = layout.flatten(
        {A: [[2.0, 0.0], [0.0, 0.0]], B: [[4.0, 0.0], [6.0, 0.0]], HEAD: [9.0, 9.0]}
    )
    assert layer_fisher_mass(fisher, layout, pairs).tolist() == [
        4.0
    ]  # (2 + 4 + 6) / 3; the head is no layer


def test_lora_keys_fail_fast_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="lora-max-rank=0"):
        parse_run_config({"method": "lora", "lora-max-rank": 0})
    with pytest.raises(ConfigError, match="method='lora' adapts a pretrained model"):
        parse_run_config({"method": "lora"})  # the default model is the image CNN
    with pytest.raises(ConfigError, match="lora-aggregation"):
        parse_run_config({"lora-aggregation": "mean"})
    pretrained = {"method": "lora", "model": "hf", "model-path": "org/model", "dataset": "ag_news"}
    parse_run_config(
        pretrained
    )  # uniform ranks read no Fisher: the fisher-* defaults do not concern them
    with pytest.raises(
        ConfigError, match="fisher-estimator='received': lora-allocation='fisher' measures"
    ):
        parse_run_config(
            {**pretrained, "lora-allocation": "fisher", "fisher-estimator": "received"}
        )


@pytest.fixture(scope="module")
def text_setup(text_setup):
    """The shared tiny BERT and news set (``tests/conftest.py``), for the tests that need
    ``peft``."""
    pytest.importorskip("peft")
    return text_setup


def _run(model_path: str, data_path: str, **extra) -> dict:
    return tiny_text_run(
        model_path,
        data_path,
        method="lora",
        **{"num-rounds": 2, "eval-every": 2, "lora-max-rank": 8, **extra},
    )


@pytest.mark.parametrize("allocation", ["uniform", "fisher"])
def test_two_round_lora_federation_sends_bytes_in_proportion_to_rank(
    text_setup, allocation, tmp_path, monkeypatch
):
    from tests.inprocess_grid import inprocess_federation

    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    keys = {"lora-allocation": allocation}
    if (
        allocation == "fisher"
    ):  # measured along training; `masked` keeps each layer's Fisher mass exact
        keys |= {"fisher-estimator": "path", "fisher-encoding": "masked"}
    fed = inprocess_federation(_run(*text_setup, **keys), {11: 1.0, 12: 0.25, 13: 0.0625})
    layout = fed.strategy.layout
    # the federated vector is the adapters (4 layers: query and value of 2 blocks, 16 x 16) and the
    # head only
    assert all(".lora_" in n or ".modules_to_save." in n for n in layout.names)
    head = 4 * 16 + 4
    assert layout.size == 4 * 8 * (16 + 16) + head
    result = fed.strategy.start(
        fed.grid, fed.strategy.to_arrays(fed.x0), 2, 60.0, evaluate_fn=fed.evaluate_fn
    )
    for rec in fed.records[1:]:
        assert rec["replies"] == 3
        by_rank = {}
        for c in rec["clients"]:
            assert c["status"] == "ok"
            rank = {1.0: 8, 0.25: 2, 0.0625: 1}[c["capacity"]]
            # a rank-r client holds r components of each layer (r * (16 + 16) values; split across
            # layers by Fisher the total is the same) and the head: its download is those float32
            # values and a mask
            assert c["selected"] == 4 * rank * 32 + head
            assert c["values_bytes"] == 4 * c["selected"]
            by_rank[rank] = c["bytes_down"]
        assert (
            by_rank[1] < by_rank[2] < by_rank[8] < 4 * layout.size + 1024
        )  # + record framing; no base weight
        assert by_rank[8] - by_rank[2] == pytest.approx(
            4 * 6 * 4 * 32, rel=0.05
        )  # linear in the rank
    sources = {c["mask_source"] for c in fed.records[2]["clients"]}
    assert sources == (
        {"uniform"} if allocation == "uniform" else {"client"}
    )  # round 2: each client's Fisher
    assert not np.array_equal(fed.strategy.x, fed.x0) and np.all(np.isfinite(fed.strategy.x))
    assert sorted(result.evaluate_metrics_serverapp) == [1, 2]


def test_a_rank_above_the_layer_dimension_is_rejected_naming_the_key(
    text_setup, tmp_path, monkeypatch
):
    from tests.inprocess_grid import inprocess_federation

    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(
        ConfigError, match=r"lora-max-rank=17: above the dimension of layer .*at most 16"
    ):
        inprocess_federation(_run(*text_setup, **{"lora-max-rank": 17}), {11: 1.0})
