"""Personalised evaluation (``adapt-steps``): each node evaluates the submodel it would train next
as received and after a few local SGD steps on its own training split; only the accuracies leave the
node."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config.parse import parse_run_config
from common.config.schema import ConfigError
from common.data.arrays import ArrayDataset
from common.methods import create_method
from common.methods.contract.payloads import Received
from common.models.architectures import build_model, model_layout, trainable_arrays
from common.training.loop import TrainConfig
from common.training.personalisation import adaptation_examples
from common.wire import protocol as P
from common.wire.validation import ReplyError, SentSubmodel, validate_evaluate_reply
from server.federated_evaluation import NodeEvaluation, federated_figures
from server.strategy_core.round_records import progress_line
from tests.inprocess_grid import inprocess_federation

CPU = torch.device("cpu")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 50), st.integers(0, 12), st.integers(1, 16), st.integers(0, 2**31))
def test_adaptation_uses_every_example_once_before_any_twice(n, steps, batch, seed):
    idx = adaptation_examples(n, steps, batch, seed)
    assert idx.shape == (steps * batch,) and idx.dtype == np.int64
    assert np.all((idx >= 0) & (idx < n))
    for start in range(
        0, idx.size, n
    ):  # each pass over the split is a permutation (the last may be cut)
        chunk = idx[start : start + n]
        assert np.unique(chunk).size == chunk.size
    assert np.array_equal(idx, adaptation_examples(n, steps, batch, seed))


def test_adaptation_refuses_an_empty_split():
    with pytest.raises(ValueError, match="num_examples=0"):
        adaptation_examples(0, 3, 8, 0)


def _digits(n=96, seed=0):
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.random((n, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, n), 10)


def _received(method_name, gamma):
    run = parse_run_config({"method": method_name, "seed": 3})
    method = create_method(run)
    model = build_model(run.model, 10, 1, run.seed)
    layout = model_layout(model)
    method.start_server(layout)
    x = layout.flatten(trainable_arrays(model))
    mask, _ = method.mask_for("c", 2, gamma, x)
    down = method.encode(x, mask)
    return method, layout, mask, Received(down.records, down.kind, down.digest, layout.size, 2)


def _flat(model, layout):
    return layout.flatten(
        {n: p.detach().numpy() for n, p in model.named_parameters() if n in layout.names}
    )


@pytest.mark.parametrize("method_name", ["fedfibos", "fiarse", "heterofl"])
def test_an_element_wise_submodel_adapts_only_where_it_is_held(method_name):
    method, layout, mask, got = _received(method_name, 0.25)
    cfg = TrainConfig(epochs=1, batch_size=16, lr=0.5, seed=1)
    data = _digits()
    before = _flat(method.client_model(got, data), layout)
    unchanged = _flat(method.client_adapt(got, data, 0, cfg, CPU), layout)
    assert unchanged.tobytes() == before.tobytes()  # 0 steps: the model as received
    after = _flat(method.client_adapt(got, data, 4, cfg, CPU), layout)
    assert np.all(after[~mask] == 0)  # the positions the node never held stay empty
    assert np.any(after[mask] != before[mask])
    again = _flat(method.client_adapt(got, data, 4, cfg, CPU), layout)
    assert again.tobytes() == after.tobytes()  # seeded: the same steps every time


def test_a_structured_submodel_adapts_its_small_model():
    run = parse_run_config({"method": "cahfp", "seed": 3})
    method = create_method(run)
    model = build_model(run.model, 10, 1, run.seed)
    layout = model_layout(model)
    method.start_server(layout)
    x = layout.flatten(trainable_arrays(model))
    mask, _ = method.mask_for("c", 2, 0.25, x)
    down = method.encode(x, mask)
    got = Received(down.records, down.kind, down.digest, layout.size, 2)
    data = _digits()
    small = method.client_model(got, data)
    before = [p.detach().clone() for p in small.parameters()]
    adapted = method.client_adapt(got, data, 3, TrainConfig(1, 16, 0.5, seed=1), CPU)
    assert not adapted.training
    assert any(not torch.equal(a, b) for a, b in zip(adapted.parameters(), before))


SENT = SentSubmodel(1, 4, np.ones(3, bool), "abc", 10)
META = {"round": 4, "mask-digest": "abc"}
BASE = {"num-examples": 10, "eval-loss": 0.5, "eval-acc": 0.8}


def test_an_adapting_run_needs_the_adapted_figures_in_each_evaluation_reply():
    assert validate_evaluate_reply(BASE, META, SENT, 10) == {
        "num-examples": 10.0,
        "eval-loss": 0.5,
        "eval-acc": 0.8,
    }
    with pytest.raises(ReplyError, match=P.ADAPTED_LOSS):
        validate_evaluate_reply(BASE, META, SENT, 10, adapted=True)
    full = {**BASE, P.ADAPTED_LOSS: 0.3, P.ADAPTED_ACC: 0.9}
    assert validate_evaluate_reply(full, META, SENT, 10, adapted=True)[P.ADAPTED_ACC] == 0.9
    with pytest.raises(ReplyError, match="exceeds 1"):
        validate_evaluate_reply({**full, P.ADAPTED_ACC: 1.5}, META, SENT, 10, adapted=True)
    with pytest.raises(ReplyError, match="finite"):
        validate_evaluate_reply(
            {**full, P.ADAPTED_LOSS: float("nan")}, META, SENT, 10, adapted=True
        )


def test_the_adapted_figures_are_pooled_per_capacity_by_examples():
    evals = [
        NodeEvaluation(1.0, True, 10, 0.5, 0.8, 0.4, 0.9),
        NodeEvaluation(0.25, False, 30, 1.0, 0.4, 0.6, 0.7),
    ]
    fig = federated_figures(evals)
    assert fig["per_capacity"]["0.25"]["adapted_accuracy"] == pytest.approx(0.7)
    assert fig["all"]["adapted_accuracy"] == pytest.approx((0.9 * 10 + 0.7 * 30) / 40)
    assert fig["all"]["adapted_loss"] == pytest.approx((0.4 * 10 + 0.6 * 30) / 40)
    plain = federated_figures(
        [dataclasses.replace(e, adapted_accuracy=None, adapted_loss=None) for e in evals]
    )
    assert "adapted_accuracy" not in plain["all"]


@pytest.mark.parametrize("value", [-1, "x", 1.5])
def test_a_bad_adapt_steps_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match="adapt-steps"):
        parse_run_config({"adapt-steps": value})


def test_adapting_under_differential_privacy_is_refused():
    with pytest.raises(ConfigError, match="adapt-steps"):
        parse_run_config({"adapt-steps": 5, "dp-epsilon": 8, "model": "cnn", "label-mask": False})


def test_a_two_round_federation_reports_the_adapted_accuracy_per_capacity(tmp_path, monkeypatch):
    monkeypatch.setenv("FIBOS_CACHE_DIR", str(tmp_path / "cache"))
    run = {"num-rounds": 2, "local-epochs": 1, "eval-every": 1, "seed": 2, "adapt-steps": 5}
    run |= {"partitioner": "dirichlet", "dirichlet-alpha": 0.1}
    fed = inprocess_federation(run, {21: 1.0, 22: 0.25, 23: 0.0625})
    fed.strategy.start(
        fed.grid, fed.strategy.to_arrays(fed.x0), 2, 60.0, evaluate_fn=fed.evaluate_fn
    )
    trained = [r for r in fed.records if r["round"] > 0]
    assert len(trained) == 2
    for record in trained:
        local = record["local"]
        assert 0 <= local["adapted_accuracy"] <= 1 and np.isfinite(local["adapted_loss"])
        levels = record["federated"]["per_capacity"]
        assert set(levels) == {"1", "0.25", "0.0625"}
        assert all(0 <= v["adapted_accuracy"] <= 1 for v in levels.values())
        assert "adapted 1:" in progress_line(record, 2)
    # the adapted model differs from the received one somewhere (the steps moved it)
    assert any(
        v["adapted_loss"] != v["loss"]
        for r in trained
        for v in r["federated"]["per_capacity"].values()
    )
