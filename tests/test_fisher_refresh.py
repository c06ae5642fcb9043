"""The Fisher at the global model: inert parameters, held masks, mask stability and the refresh
exchange."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.fisher.held_masks import HeldMasks
from common.fisher.selection import select_mask
from common.fisher.state import FisherState
from common.models.architectures import build_model, model_layout
from common.models.inert import inert_parameters
from common.models.layout import ParamLayout
from server.mask_stability import MaskHistory, jaccard, per_capacity_means


# ---------------------------------------------------------------- inert parameters
def test_the_biases_before_batchnorm_are_inert_and_their_gradient_is_zero() -> None:
    model = build_model("cnn-bn", 10, 1, seed=0)
    inert = inert_parameters(model)
    assert inert == {"conv1.bias", "conv2.bias"}
    model.train()
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    params = dict(model.named_parameters())
    for name in inert:  # what the graph says is what autograd measures
        assert params[name].grad.abs().max() < 1e-6, name
    useful = [n for n, p in params.items() if n.endswith("bias") and n not in inert]
    assert useful and all(params[n].grad.abs().max() > 1e-6 for n in useful)


@pytest.mark.parametrize("name", ["cnn", "resnet18"])
def test_models_without_a_bias_before_a_norm_have_no_inert_parameters(name: str) -> None:
    assert inert_parameters(build_model(name, 10, 3, seed=0)) == frozenset()


def test_the_layout_of_a_batchnorm_model_names_its_inert_tensors() -> None:
    layout = model_layout(build_model("cnn-bn", 10, 1, seed=0))
    assert layout.inert == {"conv1.bias", "conv2.bias"}
    counts = layout.count_per_tensor(layout.inert_mask)
    assert {n for n, c in counts.items() if c} == {"conv1.bias", "conv2.bias"}
    assert sum(counts.values()) == int(layout.inert_mask.sum())


def test_an_inert_name_outside_the_arrays_is_refused() -> None:
    with pytest.raises(ValueError, match="not among the arrays"):
        ParamLayout.from_arrays({"w": np.zeros((2, 3))}, inert=frozenset({"b"}))


@pytest.mark.parametrize("keep_vectors", [True, False])
def test_a_submodel_spends_no_budget_on_inert_positions(keep_vectors: bool) -> None:
    arrays = {"w": np.zeros((4, 5)), "b": np.zeros(4), "v": np.zeros(3)}
    layout = ParamLayout.from_arrays(arrays, inert=frozenset({"b"}))
    rng = np.random.default_rng(0)
    x = rng.normal(size=layout.size).astype(np.float32)
    fisher = rng.random(layout.size).astype(np.float32)
    fisher[layout.inert_mask] = (
        1e6  # a bias that cannot learn must not win on its (meaningless) score
    )
    mask = select_mask(layout, x, 0.5, "fisher", fisher, min_per_row=0, keep_vectors=keep_vectors)
    assert not mask[layout.inert_mask].any()
    assert mask.sum() == int(np.ceil(0.5 * layout.size))
    assert select_mask(
        layout, x, 1.0, "fisher", fisher, min_per_row=0, keep_vectors=keep_vectors
    ).all()


# ---------------------------------------------------------------- held masks
def test_a_held_mask_is_given_back_only_for_its_estimate_and_capacity() -> None:
    held = HeldMasks(11)
    mask = np.arange(11) % 3 == 0
    held.put("a", 4, 0.25, mask)
    assert np.array_equal(held.get("a", 4, 0.25), mask)
    assert held.get("a", 5, 0.25) is None  # a newer estimate: rank again
    assert held.get("a", 4, 0.5) is None  # another capacity: rank again
    assert held.get("b", 4, 0.25) is None
    with pytest.raises(ValueError, match="expected"):
        held.put("a", 4, 0.25, np.ones(10, dtype=bool))


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 70),
    st.lists(st.tuples(st.text(min_size=1, max_size=6), st.integers(0, 99)), max_size=5),
)
def test_held_masks_survive_the_state_archive(d: int, clients: list[tuple[str, int]]) -> None:
    rng = np.random.default_rng(d)
    held = HeldMasks(d)
    for key, rnd in clients:
        held.put(key, rnd, 1 / 4, rng.random(d) < 0.5)
    state = FisherState(d)
    state.update(1, rng.random(d).astype(np.float32), 2.0, 1)
    archive = state.to_bytes(extra=held.arrays())
    assert (
        FisherState.from_bytes(archive).to_bytes() == state.to_bytes()
    )  # the state's own members untouched
    with np.load(io.BytesIO(archive)) as z:
        back = HeldMasks.from_arrays(z)
    assert len(back) == len(held)
    for key, rnd in dict(clients).items():
        assert np.array_equal(back.get(key, rnd, 1 / 4), held.get(key, rnd, 1 / 4))


# ---------------------------------------------------------------- mask stability
@settings(max_examples=50, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40), st.integers(0, 2**32 - 1))
def test_jaccard_is_the_brute_force_share_of_shared_positions(bits: list[bool], seed: int) -> None:
    a = np.array(bits)
    b = np.random.default_rng(seed).random(a.size) < 0.5
    both = sum(1 for i in range(a.size) if a[i] and b[i])
    either = sum(1 for i in range(a.size) if a[i] or b[i])
    assert jaccard(a, b) == (1.0 if either == 0 else both / either)
    assert jaccard(a, a) == 1.0


def test_mask_history_compares_each_client_with_its_own_previous_mask() -> None:
    hist = MaskHistory(6)
    a = np.array([1, 1, 0, 0, 0, 0], dtype=bool)
    b = np.array([0, 1, 1, 0, 0, 0], dtype=bool)
    assert hist.observe("x", a) is None
    assert hist.observe("y", b) is None
    assert hist.observe("x", b) == pytest.approx(1 / 3)
    assert hist.observe("y", b) == 1.0
    with pytest.raises(ValueError, match="expected"):
        hist.observe("x", np.ones(5, dtype=bool))


def test_per_capacity_means_average_the_clients_of_each_level() -> None:
    out = per_capacity_means([(1.0, 0.9, 0.3), (0.25, 0.5, 1.0), (0.25, 0.7, 2.0)])
    assert list(out) == ["1", "0.25"]
    assert out["0.25"] == {"accuracy": pytest.approx(0.6), "loss": pytest.approx(1.5), "clients": 2}


# ---------------------------------------------------------------- the refresh exchange
def test_a_refresh_every_two_rounds_sends_the_rest_of_the_model_and_holds_the_mask(
    tmp_path, monkeypatch
) -> None:
    from tests.inprocess_grid import inprocess_federation

    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    run_config = {
        "num-rounds": 3,
        "local-epochs": 1,
        "eval-every": 1,
        "fisher-examples": 16,
        "fisher-every": 2,
        "fedfibos-byte-budget": 0,  # every client refreshed, the warm-up with discovery
    }
    fed = inprocess_federation(run_config, {51: 1.0, 52: 0.25, 53: 0.0625})
    estimator = fed.cfg.options("fisher").estimator
    assert (
        estimator == "global" and fed.strategy.method.opening() != "none"
    )  # the defaults this test is about
    fed.strategy.start(
        fed.grid, fed.strategy.to_arrays(fed.x0), 3, 60.0, evaluate_fn=fed.evaluate_fn
    )
    records = fed.records
    assert records[0]["fisher_warmup"]["replies"] == 3
    by_round = {r["round"]: {c["capacity"]: c for c in r["clients"]} for r in records[1:]}
    d = fed.strategy.layout.size
    for rnd, asked in (
        (1, False),
        (2, True),
        (3, False),
    ):  # estimates of round 0, then 2: refresh at age 2
        for gamma, c in by_round[rnd].items():
            assert c["status"] == "ok", c
            assert c["fisher_asked"] is asked, (rnd, gamma)
            if (
                gamma < 1
            ):  # ranked by its own estimate (``held``: the mask that estimate gave before)
                assert c["mask_source"] in ("client", "held"), (rnd, gamma)
            if asked and gamma < 1:
                # the global values outside its mask, counted in the bytes down
                assert c["fisher_at_bytes"] >= 4 * (d - c["selected"])
                assert c["bytes_down"] > c["fisher_at_bytes"]
            if not asked:
                assert c["fisher_at_bytes"] == 0
            if rnd > 1:
                assert c["mask_overlap"] is not None
            assert sum(c["layer_positions"].values()) == c["selected"]
    # between refreshes the mask is held: round 2's mask was ranked by the round-0 estimate like
    # round 1's
    assert by_round[2][0.0625]["mask_overlap"] == by_round[2][0.25]["mask_overlap"] == 1.0
    trained = records[3]["global"]["trained_per_capacity"]
    assert set(trained) == {"1", "0.25", "0.0625"}
    assert trained["1"]["accuracy"] == pytest.approx(records[3]["global"]["accuracy"])
    for gamma, c in by_round[3].items():
        assert trained[f"{gamma:g}"]["accuracy"] == pytest.approx(c["submodel_accuracy"])


def test_a_refresh_reply_without_its_fisher_is_rejected_and_keeps_the_old_estimate(
    tmp_path, monkeypatch
) -> None:
    from common.methods.masked import MaskedMethod
    from common.wire import protocol as P
    from tests.inprocess_grid import inprocess_federation

    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    run = {
        "num-rounds": 2,
        "eval-every": 0,
        "fisher-every": 2,
        "fisher-examples": 8,
        "fedfibos-byte-budget": 0,
    }
    fed = inprocess_federation(run, {61: 0.25})
    real = MaskedMethod.client_train
    refreshes: list[int] = []

    def forgetful(
        self, received, train, cfg, device
    ):  # drops the Fisher of its second refresh (round 2)
        update = real(self, received, train, cfg, device)
        if P.FISHER_AT not in received.records:
            return update
        refreshes.append(1)
        if len(refreshes) == 1:  # the warm-up's
            return update
        arrays = {P.DELTA: update.arrays[P.DELTA]}
        return type(update)(arrays, update.num_examples, update.loss, update.train_seconds, 0.0)

    monkeypatch.setattr(MaskedMethod, "client_train", forgetful)
    x_after_round: list[np.ndarray] = []
    real_fold = fed.strategy.method.round_fold

    def recording_fold(x, rnd, min_replies):  # records each round's committed model
        fold = real_fold(x, rnd, min_replies)
        real_finish = fold.finish
        fold.finish = lambda: x_after_round.append(real_finish()) or x_after_round[-1]
        return fold

    monkeypatch.setattr(fed.strategy.method, "round_fold", recording_fold)
    fed.strategy.start(
        fed.grid, fed.strategy.to_arrays(fed.x0), 2, 60.0, evaluate_fn=fed.evaluate_fn
    )
    assert len(refreshes) == 2
    (client,) = fed.records[2]["clients"]
    assert client["fisher_asked"] and client["status"].startswith("rejected")
    assert "fisher" in client["status"].lower()
    assert len(x_after_round) == 1  # round 2 had no valid reply: nothing was aggregated
    assert np.array_equal(fed.strategy.x, x_after_round[0])  # the model after round 1, untouched
    (estimate,) = fed.strategy.method.fisher.clients.values()
    assert estimate.round == 0  # the warm-up's estimate is kept
